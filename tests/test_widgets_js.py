"""Runs the panels' JavaScript unit tests (node's built-in test runner) as part of pytest."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_js_unit_tests_pass():
    r = subprocess.run(
        ["node", "--test", os.path.join(ROOT, "tests", "js")], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
