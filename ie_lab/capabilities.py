"""What each backend can and cannot do: the table every CapabilityUnsupported is built from.

A Session operation a backend does not support refuses from here before the backend is called: each row of
ie_lab/backend.py's OPERATIONS names the capability it needs."""

from __future__ import annotations

from dataclasses import dataclass

from .arch import quirks
from .errors import CapabilityUnsupported


@dataclass(frozen=True)
class Capability:
    """One row of the table. Each backend's cell is "yes ...", "no: <why>", or (on a partial row) what it does.

    The cell is also the refusal's reason, so every "no" carries one: the refusal reads
    "<name> is not supported on backend='B': <why>. Instead: <instead>".
    """

    name: str
    eager: str
    vllm: str
    instead: str = ""
    refusable: bool = True  # False: a descriptive row (what is covered), not an operation one can ask for

    def supported(self, backend: str) -> bool:
        return getattr(self, backend).startswith("yes")

    def why_not(self, backend: str) -> str:
        """The reason in the backend's cell, without the cell's "no: " verdict."""
        cell = getattr(self, backend)
        return cell[4:] if cell.startswith("no: ") else cell


# ie_lab.load() returns one kind of handle, whatever the backend: the in-process model (an EagerModel).
LOAD_CAPABILITY = "ie_lab.load(): an in-process model for the free functions (ie_lab.capture and the others)"

CAPABILITIES: tuple[Capability, ...] = (
    Capability("capture", "yes", "yes", ""),
    Capability(
        "attn_scores / attn_probs",
        "yes",
        "yes (rebuilt from the post-RoPE q/k the paged-attention kernel received)",
        "",
    ),
    Capability("streaming generation (greedy, sampling, stop strings, top-n logprobs)", "yes", "yes", ""),
    Capability(
        "capture during generation (from the cached forwards)",
        "yes",
        "yes (covers the positions the model ran: prompt + every generated token but the last)",
        "",
    ),
    Capability(
        "steering (add, orthogonal, cap, norm_scaled_add, ablate, swap; position masks)",
        "yes",
        "yes (per request, with the same arithmetic functions)",
        "",
    ),
    Capability(
        "logit lens, linear transports, fitting a tuned lens",
        "yes",
        "logit lens only (read out inside the worker, top-k returned); no transports or fitting",
        "capture the residuals, or use backend='eager' for transports and fitting",
    ),
    Capability(
        "concurrent requests batched together",
        "no: operations on one Session queue behind a lock",
        "yes",
        "use backend='vllm'",
    ),
    Capability(
        "tensor parallelism",
        "no: the eager backend runs transformers' own forward, unsharded, in this process",
        "yes (sharded points gathered across ranks)",
        "use backend='vllm'",
    ),
    Capability(
        "activation patching and sweeps",
        "yes",
        "no: patching replaces activations mid-forward for one request, which vLLM's batched kernels do not expose",
        "use backend='eager'",
    ),
    Capability(
        "gradients",
        "yes (gradients(), attribution_patch(), capture(..., grad=True))",
        "no: vLLM runs inference-only kernels with no autograd graph",
        "use backend='eager'",
    ),
    Capability(
        "run(fn) on the model object",
        "yes",
        "no: the weights live inside vLLM's workers, not in this process",
        "use backend='eager'",
    ),
    Capability(
        LOAD_CAPABILITY,
        "yes (an EagerModel)",
        "no: vLLM keeps the model inside its engine, which only a Session drives",
        "ie_lab.Session(path, backend='vllm'), whose methods (s.capture, s.generate and the others) are "
        "the same operations",
    ),
    Capability(
        "model families",
        "every family the binder can measure (docs/FAMILIES.md: each model type of transformers' causal-LM mapping, "
        "bound with its invariants run on a tiny instance, or refused with the structure the probe measured)",
        "the families verified point by point against eager: "
        + ", ".join(f"`{f}`" for f in sorted(quirks.VLLM_VERIFIED))
        + "; others are refused at load (docs/VLLM.md lists the limits)",
        "use backend='eager'",
        refusable=False,
    ),
    Capability(
        "points absent on a family",
        "refused with PointAbsent naming the reason and a substitute",
        "refused the same way",
        "",
        refusable=False,
    ),
    Capability(
        "attn_scores on families that compute attention in their own module (Bloom, Falcon, GPT-J)",
        "no: the pre-softmax matrix never leaves the module",
        "no: transformers never hands these scores out, so scores rebuilt from vLLM's q and k would have "
        "nothing to be checked against",
        "capture attn_probs",
    ),
    Capability(
        "attn_probs on those families running sdpa",
        "no: their probabilities exist only on the eager code path",
        "yes (rebuilt from q and k, checked against transformers' eager path)",
        "load with attn_implementation='eager'",
    ),
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


def markdown_table() -> str:
    rows = ["| capability | eager | vLLM | instead |", "| --- | --- | --- | --- |"]
    for c in CAPABILITIES:
        rows.append(f"| {c.name} | {c.eager} | {c.vllm} | {c.instead or '—'} |")
    return "\n".join(rows) + "\n"
