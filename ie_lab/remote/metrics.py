"""The metrics a server evaluates for patch_sweep and gradients: a closed list, sent as data (a kind and its
numbers), never as code.

Locally a metric is any function of the logits; a remote server runs none of the client's code, so a remote
patch_sweep or gradients takes one of these. Each is also an ordinary callable, so the same object gives the
same number on a local Session (which is how the tests compare the two). ``ie_lab.logit_diff(good, bad)``
travels too: its three integers are read back from the function ie_lab itself made (`from_callable`).

    from ie_lab.remote import metrics
    s.patch_sweep(clean, corrupted, metrics.logprob(token_id))
    s.gradients(prompt, metrics.dot(direction), "resid_pre.2", of="resid_post.3")
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Cache
from ..errors import CapabilityUnsupported, InputError

# kind -> its parameters, in order. Every kind reads one position (the last by default) of a [batch, seq, ...]
# tensor and averages over the batch, as ie_lab.logit_diff does.
KINDS: dict[str, tuple[str, ...]] = {
    "logit_diff": ("good", "bad", "position"),  # logits[:, position, good] - logits[:, position, bad]
    "logit": ("token", "position"),  # logits[:, position, token]
    "logprob": ("token", "position"),  # log_softmax(logits[:, position])[:, token]
    "dot": ("vector", "position"),  # t[:, position] @ vector (logits or, with gradients(of=...), a point)
    "norm": ("position",),  # the L2 norm of t[:, position]
}
_TOKENS = ("good", "bad", "token")


def _int(kind: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{kind}: {name} must be an integer, got {value!r} ({type(value).__name__}).")
    return value


class Metric:
    """One metric of KINDS with its parameters; call it on logits [batch, seq, vocab] (or on a point's tensor,
    for gradients(of=...)) for a scalar tensor."""

    def __init__(self, kind: str, **params: Any):
        if not isinstance(kind, str) or kind not in KINDS:
            raise InputError(f"unknown metric kind {str(kind)[:40]!r}; a remote server evaluates {sorted(KINDS)}.")
        names = KINDS[kind]
        unknown = sorted(str(k) for k in params if k not in names)
        if unknown:
            raise InputError(f"{kind}: unknown parameter(s) {unknown}; it takes {list(names)}.")
        missing = [n for n in names if n != "position" and n not in params]
        if missing:
            raise InputError(f"{kind}: missing parameter(s) {missing}.")
        self.kind = kind
        self.params: dict[str, Any] = {"position": -1, **params}
        for name in names:
            v = self.params[name]
            if name == "vector":
                if not isinstance(v, torch.Tensor) or v.dim() != 1 or not v.is_floating_point():
                    got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise InputError(f"{kind}: vector must be a 1-D floating-point tensor, got {got}.")
                if not bool(torch.isfinite(v).all()):
                    raise InputError(f"{kind}: vector contains nan or inf values.")
            else:
                _int(kind, name, v)
                if name in _TOKENS and v < 0:
                    raise InputError(f"{kind}: {name} is a token id, so it cannot be negative (got {v}).")
        p = self.params
        self.__name__ = {
            "logit_diff": lambda: f"logit_diff({p.get('good')}, {p.get('bad')})",  # ie_lab.logit_diff's own name
            "logit": lambda: f"logit({p.get('token')})",
            "logprob": lambda: f"logprob({p.get('token')})",
            "dot": lambda: f"dot(vector[{p['vector'].numel() if 'vector' in p else 0}])",
            "norm": lambda: "norm",
        }[kind]()

    def __repr__(self) -> str:
        at = self.params["position"]
        return f"Metric({self.__name__}" + (f" at position {at}" if at != -1 else "") + ")"

    def _at(self, x: Any) -> torch.Tensor:
        """x[:, position]: the row every kind reads, checked."""
        if isinstance(x, Cache):
            raise InputError(
                f"the metric {self.__name__} reads one tensor, and gradients(of=[...]) with a list hands it a "
                "Cache; pass of= one address (of='resid_post.3')."
            )
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"the metric {self.__name__} reads a [batch, seq, width] tensor, got {got}.")
        seq, position = x.shape[1], self.params["position"]
        if not -seq <= position < seq:
            raise InputError(f"{self.kind}: position {position} is outside the {seq}-token prompt.")
        return x[:, position]

    def _token(self, name: str, width: int) -> int:
        tok = self.params[name]
        if tok >= width:
            raise InputError(f"{self.kind}: {name} token id {tok} is outside the vocabulary (0..{width - 1}).")
        return tok

    def __call__(self, x: Any) -> torch.Tensor:
        row = self._at(x)
        kind, width = self.kind, row.shape[-1]
        if kind == "logit_diff":
            good, bad = self._token("good", width), self._token("bad", width)
            return (row[..., good] - row[..., bad]).mean()
        if kind == "logit":
            return row[..., self._token("token", width)].mean()
        if kind == "logprob":
            return torch.log_softmax(row.float(), dim=-1)[..., self._token("token", width)].mean()
        if kind == "dot":
            v = self.params["vector"]
            if v.numel() != width:
                raise InputError(f"dot: the vector is {v.numel()} wide, the tensor it reads {width}.")
            return (row @ v.to(row)).mean()
        return row.norm(dim=-1).mean()

    def data(self) -> dict[str, Any]:
        """What travels: the kind and its parameters."""
        return {"kind": self.kind, "params": dict(self.params)}


def logit_diff(good: int, bad: int, position: int = -1) -> Metric:
    """logits[:, position, good] - logits[:, position, bad], averaged over the batch (as ie_lab.logit_diff)."""
    return Metric("logit_diff", good=good, bad=bad, position=position)


def logit(token: int, position: int = -1) -> Metric:
    """The logit of `token` at `position`, averaged over the batch."""
    return Metric("logit", token=token, position=position)


def logprob(token: int, position: int = -1) -> Metric:
    """The log-probability of `token` at `position` (log_softmax in float32), averaged over the batch."""
    return Metric("logprob", token=token, position=position)


def dot(vector: torch.Tensor, position: int = -1) -> Metric:
    """t[:, position] @ vector, averaged over the batch: the logits against a vocabulary direction, or (with
    gradients(of='point')) a point against a probe direction."""
    return Metric("dot", vector=vector, position=position)


def norm(position: int = -1) -> Metric:
    """The L2 norm of t[:, position], averaged over the batch."""
    return Metric("norm", position=position)


def from_callable(metric: Any) -> Metric:
    """The Metric a metric argument is: a Metric itself, or the function ie_lab.logit_diff(...) returned (its
    numbers read back from that function, which ie_lab made); any other function is code, refused here."""
    if isinstance(metric, Metric):
        return metric
    code = getattr(metric, "__code__", None)
    if (
        getattr(metric, "__module__", None) == "ie_lab.eager.patching"
        and getattr(metric, "__qualname__", None) == "logit_diff.<locals>.metric"
        and code is not None
        and metric.__closure__ is not None
    ):
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in metric.__closure__)))
        if set(cells) == {"good", "bad", "position"}:
            return logit_diff(cells["good"], cells["bad"], cells["position"])
    raise CapabilityUnsupported(
        "a metric function on a remote Session",
        "a remote server runs no code of the client, and a metric function is code",
        "pass one of the metrics a server evaluates as data: ie_lab.logit_diff(good, bad), or "
        f"ie_lab.remote.metrics.{', '.join(k for k in KINDS if k != 'logit_diff')} (docs/REMOTE.md); or run "
        "ie_lab where the model is for any metric function",
        backend="backend='remote'",
    )


__all__ = ["KINDS", "Metric", "dot", "from_callable", "logit", "logit_diff", "logprob", "norm"]
