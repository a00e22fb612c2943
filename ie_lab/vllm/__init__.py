"""The vLLM backend: ``Session(path, backend="vllm")``.

engine.py drives vLLM (AsyncLLM, or an in-process LLMEngine stepped on the Session's loop); worker.py is
the worker extension that serves capture, steering and the logit lens per request; backend.py is the Backend a
Session holds; checks.py what needs no engine (the served-point, mode and sampling checks, client-side types).
Importing this package does not import vLLM.
"""
