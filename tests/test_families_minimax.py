"""MiniMax (issue 20 item 3): a hybrid of lightning-attention (linear attention) and softmax-attention layers, each
followed by a Mixtral-like sparse MoE, whose residual is taken after each sublayer's input norm and scaled:

    attn_in = input_layernorm(resid_pre)          resid_mid  = a * attn_in + b * attn_out
    mlp_in  = post_attention_layernorm(resid_mid) resid_post = c * mlp_in  + e * mlp_out

(a, b) are full_attn_alpha/beta_factor on attention layers and linear_attn_alpha/beta_factor on lightning layers,
(c, e) mlp_alpha/beta_factor. The binder measures the structure and binds it with the config's factors;
attn_out_post = b * attn_out (what is added, as Granite's residual multiplier), mlp_out_post = e * mlp_out.

The tiny instance (ie_lab.coverage) uses factors away from 1 and distinct per pair, so every neighbour of the right
answer is a shape-correct tensor that must fail: alpha and beta swapped, one dropped, the other layer kind's pair,
the previous layer's tensors, the other branch's input.
"""

from __future__ import annotations

import re

import pytest
import torch

import ie_lab
from ie_lab import coverage, points
from ie_lab.address import Address
from ie_lab.eager.writers import Writers
from ie_lab.errors import StructureError
from tests.conftest import assert_clean, numbers_differ

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)
FACTORS = coverage.OVERRIDES["minimax"]
KINDS = ("linear", "full")  # the tiny instance: layer 0 lightning attention, layer 1 softmax attention


def _pair(kind: str) -> tuple[float, float]:
    return FACTORS[f"{kind}_attn_alpha_factor"], FACTORS[f"{kind}_attn_beta_factor"]


MLP = (FACTORS["mlp_alpha_factor"], FACTORS["mlp_beta_factor"])


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return ie_lab.load(coverage.build_tiny("minimax"), coverage._tokenizer(), quiet=True)


def _sub(lm, L: int) -> str:
    return "mixer" if lm.binding.layers[L].mixer_kind else "attn"


def _not_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not torch.allclose(a, b, **TOL)


def test_it_binds_with_the_configs_factors_per_layer_kind(lm):
    layers = lm.binding.layers
    assert [lb.mixer_kind or "attention" for lb in layers] == ["linear_attention", "attention"]
    for lb, kind in zip(layers, KINDS):
        a, b = _pair(kind)
        assert (lb.attn_alpha, lb.attn_multiplier, lb.mlp_alpha, lb.mlp_multiplier) == (a, b, *MLP)
        assert lb.norm_residual and lb.sparse_moe and lb.routing_args
    assert layers[1].uses_attention_interface and not layers[0].uses_attention_interface
    coverage.check_invariants(lm)


def _hf_truth(lm, L: int) -> dict[str, torch.Tensor]:
    """The layer's tensors read with hooks of our own on transformers' modules, not through ie_lab's binding."""
    layer = lm.hf.model.layers[L]
    got: dict[str, torch.Tensor] = {}

    def keep(name, pre):
        def hook(m, args, kwargs, out=None):
            t = kwargs.get("hidden_states", args[0] if args else None) if pre else out
            got[name] = (t[0] if isinstance(t, tuple) else t).detach().clone()

        return hook

    hs = [
        layer.register_forward_pre_hook(keep("resid_pre", True), with_kwargs=True),
        layer.input_layernorm.register_forward_hook(keep("in", False), with_kwargs=True),
        layer.self_attn.register_forward_hook(keep("out", False), with_kwargs=True),
        layer.post_attention_layernorm.register_forward_pre_hook(keep("resid_mid", True), with_kwargs=True),
        layer.post_attention_layernorm.register_forward_hook(keep("mlp_in", False), with_kwargs=True),
        layer.mlp.register_forward_hook(keep("mlp_out", False), with_kwargs=True),
        layer.register_forward_hook(keep("resid_post", False), with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            lm.hf(input_ids=X, use_cache=False)
    finally:
        for h in hs:
            h.remove()
    return got


@pytest.mark.parametrize("L", [0, 1])
def test_points_are_transformers_tensors(lm, L):
    """Each point is the tensor transformers' own modules pass (hooks of this test's own), and the sublayer's
    contribution is its output times beta: the raw output, or alpha times it, is not."""
    s = _sub(lm, L)
    c = ie_lab.capture(
        lm,
        X,
        [f"{p}.{L}" for p in ("resid_pre", f"{s}_in", f"{s}_out", f"{s}_out_post", "resid_mid")]
        + [f"{p}.{L}" for p in ("mlp_in", "mlp_out", "mlp_out_post", "resid_post")],
    )
    t = _hf_truth(lm, L)
    a, b = _pair(KINDS[L])
    pairs = [
        ("resid_pre", "resid_pre"),
        (f"{s}_in", "in"),
        (f"{s}_out", "out"),
        ("resid_mid", "resid_mid"),
        ("mlp_in", "mlp_in"),
        ("mlp_out", "mlp_out"),
        ("resid_post", "resid_post"),
    ]
    for ours, theirs in pairs:
        torch.testing.assert_close(c[f"{ours}.{L}"], t[theirs], **TOL)
    torch.testing.assert_close(c[f"{s}_out_post.{L}"], b * t["out"], **TOL)
    torch.testing.assert_close(c[f"mlp_out_post.{L}"], MLP[1] * t["mlp_out"], **TOL)
    for wrong in (t["out"], a * t["out"]):
        assert _not_close(c[f"{s}_out_post.{L}"], wrong)
    for wrong in (t["mlp_out"], MLP[0] * t["mlp_out"]):
        assert _not_close(c[f"mlp_out_post.{L}"], wrong)


@pytest.mark.parametrize("L", [0, 1])
def test_the_alpha_beta_residual_and_its_neighbours(lm, L):
    """resid_mid = a * attn_in + attn_out_post and resid_post = c * mlp_in + mlp_out_post hold; every shape-correct
    neighbour fails: alpha and beta swapped, alpha dropped (the plain resid_pre + out_post), beta dropped, the other
    layer kind's pair, the previous layer's tensors, the other branch's input."""
    s = _sub(lm, L)
    P = (L - 1) % 2  # the previous layer (layer 0's is the last), of the other kind
    names = ["resid_pre", f"{s}_in", f"{s}_out", f"{s}_out_post", "resid_mid", "mlp_in", "mlp_out", "mlp_out_post"]
    names += ["resid_post"]
    c = ie_lab.capture(lm, X, [f"{n}.{L}" for n in names] + [f"{n}.{P}" for n in ("resid_mid", "mlp_in")])
    prev = ie_lab.capture(lm, X, [f"{_sub(lm, P)}_in.{P}", f"{_sub(lm, P)}_out.{P}", f"mlp_out.{P}"])
    a, b = _pair(KINDS[L])
    oa, ob = _pair(KINDS[P])
    x_in, out, mid = c[f"{s}_in.{L}"], c[f"{s}_out.{L}"], c[f"resid_mid.{L}"]
    torch.testing.assert_close(a * x_in + c[f"{s}_out_post.{L}"], mid, **TOL)
    torch.testing.assert_close(a * x_in + b * out, mid, **TOL)
    wrong_mid = {
        "swapped": b * x_in + a * out,
        "alpha dropped (resid_pre)": c[f"resid_pre.{L}"] + b * out,
        "alpha dropped (attn_in)": x_in + b * out,
        "beta dropped": a * x_in + out,
        "the other kind's pair": oa * x_in + ob * out,
        "the previous layer's input": a * prev[f"{_sub(lm, P)}_in.{P}"] + b * out,
        "the previous layer's output": a * x_in + b * prev[f"{_sub(lm, P)}_out.{P}"],
        "the other branch's input": a * c[f"mlp_in.{L}"] + b * out,
    }
    for why, t in wrong_mid.items():
        assert t.shape == mid.shape and _not_close(t, mid), why
    ca, ce = MLP
    m_in, m_out, post = c[f"mlp_in.{L}"], c[f"mlp_out.{L}"], c[f"resid_post.{L}"]
    torch.testing.assert_close(ca * m_in + c[f"mlp_out_post.{L}"], post, **TOL)
    wrong_post = {
        "swapped": ce * m_in + ca * m_out,
        "alpha dropped (resid_mid)": mid + ce * m_out,
        "beta dropped": ca * m_in + m_out,
        "the attention pair": a * m_in + b * m_out,
        "the previous layer's input": ca * c[f"mlp_in.{P}"] + ce * m_out,
        "the previous layer's output": ca * m_in + ce * prev[f"mlp_out.{P}"],
        "the other branch's input": ca * x_in + ce * m_out,
    }
    for why, t in wrong_post.items():
        assert t.shape == post.shape and _not_close(t, post), why


def test_factors_the_config_does_not_state_are_refused(lm):
    """The binder checks the measured factors against the config: a model whose layers scale by other factors
    than its config says (here, one layer's alpha and beta swapped on the module) is refused naming both, and the
    model is left as it was."""
    model = coverage.build_tiny("minimax")
    layer = model.model.layers[0]
    layer.attn_alpha_factor, layer.attn_beta_factor = layer.attn_beta_factor, layer.attn_alpha_factor
    with pytest.raises(StructureError) as e:
        ie_lab.load(model, coverage._tokenizer(), quiet=True)
    # the measured factors (a least-squares fit, printed .4g) compared as numbers, the config's beside them
    found = re.search(
        r"layer 0 .*measured as (resid_mid = .*?), but the config's .* say (resid_mid = .*? \* attn_out)", str(e.value)
    )
    assert found, str(e.value)
    measured, stated = found.group(1).split(",")[0], found.group(2)
    assert numbers_differ("resid_mid = 1.5 * attn_in + 0.6 * attn_out", measured) is None, measured
    assert numbers_differ("resid_mid = 0.6 * attn_in + 1.5 * attn_out", stated) is None, stated
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_without_factors_in_the_config_the_residual_is_refused():
    """The same block with a config that names no factors (mlp_alpha_factor removed from what ie_lab reads) is
    refused, the measured factors named: ie_lab binds the alpha/beta residual only with the config's factors."""
    from ie_lab.arch.config_facts import ArchFacts

    model = coverage.build_tiny("minimax")
    facts = ArchFacts.from_config(model.config)
    bare = type(facts)(**{**facts.__dict__, "residual_factors": ()})
    from ie_lab.arch.binder import bind

    with pytest.raises(StructureError, match=r"input norm's output, not resid_pre \(resid_mid = ") as e:
        bind(model, bare)
    found = re.search(r"\((resid_mid = .*? \* mixer output),", str(e.value))  # measured factors, printed .4g
    assert found, str(e.value)
    want = "resid_mid = 0.6 * input_norm(resid_pre) + 1.5 * mixer output"
    assert numbers_differ(want, found.group(1)) is None, found.group(1)


def test_the_mixer_layer_refuses_attention_points_and_the_attention_layer_mixer_points(lm):
    for p in ("attn_out", "z", "attn_probs", "value", "attn_in"):
        with pytest.raises(ie_lab.PointAbsent, match="layer 0 is a linear_attention mixer layer"):
            ie_lab.capture(lm, X[:1], [f"{p}.0"])
    for p in ("mixer_out", "mixer_in", "mixer_state"):
        with pytest.raises(ie_lab.PointAbsent, match="layer 1 is an attention layer.*0 linear_attention"):
            ie_lab.capture(lm, X[:1], [f"{p}.1"])
    s = points.Structure.from_binding(lm.binding)
    assert s.mixer_layers == (0,) and s.moe_layers == (0, 1)
    assert_clean(lm)


def test_the_picker_draws_the_layer_kinds(lm):
    from ie_lab.widgets.picker import cheatsheet

    p = cheatsheet(lm, layer=0)
    assert p.spec["layer_mixers"] == ["linear_attention", "attention"]
    assert p.spec["layer_kinds_text"] == "layer 0: linear_attention (mixer); 1: attention"
    assert p.layer_kind == "linear_attention"
    p.layer = 1
    assert p.layer_kind == "attention"


def test_moe_points_route_each_token_to_k_experts(lm):
    """As on Mixtral: router_logits are the gate's logits, expert_weights the renormalised top-k softmax on the
    chosen experts only; the other layer's routing (same shape) is not this layer's."""
    k = lm.facts.experts_per_token
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in (0, 1) for p in ("router_logits", "expert_weights", "mlp_in")])
    for L in (0, 1):
        logits, w = c[f"router_logits.{L}"], c[f"expert_weights.{L}"]
        with torch.no_grad():
            torch.testing.assert_close(logits, c[f"mlp_in.{L}"] @ lm.hf.model.layers[L].mlp.gate.weight.T, **TOL)
        top = torch.softmax(logits.float(), -1).topk(k, -1)
        want = torch.zeros_like(w).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
        torch.testing.assert_close(w, want, **TOL)
        assert _not_close(c[f"expert_weights.{1 - L}"], want)


def _shift(lm, point: str, L: int, v: torch.Tensor, read: list[str]) -> tuple[dict, dict]:
    before = ie_lab.capture(lm, X, read)
    with ie_lab.steer(lm, f"{point}.{L}", v):
        after = ie_lab.capture(lm, X, read)
    assert_clean(lm)
    return before, after


@pytest.mark.parametrize("L", [0, 1])
def test_steering_a_sublayer_output_moves_resid_mid_by_what_is_added(lm, L):
    """Adding v at attn_out / mixer_out (the raw output) moves resid_mid by beta * v; adding it at *_out_post (what
    is added) moves it by v, as on Granite's residual multiplier. v alone, or alpha * v, is not the shift."""
    s = _sub(lm, L)
    a, b = _pair(KINDS[L])
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1))
    for point, want, wrongs in ((f"{s}_out", b, (1.0, a)), (f"{s}_out_post", 1.0, (a, b))):
        before, after = _shift(lm, point, L, v, [f"resid_mid.{L}", f"{s}_out.{L}"])
        moved = after[f"resid_mid.{L}"] - before[f"resid_mid.{L}"]
        torch.testing.assert_close(moved, (want * v).expand_as(moved), **TOL)
        for wrong in wrongs:
            assert _not_close(moved, (wrong * v).expand_as(moved)), (point, wrong)
    ce = MLP[1]
    before, after = _shift(lm, "mlp_out", L, v, [f"resid_post.{L}"])
    moved = after[f"resid_post.{L}"] - before[f"resid_post.{L}"]
    torch.testing.assert_close(moved, (ce * v).expand_as(moved), **TOL)
    assert _not_close(moved, v.expand_as(moved))


@pytest.mark.parametrize("L", [0, 1])
def test_writing_a_sublayer_input_reaches_the_residual_add_too(lm, L):
    """attn_in / mixer_in (and mlp_in) is the input norm's output, which is also what the residual adds to: a write
    there reaches both, so the identity holds with the written value; written at the sublayer's own input instead,
    the residual would keep the unwritten one (the neighbour below)."""
    s = _sub(lm, L)
    a, b = _pair(KINDS[L])
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    read = [f"{s}_in.{L}", f"{s}_out_post.{L}", "resid_mid", "mlp_in", "mlp_out_post", "resid_post"]
    read = [r if "." in r else f"{r}.{L}" for r in read]
    before, after = _shift(lm, f"{s}_in", L, v, read)
    torch.testing.assert_close(after[f"{s}_in.{L}"], before[f"{s}_in.{L}"] + v, **TOL)
    torch.testing.assert_close(a * after[f"{s}_in.{L}"] + after[f"{s}_out_post.{L}"], after[f"resid_mid.{L}"], **TOL)
    unwritten = a * before[f"{s}_in.{L}"] + after[f"{s}_out_post.{L}"]
    assert _not_close(unwritten, after[f"resid_mid.{L}"])
    before, after = _shift(lm, "mlp_in", L, v, read)
    torch.testing.assert_close(after[f"mlp_in.{L}"], before[f"mlp_in.{L}"] + v, **TOL)
    torch.testing.assert_close(after[f"resid_mid.{L}"], before[f"resid_mid.{L}"])
    ca = MLP[0]
    torch.testing.assert_close(ca * after[f"mlp_in.{L}"] + after[f"mlp_out_post.{L}"], after[f"resid_post.{L}"], **TOL)
    assert _not_close(ca * before[f"mlp_in.{L}"] + after[f"mlp_out_post.{L}"], after[f"resid_post.{L}"])


@pytest.mark.parametrize("L", [0, 1])
def test_writing_resid_mid_is_what_the_pre_mlp_norm_reads(lm, L):
    """resid_mid's one reader is the pre-MLP norm (the MLP's residual is that norm's output): a write takes
    exactly the written value, the MLP reads its norm, and the stream after is c * mlp_in + mlp_out_post."""
    donor = ie_lab.capture(lm, X.flip(0), [f"resid_mid.{L}"])[f"resid_mid.{L}"]
    read = [f"{p}.{L}" for p in ("resid_mid", "mlp_in", "mlp_out_post", "resid_post", "resid_pre")]
    clean = ie_lab.capture(lm, X, read)
    with Writers(lm, [(Address("resid_mid", L), lambda t, off: donor)]):
        c = ie_lab.capture(lm, X, read)
    assert_clean(lm)
    torch.testing.assert_close(c[f"resid_mid.{L}"], donor, **TOL)
    torch.testing.assert_close(c[f"resid_pre.{L}"], clean[f"resid_pre.{L}"])
    with torch.no_grad():
        torch.testing.assert_close(lm.hf.model.layers[L].post_attention_layernorm(donor), c[f"mlp_in.{L}"], **TOL)
    torch.testing.assert_close(MLP[0] * c[f"mlp_in.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
    assert _not_close(c[f"resid_post.{L}"], clean[f"resid_post.{L}"])


def test_gradients_through_attn_in_include_the_residual_path(lm):
    """With grad=True, d resid_mid / d attn_in counts the residual add (alpha) as well as attention: checked against
    a finite difference of the input norm's output (what attn_in is, on transformers' side). Linked at attention's own input, the alpha path would be missing (the
    neighbour, off by alpha * <w, u>). (mixer_in is not a linkable point on any hybrid yet: the attention layer only.)"""
    for L in (1,):
        s = _sub(lm, L)
        a = _pair(KINDS[L])[0]
        g = torch.Generator().manual_seed(3)
        w = torch.randn(X[:1].shape[1], lm.facts.d_model, generator=g)
        u = torch.randn(lm.facts.d_model, generator=g)
        c = ie_lab.capture(lm, X[:1], [f"{s}_in.{L}", f"resid_mid.{L}"], grad=True)
        (grad,) = torch.autograd.grad((c[f"resid_mid.{L}"] * w).sum(), c[f"{s}_in.{L}"])
        analytic = float((grad * u).sum())
        eps = 1e-3
        mids = []
        norm = lm.hf.model.layers[L].input_layernorm  # moved by a hook of our own: transformers' attn_in
        for sign in (1, -1):
            h = norm.register_forward_hook(lambda m, a, o, sign=sign, eps=eps, u=u: o + sign * eps * u)
            try:
                mids.append(ie_lab.capture(lm, X[:1], [f"resid_mid.{L}"])[f"resid_mid.{L}"])
            finally:
                h.remove()
        numeric = float(((mids[0] - mids[1]) * w).sum()) / (2 * eps)
        assert abs(analytic - numeric) < 2e-2 * max(1.0, abs(numeric)), (L, analytic, numeric)
        missing = analytic - a * float((w * u).sum())
        assert abs(missing - numeric) > 0.1 * max(1.0, abs(numeric)), (L, missing, numeric)
    assert_clean(lm)


def test_generation_matches_transformers(lm):
    """MiniMax keeps the lightning state in a cache of its own kind (MiniMaxCache): the decode loop carries it, and
    greedy tokens are transformers' own."""
    out = ie_lab.generate(lm, X[:1, :5], max_new_tokens=4)
    ref = lm.hf.generate(X[:1, :5], max_new_tokens=4, do_sample=False)
    assert list(out.ids) == ref[0, 5:].tolist()
    assert_clean(lm)


def _lightning_state(attn, mixer_in: torch.Tensor, key: str = "k", decay: bool = True) -> torch.Tensor:
    """The lightning attention's state after the prompt, from its definition: sum over positions t of
    exp(-slope * (n - 1 - t)) * k_t^T v_t per head, with q, k, v the activated qkv projection's per-head thirds.
    key="q" reads the query third instead (the other projection: a shape-correct neighbour)."""
    b, n, _ = mixer_in.shape
    H, d = attn.num_attention_heads, attn.head_dim
    with torch.no_grad():
        qkv = attn.act_fn(attn.qkv_proj(mixer_in)).reshape(b, n, H, 3 * d)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, d, dim=3))  # [b, H, n, d]
    k = q if key == "q" else k
    w = torch.exp(-attn.slope_rate * (n - 1 - torch.arange(n, dtype=mixer_in.dtype)))  # [H, 1, n]
    w = w.reshape(1, H, n, 1) if decay else torch.ones(1, H, n, 1)
    return (k * w).transpose(-1, -2) @ v


def test_mixer_state_is_the_lightning_key_value_state(lm):
    """mixer_state.0 is the [batch, heads, head_dim, head_dim] state MiniMax keeps in its own cache (linear_cache),
    as transformers' forward leaves it, and as the recurrence defines it from mixer_in (across the tiny instance's
    blocks of 4 tokens); the state one token earlier, the query third in place of the keys, or no decay, fail. The
    lightning layer has no convolution state, and the attention layer no state at all."""
    L = 0
    attn = lm.hf.model.layers[L].self_attn
    c = ie_lab.capture(lm, X, [f"mixer_state.{L}", f"mixer_in.{L}"])
    state = c[f"mixer_state.{L}"]
    assert state.shape == (2, attn.num_attention_heads, attn.head_dim, attn.head_dim)
    with torch.no_grad():
        out = lm.hf(input_ids=X, use_cache=True)
    own = getattr(out, "cache", None) or out.past_key_values
    assert type(own).__name__ == "MiniMaxCache"
    torch.testing.assert_close(state, own.linear_cache[L], **TOL)
    torch.testing.assert_close(state, _lightning_state(attn, c[f"mixer_in.{L}"]), **TOL)
    earlier = ie_lab.capture(lm, X[:, :-1], [f"mixer_state.{L}"])[f"mixer_state.{L}"]
    for wrong in (
        earlier,
        _lightning_state(attn, c[f"mixer_in.{L}"], key="q"),
        _lightning_state(attn, c[f"mixer_in.{L}"], decay=False),
    ):
        assert wrong.shape == state.shape and _not_close(wrong, state)
    with pytest.raises(ie_lab.PointAbsent, match="no convolution state"):
        ie_lab.capture(lm, X, [f"mixer_conv_state.{L}"])
    with pytest.raises(ie_lab.CapabilityUnsupported, match="final state"):
        Writers(lm, [(Address("mixer_state", L), lambda t, off: t)])
    assert_clean(lm)
