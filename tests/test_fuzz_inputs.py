"""Every public argument of the eager API, given bad values, is refused with an ie_lab error (issue 14.9).

An explicit table rather than random search: each case is one argument of one operation replaced by a bad
value (wrong type, out of range, nan/inf, empty, huge, non-ASCII digits, negative, None, nested lists, ...),
every other argument valid. Each must raise an IELabError subclass whose message names the argument (or the
thing it stands for), and leave the model as it was: no hook, no attention tap, no steering, same weights.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import ie_lab
from ie_lab import Address
from ie_lab.mappers import from_engine, to_engine
from tests.conftest import assert_clean, lm_for

NAN, INF = float("nan"), float("inf")
PROMPT = "When Mary and John went to the store"
N_TOK = 8  # tokens in PROMPT
D = 128  # d_model of the llama fixture


class Opaque:
    """An object of no type any argument accepts."""

    def __repr__(self) -> str:
        return "Opaque()"


OPAQUE = Opaque()

RAGGED = [[5, 6], [7]]  # a list of two prompts for capture and generate; one ragged batch for the rest
# Bad values for an argument that takes a prompt (text, token ids or a conversation).
BAD_PROMPTS = [
    None,
    OPAQUE,
    5,
    NAN,
    "",
    "   ",
    [],
    [[]],
    [[[]]],
    [""],
    ["a", ""],
    [None],
    [1.5],
    [-1],
    [512],
    [10**12],
    [2**70],
    ["the", 3],
    RAGGED,
    {"ids": 1},
    b"the cat",
    "the " * 300,
    torch.tensor([[1.0, 2.0]]),
    torch.zeros(1, 0, dtype=torch.long),
    torch.zeros(2, 3, 4, dtype=torch.long),
    torch.tensor([[5, 600]]),
    torch.tensor([True, False]),
    np.array([1.5, 2.5]),
    [{"role": "user"}],
    [{"role": "user", "content": 3}],
    [{"role": "user", "content": "hi"}],  # a conversation, but this tokenizer has no chat template
]
# Operations that take a list of prompts (capture, generate): the ragged list is fine, a bad item is not.
BAD_PROMPT_LISTS = [b for b in BAD_PROMPTS if b is not RAGGED] + [[[5, 6], "the"], [[5, 6], [7, 600]], [[5], {"a": 1}]]
PROMPT_WORDS = (
    "text",
    "token",
    "prompt",
    "input",
    "conversation",
    "message",
    "chat",
    "context",
    "batch",
    "empty",
    "vocabulary",
)

BAD_ADDRESSES = [
    None,
    OPAQUE,
    3,
    NAN,
    "",
    [],
    [None],
    [3],
    [[["resid_post.0"]]],
    "resid_post.²",
    "resid_post.١",
    "z.0.head-١",
    "resid_post.-1",
    "resid_post.99",
    "resid_post.1.5",
    "resid_post.10000000000000000000000",
    "resid_psot.0",
    "resid_post",
    "embeddings.0",
    "resid_post.0.head-1",
    "z.0.head-99",
    "z.0.head--1",
    "resid_post.0.stream-1",
]
ADDRESS_WORDS = ("address", "point", "layer", "head", "stream", "resid_post", "embeddings", "z")

BAD_LAYERS = [
    OPAQUE,
    NAN,
    INF,
    -1,
    2,
    99,
    10**12,
    1.5,
    "1",
    "١",
    [],
    [99],
    [-1],
    [1.0],
    [True],
    True,
    [0, 0],
    [[0]],
    [None],
    torch.tensor([0.5]),
]

BAD_COUNTS = [None, OPAQUE, NAN, INF, -1, 0, 1.5, "3", "٣", True, [3], 10**12]  # positive-integer arguments
BAD_FLOATS = [None, OPAQUE, NAN, INF, -INF, "1", [1.0], torch.tensor([1.0, 2.0])]  # finite-number arguments
BAD_FLAGS = [None, OPAQUE, NAN, 2, "yes", [True]]  # True/False arguments


def _vector():
    return torch.randn(D, generator=torch.Generator().manual_seed(0))


BAD_VECTORS = [
    None,
    OPAQUE,
    NAN,
    3.0,
    [],
    torch.zeros(0),
    torch.zeros(D + 1),
    torch.zeros(2, D),
    torch.full((D,), NAN),
    torch.full((D,), INF),
    torch.zeros(D, dtype=torch.complex64),
    "vector",
]
# (an integer vector is converted exactly, so it is not a bad input)


def _metric(logits):
    return logits[0, -1, 5] - logits[0, -1, 6]


BAD_METRICS = [
    None,
    OPAQUE,
    3,
    "logit_diff",
    lambda logits: logits,
    lambda logits: "x",
    lambda logits: torch.tensor([1.0, 2.0]),
]


def _cases():
    """(operation, argument, call(lm, bad), bad values, words one of which the message must contain)."""
    v = _vector()
    cap = lambda lm: ie_lab.capture(lm, PROMPT, ["resid_post.0"])  # noqa: E731
    yield (
        "capture",
        "tokens_or_text",
        lambda lm, x: ie_lab.capture(lm, x, ["resid_post.0"]),
        BAD_PROMPT_LISTS,
        PROMPT_WORDS,
    )
    yield "capture", "addresses", lambda lm, x: ie_lab.capture(lm, PROMPT, x), BAD_ADDRESSES, ADDRESS_WORDS
    yield "capture", "grad", lambda lm, x: ie_lab.capture(lm, PROMPT, ["resid_post.0"], grad=x), BAD_FLAGS, ("grad",)
    yield (
        "capture",
        "model",
        lambda lm, x: ie_lab.capture(x, PROMPT, ["resid_post.0"]),
        [None, OPAQUE, "llama", 3],
        ("model",),
    )

    def gen(lm, **kw):
        return ie_lab.generate(lm, kw.pop("prompt", PROMPT), kw.pop("max_new_tokens", 2), **kw)

    def first_step(lm, **kw):  # the stream: the error comes with the first step, before any token is computed
        return next(iter(ie_lab.generate_stream(lm, kw.pop("prompt", PROMPT), kw.pop("max_new_tokens", 2), **kw)))

    for name, fn in (("generate", gen), ("generate_stream", first_step)):
        yield name, "prompt", lambda lm, x, fn=fn: fn(lm, prompt=x), BAD_PROMPT_LISTS, PROMPT_WORDS
        yield (
            name,
            "max_new_tokens",
            lambda lm, x, fn=fn: fn(lm, max_new_tokens=x),
            BAD_COUNTS + [300],
            ("max_new_tokens",),
        )
        yield name, "temperature", lambda lm, x, fn=fn: fn(lm, temperature=x), BAD_FLOATS + [-1.0], ("temperature",)
        yield (
            name,
            "top_k",
            lambda lm, x, fn=fn: fn(lm, top_k=x, temperature=1.0),
            [v for v in BAD_COUNTS if v is not None],
            ("top_k",),
        )
        yield (
            name,
            "top_p",
            lambda lm, x, fn=fn: fn(lm, top_p=x, temperature=1.0),
            [OPAQUE, NAN, INF, 0.0, -0.5, 1.5, "0.9"],
            ("top_p",),
        )
        yield (
            name,
            "seed",
            lambda lm, x, fn=fn: fn(lm, seed=x, temperature=1.0),
            [OPAQUE, NAN, 1.5, "1", -1, [1]],
            ("seed",),
        )
        yield name, "stop", lambda lm, x, fn=fn: fn(lm, stop=x), [OPAQUE, 3, "", [""], [3], [None], [["a"]]], ("stop",)
        yield (
            name,
            "n_logprobs",
            lambda lm, x, fn=fn: fn(lm, n_logprobs=x),
            [None, OPAQUE, NAN, -1, 1.5, "3", True, 10**12],
            ("n_logprobs",),
        )
        yield (
            name,
            "capture",
            lambda lm, x, fn=fn: fn(lm, capture=x),
            [a for a in BAD_ADDRESSES if a not in (None, "", [])],
            ADDRESS_WORDS + ("capture",),
        )
        yield (
            name,
            "steer",
            lambda lm, x, fn=fn: fn(lm, steer=x),
            [OPAQUE, 3, "resid_post.0", [None], [OPAQUE], v],
            ("steer",),
        )
        yield name, "keep_logits", lambda lm, x, fn=fn: fn(lm, keep_logits=x), BAD_FLAGS, ("keep_logits",)
        yield name, "ignore_eos", lambda lm, x, fn=fn: fn(lm, ignore_eos=x), BAD_FLAGS, ("ignore_eos",)

    def steer(lm, **kw):
        spec = ie_lab.steer(lm, kw.pop("address", "resid_post.0"), kw.pop("vector", v), kw.pop("method", "add"), **kw)
        with spec:  # the spec must be refused before this; if not, its use must be
            cap(lm)

    yield (
        "steer",
        "address",
        lambda lm, x: steer(lm, address=x),
        BAD_ADDRESSES + ["z.0", "attn_probs.0", 3, NAN, {"resid_post.0"}],
        ADDRESS_WORDS + ("steer",),
    )
    # load() on the caller's model object: every argument checked before anything is copied or moved
    yield (
        "load",
        "device",
        lambda lm, x: ie_lab.load(lm.hf, lm.tokenizer, device=x, quiet=True),
        [3.5, "", "tpu", -1, OPAQUE, True, [0], "cuda:0"],
        ("device",),
    )
    yield (
        "load",
        "dtype",
        lambda lm, x: ie_lab.load(lm.hf, lm.tokenizer, dtype=x, quiet=True),
        [torch.int64, torch.bool, torch.complex64, "float77", 3, OPAQUE],
        ("dtype",),
    )
    yield "load", "tokenizer", lambda lm, x: ie_lab.load(lm.hf, x, quiet=True), [3, OPAQUE, NAN, [1]], ("tokenizer",)
    yield (
        "load",
        "trust_remote_code",
        lambda lm, x: ie_lab.load(lm.hf, lm.tokenizer, trust_remote_code=x, quiet=True),
        ["no", 1, None, OPAQUE],
        ("trust_remote_code",),
    )
    yield "load", "quiet", lambda lm, x: ie_lab.load(lm.hf, lm.tokenizer, quiet=x), ["no", 1, None], ("quiet",)
    yield "steer", "vector", lambda lm, x: steer(lm, vector=x), BAD_VECTORS, ("vector",)
    yield (
        "steer",
        "method",
        lambda lm, x: steer(lm, method=x),
        [None, OPAQUE, "", "Add", "sub", 3, ["add"]],
        ("method",),
    )
    yield "steer", "scale", lambda lm, x: steer(lm, scale=x), BAD_FLOATS, ("scale",)
    yield "steer", "normalize", lambda lm, x: steer(lm, normalize=x), BAD_FLAGS, ("normalize",)
    yield (
        "steer",
        "min/max",
        lambda lm, x: steer(lm, method="cap", min=x, max=1.0),
        [OPAQUE, NAN, "1", [0.0], 5.0],
        ("min", "max", "cap"),
    )
    yield (
        "steer",
        "target",
        lambda lm, x: steer(lm, method="swap", target=x),
        [None, OPAQUE, NAN, INF, "0"],
        ("target",),
    )
    # (a position past this prompt is not refused: inside a `with` block it may steer a later, longer call)
    yield (
        "steer",
        "positions",
        lambda lm, x: steer(lm, positions=x),
        [None, OPAQUE, NAN, "everywhere", "", [-1], [1.5], [[0]], [None], ["0"], ["٠"], torch.tensor([0.5]), 3],
        ("position",),
    )

    yield (
        "attention",
        "prompt",
        lambda lm, x: ie_lab.attention(lm, x),
        BAD_PROMPTS + [["the cat", "the dog"]],
        PROMPT_WORDS + ("batch", "attention"),
    )
    yield "attention", "layers", lambda lm, x: ie_lab.attention(lm, PROMPT, x), BAD_LAYERS, ("layer",)

    yield (
        "logit_lens",
        "prompt",
        lambda lm, x: ie_lab.logit_lens(lm, x),
        BAD_PROMPTS + [["the cat", "the dog"]],
        PROMPT_WORDS + ("batch",),
    )
    yield "logit_lens", "layers", lambda lm, x: ie_lab.logit_lens(lm, PROMPT, x), BAD_LAYERS, ("layer",)
    yield "logit_lens", "k", lambda lm, x: ie_lab.logit_lens(lm, PROMPT, k=x), BAD_COUNTS + [513], ("k ",)
    yield (
        "logit_lens",
        "point",
        lambda lm, x: ie_lab.logit_lens(lm, PROMPT, point=x),
        [None, OPAQUE, 3, "", "resid_post.0", "z", "embeddings", "resid_psot", ["resid_post"]],
        ("point", "resid"),
    )
    yield (
        "logit_lens",
        "transports",
        lambda lm, x: ie_lab.logit_lens(lm, PROMPT, [0], transports=x),
        [
            OPAQUE,
            3,
            [1],
            {1: (torch.eye(D), torch.zeros(D))},
            {0: None},
            {0: (torch.eye(D),)},
            {0: (torch.eye(3), torch.zeros(3))},
            {"0": (torch.eye(D), torch.zeros(D))},
            {0: "identity"},
        ],
        ("transport",),
    )
    yield (
        "logit_lens",
        "keep_logits",
        lambda lm, x: ie_lab.logit_lens(lm, PROMPT, keep_logits=x),
        BAD_FLAGS,
        ("keep_logits",),
    )

    yield (
        "fit_tuned_lens",
        "corpus",
        lambda lm, x: ie_lab.fit_tuned_lens(lm, x),
        [None, OPAQUE, 3, "the cat sat", [], [None], [""], [[1.5]]],
        ("corpus", "text", "token", "empty"),
    )
    yield "fit_tuned_lens", "layers", lambda lm, x: ie_lab.fit_tuned_lens(lm, [PROMPT], x), BAD_LAYERS, ("layer",)
    yield (
        "fit_tuned_lens",
        "point",
        lambda lm, x: ie_lab.fit_tuned_lens(lm, [PROMPT], point=x),
        [None, OPAQUE, "z", "resid_post.0", "embeddings"],
        ("point", "resid", "lens"),
    )
    yield (
        "fit_tuned_lens",
        "ridge",
        lambda lm, x: ie_lab.fit_tuned_lens(lm, [PROMPT], ridge=x),
        [None, OPAQUE, NAN, INF, -1.0, "0.1"],
        ("ridge",),
    )

    src = lambda lm: ie_lab.capture(lm, PROMPT, ["resid_post.0"])  # noqa: E731
    yield (
        "patch",
        "prompt",
        lambda lm, x: ie_lab.patch(lm, x, src(lm), ["resid_post.0"]),
        [p for p in BAD_PROMPTS],
        PROMPT_WORDS + ("patch", "shape", "length"),
    )
    yield (
        "patch",
        "source",
        lambda lm, x: ie_lab.patch(lm, PROMPT, x, ["resid_post.0"]),
        [b for b in BAD_PROMPTS if not isinstance(b, str) or b.strip()] + ["the cat"],
        PROMPT_WORDS + ("source", "patch", "length", "shape"),
    )
    yield (
        "patch",
        "addresses",
        lambda lm, x: ie_lab.patch(lm, PROMPT, PROMPT, x),
        BAD_ADDRESSES + ["attn_probs.0", "attn_scores.0"],
        ADDRESS_WORDS + ("patch",),
    )
    yield (
        "patch",
        "positions",
        lambda lm, x: ie_lab.patch(lm, PROMPT, PROMPT, ["resid_post.0"], positions=x),
        [OPAQUE, 3, NAN, "0", [N_TOK], [-N_TOK - 1], [1.5], [None], [[0]], ["١"], [True], []],
        ("position",),
    )
    yield (
        "run_with_patches",
        "patches",
        lambda lm, x: ie_lab.run_with_patches(lm, PROMPT, x),
        [
            None,
            OPAQUE,
            [1],
            {"resid_post.0": None},
            {"resid_post.0": torch.zeros(1, 3, D)},
            {"resid_post.0": torch.zeros(1, N_TOK, D + 1)},
            {"resid_post.0": torch.full((1, N_TOK, D), NAN)},
            {"resid_post.0": torch.zeros(1, N_TOK, D, dtype=torch.long)},
            {3: torch.zeros(1, N_TOK, D)},
        ],
        ("patch",) + ADDRESS_WORDS,
    )

    yield (
        "patch_sweep",
        "clean",
        lambda lm, x: ie_lab.patch_sweep(lm, x, PROMPT, _metric, progress=False),
        BAD_PROMPTS + ["the cat"],
        PROMPT_WORDS + ("length", "clean"),
    )
    yield (
        "patch_sweep",
        "corrupted",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, x, _metric, progress=False),
        BAD_PROMPTS + ["the cat"],
        PROMPT_WORDS + ("length", "corrupted"),
    )
    yield (
        "patch_sweep",
        "metric",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, PROMPT, x, progress=False),
        BAD_METRICS,
        ("metric",),
    )
    yield (
        "patch_sweep",
        "point",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, PROMPT, _metric, point=x, progress=False),
        [None, OPAQUE, "", "resid_post.0", "resid_psot", "attn_probs", "embeddings"],
        ("point", "resid", "patch"),
    )
    yield (
        "patch_sweep",
        "over",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, PROMPT, _metric, over=x, progress=False),
        [None, OPAQUE, "", "layer", ["layer_head"]],
        ("over",),
    )
    yield (
        "patch_sweep",
        "layers",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, PROMPT, _metric, layers=x, progress=False),
        BAD_LAYERS,
        ("layer",),
    )
    yield (
        "patch_sweep",
        "progress",
        lambda lm, x: ie_lab.patch_sweep(lm, PROMPT, PROMPT, _metric, layers=[0], progress=x),
        BAD_FLAGS,
        ("progress",),
    )

    yield (
        "gradients",
        "prompt",
        lambda lm, x: ie_lab.gradients(lm, x, _metric, ["resid_post.0"]),
        BAD_PROMPTS,
        PROMPT_WORDS,
    )
    yield (
        "gradients",
        "metric",
        lambda lm, x: ie_lab.gradients(lm, PROMPT, x, ["resid_post.0"]),
        BAD_METRICS,
        ("metric",),
    )
    yield (
        "gradients",
        "addresses",
        lambda lm, x: ie_lab.gradients(lm, PROMPT, _metric, x),
        BAD_ADDRESSES + ["attn_probs.0"],
        ADDRESS_WORDS + ("gradient",),
    )
    yield (
        "attribution_patch",
        "layers",
        lambda lm, x: ie_lab.attribution_patch(lm, PROMPT, PROMPT, _metric, layers=x),
        BAD_LAYERS,
        ("layer",),
    )
    yield (
        "attribution_patch",
        "point",
        lambda lm, x: ie_lab.attribution_patch(lm, PROMPT, PROMPT, _metric, point=x),
        [None, OPAQUE, "", "resid_post.0", "attn_probs"],
        ("point", "resid", "gradient", "patch"),
    )
    yield (
        "attribution_patch",
        "metric",
        lambda lm, x: ie_lab.attribution_patch(lm, PROMPT, PROMPT, x),
        BAD_METRICS,
        ("metric",),
    )
    yield (
        "logit_diff",
        "good/bad",
        lambda lm, x: ie_lab.gradients(lm, PROMPT, ie_lab.logit_diff(x, 6), ["resid_post.0"]),
        [None, OPAQUE, -1, 512, 10**12, 1.5, "5", NAN],
        ("good", "token", "logit_diff"),
    )
    yield (
        "logit_diff",
        "position",
        lambda lm, x: ie_lab.gradients(lm, PROMPT, ie_lab.logit_diff(5, 6, x), ["resid_post.0"]),
        [None, OPAQUE, N_TOK, -N_TOK - 1, 1.5, "0"],
        ("position", "logit_diff"),
    )

    msgs = [{"role": "user", "content": "the cat"}]
    yield (
        "apply_chat_template",
        "messages",
        lambda lm, x: ie_lab.apply_chat_template(lm, x),
        [None, OPAQUE, "hi", [], [None], [{}], [{"role": "user"}], [{"role": 3, "content": "x"}], msgs],
        ("message", "chat template"),
    )
    yield (
        "apply_chat_template",
        "add_generation_prompt",
        lambda lm, x: ie_lab.apply_chat_template(lm, msgs, add_generation_prompt=x),
        BAD_FLAGS,
        ("add_generation_prompt", "chat template"),
    )
    yield (
        "message_spans",
        "messages",
        lambda lm, x: ie_lab.message_spans(lm, x),
        [None, OPAQUE, "hi", [], [{"role": "user"}], msgs],
        ("message", "chat template"),
    )

    yield (
        "Address.parse",
        "text",
        lambda lm, x: Address.parse(x),
        [
            a
            for a in BAD_ADDRESSES
            if a not in ("resid_post.99", "z.0.head-99", "resid_post.0.stream-1", "resid_post.10000000000000000000000")
            and not isinstance(a, Address)
        ],
        ADDRESS_WORDS,
    )
    yield (
        "Address",
        "layer",
        lambda lm, x: Address("resid_post", x),
        [OPAQUE, NAN, INF, -1, 1.5, "1", "١", True, [1], torch.tensor(1.5)],
        ("layer",),
    )
    yield "Address", "head", lambda lm, x: Address("z", 0, x), [OPAQUE, NAN, -1, 1.5, "1", True], ("head",)
    yield (
        "Address",
        "name",
        lambda lm, x: Address(x, 0),
        [None, OPAQUE, 3, "", "resid_psot", ["resid_post"]],
        ("name", "point"),
    )
    yield (
        "to_engine",
        "model",
        lambda lm, x: to_engine("resid_post.0", x),
        [None, OPAQUE, 3, "", "totally_made_up", "glm4", {}],
        ("model", "family", "config"),
    )
    yield (
        "to_engine",
        "engine",
        lambda lm, x: to_engine("resid_post.0", lm, x),
        [None, OPAQUE, "", "tl", 3],
        ("engine",),
    )
    yield (
        "to_engine",
        "address",
        lambda lm, x: to_engine(x, lm),
        [a for a in BAD_ADDRESSES if a not in ("", [])],
        ADDRESS_WORDS,
    )
    yield (
        "from_engine",
        "name",
        lambda lm, x: from_engine(x, lm),
        [
            None,
            OPAQUE,
            3,
            "",
            "blocks.١.hook_resid_post",
            "blocks.-1.hook_resid_post",
            "blocks.99.hook_resid_post",
            "blocks.0.hook_resid_psot",
            ["blocks.0.hook_resid_post"],
        ],
        ("name", "blocks", "layer"),
    )
    yield (
        "cheatsheet",
        "family_or_config",
        lambda lm, x: ie_lab.cheatsheet(x),
        [None, OPAQUE, 3, "", "totally_made_up", {}],
        ("family", "config", "model_type"),
    )
    yield (
        "cheatsheet",
        "layer",
        lambda lm, x: ie_lab.cheatsheet("llama", layer=x),
        [OPAQUE, NAN, -1, 99, 1.5, "1", "١", True],
        ("layer",),
    )
    yield (
        "cheatsheet",
        "backend",
        lambda lm, x: ie_lab.cheatsheet("llama", backend=x),
        [None, OPAQUE, "", "gpu"],
        ("backend",),
    )


CASES = [
    (f"{op}-{arg}-{i}", call, bad, words) for op, arg, call, values, words in _cases() for i, bad in enumerate(values)
]


@pytest.fixture(scope="module")
def lm():
    return lm_for("llama")


def _short(x) -> str:
    r = repr(x)
    return r if len(r) < 60 else r[:57] + "..."


def test_every_bad_eager_input_is_an_ie_lab_error(lm):
    before = {k: t.clone() for k, t in lm.hf.state_dict().items()}
    failures = []
    for case_id, call, bad, words in CASES:
        try:
            call(lm, bad)
        except ie_lab.IELabError as e:
            msg = str(e)
            if not any(w.lower() in msg.lower() for w in words):
                failures.append(f"{case_id} {_short(bad)}: message names none of {words}: {msg[:200]}")
        except Exception as e:  # noqa: BLE001 - the point of the test
            failures.append(f"{case_id} {_short(bad)}: {type(e).__name__}: {str(e)[:200]}")
        else:
            failures.append(f"{case_id} {_short(bad)}: accepted")
        try:
            assert_clean(lm)
        except AssertionError as e:
            failures.append(f"{case_id} {_short(bad)}: model left dirty: {e}")
            break
    after = lm.hf.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a bad input changed the weights"
    assert len(CASES) > 400
    assert not failures, f"{len(failures)} of {len(CASES)} bad inputs were not refused cleanly:\n" + "\n".join(failures)


def test_session_methods_refuse_bad_input_the_same_way(lm):
    s = ie_lab.Session(lm.hf, tokenizer=lm.tokenizer, progress=False)
    try:
        calls = {
            "capture": lambda: s.capture(PROMPT, ["resid_post.²"]),
            "generate": lambda: s.generate([None], 2),
            "generate_stream": lambda: next(iter(s.generate_stream(PROMPT, -1))),
            "steer": lambda: s.steer("resid_post.0", torch.zeros(D + 1)),
            "attention": lambda: s.attention(PROMPT, [99]),
            "logit_lens": lambda: s.logit_lens(PROMPT, layers=["١"]),
            "patch": lambda: s.patch(PROMPT, PROMPT, [3]),
            "patch_sweep": lambda: s.patch_sweep(PROMPT, PROMPT, None, progress=False),
            "gradients": lambda: s.gradients(PROMPT, _metric, ["resid_post.-1"]),
            "tokens": lambda: s.tokens(None),
            "to_str_tokens": lambda: s.to_str_tokens([[1.5]]),
            "picker": lambda: s.picker(layer=99),
            "picker layer type": lambda: s.picker(layer="1"),
            "show_attention": lambda: s.show_attention(PROMPT, [99]),
            "show_attention layer type": lambda: s.show_attention(PROMPT, layer="1"),
            "generate print_tokens prompt": lambda: s.generate([[1.5]], 2, print_tokens=True),
            "generate print_tokens flag": lambda: s.generate(PROMPT, 2, print_tokens="yes"),
            "run": lambda: s.run(None),
            "arun": lambda: asyncio.run(s.arun(3)),
        }
        bad = []
        for name, call in calls.items():
            try:
                call()
            except ie_lab.IELabError:
                pass
            except Exception as e:  # noqa: BLE001
                bad.append(f"{name}: {type(e).__name__}: {e}")
            else:
                bad.append(f"{name}: accepted")
            assert_clean(s._lm)
        assert not bad, "\n".join(bad)
        assert s.capture(PROMPT, ["resid_post.0"])["resid_post.0"].shape == (1, N_TOK, D)  # still usable
    finally:
        s.close()


@pytest.mark.parametrize(
    "arg,bad",
    [
        ("backend", "gpu"),
        ("backend", None),
        ("dtype", "float77"),
        ("dtype", 3),
        ("dtype", torch.int64),
        ("tokenizer", ""),
        ("tokenizer", 3),
        ("device", 3.5),
        ("device", ""),
        ("device", "tpu"),
        ("device", -1),
        ("progress", "yes"),
        ("replace", "x"),
        ("trust_remote_code", "no"),
    ],
)
def test_session_constructor_refuses_bad_arguments(lm, arg, bad):
    kwargs = {"tokenizer": lm.tokenizer, "progress": False, "replace": False, arg: bad}
    with pytest.raises(ie_lab.IELabError) as e:
        ie_lab.Session(lm.hf, **kwargs).close()
    assert arg in str(e.value) or repr(bad) in str(e.value)
    assert_clean(lm)


def test_non_ascii_digits_are_never_read_as_numbers():
    for text in ("resid_post.١", "resid_post.²", "z.0.head-١", "resid_post.0.stream-٢", "resid_post.𝟘"):
        with pytest.raises(ie_lab.AddressError, match="ASCII digits"):
            Address.parse(text)
    assert Address.parse("resid_post.10") == Address("resid_post", 10)
