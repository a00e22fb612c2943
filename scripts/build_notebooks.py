"""Build notebooks/*.ipynb and tutorials/*.ipynb from their percent-format sources and execute them.

    python scripts/build_notebooks.py            # rebuild every notebook and fill its outputs
    python scripts/build_notebooks.py --check    # only check the .ipynb cells match the sources

    python scripts/build_notebooks.py --metadata # only rewrite markdown and the cells' metadata from the sources
                                                 # (no execution, outputs kept; code cells must already match)

Sources live in notebooks/src/*.py and tutorials/src/*.py: `# %%` starts a code cell, `# %% [markdown]`
a markdown cell (its lines start with "# "). `# %% [solution]` starts an exercise's solution: a code cell shown
collapsed, input and output (JupyterLab's `jupyter.source_hidden` / `outputs_hidden`: a "..." bar the reader
clicks to open), which runs like any other cell. A code cell whose first line is `# NBVAL_SKIP` (needs a
download or a GPU) is tagged so neither this build nor CI executes it. Outputs are committed; CI re-runs
every notebook under nbval, comparing the cells marked `# NBVAL_CHECK_OUTPUT`.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tomllib

import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("notebooks", "tutorials")


def repository_url() -> str:
    """pyproject.toml's [project.urls] Repository: the one place the address is configured."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        url = tomllib.load(fh)["project"]["urls"]["Repository"].rstrip("/")
    # Colab opens notebooks straight from GitHub only (colab.research.google.com/github/<owner>/<name>/...).
    if not url.startswith("https://github.com/") or url.count("/") != 4:
        raise SystemExit(
            f"pyproject.toml [project.urls] Repository must be https://github.com/<owner>/<name>, got {url!r}"
        )
    return url


REPO_URL = repository_url()
REPO = REPO_URL.removeprefix("https://github.com/")  # owner/name, for the Colab links

COLAB_CELL = f"""import sys
if "google.colab" in sys.modules:  # on Colab: install ie_lab (the demo model ships inside the package)
    get_ipython().run_line_magic("pip", "install -q 'ie_lab @ git+{REPO_URL}'")"""


def parse(path: str) -> list[nbformat.NotebookNode]:
    cells, kind, lines = [], None, []

    def flush():
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(text))
        elif text:
            cell = nbformat.v4.new_code_cell(text)
            if text.startswith("# NBVAL_SKIP"):
                cell.metadata["tags"] = ["skip-execution"]
            if kind == "solution":  # hidden until the reader asks; executed all the same (nbval, Run All)
                cell.metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
                cell.metadata["tags"] = [*cell.metadata.get("tags", []), "solution"]
            cells.append(cell)

    for line in open(path, encoding="utf-8").read().splitlines():
        if line.startswith("# %%"):
            flush()
            kind = "markdown" if "[markdown]" in line else "solution" if "[solution]" in line else "code"
            lines = []
        else:
            lines.append(line)
    flush()
    return cells


def build(src: str) -> tuple[str, nbformat.NotebookNode]:
    folder = os.path.basename(os.path.dirname(os.path.dirname(src)))
    name = os.path.splitext(os.path.basename(src))[0]
    out = os.path.join(ROOT, folder, name + ".ipynb")
    cells = parse(src)
    badge = (
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{REPO}/blob/main/{folder}/{name}.ipynb)"
    )
    if cells and cells[0].cell_type == "markdown":
        cells[0].source = cells[0].source + "\n\n" + badge
    cells.insert(1, nbformat.v4.new_code_cell(COLAB_CELL))
    nb = nbformat.v4.new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        },
    )
    for i, c in enumerate(nb.cells):
        c["id"] = f"{name[:40]}-{i}"
    return out, nb


def _cells(nb: nbformat.NotebookNode) -> list[tuple]:
    """What a notebook's source decides of each cell: its kind, its text, its tags and whether it is hidden."""
    return [(c.cell_type, c.source, c.metadata.get("tags", []), c.metadata.get("jupyter", {})) for c in nb.cells]


def sources() -> list[str]:
    return sorted(p for f in FOLDERS for p in glob.glob(os.path.join(ROOT, f, "src", "*.py")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--metadata", action="store_true")
    ap.add_argument("only", nargs="*", help="names to build (default: all)")
    args = ap.parse_args()
    bad = []
    for src in sources():
        out, nb = build(src)
        name = os.path.basename(out)
        if args.only and not any(o in name for o in args.only):
            continue
        if args.check:
            if not os.path.exists(out):
                bad.append(f"{out} missing")
                continue
            have = nbformat.read(out, as_version=4)
            if _cells(have) != _cells(nb):
                bad.append(f"{out} differs from its source")
            continue
        if args.metadata:
            have = nbformat.read(out, as_version=4)
            code = [[c.source for c in n.cells if c.cell_type == "code"] for n in (have, nb)]
            if [c.cell_type for c in have.cells] != [c.cell_type for c in nb.cells] or code[0] != code[1]:
                bad.append(f"{out}: its code cells changed; build it (executes it) instead of --metadata")
                continue
            for old, new in zip(have.cells, nb.cells, strict=True):
                old.source = new.source  # markdown text: nothing runs
                for key in ("tags", "jupyter"):
                    old.metadata.pop(key, None)
                    if key in new.metadata:
                        old.metadata[key] = new.metadata[key]
            nbformat.write(have, out)
            continue
        from nbclient import NotebookClient

        print("executing", os.path.relpath(out, ROOT), flush=True)
        os.environ.setdefault("OMP_NUM_THREADS", "2")
        NotebookClient(
            nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(out)}}
        ).execute()
        nbformat.write(nb, out)
    if bad:
        print("\n".join(bad), file=sys.stderr)
        print("run `python scripts/build_notebooks.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
