"""Chat conventions by what the tokenizer can do (issue 30 item 5): harmony channels, think-style reasoning, turn-end
tokens. Each convention's tokenizer is ie_lab.toy's (marker tokens added to a byte-level BPE, a template written for
it), its model the llama toy: no network, and the conventions are read from the tokenizer alone."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab.core import chat_conventions as cc
from ie_lab.toy import CHAT_MARKERS, chat_model


@pytest.fixture(scope="module")
def models():
    """One toy per convention (ie_lab.toy.chat_model: a byte-level BPE tokenizer with the convention's marker tokens
    and a template written for it). The markers' unembedding rows are drawn long, so a vector along a marker's row
    makes it the greedy token (steering toward it forces the token)."""
    out = {}
    for name in ("harmony", "think", "llama3"):
        hf, tok = chat_model(name)
        with torch.no_grad():
            w = hf.get_output_embeddings().weight
            for t in tok.convert_tokens_to_ids(list(CHAT_MARKERS[name])):
                w[t] *= 10
        out[name] = ie_lab.load(hf, tok)
    return out


def ids_of(lm, *tokens):
    return [lm.tokenizer.convert_tokens_to_ids(t) for t in tokens]


def check_spans_exact(lm, chat, want):
    """Each part's span decodes to exactly its text, inside its message's span; the same span shifted by one token
    either way does not decode to it."""
    ids = chat.ids[0].tolist()
    parts = [s for s in chat.spans if s.part not in ("message", "generation_prompt")]
    assert [(s.part, s.role, s.index, lm.tokenizer.decode(ids[s.slice])) for s in parts] == want
    message = {m.index: m for m in chat.parts("message")}
    for s in parts:
        assert s.text == lm.tokenizer.decode(ids[s.start : s.end])
        assert message[s.index].start <= s.start < s.end <= message[s.index].end  # inside its message
        for d in (-1, 1):
            assert lm.tokenizer.decode(ids[s.start + d : s.end + d]) != s.text


def test_conventions_are_read_from_the_tokenizer(models):
    h, q, l3 = (cc.detect(models[k].tokenizer) for k in ("harmony", "think", "llama3"))
    assert (h.style, h.reasoning_key) == ("harmony", "thinking")
    assert set(h.turn_end_ids) == set(ids_of(models["harmony"], "<|return|>", "<|call|>"))  # not <|end|>
    assert (q.style, q.reasoning_key, q.thinking_switch) == ("think", "reasoning_content", True)
    assert q.turn_end_ids == tuple(ids_of(models["think"], "<|im_end|>"))
    assert (l3.style, l3.reasoning, l3.thinking_switch) == ("plain", False, False)
    assert l3.turn_end_ids == tuple(ids_of(models["llama3"], "<|eot_id|>"))


def test_harmony_channels_are_spans(models):
    lm = models["harmony"]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning": "Need the tool.",
            "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],  # no content: a call
        },
        {"role": "user", "content": "And so?"},
        {"role": "assistant", "thinking": "It rains.", "content": "Take an umbrella."},
    ]
    chat = ie_lab.to_chat(lm, msgs, add_generation_prompt=False)
    check_spans_exact(
        lm,
        chat,
        [
            ("content", "system", 0, "Be brief."),
            ("content", "user", 1, "Weather in Paris?"),
            ("analysis", "assistant", 2, "Need the tool."),
            ("tool_call", "assistant", 2, '{"city": "Paris"}'),
            ("content", "user", 3, "And so?"),
            ("analysis", "assistant", 4, "It rains."),
            ("final", "assistant", 4, "Take an umbrella."),
        ],
    )
    assert chat.parts("tool_call")[0].recipient == "functions.get_weather"
    assert [s.role for s in chat.parts("message")] == [m["role"] for m in msgs]
    # A capture of the chat is sliced by span: its rows are the rows of those tokens.
    c = ie_lab.capture(lm, chat, ["resid_post.1"])
    final = chat.parts("final")[0]
    torch.testing.assert_close(c["resid_post.1"][:, final.slice], c["resid_post.1"][:, final.start : final.end])
    assert torch.equal(c.tokens.cpu(), chat.ids)


def test_harmony_split_of_a_generated_sequence(models):
    lm = models["harmony"]
    tok = lm.tokenizer
    text = (
        "<|channel|>analysis<|message|>User asks x.<|end|><|start|>assistant<|channel|>final<|message|>"
        "The answer.<|return|>"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    parts = ie_lab.split_channels(lm, ids)
    assert [(p.part, p.text) for p in parts] == [("analysis", "User asks x."), ("final", "The answer.")]
    assert [ids[p.start - 1] for p in parts] == ids_of(lm, "<|message|>", "<|message|>")
    assert [ids[p.end] for p in parts] == ids_of(lm, "<|end|>", "<|return|>")
    # Cut off before its end token (a generation out of tokens): the part runs to the end.
    assert [(p.part, p.text) for p in ie_lab.split_channels(lm, ids[:-1])][-1] == ("final", "The answer.")


def test_think_spans_and_the_thinking_switch(models):
    lm = models["think"]
    msgs = [
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "reasoning": "Add them: four.", "content": "Four."},
    ]
    chat = ie_lab.to_chat(lm, msgs, add_generation_prompt=False)
    want = [("content", "user", 0, "Two plus two?"), ("reasoning", "assistant", 1, "Add them: four.")]
    check_spans_exact(lm, chat, [*want, ("final", "assistant", 1, "Four.")])
    off = ie_lab.to_chat(lm, msgs[:1], enable_thinking=False)
    assert lm.tokenizer.decode(off.ids[0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert torch.equal(off.ids, ie_lab.apply_chat_template(lm, msgs[:1], enable_thinking=False))
    on = ie_lab.to_chat(lm, msgs[:1])
    assert lm.tokenizer.decode(on.ids[0]).endswith("<|im_start|>assistant\n")
    # A generated reply is cut after the prompt: reasoning, then the answer up to the turn's end.
    tail = lm.tokenizer("<think>\nHm.\n</think>\n\nFour.<|im_end|>", add_special_tokens=False)["input_ids"]
    result = ie_lab.generate(lm, on, 1)
    result.ids = tail
    parts = ie_lab.split_channels(lm, result)
    assert [(p.part, p.text) for p in parts] == [("reasoning", "Hm."), ("final", "Four.")]
    assert parts[0].start > on.ids.shape[1]  # positions in prompt + generated


def test_a_chat_stops_at_the_end_of_the_assistant_turn(models):
    lm = models["llama3"]
    (eot,) = ids_of(lm, "<|eot_id|>")
    msgs = [{"role": "user", "content": "Hi"}]
    chat = ie_lab.to_chat(lm, msgs)
    assert chat.stop_ids == {eot, lm.tokenizer.eos_token_id}
    # The message spans and the generation prompt's tile the ids.
    check_spans_exact(lm, chat, [("content", "user", 0, "Hi")])
    user, gen = chat.parts("message")[0], chat.parts("generation_prompt")[0]
    assert (user.part, gen.part, user.start, user.end, gen.end) == ("message", "generation_prompt", 0, gen.start, 18)
    assert user.text == "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    assert gen.text == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    # Steering the last residual along <|eot_id|>'s unembedding row makes it the greedy token at every step.
    w = lm.hf.get_output_embeddings().weight[eot].detach()
    spec = ie_lab.steer(lm, "resid_post.1", w, scale=100.0)
    for prompt in (msgs, chat):
        r = ie_lab.generate(lm, prompt, 4, steer=spec)
        assert (r.ids, r.stop_reason) == ([eot], "eos")
    # The rendered ids alone are no conversation: no turn end, the model's EOS only; the user may override.
    assert ie_lab.generate(lm, chat.ids, 4, steer=spec).ids == [eot] * 4
    assert ie_lab.generate(lm, msgs, 4, steer=spec, ignore_eos=True).ids == [eot] * 4
    assert ie_lab.generate(lm, ie_lab.to_chat(lm, msgs, stop_ids=[]), 4, steer=spec).ids == [eot] * 4


def test_project_with_generation_stops_where_generate_does(models):
    """project(..., max_new_tokens>0) stops at a conversation's (and a Chat's) turn end as generate does; the rendered
    ids alone run on to the length. The scores cover the tokens the model read: the prompt, then all but the last
    generated token."""
    lm = models["llama3"]
    (eot,) = ids_of(lm, "<|eot_id|>")
    msgs = [{"role": "user", "content": "Hi"}]
    chat = ie_lab.to_chat(lm, msgs)
    n = chat.ids.shape[1]
    w = lm.hf.get_output_embeddings().weight[eot].detach()
    spec = ie_lab.steer(lm, "resid_post.1", w, scale=100.0)
    probe = torch.randn(3, lm.facts.d_model, generator=torch.Generator().manual_seed(0))
    for prompt in (msgs, chat):
        p = ie_lab.project(lm, prompt, "resid_post.0", probe, max_new_tokens=4, steer=spec)
        assert p.generated == ie_lab.generate(lm, prompt, 4, steer=spec).ids == [eot]
        assert p.scores.shape == (n, 3)
    p = ie_lab.project(lm, chat.ids, "resid_post.0", probe, max_new_tokens=4, steer=spec)
    assert p.generated == [eot] * 4 and p.scores.shape == (n + 3, 3)
    assert (
        ie_lab.project(lm, msgs, "resid_post.0", probe, max_new_tokens=4, steer=spec, ignore_eos=True).generated
        == [eot] * 4
    )


def test_harmony_stops_at_return_not_at_end(models):
    lm = models["harmony"]
    end, ret = ids_of(lm, "<|end|>", "<|return|>")
    msgs = [{"role": "user", "content": "Hi"}]
    w = lm.hf.get_output_embeddings().weight
    r = ie_lab.generate(lm, msgs, 3, steer=ie_lab.steer(lm, "resid_post.1", w[end].detach(), scale=100.0))
    assert (r.ids, r.stop_reason) == ([end] * 3, "length")  # <|end|> closes an analysis: the turn goes on
    r = ie_lab.generate(lm, msgs, 3, steer=ie_lab.steer(lm, "resid_post.1", w[ret].detach(), scale=100.0))
    assert (r.ids, r.stop_reason) == ([ret], "eos")


def test_a_convention_the_tokenizer_lacks_is_refused_with_the_fix(models):
    lm = models["llama3"]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning": "Hm.", "content": "Hello."}]
    for call in (
        lambda: ie_lab.to_chat(lm, msgs),
        lambda: ie_lab.generate(lm, msgs, 1),
        lambda: ie_lab.split_channels(lm, [1, 2]),
    ):
        with pytest.raises(ie_lab.InputError, match="no reasoning convention.*chat_template"):
            call()
    with pytest.raises(ie_lab.InputError, match="no enable_thinking switch"):
        ie_lab.to_chat(lm, msgs[:1], enable_thinking=False)
    with pytest.raises(ie_lab.InputError, match="only an assistant message reasons"):
        ie_lab.to_chat(models["think"], [{"role": "user", "content": "Hi", "reasoning": "x"}])


def test_reasoning_read_from_the_content_deepseek_r1_style(models):
    """A template with no reasoning field that finds </think> in the content (and drops it from the history), and a
    generation prompt that opens <think> itself: the reply's reasoning is cut from the prompt's open marker."""
    lm = models["think"]
    saved = lm.tokenizer.chat_template
    lm.tokenizer.chat_template = (
        "{%- for m in messages -%}{%- set c = m.content -%}"
        "{%- if '</think>' in c -%}{%- set c = c.split('</think>')[-1].strip() -%}{%- endif -%}"
        "{{ '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}"
    )
    try:
        conv = cc.detect(lm.tokenizer)
        assert (conv.style, conv.reasoning_key, conv.reasoning_in_content) == ("think", None, True)
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning": "Hm.", "content": "Hello."}]
        with pytest.raises(ie_lab.InputError, match="reasoning is not in the rendered conversation"):
            ie_lab.to_chat(lm, msgs)
        result = ie_lab.generate(lm, msgs[:1], 1)
        result.ids = lm.tokenizer("Hm.\n</think>\n\nHello.<|im_end|>", add_special_tokens=False)["input_ids"]
        want = [("reasoning", "Hm."), ("final", "Hello.")]
        assert [(p.part, p.text) for p in ie_lab.split_channels(lm, result)] == want
        # The reply's ids alone: a reasoning closed with no opener began where the ids begin.
        assert [(p.part, p.text) for p in ie_lab.split_channels(lm, result.ids)] == want
    finally:
        lm.tokenizer.chat_template = saved


def test_a_chat_travels_to_a_remote_server_as_its_ids_and_stop_ids(models):
    from ie_lab.remote.client import _chat_ids

    chat = ie_lab.to_chat(models["llama3"], [{"role": "user", "content": "Hi"}])
    wire = {"chat_ids": chat.ids[0].tolist(), "stop_ids": sorted(chat.stop_ids)}
    assert _chat_ids(chat) == wire and _chat_ids([chat, "x"]) == [wire, "x"]


def test_the_harmony_cut_agrees_with_openai_harmony():
    """openai_harmony (a vLLM dependency; its encoding loads with no network) parses gpt-oss's own token ids: the
    cut here, run on the same ids, finds the same messages, channels, recipients and texts."""
    oh = pytest.importorskip("openai_harmony")
    try:
        enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # pragma: no cover - an install whose encoding needs a download
        pytest.skip(f"openai_harmony's encoding does not load offline here: {e}")
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"rain": true}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Take an umbrella.<|return|>"
    )
    ids = enc.encode(text, allowed_special="all")
    want = [
        (m.channel, m.recipient, m.content[0].text)
        for m in enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    ]

    class Tok:  # what the cut reads of a tokenizer: its decoding
        def decode(self, ids, skip_special_tokens=False):
            return enc.decode_utf8(list(ids))

    markers = {m: enc.encode(m, allowed_special="all")[0] for m in (*cc.HARMONY_MARKERS, *cc.HARMONY_ENDS)}
    conv = cc.ChatConvention("harmony", (), "thinking", False, False, markers)
    got = cc.cut(conv, Tok(), ids)
    assert [
        (c.part if c.part != "tool_call" else "commentary", c.recipient, Tok().decode(ids[c.start : c.end]))
        for c in got
    ] == want
    assert [c.part for c in got] == ["analysis", "tool_call", "commentary", "final"]
    assert got[2].role == "functions.get_weather"


def test_bad_arguments_are_refused_naming_them(models):
    lm, msgs = models["think"], [{"role": "user", "content": "Hi"}]
    cases = [
        (
            lambda x: ie_lab.to_chat(lm, msgs, stop_ids=x),
            [3, "x", [-1], [10**12], [1.5], [True], object()],
            "stop_ids",
        ),
        (lambda x: ie_lab.to_chat(lm, msgs, enable_thinking=x), ["yes", 1, float("nan")], "enable_thinking"),
        (lambda x: ie_lab.to_chat(lm, msgs, add_generation_prompt=x), ["yes", None], "add_generation_prompt"),
        (
            lambda x: ie_lab.split_channels(lm, x),
            [None, "text", [1.5], torch.zeros(2, 3), {"ids": [1]}],
            "split_channels",
        ),
        (lambda x: ie_lab.to_chat(lm, [{"role": "assistant", "content": "", "reasoning": x}]), [3, ["a"]], "string"),
    ]
    for call, values, word in cases:
        for x in values:
            with pytest.raises(ie_lab.InputError, match=word):
                call(x)
