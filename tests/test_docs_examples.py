"""Every ```python block in docs/*.md runs (blocks of one file share a namespace, in order)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if BLOCK.search(open(p).read())], ids=os.path.basename)
def test_doc_examples_run(path):
    ns: dict = {"__name__": "__docs__"}
    for i, code in enumerate(BLOCK.findall(open(path).read())):
        exec(compile(code, f"{os.path.basename(path)}[block {i}]", "exec"), ns)


def test_quickstart_script_runs():
    import runpy

    runpy.run_path(os.path.join(ROOT, "docs", "examples", "quickstart.py"), run_name="__main__")
