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


@pytest.mark.parametrize(
    "inp,addresses,exc,fragment",
    [
        ([5, 6, 7], ["resid_psot.0"], ie_lab.AddressError, "Did you mean resid_post.0"),
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
    ],
)
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


def test_capability_refusals_read_as_one_sentence_each():
    # Issue 13.6: the table's cells are "no: <why>", and the refusal used to paste the cell in whole
    # ("... is not supported: no: patching replaces ...").
    import re

    from ie_lab.capabilities import CAPABILITIES, require

    shape = re.compile(
        r"(?P<name>.+) is not supported on backend='(?P<b>eager|vllm)': (?P<why>[^.].+)\. "
        r"Instead: (?P<instead>.+)\."
    )
    n = 0
    for cap in CAPABILITIES:
        for backend in ("eager", "vllm"):
            if not cap.refusable or cap.supported(backend):
                continue
            with pytest.raises(ie_lab.CapabilityUnsupported) as e:
                require(cap.name, backend)
            msg = str(e.value)
            m = shape.fullmatch(msg)
            assert m, msg
            assert m["name"] == cap.name and m["b"] == backend and m["instead"].rstrip(".") == cap.instead.rstrip(".")
            assert "no:" not in msg and ".." not in msg and not m["why"].lower().startswith(("no ", "no,", "no;"))
            assert e.value.why == m["why"] and e.value.backend == f"backend={backend!r}"
            n += 1
    assert n >= 8
    # the vLLM session's refusals come from the same table
    with pytest.raises(
        ie_lab.CapabilityUnsupported,
        match=r"^activation patching and sweeps is not supported on "
        r"backend='vllm': patching replaces",
    ):
        require("activation patching and sweeps", "vllm")


def test_refusals_built_anywhere_end_each_part_once():
    e = ie_lab.CapabilityUnsupported("attention() on a batch", "the viewer shows one prompt.", "call it per prompt.")
    assert (
        str(e) == "attention() on a batch is not supported: the viewer shows one prompt. Instead: call it per prompt."
    )
    e = ie_lab.CapabilityUnsupported("x", "no reason given", "do y")
    assert str(e) == "x is not supported: no reason given. Instead: do y."


@pytest.fixture
def chat_lm():
    """A model whose tokenizer has a chat template (a copy: the fixture tokenizer is shared)."""
    import copy

    from tests.families import make_model, make_tokenizer

    tok = copy.deepcopy(make_tokenizer())
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}She{% else %}He{% endif %} said : "
        "{{ m['content'] }} . {% endfor %}{% if add_generation_prompt %}He said :{% endif %}"
    )
    return ie_lab.load(make_model("llama"), tok)


def test_a_conversation_is_rendered_with_the_chat_template(chat_lm):
    # Issue 13.6: ie_lab.generate(lm, [{"role": ..., "content": ...}], 3) raised "Could not infer dtype of dict".
    msgs = [{"role": "user", "content": "When Mary went to the store"}]
    want = ie_lab.apply_chat_template(chat_lm, msgs)
    toks = chat_lm.tokenizer.convert_ids_to_tokens(want[0].tolist())
    assert toks[:3] == ["She", "said", ":"] and toks[-3:] == ["He", "said", ":"]  # the generation prompt
    out = ie_lab.generate(chat_lm, msgs, 3)
    assert torch.equal(out.prompt_ids.cpu(), want)
    assert out.ids == ie_lab.generate(chat_lm, want, 3).ids
    c = ie_lab.capture(chat_lm, msgs, ["resid_post.0"])
    assert torch.equal(c.tokens.cpu(), want)
    assert_clean(chat_lm)


def test_a_session_streams_a_conversation_with_print_tokens(chat_lm, capsys):
    # print_tokens=True read the prompt back with torch.as_tensor, which cannot read a conversation.
    msgs = [{"role": "user", "content": "When Mary went to the store"}]
    s = ie_lab.Session(chat_lm.hf, tokenizer=chat_lm.tokenizer, progress=False, replace=False)
    try:
        printed = s.generate(msgs, 3, print_tokens=True)
        plain = s.generate(msgs, 3)
    finally:
        s.close()
    assert torch.equal(printed.prompt_ids.cpu(), plain.prompt_ids.cpu())
    assert printed.ids == plain.ids and printed.text == plain.text
    assert printed.text.split()[0] in capsys.readouterr().out
    assert_clean(chat_lm)


def test_a_conversation_without_a_template_is_refused_naming_the_helper(lm):
    msgs = [{"role": "user", "content": "hi"}]
    for call in (lambda: ie_lab.generate(lm, msgs, 3), lambda: ie_lab.capture(lm, msgs, ["resid_post.0"])):
        with pytest.raises(ie_lab.InputError, match="no chat template") as e:
            call()
        assert "apply_chat_template" in str(e.value) and "chat_template" in str(e.value)
    with pytest.raises(ie_lab.InputError, match=r"'content': str"):
        ie_lab.capture(lm, [{"role": "user"}], ["resid_post.0"])
    with pytest.raises(ie_lab.InputError, match="wrap a message in a list"):
        ie_lab.capture(lm, {"role": "user", "content": "hi"}, ["resid_post.0"])
    assert_clean(lm)


@pytest.mark.parametrize(
    "call,fragment",
    [
        (lambda lm: ie_lab.attention(lm, [5, 6, 7], layers=[99]), "has 2 layers"),
        (lambda lm: ie_lab.attention(lm, [5, 6, 7], layers=[1.7]), "integers 0..1"),
        (lambda lm: ie_lab.attention(lm, [[5, 6, 7], [5, 6, 8]]), "one prompt"),
        (lambda lm: ie_lab.logit_lens(lm, [5, 6, 7], layers=["١"]), "integers 0..1"),
        (lambda lm: ie_lab.logit_lens(lm, [[5, 6, 7], [5, 6, 8]]), "batch of 2"),
        (lambda lm: ie_lab.logit_lens(lm, [5, 6, 7], k=True), "k (how many top tokens"),
        (lambda lm: ie_lab.logit_lens(lm, [5, 6, 7], k=10_000), "vocabulary size 512"),
        (
            lambda lm: ie_lab.logit_lens(lm, [5, 6, 7], layers=[0], transports={0: (torch.eye(3), torch.zeros(3))}),
            "A [128, 128]",
        ),
        (lambda lm: ie_lab.fit_tuned_lens(lm, "the cat sat"), "character by character"),
        (lambda lm: ie_lab.fit_tuned_lens(lm, ["the cat"], ridge=float("nan")), "ridge"),
        (lambda lm: ie_lab.capture(lm, [None], ["resid_post.0"]), "could not read the token list"),
        (lambda lm: ie_lab.capture(lm, [], ["resid_post.0"]), "the token list is empty"),
        (lambda lm: ie_lab.capture(lm, [5, 6, 7], 3), "list of them"),
        (lambda lm: ie_lab.capture(None, [5, 6, 7], ["resid_post.0"]), "model must be"),
    ],
)
def test_viewer_and_lens_arguments_are_refused_before_any_work(lm, call, fragment):
    # attention(layers=[99]) used to raise IndexError, logit_lens on a batch silently read the first prompt only.
    with pytest.raises(ie_lab.IELabError) as e:
        call(lm)
    assert fragment in str(e.value)
    assert_clean(lm)


def test_attention_viewer_arguments_are_checked_like_the_operations(lm):
    s = ie_lab.Session(lm.hf, tokenizer=lm.tokenizer, progress=False)
    try:
        for kwargs, fragment in [
            ({"layer": "1"}, "layer must be an integer"),
            ({"head": 1.5}, "head must be"),
            ({"layers": [0.5]}, "integers 0..1"),
            ({"layers": [0, 0]}, "twice"),
        ]:
            with pytest.raises(ie_lab.InputError, match=fragment):
                s.show_attention("When Mary and John went to the store", **kwargs)
        with pytest.raises(ie_lab.InputError, match="could not read the token list"):
            s.show_attention([None])
    finally:
        s.close()
    assert_clean(lm)
