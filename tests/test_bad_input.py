"""Bad input gets a clear error naming the fix, and leaves the model exactly as it was."""

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for


@pytest.fixture(scope="module")
def lm():
    return lm_for("llama")


def _params(lm):
    return {k: v.clone() for k, v in lm.hf.state_dict().items()}


@pytest.mark.parametrize("inp,addresses,exc,fragment", [
    ([5, 6, 7], ["resid_psot.0"], ie_lab.AddressError, "Did you mean 'resid_post'"),
    ([5, 6, 7], ["resid_post.9"], ie_lab.AddressError, "out of range"),
    ([5, 6, 7], ["z.0.head-9"], ie_lab.AddressError, "out of range"),
    ([5, 6, 7], ["router_logits.0"], ie_lab.PointAbsent, "dense MLP layer"),
    ([5, 6, 7], ["resid_post.0.stream-1"], ie_lab.AddressError, "single residual stream"),
    (torch.tensor([[1.0, 2.0]]), ["resid_post.0"], ie_lab.InputError, "tokens.long()"),
    (torch.tensor([[1, 600]]), ["resid_post.0"], ie_lab.InputError, "outside the vocabulary"),
    (torch.tensor([[-1, 6]]), ["resid_post.0"], ie_lab.InputError, "outside the vocabulary"),
    (torch.zeros((1, 0), dtype=torch.long), ["resid_post.0"], ie_lab.InputError, "empty input"),
    ("", ["resid_post.0"], ie_lab.InputError, "empty text"),
    (torch.ones((1, 300), dtype=torch.long), ["resid_post.0"], ie_lab.InputError, "context is 256"),
    ({"ids": 1}, ["resid_post.0"], ie_lab.InputError, "expected text"),
    ([5, 6, 7], [], ie_lab.AddressError, "no addresses"),
])
def test_bad_input_is_refused_cleanly(lm, inp, addresses, exc, fragment):
    before = _params(lm)
    with pytest.raises(exc) as e:
        ie_lab.capture(lm, inp, addresses)
    assert fragment in str(e.value)
    assert_clean(lm)
    after = lm.hf.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_absent_points_are_refused_on_each_kind_of_family():
    cases = [
        ("gpt_neox", "resid_mid.0", "in parallel"),
        ("mixtral", "mlp_act.0", "sparse mixture-of-experts"),
        ("llama", "q_norm_in.0", "no QK-norm"),
        ("gpt2", "mlp_pre_linear.0", "not gated"),
        ("llama", "attn_gate.0", "no output gate"),
        ("bloom", "attn_scores.0", "never leaves that module"),
    ]
    for fam, addr, fragment in cases:
        lm = lm_for(fam)
        with pytest.raises((ie_lab.PointAbsent, ie_lab.CapabilityUnsupported)) as e:
            ie_lab.capture(lm, [5, 6, 7], [addr])
        assert fragment in str(e.value), (fam, addr, str(e.value))
        assert_clean(lm)


def test_exception_inside_the_forward_removes_every_hook(lm):
    # A hook of the user's that raises mid-forward must not strand ie_lab's hooks or the attention tap.
    def boom(mod, args, out):
        raise RuntimeError("user hook failed")

    h = lm.binding.layers[1].layer.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="user hook failed"):
            ie_lab.capture(lm, [5, 6, 7], ["resid_post.0", "attn_probs.1", "value.0", "mlp_act.1"])
    finally:
        h.remove()
    assert_clean(lm)
    c = ie_lab.capture(lm, [5, 6, 7], ["resid_post.0"])
    assert c["resid_post.0"].shape == (1, 3, lm.facts.d_model)


def test_capture_does_not_change_the_forward(lm):
    x = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = lm.hf(input_ids=x).logits
    ie_lab.capture(lm, x, ["attn_scores.0", "attn_probs.1", "value.1", "resid_mid.0"])
    with torch.no_grad():
        after = lm.hf(input_ids=x).logits
    assert torch.equal(before, after)


def test_cache_lookup_errors_are_helpful(lm):
    c = ie_lab.capture(lm, [5, 6, 7], ["resid_post.0"])
    assert c[ie_lab.Address("resid_post", 0)] is c["resid_post.0"]
    with pytest.raises(ie_lab.AddressError, match="was not captured"):
        c["resid_post.1"]
    assert "resid_post.0" in repr(c) and "[1, 3, 128]" in repr(c)
