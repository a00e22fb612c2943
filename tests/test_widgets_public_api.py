"""The panels reach a Session only through its public API (facts, tokenizer, tokens, capture, submit, ...).

ie_lab/widgets is a client of Session like any notebook: a panel that read ``session._lm`` or submitted to
``session._loop`` would break when the session's insides change (another backend, a restructured lifecycle), and
would not work on every backend. Checked on the source, so every path counts, not only the ones tests run.
"""

import ast
import pathlib

import pytest

WIDGETS = pathlib.Path(__file__).resolve().parent.parent / "ie_lab" / "widgets"
OWN = {"self", "cls"}  # a panel's own private members are its business


def private_reaches(source: str) -> list[str]:
    """Every place the code touches a private member of something that is not itself, or imports a private name
    from another part of ie_lab (the panels' own helper modules, ``from . import _base``, are theirs)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("_")
            and not str(node.args[1].value).startswith("__")
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and not (node.level == 1 and node.module is None):
            found += [
                f"line {node.lineno}: from {'.' * node.level}{node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_")
            ]
    return found


@pytest.mark.parametrize("path", sorted(WIDGETS.glob("*.py")), ids=lambda p: p.name)
def test_panels_use_only_public_session_members(path):
    assert not private_reaches(path.read_text(encoding="utf-8")), (
        f"{path.name} reaches into private members; use Session's public API (session.py: 'public API for the "
        f"notebook panels'): {private_reaches(path.read_text(encoding='utf-8'))}"
    )


def test_the_scan_catches_what_the_panels_used_to_do():
    old = """
lm = session._lm
fut = asyncio.run_coroutine_threadsafe(coro, self._session._loop)
lm = getattr(src, "_lm", src)
from ..session import _CancelToken
"""
    assert len(private_reaches(old)) == 4, private_reaches(old)
    ok = """
from . import _base, _static
x = self._vector
f = session.submit(coro)
n = session.facts.n_layers
getattr(self, "_lock", None)
"""
    assert private_reaches(ok) == []


def test_submit_runs_a_coroutine_on_the_session_loop_and_refuses_once_closed():
    import asyncio
    import threading

    import ie_lab
    from ie_lab.session import SessionClosed
    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False, replace=False)
    try:

        async def where():
            await asyncio.sleep(0)
            return threading.current_thread() is not threading.main_thread(), (
                await s.acapture("a b", ["resid_post.0"])
            )

        off_main, cache = s.submit(where()).result(timeout=60)
        assert off_main and cache["resid_post.0"].shape[:2] == s.tokens("a b").shape
        with pytest.raises(ie_lab.InputError, match="coroutine"):
            s.submit(where)  # the function, not a call of it
    finally:
        s.close()
    coro = where()
    with pytest.raises(SessionClosed):
        s.submit(coro)
    assert coro.cr_frame is None  # closed by submit: no "never awaited" warning later
