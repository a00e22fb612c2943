"""Every "n/a" cell of the benchmark results names why (its `reason`) and how to ask the code whether that is still
so (its `replay` id). A replay asks ie_lab (or the peer engine) for the capability the cell says is missing, so a
cell cannot outlive the limitation: once the code serves it, the replay reports the cell stale and the tests fail
until the cell is measured again (tests/test_bench_tables.py; the graph-mode ones in tests/test_vllm_graph_steer.py,
which has a graph-mode Session at hand).

A replay returns None when the limitation still holds, or a sentence saying what now works.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IE_ENGINES = ("ie_eager", "ie_vllm", "ie_vllm_graph")


def _vllm_no_logits(cell: dict, **_) -> str | None:
    """vLLM keeps the logits in the worker: no hook sees lm_head there, and run(fn) (a forward of one's own) is
    refused on vLLM. Either one served would give the forward_512 cell a way to return logits."""
    from ie_lab import points
    from ie_lab.capabilities import _BY_NAME

    if points.get("lm_head").verdict("vllm").verdict.ok:
        return "lm_head is now served on vLLM: capture it for forward_512"
    if _BY_NAME["run(fn) on the model object"].supported("vllm"):
        return "run(fn) is now supported on vLLM"
    return None


def _vllm_free_position(cell: dict, **_) -> str | None:
    """A full-context capture on vLLM needs one free position: ask the backend's own check with the cell's sizes."""
    from ie_lab.errors import CapabilityUnsupported
    from ie_lab.vllm.backend import VLLMBackend

    n = int(re.search(r" of (\d+) tokens", cell["reason"]).group(1))
    ctx = int(re.search(r"context of (\d+)", cell["reason"]).group(1))
    try:
        VLLMBackend._check_room(SimpleNamespace(_max_len=ctx, _len_why=""), n, "a capture")
    except CapabilityUnsupported:
        return None
    return f"vLLM now captures {n} tokens in a context of {ctx}"


def _graph_refuses(op: Callable[[], object], what: str) -> str | None:
    from ie_lab.errors import CapabilityUnsupported

    try:
        op()
    except CapabilityUnsupported as e:
        return None if "graph mode" in str(e) else f"{what} in graph mode now fails otherwise: {e}"
    return f"{what} now works in graph mode"


def _vllm_graph_lens(cell: dict, graph_session=None, prompt=None, **_) -> str | None:
    return _graph_refuses(lambda: graph_session.logit_lens(prompt, k=3), "the logit lens")


def _vllm_graph_attention(cell: dict, graph_session=None, prompt=None, **_) -> str | None:
    return _graph_refuses(lambda: graph_session.attention(prompt, [0]), "attention()")


def _interp_one_sequence(cell: dict, **_) -> str | None:
    """interp-engine (a peer, in its own environment): asked whether its generate takes several sequences."""
    py = os.path.join(os.environ.get("IE_LAB_VALIDATOR_VENVS", os.path.join(ROOT, ".venvs")), "interp", "bin", "python")
    if not os.path.exists(py):
        return "SKIP: no .venvs/interp to ask (bash validator/envs/setup.sh interp)"
    probe = (
        "import inspect, interp_engine as ie\n"
        "names = [n for n in dir(ie) if 'batch' in n.lower()]\n"
        "p = list(inspect.signature(ie.generate_stream).parameters)\n"
        "print('batched' if names or any('prompts' in x for x in p) else 'single')\n"
    )
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:  # its API moved: the cell must be measured again to say anything
        return f"interp-engine's generate_stream could not be inspected: {r.stderr.strip()[-300:]}"
    return None if r.stdout.strip() == "single" else "interp-engine now has batched generation"


def _kv_switch_only_generation(cell: dict, **_) -> str | None:
    """TL's no-KV-cache column repeats TL's cell where the workload generates nothing (the switch cannot matter)."""
    import sys

    sys.path.insert(0, HERE)
    from cell import tokens_of

    if tokens_of(cell["workload"], {"new_tokens": 1, "short_new": 1}) is not None:
        return f"{cell['workload']} generates tokens: the no-KV-cache mode differs there and must be measured"
    return None


def _no_widgets(cell: dict, **_) -> str | None:
    """The notebook widgets are ie_lab's; a peer engine has none (ie_lab engines' cells are never n/a here)."""
    return f"{cell['engine']} is an ie_lab engine: its widgets exist" if cell["engine"] in IE_ENGINES else None


REPLAYS: dict[str, Callable[..., str | None]] = {
    "vllm_no_logits": _vllm_no_logits,
    "vllm_free_position": _vllm_free_position,
    "vllm_graph_lens": _vllm_graph_lens,
    "vllm_graph_attention": _vllm_graph_attention,
    "interp_one_sequence": _interp_one_sequence,
    "kv_switch_only_generation": _kv_switch_only_generation,
    "no_widgets": _no_widgets,
}
NEEDS_GRAPH_SESSION = {"vllm_graph_lens", "vllm_graph_attention"}


def replay_id_for(engine: str, workload: str, reason: str) -> str | None:
    """The replay id of a refusal ie_lab raised (CapabilityUnsupported), from its own words."""
    if "needs one free position" in reason:
        return "vllm_free_position"
    if engine == "ie_vllm_graph" and "in graph mode" in reason:
        return {"lens_topk": "vllm_graph_lens", "attention": "vllm_graph_attention"}.get(workload)
    return None


def na_cells() -> list[dict]:
    """Every n/a cell of the committed results, with the file it came from."""
    import glob
    import json

    out = []
    for p in sorted(glob.glob(os.path.join(HERE, "results", "sidebyside", "*", "*.json"))):
        c = json.load(open(p))
        if c.get("status") == "n/a":
            out.append(dict(c, path=os.path.relpath(p, ROOT)))
    return out
