"""Hybrid trunks (issue 20 item 3) and gated attention: a layer whose token mixer is not attention serves mixer_in /
mixer_out / mixer_out_post and every residual and MLP point, refuses the attention points naming its kind, and
steers; an attention output gate is measured: z is o_proj's input (the gated product), attn_gate the gate.

Each identity is checked against the neighbouring layer's tensor too (same shape, wrong place): it must fail there.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, points
from ie_lab.address import Address
from ie_lab.eager.writers import Writers
from ie_lab.errors import IELabError
from tests.conftest import assert_clean
from tests.families import make_model, make_tokenizer

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
TOL = dict(atol=2e-4, rtol=1e-4)

# family -> the kind of each layer, as the binder must report it (None: attention)
HYBRIDS = {
    "qwen3_next": ("linear_attention", None),  # gated delta net, then gated attention (tests/families.py)
    "jamba": ("mamba", None),  # selective state space (slow torch path), then attention
    "bamba": ("linear_attention", None),  # Mamba 2 mixer, then attention
    "lfm2": ("conv", None),  # short convolution, then attention
    "recurrent_gemma": ("recurrent", None),  # RG-LRU recurrence (transformers 5.24 names it linear_attention)
    "granitemoehybrid": ("linear_attention", None),  # Mamba 2 mixer, then attention; a shared expert beside each MoE
    "xlstm": ("mlstm", "mlstm"),  # every block: mLSTM recurrence, then a gated MLP (no config key names the mixer)
}


def _load(family: str):
    if family == "qwen3_next":
        return ie_lab.load(make_model(family), make_tokenizer(), quiet=True)
    model = coverage.build_tiny(family)
    with torch.no_grad():  # xLSTM starts its output projections at zero: a zero sublayer output proves nothing
        gen = torch.Generator().manual_seed(5)
        for w in model.parameters():
            if w.ndim >= 2 and w.is_floating_point() and not w.any():
                w.copy_(0.05 * torch.randn(w.shape, generator=gen))
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    torch.set_num_threads(1)
    return request.param, _load(request.param)


def _sub(lm, L: int) -> str:
    return "mixer_out_post" if lm.binding.layers[L].mixer_kind else "attn_out_post"


def test_layer_kinds_are_measured_and_the_invariants_hold(hybrid):
    family, lm = hybrid
    kinds = tuple(lb.mixer_kind or None for lb in lm.binding.layers)
    # the label is the config's own name for the layer type, which newer transformers may spell linear_attention
    assert kinds in (HYBRIDS[family], tuple(k and "linear_attention" for k in HYBRIDS[family])), kinds
    s = points.Structure.from_binding(lm.binding)
    assert s.mixer_layers == tuple(i for i, k in enumerate(kinds) if k)
    coverage.check_invariants(lm)


def test_residual_identities_per_layer_kind_fail_with_the_neighbour_layer(hybrid):
    """resid_pre + (mixer|attn)_out_post = resid_mid and resid_mid + mlp_out_post = resid_post on every layer kind;
    the other layer's sublayer output (a shape-correct neighbour) must break both."""
    _, lm = hybrid
    n = lm.facts.n_layers
    names = [
        f"{p}.{L}" for L in range(n) for p in ("resid_pre", _sub(lm, L), "resid_mid", "mlp_out_post", "resid_post")
    ]
    c = ie_lab.capture(lm, X, names)
    for L in range(n):
        other = (L - 1) % n  # the previous layer (layer 0's neighbour is the last layer)
        sub, sub_other = f"{_sub(lm, L)}.{L}", f"{_sub(lm, other)}.{other}"
        torch.testing.assert_close(c[f"resid_pre.{L}"] + c[sub], c[f"resid_mid.{L}"], **TOL)
        torch.testing.assert_close(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
        assert c[sub_other].shape == c[sub].shape
        assert not torch.allclose(c[f"resid_pre.{L}"] + c[sub_other], c[f"resid_mid.{L}"], **TOL)
        assert not torch.allclose(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{other}"], c[f"resid_post.{L}"], **TOL)


def test_mixer_out_is_the_mixer_modules_output_and_mixer_in_its_input(hybrid):
    _, lm = hybrid
    for lb in lm.binding.layers:
        if not lb.mixer_kind:
            continue
        L = lb.index
        seen: dict[str, torch.Tensor] = {}
        h = lb.attn.register_forward_hook(lambda m, a, o, seen=seen: seen.setdefault("out", _first(o)))
        try:
            c = ie_lab.capture(lm, X, [f"mixer_in.{L}", f"mixer_out.{L}", f"resid_pre.{L}"])
        finally:
            h.remove()
        torch.testing.assert_close(c[f"mixer_out.{L}"], seen["out"])
        # the input norm sits between the residual and the mixer: mixer_in is not resid_pre
        assert not torch.allclose(c[f"mixer_in.{L}"], c[f"resid_pre.{L}"], **TOL)


def _first(o):
    from ie_lab.arch.binder import first_tensor

    return first_tensor(o).detach().clone()


def test_attention_points_are_refused_on_mixer_layers_naming_the_kind(hybrid):
    family, lm = hybrid
    for lb in lm.binding.layers:
        L = lb.index
        for p in points.all_points():
            if p.scope is not points.Scope.LAYER or p.multi_stream_only:
                continue
            wrong_kind = (points.Needs.ATTENTION in p.needs and lb.mixer_kind) or (
                points.Needs.MIXER in p.needs and not lb.mixer_kind
            )
            try:
                ie_lab.capture(lm, X[:1], [f"{p.name}.{L}"])
            except ie_lab.PointAbsent as e:
                if wrong_kind:
                    assert (lb.mixer_kind or "attention layer") in str(e), str(e)
                continue
            except IELabError:
                assert not wrong_kind, p.name
                continue
            # no other exception class may escape (a crash is a defect); a served point is on its kind of layer
            assert not wrong_kind, f"{family}: {p.name}.{L} served on a {lb.mixer_kind or 'attention'} layer"
    assert_clean(lm)


@pytest.mark.parametrize("point", ["mixer_out", "mixer_in", "mixer_out_post"])
def test_steering_a_mixer_point_moves_the_stream_by_the_vector(hybrid, point):
    """Adding v at mixer_out (no post-mixer norm or multiplier on these families) adds exactly v to resid_mid."""
    _, lm = hybrid
    L = next(lb.index for lb in lm.binding.layers if lb.mixer_kind)
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1))
    before = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_mid.{L}"])
    with ie_lab.steer(lm, f"{point}.{L}", v):
        after = ie_lab.capture(lm, X, [f"{point}.{L}", f"resid_mid.{L}"])
    torch.testing.assert_close(after[f"{point}.{L}"], before[f"{point}.{L}"] + v, **TOL)
    if point != "mixer_in":
        torch.testing.assert_close(after[f"resid_mid.{L}"], before[f"resid_mid.{L}"] + v, **TOL)
    else:
        assert not torch.allclose(after[f"resid_mid.{L}"], before[f"resid_mid.{L}"], **TOL)
    assert_clean(lm)
    again = ie_lab.capture(lm, X, [f"resid_mid.{L}"])
    torch.testing.assert_close(again[f"resid_mid.{L}"], before[f"resid_mid.{L}"])


@pytest.mark.parametrize("family", ["afmoe", "laguna", "qwen3_next", "axk2"])
def test_attention_output_gate_is_measured(family):
    """z is o_proj's input (the gated product; check_invariants holds attn_probs @ value * attn_gate = z), so
    o_proj(z) is attn_out, and gating it again does not give it. The previous layer's z (same shape) does not give
    it; writing z acts there (tests/test_gated_attention.py)."""
    lm = _load(family)
    gated = [lb for lb in lm.binding.layers if lb.attn_gate is not None]
    assert gated, "no gate measured"
    coverage.check_invariants(lm)  # includes attn_probs @ value = z on every attention layer
    n = lm.facts.n_layers
    for lb in gated:
        L = lb.index
        c = ie_lab.capture(lm, X, [f"z.{L}", f"attn_gate.{L}", f"attn_out.{L}"])
        with torch.no_grad():
            torch.testing.assert_close(lb.o_proj(c[f"z.{L}"]), c[f"attn_out.{L}"], **TOL)
            assert not torch.allclose(lb.o_proj(c[f"z.{L}"] * c[f"attn_gate.{L}"]), c[f"attn_out.{L}"], **TOL)
        other = next((o.index for o in gated if o.index != L), None)
        if other is not None:
            z_other = ie_lab.capture(lm, X, [f"z.{other}"])[f"z.{other}"]
            if z_other.shape == c[f"z.{L}"].shape:
                with torch.no_grad():
                    assert not torch.allclose(lb.o_proj(z_other), c[f"attn_out.{L}"], **TOL)
        assert_clean(lm)
    assert n >= 1


@pytest.fixture(scope="module", params=["mamba", "mamba2", "falcon_mamba"])
def ssm(request):
    torch.set_num_threads(1)
    return request.param, _load(request.param)  # the slow torch path (no mamba_ssm kernels here)


def test_state_space_blocks_bind_and_fail_with_the_neighbour_layer(ssm):
    """A pure state-space trunk: every block is norm -> mixer -> residual add, with no MLP. resid_pre +
    mixer_out_post = resid_post on each layer; the other layer's mixer output (same shape) does not add up."""
    _, lm = ssm
    assert all(lb.mixer_kind == "state_space" and not lb.has_mlp for lb in lm.binding.layers)
    coverage.check_invariants(lm)
    n = lm.facts.n_layers
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in ("resid_pre", "mixer_out_post", "resid_post")])
    for L in range(n):
        other = (L - 1) % n
        torch.testing.assert_close(c[f"resid_pre.{L}"] + c[f"mixer_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
        assert c[f"mixer_out_post.{other}"].shape == c[f"mixer_out_post.{L}"].shape
        assert not torch.allclose(c[f"resid_pre.{L}"] + c[f"mixer_out_post.{other}"], c[f"resid_post.{L}"], **TOL)


def test_state_space_blocks_refuse_mlp_and_attention_points(ssm):
    _, lm = ssm
    for p in points.all_points():
        if p.scope is not points.Scope.LAYER or p.multi_stream_only:
            continue
        absent = points.Needs.ATTENTION in p.needs or points.Needs.MLP in p.needs
        try:
            ie_lab.capture(lm, X[:1], [f"{p.name}.1"])
        except ie_lab.PointAbsent as e:
            assert absent, p.name
            assert "mixer-only block" in str(e) or "state_space mixer layer" in str(e), str(e)
            continue
        assert not absent, p.name  # and nothing but an IELabError escapes
    assert_clean(lm)


def test_steering_a_state_space_mixer_moves_resid_post(ssm):
    _, lm = ssm
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    before = ie_lab.capture(lm, X, ["resid_post.0"])["resid_post.0"]
    with ie_lab.steer(lm, "mixer_out.0", v):
        after = ie_lab.capture(lm, X, ["resid_post.0"])["resid_post.0"]
    torch.testing.assert_close(after, before + v, **TOL)
    assert_clean(lm)


def test_generation_runs_or_is_refused_before_any_forward(hybrid):
    """Generating on a hybrid either decodes (its cache carries both kinds of layer) or, where the forward hands no
    KV cache back (RecurrentGemma), is refused with an IELabError before the first forward: it crashed with an
    AttributeError after it."""
    _, lm = hybrid
    _generate_or_refuse(lm)


def test_generation_on_a_state_space_trunk_runs_or_is_refused(ssm):
    _, lm = ssm
    _generate_or_refuse(lm)


def _generate_or_refuse(lm):
    calls = []
    h = lm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        out = ie_lab.generate(lm, X[:1, :4], max_new_tokens=3, capture=["resid_post.0"])
    except IELabError as e:
        assert "KV cache" in str(e), str(e)
        assert not calls  # refused before any forward ran
    else:
        assert out is not None and calls
    finally:
        h.remove()
    assert_clean(lm)


def test_attention_sub_norm_is_measured():
    """BitNet normalises the kernel's output before o_proj (attn_sub_norm; it was refused): z is the kernel's output
    (attn_probs @ value), o_proj reads sub_norm(z), so o_proj(z) is not attn_out; writing z is refused."""
    lm = _load("bitnet")
    coverage.check_invariants(lm)
    for lb in lm.binding.layers:
        L = lb.index
        assert lb.z_sub_norm is not None and lb.attn_gate is None
        c = ie_lab.capture(lm, X, [f"z.{L}", f"attn_out.{L}"])
        with torch.no_grad():
            torch.testing.assert_close(lb.o_proj(lb.z_sub_norm(c[f"z.{L}"])), c[f"attn_out.{L}"], **TOL)
            assert not torch.allclose(lb.o_proj(c[f"z.{L}"]), c[f"attn_out.{L}"], **TOL)
        with pytest.raises(ie_lab.CapabilityUnsupported, match="norm"):
            with Writers(lm, [(Address("z", L), lambda t, off: t)]):
                pass
        with pytest.raises(ie_lab.PointAbsent):
            ie_lab.capture(lm, X, [f"attn_gate.{L}"])
    assert_clean(lm)


def test_the_config_only_picker_knows_the_mixer_layers(hybrid):
    """The cheat sheet (config only) greys the same points on the same layers as the picker on the loaded model:
    attention points on mixer layers, mixer points on attention layers (it served attn_out on every layer)."""
    from ie_lab.widgets.picker import describe

    _, lm = hybrid
    live = {p["name"]: p for p in describe(lm.facts, "eager", lm=lm)["points"]}
    config = {p["name"]: p for p in describe(lm.facts, "eager")["points"]}
    for name in ("attn_out", "z", "mixer_out", "mixer_in", "mlp_out", "resid_mid"):
        assert config[name]["served"] == live[name]["served"], name
        assert config[name]["why"] == live[name]["why"], name
    mixers = [lb.index for lb in lm.binding.layers if lb.mixer_kind]
    assert all(live["attn_out"]["served"][L] == "0" and live["mixer_out"]["served"][L] == "1" for L in mixers)


# Single-sublayer trunks: each block is exactly one of a mixer, attention, or an MLP/MoE, as the config's per-layer
# type list says; layer L is the config's block L, and its kind as the registry names it.
SINGLE_SUBLAYER = {
    "nemotron_h": ("linear_attention", "moe", "attention", "mlp"),
    # a Mamba layer, then Mamba layers whose input also receives the shared transformer block's output
    "zamba": ("linear_attention", "hybrid", "hybrid"),
    "zamba2": ("linear_attention", "hybrid"),
}
_ONE_SUB = {"attention": "attn_out_post", "mlp": "mlp_out_post", "moe": "mlp_out_post"}


@pytest.fixture(scope="module", params=sorted(SINGLE_SUBLAYER))
def single(request):
    torch.set_num_threads(1)
    return request.param, _load(request.param)


def _one_sub(kind: str) -> str:
    return _ONE_SUB.get(kind, "mixer_out_post")


def test_single_sublayer_blocks_bind_per_kind_and_fail_with_the_neighbour_layer(single):
    """resid_pre + (the block's one sublayer output) = resid_post on every kind of block (mixer, MoE, attention,
    MLP); the previous layer's sublayer output (same shape, another kind of block) does not add up, nor does the
    same layer's resid_pre alone."""
    family, lm = single
    s = points.Structure.from_binding(lm.binding)
    n = lm.facts.n_layers
    assert tuple(s.layer_kind(L) for L in range(n)) == SINGLE_SUBLAYER[family]
    assert s.mlp_only_layers == tuple(L for L in range(n) if SINGLE_SUBLAYER[family][L] in ("mlp", "moe"))
    assert points.Structure.from_facts(lm.facts).mlp_only_layers == s.mlp_only_layers  # the config says the same
    coverage.check_invariants(lm)
    subs = [_one_sub(s.layer_kind(L)) for L in range(n)]
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in ("resid_pre", subs[L], "resid_post")])
    for L in range(n):
        other = (L - 1) % n
        torch.testing.assert_close(c[f"resid_pre.{L}"] + c[f"{subs[L]}.{L}"], c[f"resid_post.{L}"], **TOL)
        assert c[f"{subs[other]}.{other}"].shape == c[f"{subs[L]}.{L}"].shape
        assert not torch.allclose(c[f"resid_pre.{L}"] + c[f"{subs[other]}.{other}"], c[f"resid_post.{L}"], **TOL)
        if L + 1 < n:
            torch.testing.assert_close(c[f"resid_post.{L}"], c[f"resid_pre.{L + 1}"])


def test_single_sublayer_blocks_refuse_what_their_kind_lacks_naming_it(single):
    """resid_mid exists on no block; attention points on attention blocks only, mixer points on mixer blocks only,
    MLP points on MLP/MoE blocks only; every refusal is a PointAbsent naming the block's kind."""
    _, lm = single
    s = points.Structure.from_binding(lm.binding)
    for L in range(lm.facts.n_layers):
        kind = s.layer_kind(L)
        for p in points.all_points():
            if p.scope is not points.Scope.LAYER or p.multi_stream_only:
                continue
            absent = (
                p.name == "resid_mid"
                or (points.Needs.ATTENTION in p.needs and kind != "attention")
                or (points.Needs.MIXER in p.needs and kind in ("attention", "mlp", "moe"))
                or (points.Needs.MLP in p.needs and kind not in ("mlp", "moe"))
            )
            try:
                ie_lab.capture(lm, X[:1], [f"{p.name}.{L}"])
            except ie_lab.PointAbsent as e:
                kind_need = (points.Needs.ATTENTION, points.Needs.MIXER, points.Needs.MLP, points.Needs.TOKEN_MIXER)
                a = points.absence(p, s, L)
                assert a is not None and (a.need in kind_need) == absent, f"{p.name}.{L} on a {kind} block: {e}"
                if not absent:
                    continue  # absent for another reason (a MoE block has no single mlp_pre; no QK-norm here)
                words = {"attention": "attention", "mlp": "MLP-only block", "moe": "MLP-only block"}
                assert words.get(kind, kind) in str(e), str(e)
                continue
            except IELabError:
                assert not absent, p.name
                continue
            assert not absent, f"{p.name}.{L} served on a {kind} block"
    assert_clean(lm)


def test_steering_every_single_sublayer_block_moves_resid_post_by_the_vector(single):
    """Steering works on every layer: v added at the block's one sublayer output (mixer_out / attn_out / mlp_out; no
    post-norm or multiplier here) moves resid_post by exactly v, and the layer's input not at all."""
    _, lm = single
    s = points.Structure.from_binding(lm.binding)
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3))
    for L in range(lm.facts.n_layers):
        point = _one_sub(s.layer_kind(L)).replace("_post", "") + f".{L}"
        names = [f"resid_pre.{L}", f"resid_post.{L}"]
        before = ie_lab.capture(lm, X, names)
        with ie_lab.steer(lm, point, v):
            after = ie_lab.capture(lm, X, names)
        torch.testing.assert_close(after[f"resid_pre.{L}"], before[f"resid_pre.{L}"])
        torch.testing.assert_close(after[f"resid_post.{L}"], before[f"resid_post.{L}"] + v, **TOL)
        assert_clean(lm)


def test_the_config_only_picker_draws_single_sublayer_kinds(single):
    """The cheat sheet (config only) names each block's kind and greys the same points as the live picker; the
    block diagram of an MLP-only block has no attention or mixer (the spec's mlp_only_layers)."""
    from ie_lab.widgets.picker import describe

    family, lm = single
    live, config = describe(lm.facts, "eager", lm=lm), describe(lm.facts, "eager")
    assert live["layer_mixers"] == config["layer_mixers"] == list(SINGLE_SUBLAYER[family])
    if {"mlp", "moe"} & set(SINGLE_SUBLAYER[family]):
        assert "MLP-only block" in live["layer_kinds_text"]
    lp, cp = ({p["name"]: p for p in d["points"]} for d in (live, config))
    for name in lp:
        assert lp[name]["served"] == cp[name]["served"], name
    assert live["structure"]["mlp_only_layers"] == config["structure"]["mlp_only_layers"]
    assert config["structure"]["mlp_only_layers"] == [
        L for L, k in enumerate(SINGLE_SUBLAYER[family]) if k in ("mlp", "moe")
    ]


@pytest.mark.parametrize("family", ["zamba", "zamba2"])
def test_a_shared_block_layers_mixer_input_carries_the_shared_blocks_output(family):
    """On Zamba's hybrid layers mixer_in is the mixer's norm of resid_pre plus the shared transformer block's output
    through the layer's linear (the other branch); the norm of resid_pre alone (the Mamba-only layer's recipe, same
    shape) is not it. On the Mamba-only layer it is. The shared block's attention and MLP points are refused there,
    naming the shared block."""
    lm = _load(family)
    seen: dict[int, torch.Tensor] = {}
    hybrid = [lb for lb in lm.binding.layers if lb.mixer_kind == "hybrid"]
    assert hybrid and all(not lb.has_mlp for lb in lm.binding.layers)
    handles = [
        lb.layer.linear.register_forward_hook(lambda m, a, o, i=lb.index: seen.setdefault(i, o.detach().clone()))
        for lb in hybrid
    ]
    try:
        c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(lm.facts.n_layers) for p in ("resid_pre", "mixer_in")])
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for lb in lm.binding.layers:
            L = lb.index
            norm = (lb.layer.mamba_decoder if lb.mixer_kind == "hybrid" else lb.layer).input_layernorm
            alone = norm(c[f"resid_pre.{L}"])
            if lb.mixer_kind != "hybrid":
                torch.testing.assert_close(c[f"mixer_in.{L}"], alone, **TOL)
                continue
            torch.testing.assert_close(c[f"mixer_in.{L}"], norm(c[f"resid_pre.{L}"] + seen[L]), **TOL)
            assert not torch.allclose(c[f"mixer_in.{L}"], alone, **TOL)
            for name in ("z", "attn_out", "mlp_out"):
                with pytest.raises(ie_lab.PointAbsent, match="shared across layers"):
                    ie_lab.capture(lm, X[:1], [f"{name}.{L}"])
    assert_clean(lm)
