"""What every panel shares: commands from the front end are validated here and nothing else is accepted.

The browser never sets a trait directly: ``set_state`` from the front end is refused (a hostile or buggy
front end cannot change a panel's state or the model), and each panel declares the commands it accepts
with a checker per field. A rejected message is answered with an ``error`` message and logged on the
panel (``panel.rejected``); the kernel never raises on a front-end message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anywidget
import traitlets

from . import _static

MAX_MESSAGE_KEYS = 32
MAX_TEXT = 4000
MAX_LIST = 64


class Rejected(ValueError):
    pass


def var_name(obj: Any, given: str | None, default: str) -> str:
    """The variable a panel's code snippets call `obj` by: `given` (a panel's ``var_name=``), else the name the
    caller's code holds it under (``g = Session(...); g.picker()`` gives "g", as the notebook has it), else
    `default`. Frames inside ie_lab are passed over; IPython's output names (``_``, ``_3``) are not names a user
    typed."""
    if given is not None:
        if not isinstance(given, str) or not given.isidentifier():
            from ..errors import InputError

            raise InputError(f"var_name must be a Python variable name such as 's', got {given!r}.")
        return given
    import inspect

    root = __name__.split(".")[0] + "."
    here = inspect.currentframe()
    f = here.f_back if here is not None else None
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if not (mod + ".").startswith(root):
            for scope in (f.f_locals, f.f_globals):
                for k, v in list(scope.items()):
                    if v is obj and not k.startswith("_") and k.isidentifier():
                        return k
            return default  # the first frame outside ie_lab is the caller's: nothing further out is theirs
        f = f.f_back
    return default


def integer(lo: int, hi: int) -> Callable[[Any], int]:
    def check(x: Any) -> int:
        if isinstance(x, bool) or not isinstance(x, int):
            if isinstance(x, float) and x.is_integer():
                x = int(x)
            else:
                raise Rejected(f"expected an integer, got {type(x).__name__}")
        if not lo <= x <= hi:
            raise Rejected(f"{x} is outside {lo}..{hi}")
        return x

    return check


def number(lo: float, hi: float) -> Callable[[Any], float]:
    def check(x: Any) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise Rejected(f"expected a number, got {type(x).__name__}")
        try:
            x = float(x)
        except OverflowError:  # an integer literal of hundreds of digits in the JSON
            raise Rejected(f"a {len(str(x))}-digit integer is not a number in [{lo}, {hi}]") from None
        if not math.isfinite(x) or not lo <= x <= hi:
            raise Rejected(f"{x} is not a finite number in [{lo}, {hi}]")
        return x

    return check


def text(max_len: int = MAX_TEXT) -> Callable[[Any], str]:
    def check(x: Any) -> str:
        if not isinstance(x, str):
            raise Rejected(f"expected text, got {type(x).__name__}")
        if len(x) > max_len:
            raise Rejected(f"text of {len(x)} characters is over the {max_len} limit")
        try:  # JSON can carry a lone surrogate ("\ud800"); the tokenizer would fail on it much later
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise Rejected("text is not valid Unicode (it holds a lone surrogate)") from None
        return x

    return check


def choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(x: Any) -> str:
        if not isinstance(x, str) or x not in options:
            raise Rejected(f"expected one of {', '.join(options)}")
        return x

    return check


def boolean(x: Any) -> bool:
    if not isinstance(x, bool):
        raise Rejected(f"expected true/false, got {type(x).__name__}")
    return x


def text_list(max_items: int = MAX_LIST, max_len: int = MAX_TEXT) -> Callable[[Any], list[str]]:
    item = text(max_len)

    def check(x: Any) -> list[str]:
        if not isinstance(x, list):
            raise Rejected(f"expected a list of texts, got {type(x).__name__}")
        if len(x) > max_items:
            raise Rejected(f"{len(x)} items is over the {max_items} limit")
        return [item(v) for v in x]

    return check


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: None if x is None else check(x)


class Panel(anywidget.AnyWidget):
    """Base class: front-end commands go through COMMANDS (name -> {field: checker}) and on_<name>."""

    COMMANDS: dict[str, dict[str, Callable[[Any], Any]]] = {}
    OPTIONAL: frozenset[str] = frozenset()
    # anywidget reads a Path given in a class body (and watches it under ANYWIDGET_HMR=1); each panel sets _esm
    _css = _static.bundle("ie_lab.css")

    error = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rejected: list[str] = []
        self.on_msg(self._on_front_end_msg)

    # The front end reads state; it never writes it.
    def set_state(self, sync_data: dict) -> None:  # noqa: D401 - ipywidgets hook
        keys = sorted(sync_data) if isinstance(sync_data, dict) else [type(sync_data).__name__]
        self._reject(f"state update from the front end ignored ({', '.join(map(str, keys))[:200]})")

    def _reject(self, why: str) -> None:
        """Refuse a command: the reason stays on screen (the ``error`` trait) until a later command succeeds."""
        self.rejected.append(why)
        del self.rejected[:-20]
        self.error = why
        try:
            self.send({"type": "error", "message": why})
        except Exception:  # noqa: BLE001 - no comm (plain Python): nothing to answer
            pass

    def _handle_msg(self, msg: Any) -> None:
        """Every comm message from the front end, before ipywidgets reads it.

        ipywidgets would apply ``buffer_paths`` to the state before ``set_state`` refuses it, and a malformed
        message raises inside ipywidgets (a traceback in the kernel's log); here each part is checked first.
        """
        try:
            data = msg["content"]["data"] if isinstance(msg, dict) and isinstance(msg.get("content"), dict) else None
            method = data.get("method") if isinstance(data, dict) else None
            if not isinstance(data, dict) or not isinstance(method, str):
                raise Rejected("malformed widget message (no data.method)")
            if method == "update":
                state = data.get("state")
                self.set_state(state if isinstance(state, dict) else {"(not an object)": None})
            elif method == "request_state":
                self.send_state()
            elif method == "custom":
                buffers = msg.get("buffers") or []
                self._on_front_end_msg(self, data.get("content"), buffers if isinstance(buffers, list) else [b""])
            else:
                raise Rejected(f"unknown widget message method {method[:40]!r}")
        except Rejected as e:
            self._reject(str(e))

    def _on_front_end_msg(self, _widget: Any, content: Any, buffers: Any) -> None:
        try:
            if not isinstance(content, dict):
                raise Rejected(f"a message is an object, got {type(content).__name__}")
            if buffers:
                raise Rejected("messages to the kernel carry no binary buffers")
            if len(content) > MAX_MESSAGE_KEYS:
                raise Rejected("too many fields")
            cmd = content.get("cmd")
            if not isinstance(cmd, str) or cmd not in self.COMMANDS:
                raise Rejected(
                    f"unknown command {str(cmd)[:40]!r}; this panel accepts {', '.join(sorted(self.COMMANDS))}"
                )
            spec = self.COMMANDS[cmd]
            extra = set(content) - set(spec) - {"cmd"}
            if extra:
                raise Rejected(f"unexpected field(s) {', '.join(sorted(map(str, extra)))[:100]} for {cmd}")
            args = {}
            for field, check in spec.items():
                if field not in content:
                    if field in self.OPTIONAL:
                        continue
                    raise Rejected(f"{cmd} needs {field}")
                try:
                    args[field] = check(content[field])
                except Rejected as e:
                    raise Rejected(f"{cmd}.{field}: {e}") from None
        except Rejected as e:
            self._reject(str(e))
            return
        try:
            getattr(self, "on_" + cmd)(**args)
        except Exception as e:  # noqa: BLE001 - shown in the panel, never raised into the kernel's shell
            self.error = f"{type(e).__name__}: {e}"
            self._reject(self.error)
