"""Committed notebooks are built from notebooks/src and tutorials/src (their outputs are checked by nbval)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_notebooks_match_their_sources():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_notebooks.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def test_every_notebook_has_a_colab_cell_and_link():
    import glob

    import nbformat

    for path in glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")) + glob.glob(os.path.join(ROOT, "tutorials", "*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert "colab.research.google.com" in nb.cells[0].source, path
        assert "google.colab" in nb.cells[1].source, path


def test_widget_state_is_saved_for_static_exports():
    """Executed notebooks keep each panel's state (its ES module and traits), so an HTML export redraws it."""
    import nbformat

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "03_hook_points_picker.ipynb"), as_version=4)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    pickers = [v["state"] for v in state.values() if v["state"].get("_anywidget_id", "").endswith("Picker")]
    assert pickers and all("_esm" in p and p.get("spec") for p in pickers)
    assert any("mlp_out.2" in str(p.get("selected")) for p in pickers), "the selection made in the notebook"


def test_notebooks_and_tutorials_use_only_public_attributes():
    """What users copy from must not reach into ie_lab's private state (`s._lm` and the like): the public API
    covers it (mappers take the Session itself)."""
    import glob
    import re

    private = re.compile(r"[A-Za-z0-9_)\]]\.(_[A-Za-z]\w*)")  # x._name, not x.__dunder__
    found = []
    sources = [p for f in ("notebooks", "tutorials") for p in glob.glob(os.path.join(ROOT, f, "src", "*.py"))]
    assert len(sources) >= 10
    for path in sources + [os.path.join(ROOT, "README.md")]:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                code = line.split("#", 1)[0] if path.endswith(".py") else line
                found += [f"{os.path.relpath(path, ROOT)}:{i}: {m.group(0)}" for m in private.finditer(code)]
    assert not found, "private attributes used:\n" + "\n".join(found)
