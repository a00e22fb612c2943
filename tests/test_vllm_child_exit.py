"""ie_lab/vllm/child_exit.py: vLLM's engine-core and worker processes end without the interpreter's teardown once their
shutdown is done, so Session.close() does not wait seconds for it (or have vLLM kill the process, warning).

Real spawned processes named as vLLM names its own, each running the module (loaded from its file: a child that imported
ie_lab would spend seconds importing torch) under a stand-in for vLLM's SIGTERM handler. Whether the interpreter's
teardown ran is seen from an object whose __del__ writes a file only when module globals are torn down; whether the
other exit handlers ran, from one registered with atexit before the module was installed. The processes of a real
engine are checked in tests/test_vllm_transformers_backend.py (each engine's close leaves no process and no warning).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.join(os.path.dirname(HERE), "ie_lab", "vllm", "child_exit.py")


class _TornDown:
    """Writes its file when the interpreter's teardown collects it (a module global: freed only then)."""

    def __init__(self, path: str):
        self.path = path

    def __del__(self, _open=open):  # (bound now: builtins may be gone by then)
        with _open(self.path, "w") as f:
            f.write("torn down")


def _child(out: str, how: str) -> None:
    import atexit

    spec = importlib.util.spec_from_file_location("child_exit_under_test", MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["child_exit_under_test"] = mod
    mod.KEEP = _TornDown(os.path.join(out, "teardown"))  # freed only by the interpreter's teardown

    def vllms_handler(signum, frame):  # as vLLM's engine core: a requested shutdown ends in SystemExit (status 0)
        raise SystemExit()

    signal.signal(signal.SIGTERM, vllms_handler)
    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())  # registered before install, as vLLM's
    with open(os.path.join(out, "installed"), "w") as f:
        f.write(str(mod.install()))
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "error":
        raise RuntimeError("a fatal error, not a requested shutdown")
    # "return": a worker's busy loop ended after its parent closed the pipe


def _run(tmp_path, name: str, how: str) -> tuple[int, set[str], str]:
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_child, args=(str(tmp_path), how), name=name)
    p.start()
    p.join(120)
    assert p.exitcode is not None, "the child did not end"
    installed = (tmp_path / "installed").read_text() if (tmp_path / "installed").exists() else ""
    return p.exitcode, {f.name for f in tmp_path.iterdir()} - {"installed"}, installed


@pytest.mark.parametrize("name", ["EngineCore", "EngineCore_DP1"])
def test_an_engine_core_asked_to_stop_skips_the_teardown_and_runs_the_exit_handlers(tmp_path, name):
    code, files, installed = _run(tmp_path, name, "sigterm")
    assert installed == "True"
    assert code == 0
    assert files == {"atexit"}  # the exit handlers ran; the teardown did not


def test_an_engine_core_that_fails_exits_as_python_does_its_status_intact(tmp_path):
    code, files, installed = _run(tmp_path, "EngineCore", "error")
    assert installed == "True" and code == 1
    assert files == {"atexit", "teardown"}


def test_a_worker_skips_the_teardown_without_a_signal(tmp_path):
    code, files, installed = _run(tmp_path, "VllmWorker-0", "return")
    assert installed == "True" and code == 0
    assert files == {"atexit"}


def test_any_other_process_is_left_alone(tmp_path):
    code, files, installed = _run(tmp_path, "Process-1", "sigterm")
    assert installed == "False" and code == 0
    assert files == {"atexit", "teardown"}
    from ie_lab.vllm import child_exit

    assert child_exit.install() is False  # this test process (pytest's) is not one vLLM started
    assert [child_exit.role(n) for n in ("EngineCore", "EngineCore_DP0", "VllmWorker-1", "MainProcess")] == [
        "engine core",
        "engine core",
        "worker",
        None,
    ]
