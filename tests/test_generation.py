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
    assert ours.ids == ref[0, PROMPT.shape[1] : PROMPT.shape[1] + n].tolist()
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
    h = lm.binding.layers[0].layer.register_forward_pre_hook(
        lambda m, a, k: lengths.append((k.get("hidden_states") if "hidden_states" in k else a[0]).shape[1]),
        with_kwargs=True,
    )
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
    for step in ie_lab.generate_stream(
        lm, PROMPT, 20, capture=["resid_post.1"], steer=ie_lab.steer(lm, "resid_post.0", v, scale=3.0)
    ):
        if step.index == 2:
            break
    import gc

    gc.collect()
    assert_clean(lm)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens=8, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=8, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=8, temperature=float("inf")), "temperature"),
        (dict(max_new_tokens=8, temperature="hot"), "temperature"),
        (dict(max_new_tokens=8, top_p=0.0), "top_p"),
        (dict(max_new_tokens=8, top_p=float("nan")), "top_p"),
        (dict(max_new_tokens=8, top_k=0), "top_k"),
        (dict(max_new_tokens=8, top_k=2.5), "top_k"),
        (dict(max_new_tokens=8, top_k=10**12), "top_k"),
        (dict(max_new_tokens=8, n_logprobs=513), "n_logprobs"),
        (dict(max_new_tokens=8, n_logprobs=-1), "n_logprobs"),
        (dict(max_new_tokens=8, n_logprobs=1.5), "n_logprobs"),
        (dict(max_new_tokens=8, seed=-1), "seed"),
        (dict(max_new_tokens=8, seed="x"), "seed"),
        (dict(max_new_tokens=8, stop=[None]), "stop"),
        (dict(max_new_tokens=8, stop=""), "stop"),
        (dict(max_new_tokens=8, stop=5), "stop"),
        (dict(max_new_tokens=8, keep_logits="no"), "keep_logits"),
        (dict(max_new_tokens=8, ignore_eos=1), "ignore_eos"),
        (dict(max_new_tokens=300), "context of 256"),
    ],
)
def test_bad_generation_arguments(kwargs, fragment):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match=fragment):
        ie_lab.generate(lm, PROMPT, **kwargs)
    assert_clean(lm)


@pytest.mark.parametrize("prompt", [[], [[]], torch.tensor([], dtype=torch.long)])
def test_empty_prompt_is_refused_as_empty(prompt):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match="empty input"):
        ie_lab.generate(lm, prompt, 3)
    assert_clean(lm)


def test_bad_arguments_are_refused_before_any_forward():
    lm = lm_for("llama")
    calls = []
    h = lm.hf.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for kwargs in (dict(stop=[None]), dict(n_logprobs=10**6), dict(temperature=float("nan"))):
            with pytest.raises(ie_lab.InputError):
                ie_lab.generate(lm, PROMPT, 4, **kwargs)
    finally:
        h.remove()
    assert calls == []
    assert_clean(lm)


def test_tiny_temperature_samples_the_argmax():
    lm = lm_for("llama")
    greedy = ie_lab.generate(lm, PROMPT, 6).ids
    for t in (1e-45, 1e-300, 5e-324):
        assert ie_lab.generate(lm, PROMPT, 6, temperature=t, seed=0).ids == greedy


def test_n_logprobs_up_to_the_vocabulary():
    lm = lm_for("llama")
    step = next(iter(ie_lab.generate_stream(lm, PROMPT, 1, n_logprobs=lm.facts.vocab_size)))
    assert len(step.top_logprobs) > 1
    assert step.logprob == pytest.approx(max(step.top_logprobs.values()))


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


# ---- captures on streamed steps (issue 13.4) ------------------------------------------------------------


def _join_steps(steps, addr, total):
    """Concatenate each step's rows of one point along positions (attention: pad keys to the full length)."""
    rows = [s.captured[addr] for s in steps]
    if rows[0].dim() == 4:  # [batch, heads, new queries, keys so far]
        fill = float("-inf") if addr.startswith("attn_scores") else 0.0
        rows = [torch.nn.functional.pad(r, (0, total - r.shape[-1]), value=fill) for r in rows]
        return torch.cat(rows, dim=2)
    return torch.cat(rows, dim=1)


def _check_streamed_captures(steps, res, addrs):
    assert [s.token_id for s in steps] == res.ids
    total = res.cache.tokens.shape[1]
    # Step 0 holds the prompt's rows, each later step one row, the last step also its own token's row.
    assert steps[0].captured_positions == range(0, PROMPT.shape[1])
    for prev, s in zip(steps, steps[1:]):
        assert s.captured_positions.start == prev.captured_positions.stop
    assert steps[-1].captured_positions.stop == total
    for s in steps:
        assert torch.equal(
            s.captured.tokens, res.cache.tokens[:, s.captured_positions.start : s.captured_positions.stop]
        )
    for a in addrs:
        assert torch.equal(_join_steps(steps, a, total), res.cache[a]), a
    # The last step carries the whole cache; no earlier one does.
    assert all(s.cache is None for s in steps[:-1])
    for a in addrs:
        assert torch.equal(steps[-1].cache[a], res.cache[a]), a


@pytest.mark.parametrize("fam", ["llama", "mistral_sliding", "gpt2"])
def test_streamed_steps_carry_their_captures(fam):
    lm = lm_for(fam)
    addrs = ["resid_post.0", "z.1.head-1", "mlp_out.1"]
    if lm.binding.layers[0].uses_attention_interface:
        addrs += ["attn_probs.0", "attn_scores.1"]
    res = ie_lab.generate(lm, PROMPT, 7, capture=addrs)
    steps = list(ie_lab.generate_stream(lm, PROMPT, 7, capture=addrs))
    _check_streamed_captures(steps, res, addrs)
    assert_clean(lm)


def test_streamed_captures_stop_early_at_a_stop_string():
    lm = lm_for("llama")
    first = ie_lab.generate(lm, PROMPT, 5)
    word = lm.tokenizer.decode([first.ids[1]])
    res = ie_lab.generate(lm, PROMPT, 5, stop=word, capture=["resid_post.1"])
    steps = list(ie_lab.generate_stream(lm, PROMPT, 5, stop=word, capture=["resid_post.1"]))
    assert len(steps) == 2 and res.stop_reason == "stop"
    _check_streamed_captures(steps, res, ["resid_post.1"])
    assert res.cache["resid_post.1"].shape[1] == PROMPT.shape[1] + 2


def test_session_streams_carry_captures():
    import asyncio

    from tests.families import make_model, make_tokenizer

    addrs = ["resid_post.0", "attn_probs.1"]
    with ie_lab.Session(make_model("llama"), tokenizer=make_tokenizer(), progress=False) as s:
        res = s.generate(PROMPT, 6, capture=addrs)
        _check_streamed_captures(list(s.generate_stream(PROMPT, 6, capture=addrs)), res, addrs)

        async def consume():
            return [step async for step in s.agenerate_stream(PROMPT, 6, capture=addrs)]

        _check_streamed_captures(asyncio.run(consume()), res, addrs)
        printed = s.generate(PROMPT, 6, capture=addrs, print_tokens=True)  # streamed into the cell
        for a in addrs:
            assert torch.equal(printed.cache[a], res.cache[a]), a


def test_steps_without_capture_carry_no_rows():
    steps = list(ie_lab.generate_stream(lm_for("llama"), PROMPT, 3))
    assert all(s.captured is None and s.cache is None and s.captured_positions is None for s in steps)


# ---- no deprecated transformers call path (issue 13, "Also") --------------------------------------------


@pytest.mark.parametrize("fam", ["llama", "gpt2", "gemma2", "falcon", "opt", "bloom", "mistral_sliding"])
def test_generate_uses_no_deprecated_transformers_path(fam):
    # transformers 5.24 warns (FutureWarning) when the KV cache is passed as `past_key_values`, removed in 5.40;
    # `./dev test` runs this on the newest transformers too.
    import warnings

    lm = lm_for(fam)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        res = ie_lab.generate(lm, PROMPT, 4, capture=["resid_post.0"], ignore_eos=True)
        steps = list(ie_lab.generate_stream(lm, PROMPT, 2, ignore_eos=True))
    assert len(res.ids) == 4 and len(steps) == 2
    assert_clean(lm)
