"""RWKV (issue 20 item 3): a pure recurrent trunk bound on eager. Each block runs its time mix (a WKV recurrence, the
layer's mixer: module `attention`) on ln1 of the stream, then its channel mix (the layer's MLP: `feed_forward`) on ln2,
each added to the stream. Three things are RWKV's own, measured by the binder and checked here:

- layer 0 normalises the stream itself first (pre_ln): resid_pre.0 is the embedding (the block's input), and
  resid_mid.0 = pre_ln(resid_pre.0) + mixer_out_post.0;
- in eval mode the trunk halves the stream after every rescale_every-th layer (and rescales its weights to match on
  the first eval forward): resid_pre.{L+1} = 0.5 * resid_post.L there, and the final norm reads the halved stream
  after the last layer (the tiny instance: 4 layers, rescale_every=2, so after layers 1 and 3);
- the channel mix reads the previous token too (a token shift) and gates its value projection's output with
  sigmoid(receptance): mlp_out is that gated product, mlp_act the value projection's input.

Its state is the list the forward returns: mixer_state.L is layer L's WKV numerator, denominator and running maximum
([batch, hidden, 3]), mixer_conv_state.L its time mix's token-shift state (its last input, [batch, hidden, 1]). A decode
step started from the captured states gives the full forward's logits; the previous layer's state does not.

Every identity is also checked against a shape-correct neighbour (the previous layer's tensor, the ungated or unscaled
one): it must fail there.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, points
from ie_lab.arch.config_facts import ArchFacts
from ie_lab.errors import IELabError
from tests.conftest import assert_clean

X = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(0))
CORRUPT = torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(1))
NEXT = torch.tensor([[7]])
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    model = coverage.build_tiny("rwkv")
    assert model.config.rescale_every == 2 and model.config.num_hidden_layers == 4
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


def _hf(lm, ids, **kw):
    with torch.no_grad():
        return lm.hf(input_ids=ids, **kw)


def test_every_layer_is_a_time_mix_then_a_channel_mix_and_the_invariants_hold(lm):
    assert [lb.mixer_kind for lb in lm.binding.layers] == ["time_mix"] * 4
    assert all(lb.has_mlp and not lb.mlp_only and lb.names["mixer"] == "attention" for lb in lm.binding.layers)
    s = points.Structure.from_binding(lm.binding)
    assert s.mixer_layers == (0, 1, 2, 3) and s.no_mlp_layers == () and not s.gated_mlp
    # what the cheat sheet reads from the config alone says the same (no head count: no attention anywhere)
    facts = ArchFacts.from_config(lm.hf.config)
    assert facts.n_heads == 0 and facts.mixer_kinds == ("time_mix",) * 4
    assert points.Structure.from_facts(facts, final_norm=True) == s
    assert lm.binding.final_norm is lm.hf.rwkv.ln_out
    coverage.check_invariants(lm)


def test_the_measured_quirks_are_stated_where_the_model_is_described(lm):
    """`ie-lab points rwkv` and Session.describe() print the binder's notes: the stream norm, the halving, the gate
    after the down projection and the token shift (each measured, as the tests below check)."""
    from ie_lab.eager.backend import EagerBackend

    notes = lm.binding.notes
    assert len(notes) == 4, notes
    for words in ("pre_ln(resid_pre.0)", "by 0.5 after layers 1, 3", "sigmoid(feed_forward.receptance)", "token shift"):
        assert any(words in n for n in notes), (words, notes)
    text = EagerBackend.describe(type("B", (), {"lm": lm})())
    assert all(n[1:] in text for n in notes)


def test_layer_0_normalises_the_stream_first_and_resid_pre_0_is_the_embedding(lm):
    """resid_pre.0 is the block's input (the embedding, as on every family); the first residual add reads
    pre_ln(resid_pre.0). resid_pre.0 + mixer_out_post.0 (the identity without the norm) does not give resid_mid.0."""
    b = lm.binding
    assert b.layers[0].stream_norm is lm.hf.rwkv.blocks[0].pre_ln
    assert all(lb.stream_norm is None for lb in b.layers[1:])
    c = ie_lab.capture(lm, X, ["embeddings", "resid_pre.0", "mixer_out_post.0", "mixer_in.0", "resid_mid.0"])
    torch.testing.assert_close(c["resid_pre.0"], c["embeddings"])
    with torch.no_grad():
        normed = b.layers[0].stream_norm(c["resid_pre.0"])
        torch.testing.assert_close(normed + c["mixer_out_post.0"], c["resid_mid.0"], **TOL)
        torch.testing.assert_close(lm.hf.rwkv.blocks[0].ln1(normed), c["mixer_in.0"], **TOL)
    assert not torch.allclose(c["resid_pre.0"] + c["mixer_out_post.0"], c["resid_mid.0"], **TOL)


def test_residual_identities_fail_with_the_neighbour_layer(lm):
    n = lm.facts.n_layers
    names = ["resid_pre", "mixer_out_post", "resid_mid", "mlp_out_post", "resid_post"]
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in names])
    for L in range(n):
        other = (L - 1) % n
        pre = c[f"resid_pre.{L}"]
        if L == 0:
            with torch.no_grad():
                pre = lm.binding.layers[0].stream_norm(pre)
        torch.testing.assert_close(pre + c[f"mixer_out_post.{L}"], c[f"resid_mid.{L}"], **TOL)
        torch.testing.assert_close(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"], c[f"resid_post.{L}"], **TOL)
        assert c[f"mixer_out_post.{other}"].shape == c[f"mixer_out_post.{L}"].shape
        assert not torch.allclose(pre + c[f"mixer_out_post.{other}"], c[f"resid_mid.{L}"], **TOL)
        assert not torch.allclose(c[f"resid_mid.{L}"] + c[f"mlp_out_post.{other}"], c[f"resid_post.{L}"], **TOL)


def test_the_stream_is_halved_every_rescale_every_layers_as_measured(lm):
    """The binder measures the factor between a layer's output and what the next reads: 0.5 after layers 1 and 3
    (rescale_every=2), none elsewhere. transformers' own hidden_states (taken after the halving) agree; resid_post.1
    unscaled is not resid_pre.2, and the last layer's output reaches the final norm halved."""
    b = lm.binding
    assert [lb.stream_scale for lb in b.layers] == [None, 0.5, None, 0.5]
    assert lm.hf.rwkv.layers_are_rescaled  # eval mode: transformers rescaled the weights on the first forward
    n = lm.facts.n_layers
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in ("resid_pre", "resid_post")] + ["final_norm"])
    theirs = _hf(lm, X, output_hidden_states=True, use_cache=False).hidden_states
    for L in range(n):
        s = b.layers[L].stream_scale or 1.0
        torch.testing.assert_close(c[f"resid_post.{L}"] * s, theirs[L], **TOL)
        if L + 1 < n:
            torch.testing.assert_close(c[f"resid_post.{L}"] * s, c[f"resid_pre.{L + 1}"], **TOL)
    assert not torch.allclose(c["resid_post.1"], c["resid_pre.2"], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(b.final_norm(0.5 * c["resid_post.3"]), c["final_norm"], atol=1e-6, rtol=0)
        assert not torch.allclose(b.final_norm(c["resid_post.3"]), c["final_norm"], atol=1e-6, rtol=0)


def test_the_logit_lens_of_the_last_layer_is_the_models_logits(lm):
    """The lens reads a residual through the trunk's own read-out, the halving after the last layer included: on
    the last layer it is the logits exactly (without the factor it is not)."""
    from ie_lab.eager.lens import decode_residual
    from ie_lab.ops.lens import postprocess_logits

    c = ie_lab.capture(lm, X, ["resid_post.3"])
    logits = _hf(lm, X, use_cache=False).logits
    torch.testing.assert_close(decode_residual(lm, c["resid_post.3"]), logits, atol=1e-5, rtol=0)
    with torch.no_grad():
        unscaled = postprocess_logits(lm.facts, lm.binding.lm_head(lm.binding.final_norm(c["resid_post.3"])))
    assert not torch.allclose(unscaled, logits, atol=1e-5, rtol=0)


def test_steering_and_patching_across_a_halving_act_where_they_are_addressed(lm):
    """A vector added at resid_post.1 reaches layer 2 halved (the trunk halves what layer 1 hands on); one added at
    resid_pre.2 reaches it whole. Patching resid_post.1 from another prompt gives that prompt's logits; patching
    resid_pre.2 with that prompt's resid_post.1 (unscaled: the neighbour tensor) does not."""
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    before = ie_lab.capture(lm, X, ["resid_pre.2"])["resid_pre.2"]
    with ie_lab.steer(lm, "resid_post.1", v):
        after = ie_lab.capture(lm, X, ["resid_pre.2"])["resid_pre.2"]
    torch.testing.assert_close(after, before + 0.5 * v, **TOL)
    with ie_lab.steer(lm, "resid_pre.2", v):
        after = ie_lab.capture(lm, X, ["resid_pre.2"])["resid_pre.2"]
    torch.testing.assert_close(after, before + v, **TOL)
    assert_clean(lm)

    clean = ie_lab.capture(lm, X, ["resid_post.1", "resid_pre.2"])
    want = _hf(lm, X, use_cache=False).logits
    got = ie_lab.run_with_patches(lm, CORRUPT, {"resid_post.1": clean["resid_post.1"]})
    torch.testing.assert_close(got, want, **TOL)
    got = ie_lab.run_with_patches(lm, CORRUPT, {"resid_pre.2": clean["resid_pre.2"]})
    torch.testing.assert_close(got, want, **TOL)
    wrong = ie_lab.run_with_patches(lm, CORRUPT, {"resid_pre.2": clean["resid_post.1"]})
    assert not torch.allclose(wrong, want, **TOL)
    assert_clean(lm)


@pytest.mark.parametrize("point", ["mixer_out", "mixer_out_post", "mlp_out"])
def test_steering_a_sublayer_output_moves_the_stream_by_the_vector(lm, point):
    L = 2
    after_point = "resid_mid" if point.startswith("mixer") else "resid_post"
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3))
    before = ie_lab.capture(lm, X, [f"{after_point}.{L}"])[f"{after_point}.{L}"]
    with ie_lab.steer(lm, f"{point}.{L}", v):
        after = ie_lab.capture(lm, X, [f"{after_point}.{L}"])[f"{after_point}.{L}"]
    torch.testing.assert_close(after, before + v, **TOL)
    assert_clean(lm)


def test_mixer_points_are_the_time_mix_modules_input_and_output(lm):
    for L in range(lm.facts.n_layers):
        block = lm.hf.rwkv.blocks[L]
        seen: dict[str, torch.Tensor] = {}
        # (hooks that return None: a returned value would replace the module's output or input)
        h1 = block.attention.register_forward_hook(lambda m, a, o, s=seen: s.update(out=o[0].detach().clone()))
        h2 = block.attention.register_forward_pre_hook(lambda m, a, s=seen: s.update({"in": a[0].detach().clone()}))
        try:
            c = ie_lab.capture(lm, X, [f"mixer_in.{L}", f"mixer_out.{L}", f"mixer_out.{(L - 1) % 4}"])
        finally:
            h1.remove()
            h2.remove()
        torch.testing.assert_close(c[f"mixer_out.{L}"], seen["out"])
        torch.testing.assert_close(c[f"mixer_in.{L}"], seen["in"])
        assert not torch.allclose(c[f"mixer_out.{(L - 1) % 4}"], seen["out"], **TOL)
    assert_clean(lm)


def test_the_sublayer_inputs_are_the_norms_of_the_stream(lm):
    """mixer_in.L = ln1(the stream, after pre_ln on layer 0) and mlp_in.L = ln2(resid_mid.L); the previous layer's
    (same shape) are not."""
    n = lm.facts.n_layers
    c = ie_lab.capture(lm, X, [f"{p}.{L}" for L in range(n) for p in ("resid_pre", "mixer_in", "resid_mid", "mlp_in")])
    with torch.no_grad():
        for L in range(n):
            block, prev = lm.hf.rwkv.blocks[L], (L - 1) % n
            stream = block.pre_ln(c["resid_pre.0"]) if L == 0 else c[f"resid_pre.{L}"]
            torch.testing.assert_close(block.ln1(stream), c[f"mixer_in.{L}"], **TOL)
            torch.testing.assert_close(block.ln2(c[f"resid_mid.{L}"]), c[f"mlp_in.{L}"], **TOL)
            assert not torch.allclose(block.ln1(stream), c[f"mixer_in.{prev}"], **TOL)
            assert not torch.allclose(block.ln2(c[f"resid_mid.{L}"]), c[f"mlp_in.{prev}"], **TOL)


def test_the_channel_mix_is_the_mlp_gated_after_its_down_projection(lm):
    """mlp_pre is the key projection's output, mlp_act = relu(mlp_pre)^2 the value projection's input, and mlp_out the
    module's output: sigmoid(receptance) * value(mlp_act). value(mlp_act) alone (the ungated tensor, same shape) is
    not mlp_out, and the previous layer's mlp_act is not this layer's."""
    for L in range(lm.facts.n_layers):
        lb = lm.binding.layers[L]
        ff = lm.hf.rwkv.blocks[L].feed_forward
        assert lb.up_proj is ff.key and lb.down_proj is ff.value and lb.mlp_out_gate is ff.receptance
        assert lb.mlp_out_gate_fn == "sigmoid" and lb.mlp_token_shift
        gate: list[torch.Tensor] = []
        h = ff.receptance.register_forward_hook(lambda m, a, o, g=gate: g.append(o.detach().clone()))  # returns None
        try:
            prev = [f"mlp_act.{(L - 1) % 4}", f"mlp_pre.{(L - 1) % 4}"]
            c = ie_lab.capture(lm, X, [f"mlp_pre.{L}", f"mlp_act.{L}", f"mlp_out.{L}", *prev])
        finally:
            h.remove()
        torch.testing.assert_close(c[f"mlp_act.{L}"], torch.relu(c[f"mlp_pre.{L}"]) ** 2, **TOL)
        assert not torch.allclose(c[f"mlp_act.{L}"], torch.relu(c[prev[1]]) ** 2, **TOL)
        with torch.no_grad():
            down = lb.down_proj(c[f"mlp_act.{L}"])
            torch.testing.assert_close(torch.sigmoid(gate[0]) * down, c[f"mlp_out.{L}"], **TOL)
            assert not torch.allclose(down, c[f"mlp_out.{L}"], **TOL)
            wrong = torch.sigmoid(gate[0]) * lb.down_proj(c[f"mlp_act.{(L - 1) % 4}"])
            assert not torch.allclose(wrong, c[f"mlp_out.{L}"], **TOL)
    with pytest.raises(ie_lab.PointAbsent, match="not gated"):
        ie_lab.capture(lm, X, ["mlp_pre_linear.1"])
    assert_clean(lm)


def test_the_channel_mix_reads_the_previous_token(lm):
    """Writing mlp_in at position 3 only changes mlp_out at positions 3 and 4 (the token shift), not at 5 or before 3:
    the binder's mlp_token_shift is what the module does."""
    L = 1
    c = ie_lab.capture(lm, X, [f"mlp_in.{L}", f"mlp_out.{L}"])
    edited = c[f"mlp_in.{L}"].clone()
    edited[:, 3] += 1.0
    seen: list[torch.Tensor] = []
    ff = lm.hf.rwkv.blocks[L].feed_forward
    h = ff.register_forward_hook(lambda m, a, o: seen.append(o[0].detach().clone()))
    try:
        ie_lab.run_with_patches(lm, X, {f"mlp_in.{L}": edited})
    finally:
        h.remove()
    moved = (seen[0] - c[f"mlp_out.{L}"]).abs().amax(dim=(0, 2)) > 1e-6
    assert moved.tolist() == [False, False, False, True, True, False, False, False, False]
    assert_clean(lm)


def test_attention_points_are_refused_naming_the_layer_kind(lm):
    for L in range(lm.facts.n_layers):
        for p in points.all_points():
            if p.scope is not points.Scope.LAYER or p.multi_stream_only or points.Needs.ATTENTION not in p.needs:
                continue
            with pytest.raises(ie_lab.PointAbsent, match=f"layer {L} is a time_mix mixer layer"):
                ie_lab.capture(lm, X[:1], [f"{p.name}.{L}"])
    assert_clean(lm)


def _states(lm, ids) -> dict[str, torch.Tensor]:
    n = lm.facts.n_layers
    names = [f"{p}.{L}" for L in range(n) for p in ("mixer_state", "mixer_conv_state", "mixer_in", "mlp_in")]
    c = ie_lab.capture(lm, ids, names)
    return {name: c[name] for name in names}


def _decode_from(lm, c: dict[str, torch.Tensor], replace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step of NEXT from a state list built out of captured points: per layer, the channel mix's token
    shift (mlp_in at the last position), the time mix's (mixer_conv_state) and the WKV state (mixer_state)."""
    c = {**c, **(replace or {})}
    n = lm.facts.n_layers
    ffn = torch.stack([c[f"mlp_in.{L}"][:, -1] for L in range(n)], dim=-1)
    att = torch.stack([c[f"mixer_conv_state.{L}"][..., 0] for L in range(n)], dim=-1)
    wkv = [torch.stack([c[f"mixer_state.{L}"][..., k] for L in range(n)], dim=-1) for k in range(3)]
    state = [ffn.clone(), att.clone(), *(w.float().clone() for w in wkv)]
    return _hf(lm, NEXT, state=state, use_cache=True).logits[:, -1]


def test_mixer_states_are_the_returned_state_and_a_decode_step_starts_from_them(lm):
    """One prompt: transformers' one-token RWKV step broadcasts a [batch, hidden] shift state against [batch, 1,
    hidden] activations, so it decodes a batch of several wrongly whatever state it is given (5.19 and 5.24)."""
    n = lm.facts.n_layers
    x = X[:1]
    c = _states(lm, x)
    theirs = _hf(lm, x, use_cache=True).state
    for L in range(n):
        assert c[f"mixer_state.{L}"].shape == (1, lm.facts.d_model, 3)
        assert c[f"mixer_conv_state.{L}"].shape == (1, lm.facts.d_model, 1)
        torch.testing.assert_close(c[f"mixer_state.{L}"], torch.stack([t[..., L] for t in theirs[2:]], -1))
        torch.testing.assert_close(c[f"mixer_conv_state.{L}"][..., 0], theirs[1][..., L])
        torch.testing.assert_close(c[f"mixer_conv_state.{L}"][..., 0], c[f"mixer_in.{L}"][:, -1])
    full = _hf(lm, torch.cat([x, NEXT], 1), use_cache=False).logits[:, -1]
    torch.testing.assert_close(_decode_from(lm, c), full, **TOL)
    short = _states(lm, x[:, :-1])
    for L in range(n):
        for name in (f"mixer_state.{L}", f"mixer_conv_state.{L}"):
            prev = name.replace(f".{L}", f".{(L - 1) % n}")
            assert c[prev].shape == c[name].shape
            for wrong in (c[prev], short[name]):  # the previous layer's state; this layer's one token earlier
                assert not torch.allclose(_decode_from(lm, c, {name: wrong}), full, **TOL), (name, L)


def test_a_list_of_prompts_gets_each_prompts_own_points_and_state(lm):
    """RWKV takes no attention mask: a right-padded batch is read before its pads (a recurrence runs forward), and a
    state is read from each prompt's own run, so each prompt equals its solo run."""
    long, short = X[:1], X[1:, :5]
    names = ["resid_post.3", "mlp_out.1", "mixer_state.2"]
    both = ie_lab.capture(lm, [long, short], names)
    for got, ids in zip(both, (long, short)):
        solo = ie_lab.capture(lm, ids, names)
        for name in names:
            torch.testing.assert_close(got[name], solo[name], atol=1e-6, rtol=1e-6)


def test_states_are_capture_only(lm):
    """No position axis to steer, and a written state would only matter to a later forward: both refused."""
    c = ie_lab.capture(lm, X, ["mixer_state.1"])
    with pytest.raises(ie_lab.AddressError, match="cannot be steered"):
        ie_lab.steer(lm, "mixer_state.1", torch.randn(lm.facts.d_model))
    with pytest.raises(IELabError):
        ie_lab.run_with_patches(lm, X, {"mixer_state.1": c["mixer_state.1"]})
    with pytest.raises(ie_lab.CapabilityUnsupported, match="capture only"):
        ie_lab.capture(lm, X, ["mixer_state.1"], grad=True)
    assert_clean(lm)


def test_generation_runs_or_is_refused_before_any_forward(lm):
    calls = []
    h = lm.hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        out = ie_lab.generate(lm, X[:1, :4], max_new_tokens=3, capture=["resid_post.0"])
    except IELabError as e:
        assert "cache" in str(e).lower(), str(e)
        assert not calls
    else:
        assert out is not None and calls
    finally:
        h.remove()
    assert_clean(lm)
