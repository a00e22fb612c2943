"""The steering panel's difference-of-means job (issue 16 item 4): its prompts are read in memory-bounded batches
(ie_lab.sizing), progress moves once per batch, and the vector is the one-prompt-at-a-time vector, with no padded
position in any mean; and a new prompt streams the baseline beside the steered text. Each test takes conftest's
fresh tiny-Llama `session`."""

import torch

from ie_lab.sizing import forward_bytes_per_row
from tests.conftest import assert_clean

ADDRESS = "resid_post.1"
# ragged on purpose: 1 to 40 tokens, so a right-padded batch carries many pad positions in its short rows
POSITIVE = [f"happy good day {i} " + "and so on " * (i % 5) for i in range(11)]
NEGATIVE = ["sad", "a bad night " * 4, "awful", "gloomy rain all day long and more", "no", "bleak"]


def _one_at_a_time(s, prompts):
    return torch.stack([s.capture(p, [ADDRESS])[ADDRESS][0].float().mean(0) for p in prompts]).mean(0)


def _padded_mean(s, prompts):
    """The wrong answer: every row of one right-padded batch averaged over the batch's full width."""
    ids = [s.tokens(p)[0] for p in prompts]
    width = max(len(i) for i in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.long)
    for r, i in enumerate(ids):
        batch[r, : len(i)] = i
    return s.capture(batch, [ADDRESS])[ADDRESS].float().mean(1).mean(0)


class _Forwards:
    """[rows, tokens] of every forward the model runs (a pre-hook on the embedding, removed after)."""

    def __init__(self, s):
        self.shapes = []
        self.h = s._lm.binding.embed.register_forward_pre_hook(lambda m, a: self.shapes.append(tuple(a[0].shape)))

    def remove(self):
        self.h.remove()


def test_the_vector_job_reads_its_prompts_in_bounded_batches_and_equals_the_one_at_a_time_vector(session):
    s = session
    lens = [s.tokens(p).shape[-1] for p in POSITIVE + NEGATIVE]
    assert max(lens) >= 8 * min(lens)
    sp = s.steering_panel("Mary went to the", address=ADDRESS, vector=torch.ones(s.facts.d_model), max_new_tokens=3)
    # a budget that fits 4 rows of the longest prompt at one point: the batches are sized from ie_lab.sizing
    sp.VECTOR_BUDGET_BYTES = 4 * forward_bytes_per_row(s.facts, max(lens), 1)
    seen = []
    sp.observe(lambda ch: seen.append(list(ch["new"])), "progress")
    forwards = _Forwards(s)
    try:
        sp.on_contrast(5, POSITIVE, NEGATIVE)
        sp.wait()
    finally:
        forwards.remove()
    total = len(POSITIVE) + len(NEGATIVE)
    # progress once per batch of at most 4 prompts, each side cut on its own
    assert [d for d, _ in seen if d] == [4, 8, 11, 15, 17] and all(t == total for _, t in seen)
    reads = [shape for shape in forwards.shapes if shape[0] > 1]
    assert [r for r, _ in reads] == [4, 4, 3, 4, 2], forwards.shapes  # one forward a batch, none over the bound
    assert sp.status == "ready" and sp.error == "" and sp.progress == [total, total]
    ref = _one_at_a_time(s, POSITIVE) - _one_at_a_time(s, NEGATIVE)
    torch.testing.assert_close(sp.vector, ref, atol=1e-5, rtol=0)
    # padding never enters a mean: the vector that averaged the pads of a padded batch is far from this one
    leaky = _padded_mean(s, POSITIVE) - _padded_mean(s, NEGATIVE)
    assert (leaky - ref).abs().max() > 1e-2
    assert not torch.allclose(sp.vector, leaky, atol=1e-3)
    assert sp.vector_source == f"difference of means at {ADDRESS} (11 vs 6 prompts)"
    sp.close()
    assert_clean(s._lm)


def test_set_contrast_runs_in_batches_and_equals_the_one_at_a_time_vector(session):
    s = session
    sp = s.steering_panel("Mary went to the", address=ADDRESS, max_new_tokens=3)
    forwards = _Forwards(s)
    try:
        sp.set_contrast(POSITIVE, NEGATIVE)
    finally:
        forwards.remove()
    ref = _one_at_a_time(s, POSITIVE) - _one_at_a_time(s, NEGATIVE)
    torch.testing.assert_close(sp.vector, ref, atol=1e-5, rtol=0)
    assert (_padded_mean(s, POSITIVE) - _padded_mean(s, NEGATIVE) - sp.vector).abs().max() > 1e-2
    # one forward a side (the tiny model fits both lists in its budget), not one a prompt
    assert [r for r, _ in forwards.shapes[:2]] == [len(POSITIVE), len(NEGATIVE)], forwards.shapes
    sp.close()
    assert_clean(s._lm)


def test_the_batched_vector_job_on_one_prompt_a_side_is_the_old_answer(session):
    """One prompt a side: a batch of one, exactly the one-prompt capture (no padding anywhere)."""
    s = session
    sp = s.steering_panel("Mary went to the", address=ADDRESS, vector=torch.ones(s.facts.d_model), max_new_tokens=3)
    sp.on_contrast(2, ["happy good day"], ["sad bad night"])
    sp.wait()
    ref = _one_at_a_time(s, ["happy good day"]) - _one_at_a_time(s, ["sad bad night"])
    torch.testing.assert_close(sp.vector, ref, atol=1e-6, rtol=0)
    assert sp.progress == [2, 2]
    sp.close()


# ---- the baseline streams beside the steered text ------------------------------------------------------------
def test_the_baseline_streams_beside_the_steered_text_in_one_batch(session, monkeypatch):
    """A new prompt regenerates both texts: the baseline's tokens reach the front end as they are produced,
    interleaved with the steered ones (not in one burst after them), from one shared decode loop."""
    s = session
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(1)) * 4
    sp = s.steering_panel("Mary went to the", address="resid_post.0", vector=v, scale=3.0, max_new_tokens=24)
    sent = []
    monkeypatch.setattr(sp, "send", lambda content, buffers=None: sent.append(content))
    forwards = _Forwards(s)
    try:
        sp._on_front_end_msg(sp, {"cmd": "prompt", "seq": 7, "prompt": "The cat sat on the"}, [])
        sp.wait()
    finally:
        forwards.remove()
    tokens = [(i, m["which"]) for i, m in enumerate(sent) if m["type"] == "token"]
    steered = [i for i, w in tokens if w == "steered"]
    baseline = [i for i, w in tokens if w == "baseline"]
    assert len(steered) == len(baseline) == 24
    # the baseline grew while the steered text was still growing: its first token came before the steered text's
    # last, and some steered token came between two baseline tokens (one burst at the end has neither)
    assert baseline[0] < steered[-1], "".join(w[0] for _, w in tokens)
    assert any(baseline[0] < i < baseline[-1] for i in steered), "".join(w[0] for _, w in tokens)
    # both from one decode loop: forwards carried the two rows together
    assert (2, 1) in forwards.shapes, forwards.shapes
    # what streamed is what was kept, and each is its solo run
    assert [m["token"] for m in sent if m["type"] == "token" and m["which"] == "baseline"] == sp.baseline
    assert sp.baseline_ids == s.generate("The cat sat on the", 24, keep_logits=False).ids
    spec = s.steer("resid_post.0", v, scale=3.0)
    assert sp.steered_ids == s.generate("The cat sat on the", 24, steer=spec, keep_logits=False).ids
    assert sp.steered_ids != sp.baseline_ids
    assert sent[0] == {"type": "start", "seq": 7, "baseline": True} and sent[-1] == {"type": "done", "seq": 7}
    sp.close()
    assert_clean(s._lm)
