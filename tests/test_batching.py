"""A list of prompts on the eager backend: batched generation and capture, each prompt equal to its solo run.

Prompts are ragged (11, 3 and 6 tokens), so the batch is padded and every check below fails if the padding
leaks: unshifted positions change the tokens of learned-position (gpt2) and rotary families, an unmasked pad
changes every later row, a capture with pad rows left in has the wrong shape or the wrong values.
"""

import asyncio

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
FAMILIES = ["llama", "gpt2", "gemma2", "mistral_sliding", "qwen3_moe"]


def _lm(fam):
    # Gemma 2 on its eager kernel: the one that applies the attention softcap the model defines (and the
    # padded-query path of the eager mask), rather than sdpa's approximation.
    return lm_for(fam, "eager") if fam == "gemma2" else lm_for(fam)


def _solo(lm, p, n, **kw):
    return ie_lab.generate(lm, torch.tensor([p]), n, **kw)


def _same_generation(solo, bat, atol=1e-4):
    assert bat.ids == solo.ids
    assert bat.stop_reason == solo.stop_reason
    torch.testing.assert_close(bat.prompt_ids, solo.prompt_ids, rtol=0, atol=0)
    for a, b in zip(solo.steps, bat.steps):
        torch.testing.assert_close(b.logits, a.logits, atol=atol, rtol=1e-4)
        assert b.logprob == pytest.approx(a.logprob, abs=atol)


@pytest.mark.parametrize("fam", FAMILIES)
def test_batched_greedy_equals_each_solo_run(fam):
    lm = _lm(fam)
    bat = ie_lab.generate(lm, PROMPTS, 10, ignore_eos=True)
    assert isinstance(bat, list) and len(bat) == len(PROMPTS)
    for p, b in zip(PROMPTS, bat):
        _same_generation(_solo(lm, p, 10, ignore_eos=True), b)
        assert [s.prompt_index for s in b.steps] == [PROMPTS.index(p)] * 10
    assert_clean(lm)


def test_batched_texts_and_a_tensor_of_rows():
    lm = lm_for("llama")
    texts = ["When Mary and John went to the store , John gave a drink to", "Mary went", "The cat sat on"]
    bat = ie_lab.generate(lm, texts, 6, ignore_eos=True)
    for t, b in zip(texts, bat):
        solo = ie_lab.generate(lm, t, 6, ignore_eos=True)
        _same_generation(solo, b)
        assert b.text == solo.text
    rows = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])  # a [batch, seq] tensor is that many prompts
    got = ie_lab.generate(lm, rows, 5)
    assert [g.ids for g in got] == [ie_lab.generate(lm, rows[i : i + 1], 5).ids for i in range(2)]


def test_sampling_is_reproducible_per_prompt():
    lm = lm_for("llama")
    kw = dict(temperature=1.0, top_k=50, ignore_eos=True)
    bat = ie_lab.generate(lm, PROMPTS, 10, seed=3, **kw)
    for p, b in zip(PROMPTS, bat):
        assert b.ids == _solo(lm, p, 10, seed=3, **kw).ids  # each prompt its own generator, seeded alike
    per = ie_lab.generate(lm, PROMPTS, 10, seed=[7, 8, 9], **kw)
    for p, s, b in zip(PROMPTS, [7, 8, 9], per):
        assert b.ids == _solo(lm, p, 10, seed=s, **kw).ids
    assert per[0].ids != bat[0].ids  # the seeds matter
    assert_clean(lm)


def test_a_prompt_that_stops_finishes_while_the_others_continue():
    lm = lm_for("llama")
    full = [_solo(lm, p, 8, ignore_eos=True) for p in PROMPTS]
    stop = lm.tokenizer.decode([full[1].ids[2]]).strip()
    solo = [_solo(lm, p, 8, stop=stop, capture=["resid_post.1", "attn_probs.0"]) for p in PROMPTS]
    reasons = [s.stop_reason for s in solo]
    assert "stop" in reasons and "length" in reasons, reasons  # the case this test is about
    bat = ie_lab.generate(lm, PROMPTS, 8, stop=stop, capture=["resid_post.1", "attn_probs.0"])
    for s, b in zip(solo, bat):
        _same_generation(s, b)
        for a in ("resid_post.1", "attn_probs.0"):
            assert b.cache[a].shape == s.cache[a].shape
            torch.testing.assert_close(b.cache[a], s.cache[a], atol=1e-5, rtol=1e-5)
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["llama", "gpt2", "mistral_sliding", "gemma2"])
def test_captures_per_prompt_equal_solo_and_tile_the_prompt(fam):
    lm = _lm(fam)
    addrs = ["resid_post.0", "mlp_out.1", "z.0.head-1", "attn_probs.1", "attn_scores.0", "attn_probs.0.head-2"]
    solo = [_solo(lm, p, 6, ignore_eos=True, capture=addrs) for p in PROMPTS]
    steps = list(ie_lab.generate_stream(lm, PROMPTS, 6, ignore_eos=True, capture=addrs))
    for r, (p, s) in enumerate(zip(PROMPTS, solo)):
        mine = [st for st in steps if st.prompt_index == r]
        assert [st.token_id for st in mine] == s.ids
        # the rows tile the prompt's own positions 0 .. len + generated, with no pad position
        assert mine[0].captured_positions == range(0, len(p))
        assert [st.captured_positions.stop for st in mine[:-1]] == [st.captured_positions.start for st in mine[1:]]
        assert mine[-1].captured_positions.stop == len(p) + 6
        n = len(p) + 6
        for a in addrs:
            want = s.cache[a]
            assert mine[-1].cache[a].shape == want.shape, a
            torch.testing.assert_close(mine[-1].cache[a], want, atol=1e-5, rtol=1e-5)
            if a.startswith("attn"):
                continue
            torch.testing.assert_close(torch.cat([st.captured[a] for st in mine], dim=1), want, atol=1e-5, rtol=1e-5)
        assert mine[-1].cache.tokens.shape == (1, n)
        assert mine[0].captured.tokens[0].tolist() == p
    assert_clean(lm)


def test_steps_come_in_prompt_order_per_token():
    lm = lm_for("llama")
    steps = list(ie_lab.generate_stream(lm, PROMPTS, 3, ignore_eos=True))
    assert [(s.index, s.prompt_index) for s in steps] == [(i, r) for i in range(3) for r in range(3)]


@pytest.mark.parametrize("positions", ["all", "generated", [1, 2, 7], "mask"])
def test_steering_acts_on_each_prompts_own_positions(positions):
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1))
    if positions == "mask":
        positions = torch.tensor([i % 3 == 1 for i in range(8)])
    spec = ie_lab.steer(lm, "resid_post.0", v, scale=8.0, positions=positions)
    bat = ie_lab.generate(lm, PROMPTS, 6, ignore_eos=True, steer=spec, capture=["resid_post.1"])
    changed = False
    for p, b in zip(PROMPTS, bat):
        solo = _solo(lm, p, 6, ignore_eos=True, steer=spec, capture=["resid_post.1"])
        _same_generation(solo, b)
        torch.testing.assert_close(b.cache["resid_post.1"], solo.cache["resid_post.1"], atol=1e-5, rtol=1e-5)
        changed |= solo.ids != _solo(lm, p, 6, ignore_eos=True).ids
    assert changed  # the steering does something, so a misplaced mask would show
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["llama", "gpt2", "gemma2", "mistral_sliding", "qwen3_moe", "bloom"])
def test_capture_over_a_list_equals_each_solo_capture(fam):
    lm = _lm(fam)
    addrs = ["embeddings", "resid_post.0", "mlp_out.1", "z.0.head-1", "value.1"]
    if lm.binding.layers[0].uses_attention_interface:
        addrs += ["attn_probs.1", "attn_scores.0", "attn_probs.0.head-2"]
    caches = ie_lab.capture(lm, PROMPTS, addrs)
    assert isinstance(caches, list) and len(caches) == len(PROMPTS)
    for p, c in zip(PROMPTS, caches):
        one = ie_lab.capture(lm, torch.tensor([p]), addrs)
        assert c.tokens.tolist() == [p]
        for a in addrs:
            assert c[a].shape == one[a].shape, a
            fin = torch.isfinite(one[a])
            assert torch.equal(fin, torch.isfinite(c[a])), a
            torch.testing.assert_close(c[a][fin], one[a][fin], atol=1e-5, rtol=1e-5)
    assert_clean(lm)


def test_capture_over_texts_steered_and_with_grad():
    lm = lm_for("llama")
    texts = ["When Mary and John went to the store", "Mary went", "The cat sat on the"]
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(2))
    spec = ie_lab.steer(lm, "resid_post.0", v, scale=4.0, positions=[1, 3])
    caches = ie_lab.capture(lm, texts, ["resid_post.1"], steer=spec)
    for t, c in zip(texts, caches):
        one = ie_lab.capture(lm, t, ["resid_post.1"], steer=spec)
        torch.testing.assert_close(c["resid_post.1"], one["resid_post.1"], atol=1e-5, rtol=1e-5)
    graphs = ie_lab.capture(lm, texts, ["resid_post.0", "resid_post.1"], grad=True)
    for c in graphs:  # each prompt's own autograd graph
        (g,) = torch.autograd.grad(c["resid_post.1"].sum(), c["resid_post.0"])
        assert g.shape == c["resid_post.0"].shape and g.abs().sum() > 0
    assert_clean(lm)


def test_bad_lists_are_refused_naming_the_prompt_before_any_forward():
    lm = lm_for("llama")
    seen = []
    h = lm.binding.layers[0].layer.register_forward_pre_hook(lambda m, a: seen.append(1))
    try:
        with pytest.raises(ie_lab.InputError, match="empty input: the token list is empty"):
            ie_lab.generate(lm, [], 4)
        with pytest.raises(ie_lab.InputError, match="empty input: the token list is empty"):
            ie_lab.capture(lm, [], ["resid_post.0"])
        with pytest.raises(ie_lab.InputError, match="prompt 1 is ids"):
            ie_lab.generate(lm, ["Mary went", [5, 6, 7]], 4)
        with pytest.raises(ie_lab.InputError, match="prompt 2 is text"):
            ie_lab.capture(lm, [[5, 6], [7, 8, 9], "Mary"], ["resid_post.0"])
        with pytest.raises(ie_lab.InputError, match=r"prompt 1 \(250 tokens\)"):
            ie_lab.generate(lm, [[5, 6], [7] * 250], 10)
        with pytest.raises(ie_lab.InputError, match="prompt 1: token id 9999"):
            ie_lab.generate(lm, [[5, 6], [7, 9999]], 2)
        with pytest.raises(ie_lab.InputError, match="3 seeds for 2 prompts"):
            ie_lab.generate(lm, [[5, 6], [7, 8]], 2, temperature=1.0, seed=[1, 2, 3])
        with pytest.raises(ie_lab.InputError, match="prompt 1: steering positions"):
            ie_lab.generate(
                lm, [[5] * 10, [7, 8]], 2, steer=ie_lab.steer(lm, "resid_post.0", torch.ones(128), positions=[6])
            )
    finally:
        h.remove()
    assert seen == []
    assert_clean(lm)


def test_session_methods_take_a_list(session):
    texts = ["When Mary and John went to the store", "Mary went", "The cat sat on the"]
    solo = [session.generate(t, 5, ignore_eos=True) for t in texts]
    bat = session.generate(texts, 5, ignore_eos=True)
    assert [b.ids for b in bat] == [s.ids for s in solo]
    steps = list(session.generate_stream(texts, 5, ignore_eos=True))
    assert [[s.token_id for s in steps if s.prompt_index == r] for r in range(3)] == [s.ids for s in solo]

    async def main():
        got = await session.agenerate(texts, 5, ignore_eos=True)
        streamed = [s async for s in session.agenerate_stream(texts, 5, ignore_eos=True)]
        caps = await session.acapture(texts, ["resid_post.1"])
        return got, streamed, caps

    got, streamed, caps = asyncio.run(main())
    assert [g.ids for g in got] == [s.ids for s in solo]
    assert [(s.prompt_index, s.token_id) for s in streamed] == [(s.prompt_index, s.token_id) for s in steps]
    for t, c in zip(texts, caps):
        torch.testing.assert_close(
            c["resid_post.1"], session.capture(t, ["resid_post.1"])["resid_post.1"], atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ie_lab.InputError, match="print_tokens"):
        session.generate(texts, 3, print_tokens=True)
    assert_clean(session._lm)
