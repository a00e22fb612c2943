"""ie_lab: a Jupyter-first workbench for looking inside language models.

The interface is the Session: `s = ie_lab.Session(model)` (an HF id, a folder, a model object and its tokenizer,
or a server's address), then `s.capture(...)`, `s.generate(...)`, `s.steer(...)` and the other operations, plain
and awaited (`s.acapture`), the same on every backend (docs/SESSION.md). The free functions `ie_lab.capture(model,
...)`, `ie_lab.generate(model, ...)` and the rest are thin doors onto the same calls over a model object: each is
the Session method of the same name, with the same arguments, computed at once on the calling thread.

`import ie_lab` imports neither torch nor transformers: the errors, Address, the point registry and DEMO_MODEL are
plain Python, and every other name (Session, load, connect, Cache, the analyses...) is imported where it is first
read (a module-level __getattr__, PEP 562), so `ie-lab --help` answers before any of them loads.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from . import points
from .address import Address
from .core import calls as _calls
from .core.demo import DEMO_MODEL, DEMO_SAE, DEMO_TRANSCODERS
from .errors import (
    AddressError,
    ArchitectureUnsupported,
    CapabilityUnsupported,
    ComputeDiffersWarning,
    IELabError,
    IELabWarning,
    InputError,
    PointAbsent,
    RequestFailed,
    StructureError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time __getattr__ below imports each on first use
    from . import sizing
    from .cache import Cache
    from .chat import apply_chat_template, message_spans, split_channels, to_chat
    from .core.graph import Graph
    from .corpus import Activations  # a harvest read back memory-mapped: docs/HARVEST.md
    from .eager.attribution_graph import attribution_graph
    from .eager.lens import fit_tuned_lens
    from .eager.patching import attribution_patch, logit_diff, run_with_patches
    from .eager.qk_attribution import QKAttribution, qk_attribution
    from .harvest_ray import harvest_on_ray  # a harvest split over a Ray cluster: docs/HARVEST.md
    from .loading import load  # an EagerModel whatever the backend: see its docstring
    from .remote.connect import connect  # a Session on a model served by `ie-lab serve`: docs/REMOTE.md
    from .saelens_export import to_saelens  # a harvest as SAELens' cached activations: docs/HARVEST.md
    from .session import OperationCancelled, Session, SessionClosed
    from .transcoders import Transcoders, load_transcoders

# Name -> (module, attribute; None for the module itself): the same names as the TYPE_CHECKING block above
# (tests/test_import_contract.py holds the two equal).
_LAZY: dict[str, tuple[str, str | None]] = {
    "sizing": (".sizing", None),
    "Cache": (".cache", "Cache"),
    "apply_chat_template": (".chat", "apply_chat_template"),
    "message_spans": (".chat", "message_spans"),
    "split_channels": (".chat", "split_channels"),
    "to_chat": (".chat", "to_chat"),
    "Graph": (".core.graph", "Graph"),
    "attribution_graph": (".eager.attribution_graph", "attribution_graph"),
    "fit_tuned_lens": (".eager.lens", "fit_tuned_lens"),
    "attribution_patch": (".eager.patching", "attribution_patch"),
    "logit_diff": (".eager.patching", "logit_diff"),
    "run_with_patches": (".eager.patching", "run_with_patches"),
    "QKAttribution": (".eager.qk_attribution", "QKAttribution"),
    "qk_attribution": (".eager.qk_attribution", "qk_attribution"),
    "harvest_on_ray": (".harvest_ray", "harvest_on_ray"),
    "load": (".loading", "load"),
    "Activations": (".corpus", "Activations"),
    "connect": (".remote.connect", "connect"),
    "to_saelens": (".saelens_export", "to_saelens"),
    "OperationCancelled": (".session", "OperationCancelled"),
    "Session": (".session", "Session"),
    "SessionClosed": (".session", "SessionClosed"),
    "Transcoders": (".transcoders", "Transcoders"),
    "load_transcoders": (".transcoders", "load_transcoders"),
}


def __getattr__(name: str) -> Any:
    """A name of _LAZY, imported on first read and kept in the module (later reads are plain lookups)."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = _importlib.import_module(module, __name__)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# ---- the operations on a model object: ie_lab.capture(model, ...) is s.capture(...) -------------------------
# The Session (ie_lab.Session) is the interface. These are thin doors onto the same records its methods build
# (ie_lab/core/calls.py): the call becomes its record here (an unknown keyword is refused naming the nearest one),
# and ie_lab.eager.backend.compute runs it on the model, on this thread. They take an EagerModel or a
# transformers model and compute at once; queueing, interrupts, batching and the other backends are the Session's.


def _free(record: type[_calls.Record]) -> Any:
    def operation(model: Any, *args: Any, **kwargs: Any) -> Any:
        from .eager.backend import compute

        return compute(model, record.build(args, kwargs))

    operation.__name__ = operation.__qualname__ = record.op
    operation.__module__ = __name__
    operation.__doc__ = (
        f"{record.doc}\n\nie_lab.{record.op}(model, ...) is s.{record.op}(...) on a Session over model (ie_lab.Session, "
        f"the interface), with the same arguments, computed at once on this thread."
    )
    operation.__signature__ = _calls.signature_with(record, before=("model",))  # type: ignore[attr-defined]
    return operation


capture = _free(_calls.Capture)
generate = _free(_calls.Generate)
generate_stream = _free(_calls.GenerateStream)
attention = _free(_calls.Attention)
logit_lens = _free(_calls.LogitLens)
project = _free(_calls.Project)
patch = _free(_calls.Patch)
patch_sweep = _free(_calls.PatchSweep)
gradients = _free(_calls.Gradients)
fit_jacobian_lens = _free(_calls.FitJacobianLens)
mean_difference = _free(_calls.MeanDifference)
logit_attribution = _free(_calls.LogitAttribution)
harvest = _free(_calls.Harvest)


def load_sae(path: Any = None, model: Any = None, **kwargs: Any):
    """A sparse autoencoder from a SAELens folder or a safetensors dict (or a published one by release= and sae_id=),
    attached to the point its hook name means on model; see docs/SAE.md."""
    from .sae import load_sae as _load_sae

    return _load_sae(path, model, **kwargs)


def steer(model: Any, address: Any, vector: Any, method: str = "add", **kwargs: Any):
    """A steering spec on model: s.steer(address, vector, ...) on a Session over model (ie_lab.Session, the
    interface). `with s.steer("resid_post.3", v, scale=4): ...` or s.generate(..., steer=spec)."""
    from .eager.steer import make_spec

    return make_spec(model, address, vector, method=method, **kwargs)


def splice(model: Any, sae: Any, *, error: bool = False):
    """An SAE spliced in at its point on model: s.splice(sae, error=...) on a Session over model. `with spec:` or
    ie_lab.capture(model, ..., splice=spec); docs/SAE.md, "Splicing". Transcoders splice in place of their MLPs'
    outputs (docs/CIRCUITS.md, "Interventions")."""
    from .eager.splice import make_splice

    return make_splice(model, sae, error=error)


def cheatsheet(family_or_config: Any, backend: str = "eager", layer: int | None = None, *, var_name: str | None = None):
    """The address picker for a family name, config or ArchFacts, with no weights loaded (see ie_lab.widgets)."""
    from .widgets.picker import cheatsheet as _cheatsheet

    if backend not in ("eager", "vllm"):
        raise InputError(f"backend must be 'eager' or 'vllm', got {backend!r}.")
    return _cheatsheet(family_or_config, backend, layer, var_name=var_name)


def export_dashboards(
    session_or_data: Any, sae: Any = None, features: Any = None, acts: Any = None, path: Any = None, **kwargs: Any
) -> str:
    """One offline HTML file with a dashboard per SAE feature (contexts, histogram, logits); see docs/SAE.md."""
    from .widgets.dashboard_export import export_dashboards as _export

    return _export(session_or_data, sae, features, acts, path, **kwargs)


__all__ = [
    "Activations",
    "Address",
    "AddressError",
    "ArchitectureUnsupported",
    "ComputeDiffersWarning",
    "IELabWarning",
    "Cache",
    "CapabilityUnsupported",
    "IELabError",
    "InputError",
    "PointAbsent",
    "RequestFailed",
    "StructureError",
    "DEMO_MODEL",
    "DEMO_SAE",
    "DEMO_TRANSCODERS",
    "Graph",
    "QKAttribution",
    "Transcoders",
    "attribution_graph",
    "qk_attribution",
    "apply_chat_template",
    "attention",
    "attribution_patch",
    "capture",
    "cheatsheet",
    "export_dashboards",
    "fit_jacobian_lens",
    "fit_tuned_lens",
    "generate",
    "generate_stream",
    "gradients",
    "harvest",
    "harvest_on_ray",
    "to_saelens",
    "load",
    "logit_attribution",
    "logit_diff",
    "logit_lens",
    "mean_difference",
    "message_spans",
    "split_channels",
    "to_chat",
    "patch",
    "patch_sweep",
    "points",
    "project",
    "load_sae",
    "splice",
    "load_transcoders",
    "run_with_patches",
    "steer",
    "Session",
    "SessionClosed",
    "OperationCancelled",
    "sizing",
    "connect",
    "__version__",
]
