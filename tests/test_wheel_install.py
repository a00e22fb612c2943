"""The wheel path a newcomer takes: build the wheel from this checkout, install it into a fresh venv outside the
checkout, and use it there (import, the bundled demo model, a capture, every notebook panel).

An editable install or a test run from the repository root would read the panels' bundles, the demo model and the
coverage data straight from the checkout and hide a wheel that forgot them; this test runs with neither.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIP = ["-m", "pip", "-q", "--disable-pip-version-check"]
# Generous bounds that only detect a hang (an install waiting on a network that never answers).
HANG_S = 900


def _expected_package_data() -> set[str]:
    """Every file the installed package reads at run time, as wheel paths (computed from the checkout)."""
    want = set()
    for sub, pattern in (
        ("demo_model", "*"),
        ("demo_sae", "*"),
        ("demo_transcoders", "*.json"),
        ("demo_transcoders", "layer_*/*"),
        ("coverage_data", "*.json"),
    ):
        for p in glob.glob(os.path.join(REPO, "ie_lab", sub, pattern)):
            want.add(f"ie_lab/{sub}/{os.path.relpath(p, os.path.join(REPO, 'ie_lab', sub))}")
    for p in glob.glob(os.path.join(REPO, "ie_lab", "static", "*")):  # the panels' bundles (widgets/build.py)
        want.add(f"ie_lab/static/{os.path.basename(p)}")
    return want


def _run(cmd: list[str], cwd: str, env: dict | None = None) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _torch_requirement() -> str:
    # The CPU build, as ./dev setup installs it: a bare `torch` would pull a multi-GB CUDA build. Prefer the local
    # file the pip configuration points at (find-links), so the step needs no download at all.
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        hits = sorted(glob.glob(os.path.join(folder, "torch-2.13.0+cpu-*.whl")))
        if hits:
            return hits[0]
    return "torch==2.13.0"


# Runs inside the fresh venv, with cwd outside the checkout; prints one JSON line the test checks.
CHILD = r"""
import json, os, sys
import ie_lab
from ie_lab.widgets import AttentionViewer, Picker, SteeringPanel, _static

out = {"file": ie_lab.__file__, "demo": ie_lab.DEMO_MODEL, "static": str(_static.STATIC)}
s = ie_lab.Session(ie_lab.DEMO_MODEL, progress=False)
try:
    c = s.capture("When Mary and John went to the store", ["resid_post.0", "attn_probs.0"])
    r, a = c["resid_post.0"], c["attn_probs.0"]
    out["capture"] = {"resid": list(r.shape), "finite": bool(r.isfinite().all()),
                      "attn_rows_sum_to_1": bool(((a.float().sum(-1) - 1).abs() < 1e-3).all())}
    panels = {
        "picker": s.picker(),
        "attention": s.show_attention("When Mary and John went to the store", layers=[0]),
        "steering": s.steering_panel("Mary went to the", positive=["happy good day"], negative=["sad bad night"],
                                     scale=0.0, max_new_tokens=3),
    }
    out["panels"] = {}
    from ipywidgets.embed import embed_snippet
    for name, w in panels.items():
        # The HTML a saved notebook carries: the view plus its full state (defaults too: _esm/_css are defaults)
        html = embed_snippet([w], drop_defaults=False)
        out["panels"][name] = {"type": type(w).__name__, "esm": w._esm, "css": w._css, "html": html,
                               "esm_file": str(_static.bundle(name + ".js"))}
        if hasattr(w, "close"):
            w.close()
finally:
    s.close()
print("RESULT " + json.dumps(out))
"""


def test_the_wheel_installs_in_a_fresh_venv_and_every_panel_renders(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, *PIP, "wheel", "--no-deps", "-w", str(wheels), REPO], cwd=str(tmp_path))
    (whl,) = glob.glob(str(wheels / "ie_lab-*.whl"))

    # The wheel's file list: every data file the package reads at run time is inside, as a real file.
    names = set(zipfile.ZipFile(whl).namelist())
    want = _expected_package_data()
    assert {
        "ie_lab/demo_model/model.safetensors",
        "ie_lab/demo_model/tokenizer.json",
        "ie_lab/demo_model/config.json",
        "ie_lab/demo_sae/cfg.json",
        "ie_lab/demo_sae/sae_weights.safetensors",
        "ie_lab/demo_transcoders/layer_3/sae_weights.safetensors",
        "ie_lab/static/ie_lab.css",
        "ie_lab/static/picker.js",
        "ie_lab/static/attention.js",
        "ie_lab/static/steering.js",
    } <= want, "the checkout's data files moved; update this test"
    assert any(n.startswith("ie_lab/coverage_data/") for n in want)
    assert not want - names, (
        f"missing from the wheel (pyproject [tool.setuptools.package-data]): {sorted(want - names)}"
    )
    assert not any(n.startswith("ie_lab/static/widgets/") for n in names), "the old symlinked sources are back"
    with zipfile.ZipFile(whl) as z:  # the committed bundles (tests/test_widgets_bundle.py keeps them built)
        for n in sorted(x for x in want if x.startswith("ie_lab/static/")):
            with open(os.path.join(REPO, n), "rb") as f:
                assert z.read(n) == f.read(), f"{n} in the wheel differs from the checkout's"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=str(tmp_path))
    py = str(venv / "bin" / "python")
    # Nothing from the checkout or the test venv may leak in: no PYTHONPATH, no inherited virtualenv. (With the
    # checkout on PYTHONPATH, pip finds its ie_lab.egg-info, says the wheel's requirement is already satisfied and
    # installs nothing.)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    _run([py, *PIP, "install", _torch_requirement()], cwd=str(tmp_path), env=env)
    constraints = os.path.join(REPO, ".ci", "constraints.txt")
    _run([py, *PIP, "install", "-c", constraints, whl], cwd=str(tmp_path), env=env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "child.py").write_text(CHILD)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    stdout = _run([py, str(work / "child.py")], cwd=str(work), env=env)
    (line,) = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    res = json.loads(line[len("RESULT ") :])
    # The `ie-lab` console script of the installed wheel (ie_lab/cli.py), run outside the checkout: its version, a
    # cheat sheet from the installed demo model, doctor, and `lab` naming the fix where JupyterLab is not installed.
    cli = str(venv / "bin" / "ie-lab")
    version = os.path.basename(whl).split("-")[1]
    assert _run([cli, "--version"], cwd=str(work), env=env).strip() == f"ie_lab {version}"
    sheet = _run([cli, "points", "demo"], cwd=str(work), env=env)
    assert res["demo"] in sheet.splitlines()[0], sheet  # the wheel's copy of the demo model
    assert re.search(r"^resid_post\.2 +\[batch, seq, 128\] +yes +yes$", sheet, re.M), sheet
    doctor = _run([cli, "doctor"], cwd=str(work), env=env)
    assert re.search(
        rf"^  ie_lab +{re.escape(version)} \({re.escape(os.path.dirname(res['file']))}\)$", doctor, re.M
    ), doctor
    if "False" in _run(
        [py, "-c", "import importlib.util as u; print(u.find_spec('jupyterlab') is not None)"], cwd=str(work), env=env
    ):
        lab = subprocess.run([cli, "lab"], cwd=str(work), env=env, capture_output=True, text=True, timeout=HANG_S)
        assert lab.returncode == 1 and "pip install jupyterlab" in lab.stderr, (lab.returncode, lab.stderr)

    site = os.path.realpath(str(venv))
    inside = lambda p: os.path.realpath(p).startswith(site + os.sep)  # noqa: E731
    repo = os.path.realpath(REPO) + os.sep
    for key in ("file", "demo", "static"):
        assert inside(res[key]) and not os.path.realpath(res[key]).startswith(repo), (key, res[key])

    cap = res["capture"]
    assert cap["resid"][0] == 1 and cap["resid"][1] > 1 and cap["finite"] and cap["attn_rows_sum_to_1"], cap

    assert set(res["panels"]) == {"picker", "attention", "steering"}
    with open(os.path.join(REPO, "ie_lab", "static", "ie_lab.css"), encoding="utf-8") as f:
        css = f.read()
    for name, p in res["panels"].items():
        assert p["esm"].strip() and p["css"].strip(), name
        # read from the installed package's bundle, which is the checkout's
        assert inside(p["esm_file"]), (name, p["esm_file"])
        with open(p["esm_file"], encoding="utf-8") as f:
            own = f.read()
        with open(os.path.join(REPO, "ie_lab", "static", os.path.basename(p["esm_file"])), encoding="utf-8") as f:
            assert own == f.read(), name
        assert p["esm"] == own and p["css"] == css, name
        # the embeddable HTML carries the view and, in the widget state, the module and style text
        assert "application/vnd.jupyter.widget-view+json" in p["html"], name
        assert "application/vnd.jupyter.widget-state+json" in p["html"], name
        state = re.search(r'<script type="application/vnd.jupyter.widget-state\+json">(.*?)</script>', p["html"], re.S)
        models = json.loads(state.group(1))["state"]
        view = re.search(r'<script type="application/vnd.jupyter.widget-view\+json">(.*?)</script>', p["html"], re.S)
        mine = models[json.loads(view.group(1))["model_id"]]["state"]
        assert mine["_esm"] == p["esm"] and mine["_css"] == p["css"], name
