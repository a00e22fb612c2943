"""The notebook panels a Session opens (a room of class Session; the panels live in ie_lab/widgets)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from ..backend import SessionClosed
from ..errors import InputError
from .handoff import (
    _OmpPool,
)


class _Panels:
    """The notebook panels a Session opens, and `submit`, the public way a panel runs work on the session's loop."""

    # attributes another room of the same class defines (declared for the type checker; no value here, so
    # nothing shadows the owner at run time)
    _backend: Any
    _check_open: Any
    _lm: Any
    _loop: Any
    _on_loop_thread: Any
    backend: Any

    # ---- public API for the notebook panels (ie_lab/widgets use only this and the operations above) ----------
    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Start a coroutine on this session's loop and return at once: a concurrent.futures.Future of its result.

        How a panel runs streaming work (``agenerate_stream``, ``acapture``) while the kernel's shell stays free;
        cancelling the future cancels the coroutine. Waiting on the future from inside the session's own loop would
        wait forever: there, ``await`` the coroutine instead. Refused (SessionClosed) once the session is closed.
        """
        if not asyncio.iscoroutine(coro):
            raise InputError(
                f"submit takes a coroutine (call the async function: submit(f(...))), got {type(coro).__name__}."
            )
        try:
            self._check_open()
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except (SessionClosed, RuntimeError):  # closed, or its loop closed between the check and the call
            coro.close()  # never awaited: no "coroutine was never awaited" warning later
            raise SessionClosed("this Session is closed; create a new one: Session(...).") from None
        if not self._on_loop_thread():
            _OmpPool.release()  # the work computes on the loop (awaited twins): no second pool on this thread
        return fut

    # ---- notebook panels (ie_lab/widgets; JS/CSS in widgets/) ----------------------------------------
    # Each panel's module is imported when one is opened: it loads anywidget and the bundled JS, which a script
    # that never draws a panel should not pay for.
    def picker(self, layer: int | None = None, *, var_name: str | None = None):
        """The architecture diagram of this model; clicking a point sets ``picker.address`` (an Address).

        The card's code snippet calls this session by ``var_name``: by default the variable your code holds it in
        (``g = Session(...); g.picker()`` writes ``g.capture(...)``), else ``s``."""
        from ..widgets import _base
        from ..widgets.picker import Picker

        self._check_open()
        # the verdicts of the backend that computes: a remote session's are its server's
        served = getattr(self._backend, "served_backend", self.backend)
        var = _base.var_name(self, var_name, "s")
        return Picker(self._lm.facts, served, lm=self._lm, layer=layer, handle={"var": var, "kind": "session"})

    def served_layers(self) -> dict[str, tuple[str, dict[str, str]]]:
        """Per point name: on which layers this model serves it (a "1"/"0" per layer; one character for a trunk
        point) and, by layer, why not where it does not: what the picker draws, for panels that offer points."""
        from ..widgets.picker import describe

        self._check_open()
        served = getattr(self._backend, "served_backend", self.backend)
        return {p["name"]: (p["served"], p["why"]) for p in describe(self._lm.facts, served, lm=self._lm)["points"]}

    def show_attention(self, prompt: Any, layers: Any = None, *, layer: int | None = None, head: int = 0):
        """Attention viewer: head thumbnails per layer, the selected head's pattern fetched on demand."""
        from ..widgets.attention import for_session

        self._check_open()
        return for_session(self, prompt, layers, layer=layer, head=head)

    def steering_panel(
        self, prompt: str, address: Any = None, vector: Any = None, *, var_name: str | None = None, **kwargs: Any
    ):
        """Baseline vs steered text with live controls; see docs/WIDGETS.md for the vector sources. The code the
        panel shows calls this session by ``var_name`` (by default the variable your code holds it in, else ``s``)."""
        from ..widgets import _base
        from ..widgets.steering import SteeringPanel

        self._check_open()
        var = _base.var_name(self, var_name, "s")
        return SteeringPanel(self, prompt, address=address, vector=vector, var_name=var, **kwargs)

    def feature_panel(self, prompt: Any, address: Any = None, features: Any = None, **kwargs: Any):
        """Tokens coloured by an SAE's (or probes') feature activations, with a feature picker (docs/WIDGETS.md)."""
        from ..widgets.features import for_session as features_for_session

        self._check_open()
        return features_for_session(self, prompt, address, features, **kwargs)

    def feature_dashboard(
        self, sae: Any, feature: int, acts: Any, *, prompt: str | None = None, top: int = 10, **kwargs: Any
    ):
        """One SAE feature's dashboard over a corpus (an ie_lab.Activations or a list of texts): top contexts,
        activation histogram and density, promoted and suppressed tokens, steering on `prompt` (docs/SAE.md)."""
        from ..widgets.dashboard import for_session as dashboard_for_session

        self._check_open()
        return dashboard_for_session(self, sae, feature, acts, prompt=prompt, top=top, **kwargs)

    def graph_panel(
        self,
        graph: Any,
        *,
        transcoders: Any = None,
        corpus: Any = None,
        node_threshold: float = 0.8,
        edge_threshold: float = 0.98,
        top: int = 8,
    ):
        """An attribution graph (ie_lab.attribution_graph) drawn by layer and position, pruned with these thresholds:
        hover for edges, click a feature for its dashboard over `corpus` (a list of texts; needs `transcoders`),
        group features into supernodes, re-prune from the panel (docs/CIRCUITS.md "The graph panel")."""
        from ..widgets.graph_panel import for_session as graph_for_session

        self._check_open()
        return graph_for_session(
            self,
            graph,
            transcoders=transcoders,
            corpus=corpus,
            node_threshold=node_threshold,
            edge_threshold=edge_threshold,
            top=top,
        )
