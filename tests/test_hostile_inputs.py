"""Inputs no caller should send never escape as a foreign exception (issue 28): each is an IELabError naming the fix,
and the model is left as it was (no hook, no attention tap, the same weights).

An address whose layer has thousands of digits (int() refuses past 4300), text holding a lone surrogate (no UTF-8
form for the tokenizer), a model whose weights are on the meta device; then a small property test over address
strings and texts (surrogates, control characters, long strings) on one tiny model built for the module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ie_lab
from ie_lab.points import NAMES
from ie_lab.toy import tiny_model
from tests.conftest import assert_clean

HUGE = "9" * 5000


@pytest.fixture(scope="module")
def lm():
    m, t = tiny_model("llama")
    return ie_lab.load(m, t, quiet=True)


@pytest.fixture(scope="module")
def s():
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False, replace=False) as session:
        yield session


def _weights(lm):
    return [p.detach().clone() for p in lm.hf.parameters()]


def _unchanged(lm, before):
    assert_clean(lm)
    assert all(torch.equal(a, b) for a, b in zip(before, lm.hf.parameters()))


@pytest.mark.parametrize(
    "address",
    ["resid_post." + HUGE, "z.0.head-" + HUGE, "resid_post.0.stream-" + HUGE, "z." + HUGE + ".head-1"],
)
def test_a_coordinate_of_thousands_of_digits_is_an_address_error(s, address):
    before = _weights(s._lm)
    with pytest.raises(ie_lab.AddressError, match="digits") as err:
        s.capture("When Mary went", [address])
    assert len(str(err.value)) < 2000  # the address is shown cut short, not 5000 digits long
    with pytest.raises(ie_lab.AddressError, match="digits"):
        ie_lab.Address.parse(address)
    with pytest.raises(ie_lab.AddressError, match="digits"):
        s.steer(address, torch.ones(s.facts.d_model))
    _unchanged(s._lm, before)


def test_a_huge_integer_coordinate_is_an_address_error_that_prints(s):
    with pytest.raises(ie_lab.AddressError, match="digits") as err:
        ie_lab.Address("resid_post", 10**5000)
    str(err.value)  # formatting the message must not itself raise (int -> str stops at 4300 digits)
    with pytest.raises(ie_lab.AddressError):
        s.capture("When Mary went", [ie_lab.Address("resid_post", 2**40)])
    with pytest.raises(ie_lab.AddressError, match="out of range"):
        s.capture("When Mary went", [ie_lab.Address("resid_post", 10**6)])


@pytest.mark.parametrize("text", ["abc\ud800", "\udfff", "a lone \udc80 low half"])
def test_text_with_a_lone_surrogate_is_an_input_error(s, text):
    before = _weights(s._lm)
    calls = [
        lambda: s.capture(text, ["resid_post.0"]),
        lambda: s.generate(text, 2),
        lambda: s.capture(["fine text", text], ["resid_post.0"]),
        lambda: s.generate(["fine text", text], 2),
        lambda: s.logit_lens(text),
        lambda: s.to_str_tokens(text),
    ]
    for call in calls:
        with pytest.raises(ie_lab.InputError, match="surrogate") as err:
            call()
        assert "errors='replace'" in str(err.value)  # the fix
        str(err.value).encode("utf-8")  # the message itself prints anywhere: the character is escaped
    _unchanged(s._lm, before)


def test_a_conversation_with_a_lone_surrogate_is_an_input_error():
    from tests.families import make_model, make_tokenizer

    tok = copy.deepcopy(make_tokenizer())
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
    lm = ie_lab.load(make_model("llama"), tok, quiet=True)
    with pytest.raises(ie_lab.InputError, match="surrogate"):
        ie_lab.capture(lm, [{"role": "user", "content": "hi \ud800"}], ["resid_post.0"])
    assert_clean(lm)


def _meta_model():
    with torch.device("meta"):
        m, t = tiny_model("llama")
    return m, t


def test_a_model_on_the_meta_device_is_refused_naming_the_fix():
    m, t = _meta_model()
    training = [mod.training for mod in m.modules()]
    for make in (lambda: ie_lab.load(m, t, quiet=True), lambda: ie_lab.Session(m, tokenizer=t, progress=False)):
        with pytest.raises(ie_lab.IELabError, match="meta") as err:
            make()
        assert "load_state_dict" in str(err.value) or "from_pretrained" in str(err.value)
    assert all(p.is_meta for p in m.parameters())  # left as given
    assert [mod.training for mod in m.modules()] == training
    assert sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in m.modules()) == 0


def test_a_model_with_only_some_weights_on_the_meta_device_is_refused():
    m, t = tiny_model("llama")
    m.lm_head.to("meta")  # what an offloading device_map leaves behind
    with pytest.raises(ie_lab.IELabError, match="meta"):
        ie_lab.load(m, t, quiet=True)


# ---- properties ------------------------------------------------------------------------------------------------

ODD = ["\ud800", "\udfff", "\x00", "\x1b", "\x7f", "\u202e", "\ufeff", "\n", "\t", "é", "²", "١", "-", ".", " "]
CHARS = st.one_of(st.characters(), st.sampled_from(ODD), st.sampled_from("0123456789.-headstrm_"))
TEXT = st.one_of(
    st.text(CHARS, max_size=60),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "9", "\ud800", "ab ", "\x00"]), st.integers(300, 5000)),
)
ADDRESS = st.one_of(
    TEXT,
    st.builds(lambda name, rest: name + rest, st.sampled_from(NAMES), TEXT),
    st.builds(
        lambda name, n, tail: f"{name}.{n}{tail}",
        st.sampled_from(NAMES),
        st.one_of(st.integers(0, 3), st.integers(0, 10**30), st.just(HUGE)),
        st.sampled_from(["", ".head-1", ".head-" + HUGE, ".stream-0", ".x", "..", "\ud800"]),
    ),
)


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(address=ADDRESS)
def test_any_address_string_works_or_is_an_ie_lab_error(lm, address):
    try:
        ie_lab.capture(lm, [5, 6, 7], [address])
    except ie_lab.IELabError as e:
        str(e).encode("utf-8")  # a message that prints
    assert_clean(lm)


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=TEXT)
def test_any_text_works_or_is_an_ie_lab_error(lm, text):
    for call in (
        lambda: ie_lab.capture(lm, text, ["resid_post.0"]),
        lambda: ie_lab.generate(lm, text, 1),
        lambda: lm.to_str_tokens(text),
    ):
        try:
            call()
        except ie_lab.IELabError as e:
            str(e).encode("utf-8")
    assert_clean(lm)
