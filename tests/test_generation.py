import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


@pytest.mark.parametrize("fam", ["llama", "gpt2", "gemma2", "qwen3_moe", "falcon", "opt"])
def test_greedy_equals_hf_generate(fam):
    lm = lm_for(fam)
    ours = ie_lab.generate(lm, PROMPT, 12)
    with torch.no_grad():
        ref = lm.hf.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    n = len(ours.ids)
    assert ours.ids == ref[0, PROMPT.shape[1]:PROMPT.shape[1] + n].tolist()
    assert n == 12 or ours.stop_reason == "eos"
    assert_clean(lm)


@pytest.mark.parametrize("fam", ["llama", "gemma2", "gpt_neox", "mixtral", "bloom", "mistral_sliding", "gemma3_text"])
def test_capture_during_generation_equals_one_forward(fam):
    lm = lm_for(fam)
    addrs = ["resid_post.0", "mlp_out.1", "value.1", "z.0.head-1", "resid_pre.1"]
    if lm.binding.layers[0].uses_attention_interface:
        addrs += ["attn_probs.1", "attn_probs.0", "attn_scores.0"]
    res = ie_lab.generate(lm, PROMPT, 8, capture=addrs)
    full = torch.cat([PROMPT, torch.tensor([res.ids])], dim=1)
    one = ie_lab.capture(lm, full, addrs)
    for a in addrs:
        assert res.cache[a].shape == one[a].shape, a
        torch.testing.assert_close(res.cache[a], one[a], atol=2e-4, rtol=1e-4)
    assert_clean(lm)


def test_captures_come_from_the_cached_forwards_not_a_rerun():
    # Count forwards of layer 0: prompt (1) + one per generated token, with no extra full-length pass.
    lm = lm_for("llama")
    lengths = []
    h = lm.binding.layers[0].layer.register_forward_pre_hook(lambda m, a, k: lengths.append(
        (k.get("hidden_states") if "hidden_states" in k else a[0]).shape[1]), with_kwargs=True)
    try:
        res = ie_lab.generate(lm, PROMPT, 5, capture=["resid_post.0"])
    finally:
        h.remove()
    assert lengths == [PROMPT.shape[1]] + [1] * len(res.ids)


def test_sampling_is_seeded_and_respects_top_k():
    lm = lm_for("llama")
    a = ie_lab.generate(lm, PROMPT, 10, temperature=1.0, seed=3)
    b = ie_lab.generate(lm, PROMPT, 10, temperature=1.0, seed=3)
    c = ie_lab.generate(lm, PROMPT, 10, temperature=1.0, seed=4)
    assert a.ids == b.ids and a.ids != c.ids
    g = ie_lab.generate(lm, PROMPT, 10, temperature=1.0, top_k=1, seed=9)
    assert g.ids == ie_lab.generate(lm, PROMPT, 10).ids  # top_k=1 is greedy
    p = ie_lab.generate(lm, PROMPT, 10, temperature=1.0, top_p=1e-6, seed=9)
    assert p.ids == g.ids  # a vanishing nucleus keeps only the argmax


def test_steps_carry_logprobs_and_logits():
    lm = lm_for("llama")
    steps = list(ie_lab.generate_stream(lm, PROMPT, 4, n_logprobs=5))
    s = steps[0]
    assert len(s.top_logprobs) == 5
    assert s.logprob == pytest.approx(max(s.top_logprobs.values()))  # greedy picks the top one
    with torch.no_grad():
        ref = lm.hf(input_ids=PROMPT).logits[0, -1]
    torch.testing.assert_close(s.logits, ref)


def test_stop_at_eos_and_stop_strings():
    lm = lm_for("llama")
    first = ie_lab.generate(lm, PROMPT, 5)
    # Make the first greedy token the EOS: generation must stop right there.
    lm.hf.generation_config.eos_token_id = first.ids[0]
    try:
        r = ie_lab.generate(lm, PROMPT, 5)
        assert r.ids == [first.ids[0]] and r.stop_reason == "eos"
    finally:
        lm.hf.generation_config.eos_token_id = 2
    word = lm.tokenizer.decode([first.ids[1]])
    r = ie_lab.generate(lm, PROMPT, 5, stop=word)
    assert r.stop_reason == "stop" and len(r.ids) == 2


def test_breaking_out_of_a_stream_removes_hooks():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model)
    for step in ie_lab.generate_stream(lm, PROMPT, 20, capture=["resid_post.1"],
                                       steer=ie_lab.steer(lm, "resid_post.0", v, scale=3.0)):
        if step.index == 2:
            break
    import gc

    gc.collect()
    assert_clean(lm)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=8, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=8, top_p=0.0), "top_p"),
    (dict(max_new_tokens=300), "context of 256"),
])
def test_bad_generation_arguments(kwargs, fragment):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match=fragment):
        ie_lab.generate(lm, PROMPT, **kwargs)
    assert_clean(lm)


def test_ignore_eos_runs_to_the_requested_length():
    lm = lm_for("llama")
    first = ie_lab.generate(lm, PROMPT, 5)
    lm.hf.generation_config.eos_token_id = first.ids[0]
    try:
        assert len(ie_lab.generate(lm, PROMPT, 5).ids) == 1
        r = ie_lab.generate(lm, PROMPT, 5, ignore_eos=True)
        assert len(r.ids) == 5 and r.stop_reason == "length" and r.ids == first.ids
    finally:
        lm.hf.generation_config.eos_token_id = 2
