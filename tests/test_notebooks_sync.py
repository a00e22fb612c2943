"""Committed notebooks are built from notebooks/src and tutorials/src (their outputs are checked by nbval)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_notebooks_match_their_sources():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "build_notebooks.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr


def test_every_notebook_has_a_colab_cell_and_link():
    import glob

    import nbformat

    for path in glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")) + glob.glob(
        os.path.join(ROOT, "tutorials", "*.ipynb")
    ):
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


def _pyproject_repository() -> str:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]["urls"]["Repository"].rstrip("/")


def test_colab_cells_install_from_pyprojects_repository_url():
    """The Colab install cell and the "Open in Colab" link of every notebook use the address configured in
    pyproject.toml [project.urls], the one place it is set."""
    import glob

    import nbformat

    url = _pyproject_repository()
    assert url.startswith("https://github.com/"), url
    owner_name = url.removeprefix("https://github.com/")
    paths = glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")) + glob.glob(
        os.path.join(ROOT, "tutorials", "*.ipynb")
    )
    assert len(paths) >= 10
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        assert f"'ie_lab @ git+{url}'" in nb.cells[1].source, path
        assert f"colab.research.google.com/github/{owner_name}/blob/main/" in nb.cells[0].source, path


def test_the_readmes_install_line_uses_pyprojects_repository_url():
    """The README must show a command, so it repeats the address; this holds that copy to pyproject's, and no
    other repository address appears in it (a fork changes pyproject and is told here what else to change)."""
    import re

    url = _pyproject_repository()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert f'pip install "ie_lab @ git+{url}"' in readme
    others = set(re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", readme)) - {url}
    assert not others, f"README names repository addresses other than pyproject's {url}: {sorted(others)}"


def test_the_build_script_takes_the_url_from_pyproject_only(tmp_path):
    """Changing [project.urls] Repository alone changes what the build writes (no second copy of the address)."""
    import importlib.util
    import re
    import shutil

    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "scripts", "build_notebooks.py"), tmp_path / "scripts")
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        text = fh.read()
    text, n = re.subn(r'(?m)^Repository = ".*"$', 'Repository = "https://github.com/someone/fork_of_ie_lab"', text)
    assert n == 1
    (tmp_path / "pyproject.toml").write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("build_notebooks_copy", tmp_path / "scripts" / "build_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "git+https://github.com/someone/fork_of_ie_lab'" in mod.COLAB_CELL
    assert "ie-lab/ie_lab" not in mod.COLAB_CELL
    src = os.path.join(tmp_path, "notebooks", "src", "01_x.py")
    os.makedirs(os.path.dirname(src))
    with open(src, "w", encoding="utf-8") as fh:
        fh.write("# %% [markdown]\n# # Title\n\n# %%\nx = 1\n")
    _, nb = mod.build(src)
    assert (
        "colab.research.google.com/github/someone/fork_of_ie_lab/blob/main/notebooks/01_x.ipynb" in nb.cells[0].source
    )
    assert nb.cells[1].source == mod.COLAB_CELL


def test_attention_viewer_is_shown_where_attention_is_taught():
    """Notebook 04 and tutorial 02 teach attention: each opens the viewer in a code cell, and the executed notebook
    keeps the displayed panel (not just a mention of `s.show_attention` in the text)."""
    import nbformat

    for rel in ("notebooks/04_attention.ipynb", "tutorials/02_attention_and_induction_heads.ipynb"):
        nb = nbformat.read(os.path.join(ROOT, rel), as_version=4)
        cells = [c for c in nb.cells if c.cell_type == "code" and "s.show_attention(" in c.source]
        assert cells, f"{rel}: no code cell opens the attention viewer"
        shown = [
            o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
            for c in cells
            for o in c.outputs
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
        ]
        assert shown, f"{rel}: the viewer cell has no displayed panel"
        state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
        for model_id in shown:
            panel = state[model_id]["state"]
            assert panel.get("_anywidget_id", "").endswith("AttentionViewer"), rel
            assert panel.get("tokens") and panel.get("n_heads", 0) > 0, rel


def test_tutorial_solutions_are_hidden_until_asked_and_still_run():
    """A teaching notebook keeps each exercise's solution collapsed (JupyterLab's jupyter.source_hidden and
    outputs_hidden: the reader clicks to open it) and still executes it: never skipped, so nbval runs it with the
    rest of the tutorial in the gate, and its committed output is from a run."""
    import glob

    import nbformat

    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tutorials", "*.ipynb"))):
        cells = nbformat.read(path, as_version=4).cells
        for i, cell in enumerate(cells):
            if cell.cell_type != "markdown" or not cell.source.startswith("**Solution"):
                continue
            where = f"{os.path.basename(path)} cell {i + 1}"
            sol = cells[i + 1]
            assert sol.cell_type == "code", where
            assert sol.metadata.get("jupyter") == {"source_hidden": True, "outputs_hidden": True}, where
            assert "skip-execution" not in sol.metadata.get("tags", []), where
            assert "NBVAL_SKIP" not in sol.source, where
            assert sol.execution_count is not None and sol.outputs, f"{where}: not run when the notebook was built"
            found.append(where)
        # and nothing else is hidden: the exercise's own prompt and the lesson stay in the open
        hidden = [c for c in cells if c.metadata.get("jupyter")]
        assert len(hidden) == sum(w.startswith(os.path.basename(path)) for w in found), path
    assert len(found) >= 6, found  # every tutorial with an exercise (01 has two)


def test_every_panel_is_shown_in_a_notebook_or_tutorial():
    """Each notebook panel a Session opens appears, run, in at least one notebook or tutorial (the feature panel
    was in none): a newcomer meets it there, and nbval runs it."""
    import glob
    import re

    from ie_lab.session import Session

    panels = {name for name in dir(Session) if re.fullmatch(r"picker|show_attention|\w+_panel", name)}
    assert {"picker", "show_attention", "steering_panel", "feature_panel"} <= panels
    text = "".join(
        open(p, encoding="utf-8").read()
        for f in ("notebooks", "tutorials")
        for p in glob.glob(os.path.join(ROOT, f, "src", "*.py"))
    )
    missing = sorted(p for p in panels if f".{p}(" not in text)
    assert not missing, f"panels shown in no notebook or tutorial: {missing}"
