"""One record per operation (ie_lab/core/calls.py): every door shows its fields and checks them there.

The Session method, its awaited twin and the free function `ie_lab.<op>(model, ...)` have exactly the record's
fields as parameters (help() lists them), the record's defaults are the computation's own, and a misspelt keyword
is refused at the door, naming the nearest keyword, before any backend or model is touched.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

import ie_lab
from ie_lab.backend import OPERATIONS
from ie_lab.core import calls
from ie_lab.session import Session

# Keywords of the Session's own door, on top of the record's: prepend_bos on every operation (the Session's
# setting per call), print_tokens on the plain generate only.
DOOR = {"prepend_bos"}
DOOR_OF = {"generate": {"print_tokens"}}


def _params(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _record(op: str) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in calls.RECORDS[op].parameters()]


def test_every_operation_has_one_record():
    assert sorted(op.name for op in OPERATIONS) == sorted(calls.RECORDS)
    for op in OPERATIONS:
        assert op.record is calls.RECORDS[op.name] and op.doc, op


@pytest.mark.parametrize("op", sorted(calls.RECORDS))
def test_every_door_shows_exactly_the_records_fields(op):
    want = _record(op)
    fields = {n for n, _, _ in want}  # harvest's prepend_bos is its record's field (its texts are read lazily)
    for name, extra in ((op, (DOOR | DOOR_OF.get(op, set())) - fields), ("a" + op, DOOR - fields)):
        got = _params(getattr(Session, name))
        assert got[0][0] == "self", name
        assert got[1 : 1 + len(want)] == want, name  # the record's fields, kinds and defaults, in order
        rest = got[1 + len(want) :]
        assert {n for n, _, _ in rest} == extra and all(k == "KEYWORD_ONLY" for _, k, _ in rest), (name, rest)
        assert calls.RECORDS[op].doc in (getattr(Session, name).__doc__ or ""), name
    if op == "run":
        return  # run(fn) is a Session's only: a free function would be fn(model)
    free = getattr(ie_lab, op)
    assert _params(free) == [("model", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty), *want], op


def test_help_lists_the_real_keywords():
    text = inspect.getdoc(Session.capture) or ""
    sig = str(inspect.signature(Session.capture))
    assert "grad" in sig and "steer" in sig and "prepend_bos" in sig and "grad=True" in text
    assert "print_tokens" in str(inspect.signature(Session.generate))
    assert "temperature" in str(inspect.signature(Session.agenerate_stream))
    assert "temperature" in str(inspect.signature(ie_lab.project))


def _computations():
    from ie_lab.eager.attention import attention
    from ie_lab.eager.attribution import logit_attribution
    from ie_lab.eager.capture import capture
    from ie_lab.eager.generate import generate_stream
    from ie_lab.eager.harvest import harvest
    from ie_lab.eager.jacobian_lens import fit_jacobian_lens
    from ie_lab.eager.lens import logit_lens
    from ie_lab.eager.means import mean_difference
    from ie_lab.eager.patching import gradients, patch, patch_sweep
    from ie_lab.eager.project import project

    return {
        "capture": capture,
        "generate": generate_stream,
        "generate_stream": generate_stream,
        "attention": attention,
        "logit_lens": logit_lens,
        "project": project,
        "patch": patch,
        "patch_sweep": patch_sweep,
        "gradients": gradients,
        "fit_jacobian_lens": fit_jacobian_lens,
        "mean_difference": mean_difference,
        "logit_attribution": logit_attribution,
        "harvest": harvest,
    }


@pytest.mark.parametrize("op", [o for o in sorted(calls.RECORDS) if o != "run"])
def test_record_defaults_are_the_computations_own(op):
    """A record whose default drifted from the eager function's would change what a Session call computes."""
    fn = _computations()[op]
    want = {
        p.name: (p.default, p.kind is p.KEYWORD_ONLY)
        for p in list(inspect.signature(fn).parameters.values())[1:]  # after the model
        if p.kind is not p.VAR_KEYWORD and not p.name.startswith("_")
    }
    if op == "project":  # its **gen are generate's sampling arguments, with generate's defaults
        gen = inspect.signature(_computations()["generate"]).parameters
        want |= {k: (gen[k].default, True) for k in ("temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")}
    if op == "capture":  # its steer= is read where the call is issued, and the forward run under it
        want["steer"] = (None, True)
    if op in ("capture", "generate", "generate_stream"):  # splice= and intervene= are folded into steer= where
        want["splice"] = want["intervene"] = (None, True)  # the call enters
    got = {p.name: (p.default, p.kind is p.KEYWORD_ONLY) for p in calls.RECORDS[op].parameters()}
    assert got == want


def _misspelt(op: str) -> tuple[tuple, dict, str]:
    """Positional placeholders and one keyword with a letter doubled: the door must name the real one."""
    params = calls.RECORDS[op].parameters()
    real = params[-1].name
    args = tuple(None for p in params if p.default is p.empty)
    return args, {real + real[-1]: 1}, real


@pytest.fixture(scope="module")
def session():
    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False, replace=False)
    yield s
    s.close()


@pytest.mark.parametrize("op", sorted(calls.RECORDS))
def test_a_misspelt_keyword_fails_at_the_door(session, op, monkeypatch):
    touched: list[str] = []
    method = next(o.method for o in OPERATIONS if o.name == op)
    monkeypatch.setattr(session._backend, method, lambda *a, **k: touched.append(method))
    args, kwargs, real = _misspelt(op)
    wrong = next(iter(kwargs))
    with pytest.raises(ie_lab.InputError, match=rf"{op}\(\) has no argument '{wrong}'; did you mean '{real}'\?"):
        getattr(session, op)(*args, **kwargs)

    async def awaited():
        it = getattr(session, "a" + op)(*args, **kwargs)
        return [s async for s in it] if op == "generate_stream" else await it

    with pytest.raises(ie_lab.InputError, match=f"did you mean '{real}'"):
        asyncio.run(awaited())
    assert touched == []
    if op != "run":
        # the free function refuses before it reads the model: object() is no model, and is never looked at
        with pytest.raises(ie_lab.InputError, match=f"did you mean '{real}'"):
            getattr(ie_lab, op)(object(), *args, **kwargs)


def test_the_door_names_what_is_missing_or_doubled(session):
    with pytest.raises(ie_lab.InputError, match=r"capture\(\) is missing 'addresses'"):
        session.capture("The cat")
    with pytest.raises(ie_lab.InputError, match=r"given|twice"):
        session.capture("The cat", "resid_post.0", tokens_or_text="The dog")
    with pytest.raises(ie_lab.InputError, match=r"takes 2 positional argument\(s\)"):
        session.capture("The cat", "resid_post.0", None)
    with pytest.raises(ie_lab.InputError, match="did you mean 'prepend_bos'"):
        session.capture("The cat", "resid_post.0", prepend_bo=True)
    with pytest.raises(ie_lab.InputError, match="did you mean 'print_tokens'"):
        session.generate("The cat", 2, print_token=True)


def test_a_record_is_built_once_and_handed_down(session, monkeypatch):
    """The backend receives the record the door built (frozen, the prompt's BOS applied), not loose keywords."""
    seen = []
    real = session._backend.capture

    def spy(call):
        seen.append(call)
        return real(call)

    monkeypatch.setattr(session._backend, "capture", spy)
    c = session.capture("The cat", "resid_post.0", prepend_bos=True)
    (call,) = seen
    assert isinstance(call, calls.Capture) and call.grad is False and call.addresses == "resid_post.0"
    assert isinstance(call.tokens_or_text, list) and call.tokens_or_text[0] == session.tokenizer.bos_token_id
    assert c.tokens.shape[1] == len(call.tokens_or_text)
    with pytest.raises(AttributeError):
        call.grad = True  # frozen: no layer below the door can change what was asked
