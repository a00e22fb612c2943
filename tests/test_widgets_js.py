"""Runs the panels' JavaScript unit tests (node's built-in test runner) as part of pytest."""

import json
import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_js_unit_tests_pass():
    r = subprocess.run(
        ["node", "--test", os.path.join(ROOT, "tests", "js")], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_commonjs_scripts_in_the_checkout_run_under_node():
    """`./dev` puts .venv inside the checkout, and JupyterLab runs CommonJS scripts from it with node (jupyter_builder's
    yarn.js, at every start). A `"type": "module"` in the root package.json made node run those as ES modules: stack
    traces in the `./dev lab` terminal. Only widgets/ declares its files ES modules."""
    script = "const util = require('util'); process.stdout.write(util.format('%s', 'commonjs'));\n"
    where = os.path.join(ROOT, "build")  # ignored by git, like .venv; the nearest package.json is the root's
    os.makedirs(where, exist_ok=True)
    d = tempfile.mkdtemp(dir=where, prefix="node-type-")
    try:
        path = os.path.join(d, "script.js")
        with open(path, "w", encoding="utf-8") as f:
            f.write(script)
        r = subprocess.run(["node", path], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert (r.returncode, r.stdout) == (0, "commonjs"), r.stderr[-2000:]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    with open(os.path.join(ROOT, "widgets", "package.json"), encoding="utf-8") as f:
        assert json.load(f)["type"] == "module"  # what the widgets' sources and tests/js import them as
