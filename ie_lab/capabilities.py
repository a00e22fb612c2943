"""What a backend can be asked to do: the list of capabilities, and the CapabilityUnsupported every refusal raises.

A Session operation a backend does not support refuses from here before the backend is called: each row of
ie_lab/backend.py's OPERATIONS names the capability it needs. Which capabilities there are, and what to use
instead, is shared and lives here; whether a backend has one is that backend's own word, its package's
verdicts.CAPABILITIES (ie_lab/eager/verdicts.py, ie_lab/vllm/verdicts.py), read through ``Capability.cell``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import points
from .errors import CapabilityUnsupported


@dataclass(frozen=True)
class Capability:
    """One row of the table. Each backend's cell is "yes ...", "no: <why>", or (on a partial row) what it does.

    The cell is also the refusal's reason, so every "no" carries one: the refusal reads
    "<name> is not supported on backend='B': <why>. Instead: <instead>".
    """

    name: str
    instead: str = ""
    refusable: bool = True  # False: a descriptive row (what is covered), not an operation one can ask for

    def cell(self, backend: str) -> str:
        """The backend's own cell for this row (its package's verdicts.CAPABILITIES)."""
        return points.verdicts_of(backend).CAPABILITIES[self.name]

    def __getattr__(self, name: str) -> Any:
        # cap.eager, cap.vllm: cap.cell(name), the spelling callers used when the cells were columns of this table
        if name in points.BACKENDS:
            return self.cell(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def supported(self, backend: str) -> bool:
        return self.cell(backend).startswith("yes")

    def why_not(self, backend: str) -> str:
        """The reason in the backend's cell, without the cell's "no: " verdict."""
        cell = self.cell(backend)
        return cell[4:] if cell.startswith("no: ") else cell


# s.splice(sae): an SAE's reconstruction written back into the forward (docs/SAE.md, "Splicing")
SPLICING = "SAE splicing (reconstruction at the point, error term, feature ablation and clamping, feature activations)"

# s.splice(transcoders) and intervene= on an attribution graph's features (docs/CIRCUITS.md, "Interventions")
TRANSCODER_SPLICING = "transcoder splicing and interventions on graph features (intervene=)"

# ie_lab.load() returns one kind of handle, whatever the backend: the in-process model (an EagerModel).
LOAD_CAPABILITY = "ie_lab.load(): an in-process model for the free functions (ie_lab.capture and the others)"

CAPABILITIES: tuple[Capability, ...] = (
    Capability("capture"),
    Capability("attn_scores / attn_probs"),
    Capability("streaming generation (greedy, sampling, stop strings, top-n logprobs)"),
    Capability("capture during generation (from the cached forwards)"),
    Capability("steering (add, orthogonal, cap, norm_scaled_add, ablate, swap; position masks)"),
    Capability(
        "logit lens, linear transports, fitting a tuned lens",
        "capture the residuals, or use backend='eager' for transports and fitting",
    ),
    Capability("concurrent requests batched together", "use backend='vllm'"),
    Capability("tensor parallelism", "use backend='vllm'"),
    Capability("activation patching and sweeps", "use backend='eager'"),
    Capability("gradients", "use backend='eager'"),
    Capability(
        "direct logit attribution",
        "use backend='eager', or capture the pieces (resid_pre.0, attn_out_post, mlp_out_post, final_norm) and "
        "decompose them yourself",
    ),
    Capability("run(fn) on the model object", "use backend='eager'"),
    Capability(SPLICING, "use backend='eager' (s.splice(sae) on Session(model, backend='eager'))"),
    Capability(TRANSCODER_SPLICING, "use backend='eager' (Session(model, backend='eager'))"),
    Capability(
        LOAD_CAPABILITY,
        "ie_lab.Session(path, backend='vllm'), whose methods (s.capture, s.generate and the others) are "
        "the same operations",
    ),
    Capability("model families", "use backend='eager'", refusable=False),
    Capability("points absent on a family", refusable=False),
    Capability(
        "attn_scores on families that compute attention in their own module (Bloom, Falcon, GPT-J)",
        "capture attn_probs",
    ),
    Capability("attn_probs on those families running sdpa", "load with attn_implementation='eager'"),
)

_BY_NAME = {c.name: c for c in CAPABILITIES}


def require(name: str, backend: str) -> None:
    """Raise CapabilityUnsupported unless the backend supports the named capability."""
    cap = _BY_NAME[name]
    if not cap.refusable:
        raise KeyError(f"{name!r} describes coverage; it is not an operation to require")
    if not cap.supported(backend):
        raise CapabilityUnsupported(
            name,
            cap.why_not(backend),
            cap.instead or "see ie_lab.capabilities.CAPABILITIES",
            backend=f"backend={backend!r}",
        )


@dataclass(frozen=True)
class GradSupport:
    """Whether gradients with respect to activations (gradients(), attribution_patch(), capture(..., grad=True),
    fit_jacobian_lens()) are available on one model and backend, and what blocks them, read before any run.

    available: True when nothing known blocks them. reasons: one sentence per blocker (empty when available),
    each naming what blocks (the backend, a parameter, a module). instead: what to use where they are blocked.
    `bool(verdict)` is `available`."""

    available: bool
    reasons: tuple[str, ...] = ()
    backend: str = ""
    instead: str = ""

    def __bool__(self) -> bool:
        return self.available

    def __repr__(self) -> str:
        if self.available:
            return f"GradSupport(available=True, backend={self.backend!r})"
        why = "; ".join(self.reasons)
        return f"GradSupport(available=False, backend={self.backend!r}: {why}" + (
            f". Instead: {self.instead})" if self.instead else ")"
        )

    def require(self, what: str) -> None:
        """Raise CapabilityUnsupported for `what` (an operation's words) unless gradients are available."""
        if not self.available:
            raise CapabilityUnsupported(
                what,
                "; ".join(self.reasons),
                self.instead or "use backend='eager'",
                backend=f"backend={self.backend!r}",
            )


def table_grad_support(backend: str) -> GradSupport:
    """A backend's gradient verdict from its cell of the table alone (a backend with no model in this process to
    look at: vLLM's workers; a new backend that reads vLLM's column)."""
    cap = _BY_NAME["gradients"]
    if cap.supported(backend):
        return GradSupport(True, (), backend)
    return GradSupport(False, (cap.why_not(backend),), backend, cap.instead)


def markdown_table() -> str:
    labels = " | ".join(points.verdicts_of(b).LABEL for b in points.BACKENDS)
    rows = [f"| capability | {labels} | instead |", "| --- | " + "--- | " * len(points.BACKENDS) + "--- |"]
    for c in CAPABILITIES:
        cells = " | ".join(c.cell(b) for b in points.BACKENDS)
        rows.append(f"| {c.name} | {cells} | {c.instead or '—'} |")
    return "\n".join(rows) + "\n"
