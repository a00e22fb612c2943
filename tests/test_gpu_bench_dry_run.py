"""benchmarks/gpu.sh cannot rot: its CPU dry run (tiny sizes of the committed configs, the same code path, no CUDA,
no network: the models are built from benchmarks/configs/*.json, never fetched) runs here and must produce every
expected row with finite numbers. Nothing is timed against a target: only that every number exists and is finite,
and that every engine's greedy tokens equal bare transformers' (float32 here, so exactly)."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_bench  # noqa: E402


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_dry")
    env = dict(os.environ, IE_LAB_PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("IE_LAB_GPU_DRY_PEERS", None)
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh"), "--dry-run", str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,  # a hang guard only: ~2 minutes quiet, ~6 with both cores busy
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.load(open(out / "results.json"))


def test_every_expected_row_has_finite_numbers(dry):
    out, res = dry
    assert res["dry_run"] is True and res["machine"] and res["date"] and res["versions"].get("torch")
    rows = {(r["model"], r["engine"], r["op"]): r for r in res["rows"]}
    want = gpu_bench.expected_rows(list(gpu_bench.MODELS), dry=True)
    assert want <= set(rows), f"missing rows: {sorted(want - set(rows))}"
    for key in want:
        r = rows[key]
        assert r["status"] == "ok" and math.isfinite(r["median_s"]) and r["median_s"] > 0, (key, r)
        assert all(math.isfinite(t) for t in r["times_s"]), key
        if r["engine"] != "bare":
            assert math.isfinite(r["ratio_vs_bare"]) and r["ratio_vs_bare"] > 0, (key, r)
        if r["op"] in gpu_bench.GENERATING:
            assert math.isfinite(r["tok_per_s"]), key
            if r["engine"] != "bare":
                assert r["agree"] == 1.0, (key, r["agree"])  # float32: every engine's tokens equal bare's


def test_what_did_not_run_says_why_and_the_tables_are_written(dry):
    out, res = dry
    missing = {(n["model"], n["engine"]) for n in res["not_run"]}
    for m in gpu_bench.MODELS:
        for p in gpu_bench.PEERS:  # no peer environment is handed to the dry run: listed, with the reason
            assert (m, p) in missing
    assert all(n["reason"] for n in res["not_run"])
    md = (out / "results.md").read_text()
    for m in gpu_bench.MODELS:
        assert f"## {m} " in md
    assert "Not run:" in md
    assert not (out / "models").exists() or not any((out / "models").iterdir())  # the checkpoints are removed


def test_the_configs_are_the_real_sizes():
    cfg = gpu_bench.load_config("llama-3.1-8b", dry=False)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 14336, 128256)
    moe = gpu_bench.load_config("qwen3-moe", dry=False)
    assert (moe.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (2048, 128, 8, 768)
