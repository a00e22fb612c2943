"""An operation's hooks read and write only its own forwards.

Hooks live on modules every thread shares. A raw model call that another thread runs while an ie_lab operation is
in flight (outside ie_lab's locks, as a user's own code may) passes through the operation's hooks; it must neither
land in the operation's tensors nor be edited by its patches. Each test forces that interleaving
deterministically: a hook inside the operation's forward runs a raw forward on another thread and waits for it.
"""

from __future__ import annotations

import threading

import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
OTHER = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])  # another length: a mix-up cannot pass as the right shape


def _raw_forward_from_another_thread_during(lm, layer: int):
    """A pre-hook on `layer` that, once, runs a raw forward of OTHER on a second thread and waits for it."""
    done: dict[str, torch.Tensor] = {}

    def hook(mod, args):
        if "logits" in done:
            return
        done["logits"] = torch.empty(0)

        def raw():
            with torch.no_grad():
                done["logits"] = lm.hf(input_ids=OTHER).logits

        t = threading.Thread(target=raw)
        t.start()
        t.join(timeout=120)  # a bound on a hang only
        assert not t.is_alive()

    return lm.binding.layers[layer].layer.register_forward_pre_hook(hook), done


def test_a_capture_keeps_only_its_own_forward():
    lm = lm_for("llama")
    want = ie_lab.capture(lm, IDS, ["resid_post.0", "resid_post.1", "attn_probs.1", "mlp_out.1"])
    with torch.no_grad():
        raw_want = lm.hf(input_ids=OTHER).logits
    for grad in (False, True):
        h, done = _raw_forward_from_another_thread_during(lm, 1)
        try:
            got = ie_lab.capture(lm, IDS, ["resid_post.0", "resid_post.1", "attn_probs.1", "mlp_out.1"], grad=grad)
        finally:
            h.remove()
        for a in want:
            assert torch.allclose(got[a].detach(), want[a], atol=1e-6), f"{a} (grad={grad}) took another forward's rows"
        assert torch.allclose(done["logits"], raw_want, atol=1e-6)  # and the raw forward was not touched either
    assert_clean(lm)


def test_a_patch_edits_only_its_own_forward():
    lm = lm_for("llama")
    source = ie_lab.capture(lm, torch.tensor([[20, 21, 22, 23, 24, 25]]), ["resid_post.0"])
    want = ie_lab.patch(lm, IDS, source, ["resid_post.0"])
    with torch.no_grad():
        raw_want = lm.hf(input_ids=OTHER).logits
    h, done = _raw_forward_from_another_thread_during(lm, 1)
    try:
        got = ie_lab.patch(lm, IDS, source, ["resid_post.0"])
    finally:
        h.remove()
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(done["logits"], raw_want, atol=1e-6), "the patch edited another thread's raw forward"
    assert_clean(lm)


def test_captures_during_generation_keep_only_their_own_forwards():
    lm = lm_for("llama")
    want = ie_lab.generate(lm, IDS, 4, capture=["resid_post.1"])
    h, done = _raw_forward_from_another_thread_during(lm, 0)
    try:
        got = ie_lab.generate(lm, IDS, 4, capture=["resid_post.1"])
    finally:
        h.remove()
    assert got.ids == want.ids
    assert torch.allclose(got.cache["resid_post.1"], want.cache["resid_post.1"], atol=1e-6)
    assert_clean(lm)
