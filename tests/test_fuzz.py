"""Property-based fuzzing of the Session's doors (issue 28, "no foreign exceptions").

Hypothesis draws hostile values for what a user passes: addresses, texts (lone surrogates, control characters, huge
strings), numbers (nan, inf, huge, negative, wrong types: positions, k, scale, max_new_tokens, temperature, top_k,
top_p, seed, layer indices) and steering specs (method names, vectors of the wrong shape, dtype or with non-finite
values, scales, position masks). Every call either works or raises an IELabError whose message prints; never a
plain Python or torch error. After each example the Session is as it was: no hook left on any module (the modules'
_forward_hooks / _forward_pre_hooks counts), and the next unsteered generation equals the reference taken at start.

Eager on the toy Llama (ie_lab.toy), a bounded number of examples per property (the module takes a few seconds).
tests/test_hostile_inputs.py holds the fixed cases (a 5,000-digit layer, a lone surrogate, a meta-device model) and
the address/text properties on a bare model; tests/test_fuzz_inputs.py the explicit table of bad arguments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ie_lab
from ie_lab.ops.steering import METHODS
from ie_lab.points import NAMES
from ie_lab.toy import tiny_model
from tests.conftest import hook_count

PROMPT = "When Mary and John went to the store"
N_REF = 3
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def s():
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False, replace=False) as session:
        yield session


@pytest.fixture(scope="module")
def ref(s):
    """What the untouched Session computes: the next outputs every example must leave as they are."""
    return s.generate(PROMPT, N_REF).ids, hook_count(s._lm.hf)


def _door(s, ref, call) -> None:
    """call() works or raises an IELabError; the Session is unchanged after it either way."""
    try:
        call()
        event("worked")  # --hypothesis-show-statistics: how many examples got past every door
    except ie_lab.IELabError as e:
        str(e).encode("utf-8")  # a message that prints anywhere
        event(f"refused: {type(e).__name__}")
    except Exception as e:  # noqa: BLE001 - the property under test
        pytest.fail(f"a foreign {type(e).__name__} escaped: {e!r}"[:2000])
    ids, hooks = ref
    assert hook_count(s._lm.hf) == hooks == 0, "a hook was left registered"
    assert s.generate(PROMPT, N_REF).ids == ids, "the Session computes something else after it"


# ---- strategies ------------------------------------------------------------------------------------------------

ODD = ["\ud800", "\udfff", "\x00", "\x1b", "\x7f", "\u202e", "\ufeff", "\n", "é", "١", "-", ".", " "]
CHARS = st.one_of(st.characters(), st.sampled_from(ODD), st.sampled_from("0123456789.-headstrm_"))
TEXT = st.one_of(
    st.text(CHARS, max_size=40),
    st.builds(lambda c, n: c * n, st.sampled_from(["a ", "9", "\ud800", "\x00"]), st.integers(300, 3000)),
)
ADDRESS = st.one_of(
    TEXT,
    st.builds(lambda name, n: f"{name}.{n}", st.sampled_from(NAMES), st.integers(0, 1)),  # mostly real ones
    st.sampled_from(NAMES),
    st.builds(
        lambda name, n, tail: f"{name}.{n}{tail}",
        st.sampled_from(NAMES),
        st.one_of(st.integers(-3, 3), st.integers(0, 10**30), st.just("9" * 5000)),
        st.sampled_from(["", ".head-1", ".head--1", ".stream-0", ".x", "..", "\ud800"]),
    ),
)
# Numbers of every kind, and things that only look like one. Small valid integers are kept small: a valid
# max_new_tokens of 10**5 would be a legitimate (and long) request.
NUMBER = st.one_of(
    st.integers(-(10**20), 6),
    st.integers(10**6, 10**30),
    st.just(10**5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 5e-324]),
    st.booleans(),
    st.none(),
    st.sampled_from(["3", "", "nan", b"1", [1], (2,), {"k": 1}, 2 + 1j, np.float32("nan"), np.int64(2)]),
    st.builds(torch.tensor, st.sampled_from([2, 0.5, float("nan")])),
)
# valid numbers, so that the other arguments of a call are what gets tested; 1e30 overflows the activations
FINITE = st.one_of(st.floats(-1e3, 1e3), st.sampled_from([1e30, -1e30, 1e-30]))
POSITIONS = st.one_of(
    st.sampled_from(["all", "prompt", "generated", "special", "bogus", "", None]),
    NUMBER,
    st.lists(NUMBER, max_size=4),
    st.lists(st.integers(-5, 12), max_size=5),
    st.builds(lambda n, v: torch.full((n,), v, dtype=torch.bool), st.integers(0, 20), st.booleans()),
)
METHOD = st.one_of(st.sampled_from(list(METHODS)), st.sampled_from(["", "Add", "bogus", None, 3, ["add"]]))


def _vector(d: int):
    """Steering vectors: right and wrong shapes and dtypes, non-finite values, plain lists, numpy."""
    shape = st.sampled_from([(d,), (d - 1,), (d + 1,), (), (1, d), (2, d), (0,)])
    fill = st.sampled_from([1.0, 0.0, -2.5, float("nan"), float("inf"), 1e38, 1e-45])
    dtype = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool])
    tensors = st.builds(lambda sh, v, dt: torch.full(sh, v).to(dt), shape, fill, dtype)
    return st.one_of(
        tensors,
        st.builds(lambda v: [v] * d, fill),
        st.builds(lambda v: np.full((d,), v, dtype=np.float32), fill),
        st.sampled_from([None, "vector", 3.0, [[1.0] * d]]),
    )


# ---- properties ------------------------------------------------------------------------------------------------


def _some_hostile(data, valid: dict, hostile: dict) -> dict:
    """valid arguments with none, one or a few of them replaced by hostile values: an argument is then tested both
    alone and together with others (every argument hostile at once would stop at the first check every time)."""
    kw = dict(valid)
    for name in data.draw(st.lists(st.sampled_from(sorted(hostile)), max_size=3, unique=True), label="hostile"):
        kw[name] = data.draw(hostile[name], label=name)
    return kw


@SETTINGS
@given(address=ADDRESS, text=TEXT)
def test_any_address_and_text_through_the_session(s, ref, address, text):
    _door(s, ref, lambda: s.capture(text, [address]))
    _door(s, ref, lambda: s.capture(PROMPT, [address]))


@SETTINGS
@given(data=st.data())
def test_generation_numbers(s, ref, data):
    valid = {
        "max_new_tokens": data.draw(st.integers(1, 4)),
        "temperature": data.draw(st.sampled_from([0.0, 0.7, 1.3])),
        "top_k": data.draw(st.sampled_from([None, 1, 40])),
        "top_p": data.draw(st.sampled_from([None, 0.5, 1.0])),
        "seed": data.draw(st.sampled_from([None, 0, 2**64 - 1])),
    }
    kw = _some_hostile(data, valid, {k: NUMBER for k in valid})
    n = kw.pop("max_new_tokens")
    _door(s, ref, lambda: s.generate(PROMPT, n, **kw))


@SETTINGS
@given(k=st.one_of(NUMBER, st.integers(1, 600)), layer=NUMBER, layers=st.one_of(st.lists(NUMBER, max_size=3), NUMBER))
def test_lens_and_layer_numbers(s, ref, k, layer, layers):
    _door(s, ref, lambda: s.logit_lens(PROMPT, k=k))
    _door(s, ref, lambda: s.logit_lens(PROMPT, layers=layers, k=3))
    _door(s, ref, lambda: s.capture(PROMPT, [ie_lab.Address("resid_post", layer)]))


@SETTINGS
@given(data=st.data())
def test_steering_specs(s, ref, data):
    d = s.facts.d_model
    method = data.draw(st.sampled_from(list(METHODS)))
    valid: dict = {
        "address": data.draw(st.sampled_from(["resid_post.0", "resid_mid.1", "mlp_out.0", "attn_out.1"])),
        "vector": torch.randn(d, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 9)))),
        "method": method,
        "scale": data.draw(FINITE),
        "positions": data.draw(st.sampled_from(["all", "prompt", "generated", "special", [0, 2], [9]])),
    }
    if method == "cap":
        valid["min"], valid["max"] = -1.0, 1.0
    if method == "swap":
        valid["target"] = data.draw(FINITE)
    hostile = {
        "address": ADDRESS,
        "vector": _vector(d),
        "method": METHOD,
        "scale": NUMBER,
        "positions": POSITIONS,
        "min": NUMBER,
        "max": NUMBER,
        "target": NUMBER,
        "normalize": st.one_of(NUMBER, st.booleans()),
    }
    kw = _some_hostile(data, valid, hostile)

    def steered():
        spec = s.steer(kw.pop("address"), kw.pop("vector"), **kw)
        s.generate(PROMPT, 3, steer=spec)
        with spec:
            s.capture(PROMPT, ["resid_post.1"])

    _door(s, ref, steered)


def test_the_reference_is_finite(s, ref):
    """The property's yardstick is a real generation (not an empty one every example would trivially equal)."""
    assert len(ref[0]) == N_REF and not math.isnan(float(s.generate(PROMPT, 1).steps[0].logprob))
