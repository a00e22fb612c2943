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
