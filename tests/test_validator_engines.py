"""CI's validator subset against TransformerLens, in an environment the test builds itself.

`validator/envs/setup.sh tl` creates .venvs/tl from PyPI (about 2.5 minutes cold on this machine, seconds when it
exists). If it cannot be built (no package index reachable), these tests skip and say so.
"""

import fcntl
import os
import subprocess

import pytest

from validator import render
from validator import run as R
from validator import spec as S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tl_env():
    os.makedirs(R.venvs_dir(), exist_ok=True)
    lock = os.path.join(R.venvs_dir(), ".setup.lock")
    with open(lock, "w") as fh:  # xdist workers build it once
        fcntl.flock(fh, fcntl.LOCK_EX)
        proc = subprocess.run(
            ["bash", os.path.join(R.HERE, "envs", "setup.sh"), "tl"], capture_output=True, text=True, timeout=900
        )
        fcntl.flock(fh, fcntl.LOCK_UN)
    if proc.returncode != 0:
        pytest.skip(
            "the TransformerLens environment could not be built from PyPI here "
            f"(validator/envs/setup.sh tl exited {proc.returncode}): {proc.stderr.strip()[-300:]}"
        )
    return True


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("validator_models_tl"))


@pytest.fixture(scope="module")
def ci_run(tl_env, models_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("validator_ci"))
    return R.run(list(S.CI_FAMILIES), list(S.CI_ENGINES), out_dir=out, models_dir=models_dir, log=lambda *a: None)


def test_mistake_selftest_fails_on_transformerlens(tl_env, models_dir, tmp_path):
    """TransformerLens' hook_mlp_out deliberately read as raw mlp_out on Gemma 2 must come out FAIL."""
    from validator.selftest import FAMILY, wrong_mapping

    (doc,) = R.run(
        [FAMILY],
        ["tl"],
        out_dir=str(tmp_path),
        models_dir=models_dir,
        override=wrong_mapping("tl"),
        log=lambda *a: None,
    )
    assert doc["status"] == "ok", doc["reason"]
    assert doc["rows"] and all(r["verdict"] == S.FAIL for r in doc["rows"]), doc["rows"]
    assert all(r["name"].endswith("hook_mlp_out") and r["address"].startswith("mlp_out.") for r in doc["rows"])
    assert all(r["rel_err"] > 1.0 and r["max_abs"] > 2e-3 for r in doc["rows"])


def test_llama_passes_on_transformerlens_and_hooks(ci_run):
    for engine in ("tl", "hf"):
        (doc,) = [d for d in ci_run if d["model"] == "tiny-llama" and d["engine"] == engine]
        verdicts = [r["verdict"] for r in doc["rows"]]
        assert verdicts.count(S.PASS) >= 30, (engine, doc["rows"])
        assert S.FAIL not in verdicts and S.WARN not in verdicts, (engine, doc["rows"])
    # the model-aware mapping is exercised: on Llama hook_mlp_out is mlp_out, on Gemma 2 it is mlp_out_post
    pairs = {(d["model"], r["address"], r["name"]) for d in ci_run if d["engine"] == "tl" for r in d["rows"]}
    assert ("tiny-llama", "mlp_out.0", "blocks.0.hook_mlp_out") in pairs
    assert ("tiny-gemma2", "mlp_out_post.0", "blocks.0.hook_mlp_out") in pairs
    assert ("tiny-gemma2", "mlp_out.0", "blocks.0.hook_mlp_out") not in pairs
    assert ("tiny-gemma2", "mlp_out.0", "blocks.0.mlp.hook_out") in pairs


def test_ci_subset_matches_committed_verdicts(ci_run):
    """A regression gate: every verdict of CI's subset equals the one committed in validator/results/."""
    committed = {(d["model"], d["engine"]): d for d in render.load()}
    changed = []
    for d in ci_run:
        old = committed.get((d["model"], d["engine"]))
        assert old is not None, f"no committed result for {d['model']} x {d['engine']}"
        before = {(r["address"], r["name"]): r["verdict"] for r in old["rows"]}
        for r in d["rows"]:
            was = before.get((r["address"], r["name"]))
            if was != r["verdict"]:
                changed.append((d["model"], d["engine"], r["address"], r["name"], was, r["verdict"], r.get("why", "")))
    assert not changed, (
        "verdicts changed since the committed sweep (rerun `python -m validator run --all`):\n"
        + "\n".join(map(str, changed))
    )
