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
