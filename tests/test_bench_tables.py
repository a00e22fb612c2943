"""The README's benchmark tables are rendered from the committed results, and no "n/a" cell outlives its limitation.

Nothing here times anything: the tables must equal what benchmarks/render.py makes of benchmarks/results/, every
n/a cell must name its reason and a replay (benchmarks/replay.py), and each replay asks the code whether the
capability is still missing. The graph-mode replays need a graph-mode vLLM Session and run in
tests/test_vllm_graph_steer.py, which has one."""

import json
import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import replay  # noqa: E402

RENDER = runpy.run_path(os.path.join(ROOT, "benchmarks", "render.py"))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_named_table_is_in_the_readme_and_rendered_from_its_results():
    text = _readme()
    for name in RENDER["README_BLOCKS"]:
        begin, end = RENDER["named_markers"](name)
        assert begin in text and end in text, f"README.md lacks the {name} table's markers"
    assert RENDER["readme_with_block"](text) == text, "README.md differs from the results: python benchmarks/render.py"


def test_a_table_edited_by_hand_is_caught(tmp_path):
    text = _readme()
    begin, _ = RENDER["named_markers"]("remote")
    head, rest = text.split(begin, 1)
    assert "| generate (64 greedy tokens) |" in rest
    edited = head + begin + rest.replace("| generate (64 greedy tokens) |", "| generate (64 greedy tokens) | 0.5x |", 1)
    assert RENDER["readme_with_block"](edited) != edited


def test_the_tables_name_machine_date_and_versions():
    text = _readme()
    for name in ("remote", "projection"):
        begin, end = RENDER["named_markers"](name)
        block = text.split(begin, 1)[1].split(end, 1)[0]
        assert "Measured 20" in block and "torch " in block, f"the {name} table does not say where it was measured"


def test_no_cell_says_graph_mode_cannot_steer():
    # steering in graph mode landed with steer_points= (tests/test_vllm_graph_steer.py checks it equals eager)
    for p in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "README.md")):
        with open(p) as f:
            assert "steering in graph mode is not supported" not in f.read(), p
    for device in RENDER["cell_devices"]():
        for c in RENDER["load_cells"](device):
            if c["engine"] == "ie_vllm_graph" and c["workload"] == "steer":
                assert c["status"] == "ok", (c["model"], c["status"], c.get("reason"))


NA = replay.na_cells()


def test_every_na_cell_names_its_reason_and_a_replay():
    assert NA, "the committed results have n/a cells: this test must see them"
    for c in NA:
        where = f"{c['path']}"
        assert c.get("reason"), f"{where}: n/a without a reason"
        assert c.get("replay") in replay.REPLAYS, f"{where}: n/a without a known replay ({c.get('replay')!r})"


@pytest.mark.parametrize(
    "cell", [c for c in NA if c.get("replay") not in replay.NEEDS_GRAPH_SESSION], ids=lambda c: c["path"]
)
def test_na_cell_still_holds(cell):
    stale = replay.REPLAYS[cell["replay"]](cell)
    if stale and stale.startswith("SKIP:"):
        pytest.skip(stale[5:])
    assert stale is None, f"{cell['path']} says n/a, but {stale}: measure it again (python -m benchmarks.run ...)"


def test_a_replay_catches_a_capability_that_arrived():
    # a plausible stale cell: a full-context capture claimed impossible where it fits
    cell = {
        "engine": "ie_vllm",
        "workload": "capture_all",
        "reason": "a capture of 100 tokens on backend='vllm' is not supported: ... 100 + 1 exceeds the context of 128.",
    }
    assert replay.REPLAYS["vllm_free_position"](cell) is not None
    assert replay.REPLAYS["no_widgets"]({"engine": "ie_vllm"}) is not None
    assert replay.REPLAYS["kv_switch_only_generation"]({"workload": "steer"}) is not None


def test_results_files_the_tables_read_record_where_they_ran():
    for name in ("remote-cpu", "projection-eager-cpu", "projection-vllm-cpu"):
        p = os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
        r = json.load(open(p))
        assert r.get("machine") and r.get("date") and r.get("versions", {}).get("torch"), name


def test_a_cell_refused_by_ie_lab_records_its_replay(tmp_path):
    import cell
    import torch

    from ie_lab.errors import CapabilityUnsupported

    class GraphLens:
        def __init__(self, spec, x, shape):
            pass

        def versions(self):
            return {}

        def run(self, w):
            raise CapabilityUnsupported("the logit lens in graph mode", "it needs Python in the forward.", "hooks")

    class NoBatch:
        def __init__(self, spec, x, shape):
            raise cell.NotApplicable("one sequence per call", replay="interp_one_sequence")

    p = tmp_path / "refs.pt"
    torch.save({"inputs": {"prompt": torch.zeros(1, 4, dtype=torch.long)}}, p)
    spec = {"model": "t", "refs": str(p), "shape": cell.shape_for(2, 64), "repeats": 1, "threads": 1}
    c = cell.run_cell(dict(spec, engine="ie_vllm_graph", workload="lens_topk"), engine_cls=GraphLens)
    assert (c["status"], c["replay"]) == ("n/a", "vllm_graph_lens")
    c = cell.run_cell(dict(spec, engine="interp", workload="generate_x8"), engine_cls=NoBatch)
    assert (c["status"], c["replay"]) == ("n/a", "interp_one_sequence")


def test_a_cell_measured_on_a_busy_machine_is_marked():
    c = {
        "model": "m",
        "engine": "ie_eager",
        "workload": "generate",
        "status": "ok",
        "median_s": 1.0,
        "tok_per_s": None,
        "load_average": [1.0, 6.5],
        "cpus": 2,
    }
    assert "\u2021load 6" in RENDER["_cell_text"](c, None, [])
    assert "\u2021" not in RENDER["_cell_text"](dict(c, load_average=[0.5, 1.5]), None, [])
