"""Builds the notebook panels: each panel's ES module in this folder, bundled with the helpers it imports
(util.js), becomes one module in ie_lab/static/, and so does the style sheet. esbuild does the bundling; its npm
package is pinned in package.json (installed by `./dev setup`, or `npm ci` in the repository root).

    python widgets/build.py          write ie_lab/static/{attention,dashboard,dashboard_export,features,graph,picker,steering}.js
                                     and ie_lab.css
    python widgets/build.py --check  exit 1 when those files are not built from the current sources (no node needed)
    python widgets/build.py --watch  rebuild build/widgets-dev/ on every save, with source maps (panels read it
                                     when ANYWIDGET_HMR=1; docs/WIDGETS.md)

The bundles are committed, so installing ie_lab (a wheel, an sdist, a fresh checkout) needs no node: setup.py's
build step rebuilds them when esbuild is installed and otherwise checks that they match the sources. Each bundle's
first line records a fingerprint of what it was built from (the sources, esbuild's pinned version, the options),
which is how a stale bundle is told without esbuild; tests/test_widgets_bundle.py also rebuilds and compares bytes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "widgets"
OUT = ROOT / "ie_lab" / "static"
DEV_OUT = ROOT / "build" / "widgets-dev"
PANELS = ("attention", "dashboard", "dashboard_export", "features", "graph", "picker", "steering")
STYLE = "ie_lab.css"
OUTPUTS = tuple(p + ".js" for p in PANELS) + (STYLE,)
# Readable output (no minifying): the committed bundles are reviewed in diffs like any other file.
OPTIONS = ("--bundle", "--format=esm", "--target=es2020", "--charset=utf8", "--log-level=warning")
FIX = "run `./dev setup` (it installs esbuild with npm and builds them), or `npm ci && python widgets/build.py`"


def esbuild_version() -> str:
    """The version package.json pins (what the committed bundles were built with)."""
    return json.loads((ROOT / "package.json").read_text(encoding="utf-8"))["devDependencies"]["esbuild"]


def fingerprint() -> str:
    """Of every source file, the pinned esbuild and the options; line endings normalized (a Windows checkout)."""
    h = hashlib.sha256(f"esbuild {esbuild_version()} {' '.join(OPTIONS)}\n".encode())
    for p in sorted(SOURCES.iterdir()):
        if p.suffix in (".js", ".css"):
            h.update(f"{p.name}\n".encode())
            h.update(p.read_bytes().replace(b"\r\n", b"\n"))
    return h.hexdigest()[:16]


def _banner(fp: str) -> str:
    return f"ie_lab notebook panels, built by widgets/build.py from widgets/ (sources {fp}); edit those, not this file"


def _esbuild() -> str | None:
    return shutil.which("esbuild", path=str(ROOT / "node_modules" / ".bin"))


def _command(outdir: Path, *extra: str) -> list[str]:
    """esbuild's command line; run with cwd at the repository root, so the bundles' "// widgets/util.js" section
    comments read the same on every machine."""
    exe = _esbuild()
    if exe is None:
        raise SystemExit(f"widgets/build.py: esbuild is not installed in this checkout (node_modules/); {FIX}.")
    fp = fingerprint()
    entries = [f"widgets/{p}.js" for p in PANELS] + [f"widgets/{STYLE}"]
    return [
        exe,
        *entries,
        *OPTIONS,
        f"--outdir={outdir}",
        f"--banner:js=// {_banner(fp)}",
        f"--banner:css=/* {_banner(fp)} */",
        *extra,
    ]


def build(out: Path = OUT) -> list[str]:
    """Bundle into ``out``; only files whose text changed are rewritten. Returns their names."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(_command(Path(tmp)), cwd=ROOT, check=True)
        changed = []
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            new = (Path(tmp) / name).read_bytes()
            target = out / name
            if not target.is_file() or target.read_bytes() != new:
                target.write_bytes(new)
                changed.append(name)
        return changed


def stale(out: Path = OUT) -> list[str]:
    """The bundles in ``out`` that are missing or were not built from the current sources (no esbuild needed)."""
    want = _banner(fingerprint())
    bad = []
    for name in OUTPUTS:
        path = out / name
        first = path.read_text(encoding="utf-8").split("\n", 1)[0] if path.is_file() else ""
        if want not in first:
            bad.append(name)
    return bad


def ensure() -> None:
    """setup.py's build step: rebuild where esbuild is installed, else insist the committed bundles are current."""
    if _esbuild() is not None:
        build()
        return
    bad = stale()
    if bad:
        raise SystemExit(f"ie_lab/static/{', '.join(bad)} not built from the current widgets/ sources; {FIX}.")


def watch() -> None:
    """Rebuild the development bundles on every save until Ctrl-C (esbuild's own watcher)."""
    DEV_OUT.mkdir(parents=True, exist_ok=True)
    print(
        f"widgets/build.py: watching widgets/, writing {DEV_OUT.relative_to(ROOT)}/ (Ctrl-C stops); start "
        "Jupyter with ANYWIDGET_HMR=1 so open panels reload"
    )
    proc = subprocess.Popen(_command(DEV_OUT, "--watch=forever", "--sourcemap=inline"), cwd=ROOT)
    # esbuild stops with this script, however it is stopped: Ctrl-C, or a terminate from a test or a supervisor
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        bad = stale()
        if bad:
            print(
                f"widgets/build.py: ie_lab/static/{', '.join(bad)} not built from the current sources; {FIX}.",
                file=sys.stderr,
            )
        return 1 if bad else 0
    if argv == ["--watch"]:
        watch()
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    changed = build()
    print(f"widgets/build.py: {', '.join(changed) if changed else 'bundles already current'} in ie_lab/static/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
