"""torchao checkpoints on the eager and vLLM backends (docs/LOADING.md, Quantized checkpoints); the cases are in
tests/torchao_cases.py.

torchao is not installed in ie_lab's test environment: where it is, transformers imports it in every process that
loads a model, and it prints its CUDA kernels' load failures on stderr (noise in every other test and notebook). So
./dev puts the pinned torchao (.ci/constraints.txt) in .venvs/torchao, and here, where torchao is not importable, one
test runs this file again in a child pytest with .venvs/torchao on its path, where the cases are imported and run."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHAO = os.path.join(ROOT, ".venvs", "torchao")
CHILD = "IE_LAB_TORCHAO_CHILD"


def _pinned() -> str:
    with open(os.path.join(ROOT, ".ci", "constraints.txt")) as fh:
        return next(line.strip() for line in fh if line.startswith("torchao=="))


if importlib.util.find_spec("torchao") is not None:
    from tests.torchao_cases import *  # noqa: F403 - the cases and their fixtures, collected from here
elif os.environ.get(CHILD):
    pytest.skip(f"torchao is not importable from {TORCHAO}", allow_module_level=True)
else:

    def test_torchao_checkpoints_in_a_process_with_torchao():
        os.makedirs(os.path.dirname(TORCHAO), exist_ok=True)
        with open(os.path.join(os.path.dirname(TORCHAO), ".torchao.lock"), "w") as fh:  # ./dev's background step
            fcntl.flock(fh, fcntl.LOCK_EX)
            if not os.path.isdir(os.path.join(TORCHAO, "torchao")):
                cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TORCHAO, _pinned()]
                got = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if got.returncode != 0:
                    pytest.skip(f"torchao could not be installed here ({' '.join(cmd)}): {got.stderr[-300:]}")
        env = {**os.environ, CHILD: "1", "PYTHONPATH": os.pathsep.join([TORCHAO, ROOT])}
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs", __file__],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        out = run.stdout[-4000:] + run.stderr[-2000:]
        assert run.returncode == 0, out
        assert " passed" in out and "skipped" not in out, out  # the cases ran, none skipped
