"""The vLLM backend: ``Session(path, backend="vllm")``.

engine.py drives vLLM (AsyncLLM, or an in-process LLMEngine stepped on the Session's loop); worker.py is
the worker extension that serves capture, steering and the logit lens per request; session.py is the
Session protocol on top. Importing this package does not import vLLM.
"""
