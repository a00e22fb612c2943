"""Porting from TransformerLens and nnsight (issue 33, item 15): Session(model, tokenizer) as those users hold a
model, and TransformerLens' prepend_bos switch, at the Session and per call, on tokenizers that add a BOS by
themselves, that have one and do not add it, that have none (EOS serves, as in TransformerLens), and that have
neither (refused)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tokenizers import processors

import ie_lab
from ie_lab.toy import tiny_model
from ie_lab.toy import tokenizer as toy_tokenizer

TEXT = "Mary went to the store"
BOS, EOS = 1, 2  # the toy tokenizer's <s> and </s>


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")[0]


@pytest.fixture(scope="module")
def plain():
    """Has a BOS token and does not add it (GPT-2's tokenizer behaves so)."""
    return toy_tokenizer()


@pytest.fixture(scope="module")
def adds_bos():
    """Adds its BOS by itself (Llama's and Gemma's tokenizers behave so)."""
    tok = toy_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    return tok


@pytest.fixture(scope="module")
def body(plain):
    return plain(TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def session(model, plain):
    s = ie_lab.Session(model, plain, progress=False, replace=False)  # the tokenizer second, positionally
    yield s
    s.close()


def test_a_model_object_and_its_tokenizer_positionally(model, plain, session, body):
    assert session.backend == "eager" and session.tokenizer is plain
    assert session.tokens(TEXT)[0].tolist() == body
    with ie_lab.Session(model, tokenizer=plain, progress=False, replace=False) as s:
        want = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
    assert torch.equal(session.capture(TEXT, ["resid_post.1"])["resid_post.1"], want)


def test_a_tokenizer_given_twice_or_a_wrong_second_argument_is_refused_naming_the_fix(model, plain):
    with pytest.raises(ie_lab.InputError, match=r"two tokenizers.*Session\(model, tokenizer\)"):
        ie_lab.Session(model, plain, tokenizer=plain, progress=False, replace=False)
    with pytest.raises(ie_lab.InputError, match=r"unknown backend 3.*a tokenizer may go second"):
        ie_lab.Session(model, 3, progress=False, replace=False)
    with pytest.raises(ie_lab.InputError, match="prepend_bos must be True, False or None"):
        ie_lab.Session(model, plain, prepend_bos="yes", progress=False, replace=False)


def test_prepend_bos_on_a_tokenizer_that_does_not_add_one(session, body):
    assert session.tokens(TEXT)[0].tolist() == body  # None: the tokenizer's own choice
    assert session.tokens(TEXT, prepend_bos=True)[0].tolist() == [BOS, *body]
    assert session.tokens(TEXT, prepend_bos=False)[0].tolist() == body
    assert session.to_str_tokens(TEXT, prepend_bos=True)[0] == "<s>"


def test_prepend_bos_on_a_tokenizer_that_adds_one_itself(model, adds_bos, body):
    with ie_lab.Session(model, adds_bos, progress=False, replace=False) as s:
        assert s.tokens(TEXT)[0].tolist() == [BOS, *body]
        assert s.tokens(TEXT, prepend_bos=True)[0].tolist() == [BOS, *body]  # one BOS, not two
        assert s.tokens(TEXT, prepend_bos=False)[0].tolist() == body  # the tokenizer's own BOS left off


def test_without_a_bos_token_eos_goes_first_and_without_either_it_is_refused(model, body):
    no_bos = toy_tokenizer()
    no_bos.bos_token = None
    with ie_lab.Session(model, no_bos, progress=False, replace=False) as s:
        assert s.tokens(TEXT, prepend_bos=True)[0].tolist() == [EOS, *body]  # as TransformerLens: bos = eos
        neither = toy_tokenizer()
        neither.bos_token = None
        neither.eos_token = None
        s2 = ie_lab.Session(model, neither, progress=False, replace=False)
        try:
            with pytest.raises(ie_lab.InputError, match="neither a BOS nor an EOS token"):
                s2.capture(TEXT, ["resid_post.0"], prepend_bos=True)
        finally:
            s2.close()


def test_every_operation_takes_it_per_call_and_the_session_default(model, plain, session, body):
    ids = [BOS, *body]
    want = session.capture(ids, ["resid_post.1"])["resid_post.1"]
    assert torch.equal(session.capture(TEXT, ["resid_post.1"], prepend_bos=True)["resid_post.1"], want)
    assert not torch.equal(session.capture(TEXT, ["resid_post.1"])["resid_post.1"][:, -1], want[:, -1])
    gen = session.generate(ids, max_new_tokens=4)
    assert session.generate(TEXT, max_new_tokens=4, prepend_bos=True).ids == gen.ids
    assert [st.token_id for st in session.generate_stream(TEXT, 4, prepend_bos=True)] == gen.ids

    async def streamed():
        return [st.token_id async for st in session.agenerate_stream(TEXT, 4, prepend_bos=True)]

    assert asyncio.run(streamed()) == gen.ids
    assert session.logit_lens(TEXT, prepend_bos=True).str_tokens[0] == "<s>"
    many = session.capture(
        [TEXT, "John went home"], ["resid_post.1"], prepend_bos=True
    )  # a list of texts: each gets one
    assert [c.str_tokens[0][0] for c in many] == ["<s>", "<s>"]
    with ie_lab.Session(model, plain, prepend_bos=True, progress=False, replace=False) as s:
        assert torch.equal(s.capture(TEXT, ["resid_post.1"])["resid_post.1"], want)  # the Session's default
        assert s.tokens(TEXT, prepend_bos=False)[0].tolist() == body  # a call's own keyword wins
        assert s.generate(TEXT, max_new_tokens=4).ids == gen.ids
