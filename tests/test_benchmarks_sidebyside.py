"""The side-by-side benchmark's tables are generated from its cells, and its correctness checks bite.

No timings are asserted here: only that README's block and results-latest.md equal what the cells render to,
and that a wrong engine output is recorded as WRONG (never as a speed)."""

import os
import runpy
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import cell  # noqa: E402

RENDER = runpy.run_path(os.path.join(ROOT, "benchmarks", "render.py"))


def test_readme_block_is_rendered_from_the_cells():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert RENDER["README_START"] in text and RENDER["README_END"] in text
    assert RENDER["readme_with_block"](text) == text, "run `python benchmarks/render.py`"


def test_every_engine_and_workload_has_a_cell_when_cells_exist():
    for device in RENDER["cell_devices"]():
        cells = RENDER["load_cells"](device)
        models = {c["model"] for c in cells} - {"widget"}
        have = {(c["model"], c["engine"], c["workload"]) for c in cells}
        for m in models:
            for e in cell.ENGINES:
                for w in cell.WORKLOADS:
                    assert (m, e, w) in have, f"missing cell {m} {e} {w}: a cell is never omitted silently"
        for c in cells:
            assert c["status"] in ("ok", "WRONG", "n/a", "error", "not run")
            if c["status"] in ("n/a", "error", "not run"):
                assert c.get("reason"), f"{c['model']} {c['engine']} {c['workload']}: {c['status']} without a reason"


SHAPE = cell.shape_for(2, 64)


class _Fake:
    name = "fake"
    out = None

    def __init__(self, spec, x, shape):
        if self.out is None:
            raise cell.NotApplicable("the fake engine has no such workload")

    def versions(self):
        return {}

    def run(self, w):
        return self.out


def _spec(tmp_path, workload, ref):
    p = tmp_path / "refs.pt"
    torch.save({"inputs": {"prompt": torch.zeros(1, 4, dtype=torch.long)}, **ref}, p)
    return {
        "model": "t",
        "engine": "fake",
        "workload": workload,
        "refs": str(p),
        "shape": SHAPE,
        "repeats": 1,
        "threads": 1,
    }


@pytest.mark.parametrize("tokens,status", [([5, 6, 7], "ok"), ([5, 6, 8], "WRONG"), ([5, 6], "WRONG")])
def test_generated_tokens_are_checked(tmp_path, tokens, status):
    fake = type("F", (_Fake,), {"out": {"tokens": tokens}})
    c = cell.run_cell(_spec(tmp_path, "generate", {"gen": [5, 6, 7]}), engine_cls=fake)
    assert c["status"] == status, c
    assert c["median_s"] is not None  # the time is kept, but under WRONG it is never shown as a plain result


def test_captured_tensors_are_checked(tmp_path):
    ref = torch.randn(8, 4)
    good = type("G", (_Fake,), {"out": {"resid_post.1": ref + 1e-6}})
    bad = type("B", (_Fake,), {"out": {"resid_post.1": ref * 1.01}})
    missing = type("M", (_Fake,), {"out": {}})
    spec = _spec(tmp_path, "capture_mid", {"resid_post.1": ref})
    assert cell.run_cell(spec, engine_cls=good)["status"] == "ok"
    assert cell.run_cell(spec, engine_cls=bad)["status"] == "WRONG"
    assert cell.run_cell(spec, engine_cls=missing)["status"] == "WRONG"


def test_lens_and_attention_checks():
    top = torch.arange(40).reshape(2, 2, 10)
    assert cell.check("lens_topk", {"top_ids": top.flip(-1)}, {"lens_top": top}, SHAPE)[0]  # order within top-k
    assert not cell.check("lens_topk", {"top_ids": top + 1}, {"lens_top": top}, SHAPE)[0]
    pat = torch.softmax(torch.randn(2, 5, 5), -1)
    assert cell.check("attention", {"pattern": pat}, {"pattern": pat}, SHAPE)[0]
    assert not cell.check("attention", {"pattern": pat.transpose(-1, -2)}, {"pattern": pat}, SHAPE)[0]


def test_engine_without_the_workload_is_na_with_reason(tmp_path):
    c = cell.run_cell(_spec(tmp_path, "generate", {"gen": [1]}), engine_cls=_Fake)
    assert c["status"] == "n/a" and "no such workload" in c["reason"]


def _c(engine, w, status="ok", s=1.0, tps=None, **kw):
    return {
        "model": "m",
        "engine": engine,
        "workload": w,
        "status": status,
        "median_s": s,
        "tok_per_s": tps,
        "peak_rss_mb": 100.0,
        "date": "2026-01-01",
        "threads": 2,
        "repeats": 3,
        "reason": kw.get("reason", ""),
        "check": kw.get("check", ""),
    }


def test_render_shows_wrong_and_na_and_target_verdicts():
    cells = [
        _c("bare", "forward_512", s=1.0),
        _c("ie_eager", "capture_all", s=1.2),
        _c("tl", "capture_all", s=2.0),
        _c("interp", "capture_all", s=1.0),
        _c("bare", "generate", tps=100),
        _c("ie_eager", "generate", tps=95),
        _c("interp", "generate", tps=90),
        _c("tl", "generate", "WRONG", s=0.1, tps=1000, check="tokens differ from HF greedy at position 3"),
        _c("interp", "generate_x8", "n/a", s=None, reason="one sequence per call"),
    ]
    md = "\n".join(RENDER["render_sidebyside"](cells, "cpu"))
    assert "**WRONG**" in md and "tokens differ from HF greedy at position 3" in md
    assert "n/a [" in md and "one sequence per call" in md
    rows = {a: (b, v) for a, b, v in RENDER["sbs_targets"](cells, "m")}
    assert rows["ie_lab eager capture_all <= 1.10x bare forward"][1] == "**missed**"
    assert rows["ie_lab eager capture_all <= every peer's"][1] == "**missed**"  # interp is faster here
    assert rows["ie_lab eager generate >= 0.90x bare HF generate (tok/s)"][1] == "met"
    assert rows["ie_lab eager generate >= interp-engine's (tok/s)"][1] == "met"
    assert rows["ie_lab eager capture_gen >= 1.5x interp-engine's (tok/s)"][1].startswith("not measured")


def test_targets_use_each_cells_in_process_baseline():
    # Across processes ie_lab looks 1.2x slower than interp-engine and 1.2x the bare forward; timed beside bare
    # transformers in their own processes, ie_lab is 0.96x its baseline and interp-engine 1.11x its own.
    ie = _c("ie_eager", "capture_all", s=1.2)
    ie["base_median_s"] = {"capture_all": 1.25, "forward_512": 1.15}
    interp = _c("interp", "capture_all", s=1.0)
    interp["base_median_s"] = {"capture_all": 0.9, "forward_512": 0.85}
    cells = [_c("bare", "forward_512", s=1.0), _c("bare", "capture_all", s=1.0), ie, interp]
    rows = {a: (b, v) for a, b, v in RENDER["sbs_targets"](cells, "m")}
    assert rows["ie_lab eager capture_all <= 1.10x bare forward"] == ("1.04x", "met")
    assert rows["ie_lab eager capture_all <= every peer's"] == ("interp 0.86x", "met")
    del interp["base_median_s"]  # a peer without one: compared across processes, and marked so
    rows = {a: (b, v) for a, b, v in RENDER["sbs_targets"](cells, "m")}
    assert rows["ie_lab eager capture_all <= every peer's"] == ("interp 1.20x\u2020", "**missed**")
    md = "\n".join(RENDER["render_sidebyside"](cells, "cpu"))
    assert "1.20 s (0.96x)" in md and "1.00 s (1.00x\u2020)" in md
