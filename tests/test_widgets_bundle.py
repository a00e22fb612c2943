"""The panels' bundles in ie_lab/static/ are what widgets/build.py makes from widgets/ (they are committed so that
installing needs no node; these tests keep them from drifting), and the development watch build serves hot reload."""

import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ie_lab.widgets import _static

ROOT = Path(__file__).resolve().parent.parent
BUILD = runpy.run_path(str(ROOT / "widgets" / "build.py"))
HAS_ESBUILD = BUILD["_esbuild"]() is not None
needs_esbuild = pytest.mark.skipif(not HAS_ESBUILD, reason="esbuild is not installed (./dev setup runs npm ci)")
HANG_S = 120  # only detects a hang


def _copy_checkout(tmp: Path) -> dict:
    """widgets/, package.json and the committed bundles in a scratch tree; its build.py, bound to that tree."""
    shutil.copytree(ROOT / "widgets", tmp / "widgets", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "package.json", tmp / "package.json")
    shutil.copytree(ROOT / "ie_lab" / "static", tmp / "ie_lab" / "static")
    return runpy.run_path(str(tmp / "widgets" / "build.py"))


def test_committed_bundles_are_built_from_the_current_sources():
    assert BUILD["stale"]() == [], "widgets/ changed after the last build: run `python widgets/build.py` and commit"
    static = ROOT / "ie_lab" / "static"
    assert sorted(p.name for p in static.iterdir()) == sorted(BUILD["OUTPUTS"])
    assert not any(p.is_symlink() for p in static.iterdir())


@needs_esbuild
def test_a_fresh_build_gives_the_committed_bytes(tmp_path):
    BUILD["build"](tmp_path)
    for name in BUILD["OUTPUTS"]:
        assert (tmp_path / name).read_bytes() == (ROOT / "ie_lab" / "static" / name).read_bytes(), (
            f"ie_lab/static/{name} differs from a fresh build: run `python widgets/build.py` and commit"
        )


def test_an_edited_helper_makes_every_bundle_stale_and_the_build_step_refuses_without_esbuild(tmp_path):
    build = _copy_checkout(tmp_path)
    assert build["stale"]() == []
    with open(tmp_path / "widgets" / "util.js", "a", encoding="utf-8") as f:
        f.write("\nexport const ADDED = 1;\n")
    assert build["stale"]() == list(build["OUTPUTS"])  # every panel imports util.js
    assert build["_esbuild"]() is None  # the scratch tree has no node_modules/
    with pytest.raises(SystemExit, match=r"not built from the current widgets/ sources; run `\./dev setup`"):
        build["ensure"]()
    (tmp_path / "widgets" / "util.js").write_bytes((ROOT / "widgets" / "util.js").read_bytes().replace(b"\n", b"\r\n"))
    assert build["stale"]() == []  # a Windows checkout's line endings are the same sources


@needs_esbuild
def test_the_build_step_rebuilds_an_edited_source(tmp_path):
    build = _copy_checkout(tmp_path)
    (tmp_path / "node_modules").symlink_to(ROOT / "node_modules")
    src = tmp_path / "widgets" / "steering.js"
    src.write_text(
        src.read_text(encoding="utf-8")
        .replace("function render(", "function render_edited_here(", 1)
        .replace("{ render }", "{ render: render_edited_here }"),
        encoding="utf-8",
    )
    build["ensure"]()
    assert build["stale"]() == []
    assert "render_edited_here" in (tmp_path / "ie_lab" / "static" / "steering.js").read_text(encoding="utf-8")


# A notebook's kernel with ANYWIDGET_HMR=1: the panel on screen gets the module of every save.
HOT_CHILD = r"""
import pathlib, sys, time
import ie_lab
from ie_lab.widgets import AttentionViewer
assert ie_lab.__file__.startswith(sys.argv[1]), ie_lab.__file__  # the scratch tree's package, not the checkout's
att = AttentionViewer(lambda L: __import__("torch").ones(2, 3, 3) / 3, ["a", "b", "c"], [0], 2)
assert "sourceMappingURL" in att._esm, "not the development bundle"
util = pathlib.Path("widgets/util.js")  # a helper attention.js imports: its bundle is rebuilt
util.write_text(util.read_text(encoding="utf-8").replace(
    "export function showToken(t) {", "export function showToken(t) {\n  console.debug('edited while watching');", 1),
    encoding="utf-8")
deadline = time.monotonic() + float(sys.argv[2])
while "edited while watching" not in att._esm:
    assert time.monotonic() < deadline, "the live panel never got the rebuilt module"
    time.sleep(0.1)
print("RELOADED")
"""


@needs_esbuild
def test_watch_build_and_anywidget_hot_reload_bring_a_saved_edit_to_a_live_panel(tmp_path):
    _copy_checkout(tmp_path)
    shutil.rmtree(tmp_path / "ie_lab")
    shutil.copytree(ROOT / "ie_lab", tmp_path / "ie_lab", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "node_modules").symlink_to(ROOT / "node_modules")
    dev = tmp_path / "build" / "widgets-dev"

    watch = subprocess.Popen(
        [sys.executable, str(tmp_path / "widgets" / "build.py"), "--watch"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not all((dev / n).is_file() for n in BUILD["OUTPUTS"]):
            assert time.monotonic() < deadline, "the watch build never wrote the development bundles"
            time.sleep(0.1)
        env = {**os.environ, "ANYWIDGET_HMR": "1", "PYTHONPATH": str(tmp_path)}
        r = subprocess.run(
            [sys.executable, "-c", HOT_CHILD, str(tmp_path), str(HANG_S)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=2 * HANG_S,
        )
        assert r.returncode == 0 and "RELOADED" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    finally:
        watch.terminate()  # build.py stops its esbuild on the way out
        watch.wait(timeout=HANG_S)
        out = watch.stdout.read().decode(errors="replace")
    assert watch.returncode == 0 and "watching widgets/" in out, out


def test_hot_reload_reads_the_development_bundle_when_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(_static, "DEV", tmp_path)
    (tmp_path / "picker.js").write_text("export default { render() {} };\n", encoding="utf-8")
    monkeypatch.delenv("ANYWIDGET_HMR", raising=False)
    assert _static.bundle("picker.js") == _static.STATIC / "picker.js"
    monkeypatch.setenv("ANYWIDGET_HMR", "1")
    assert _static.bundle("picker.js") == tmp_path / "picker.js"
    assert _static.bundle("attention.js") == _static.STATIC / "attention.js"  # no development bundle of it yet
    with pytest.raises(FileNotFoundError, match=r"\./dev setup"):
        _static.bundle("missing.js")
