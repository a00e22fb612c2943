"""ie_lab: a Jupyter-first workbench for looking inside language models.

`import ie_lab` imports neither torch nor transformers: the errors, Address, the point registry and DEMO_MODEL are
plain Python, and every other name (Session, load, connect, Cache, the analyses...) is imported where it is first
read (a module-level __getattr__, PEP 562), so `ie-lab --help` answers before any of them loads.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from . import points
from .address import Address
from .core.demo import DEMO_MODEL, DEMO_SAE
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
    from .chat import apply_chat_template, message_spans
    from .eager.attention import attention
    from .eager.lens import fit_tuned_lens, logit_lens
    from .eager.means import mean_difference
    from .eager.patching import (
        attribution_patch,
        gradients,
        logit_diff,
        patch,
        patch_sweep,
        run_with_patches,
    )
    from .loading import load  # an EagerModel whatever the backend: see its docstring
    from .remote.client import connect  # a Session on a model served by `ie-lab serve`: docs/REMOTE.md
    from .session import OperationCancelled, Session, SessionClosed

# Name -> (module, attribute; None for the module itself): the same names as the TYPE_CHECKING block above
# (tests/test_import_contract.py holds the two equal).
_LAZY: dict[str, tuple[str, str | None]] = {
    "sizing": (".sizing", None),
    "Cache": (".cache", "Cache"),
    "apply_chat_template": (".chat", "apply_chat_template"),
    "message_spans": (".chat", "message_spans"),
    "attention": (".eager.attention", "attention"),
    "fit_tuned_lens": (".eager.lens", "fit_tuned_lens"),
    "logit_lens": (".eager.lens", "logit_lens"),
    "mean_difference": (".eager.means", "mean_difference"),
    "attribution_patch": (".eager.patching", "attribution_patch"),
    "gradients": (".eager.patching", "gradients"),
    "logit_diff": (".eager.patching", "logit_diff"),
    "patch": (".eager.patching", "patch"),
    "patch_sweep": (".eager.patching", "patch_sweep"),
    "run_with_patches": (".eager.patching", "run_with_patches"),
    "load": (".loading", "load"),
    "connect": (".remote.client", "connect"),
    "OperationCancelled": (".session", "OperationCancelled"),
    "Session": (".session", "Session"),
    "SessionClosed": (".session", "SessionClosed"),
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


def capture(model: Any, tokens_or_text: Any, addresses: Any, *, steer: Any = None, **kwargs: Any) -> Cache:
    from .core.steer_spec import issued_specs
    from .eager.capture import capture as _capture
    from .eager.model import lm_of
    from .eager.steer import run_issued

    lm = lm_of(model)
    specs = issued_specs(lm, steer)  # the `with` blocks open in this context, then steer=
    return run_issued(lm, specs, lambda: _capture(lm, tokens_or_text, addresses, **kwargs))


capture.__doc__ = "See ie_lab.eager.capture.capture."


def generate(model: Any, prompt: Any, max_new_tokens: int = 32, **kwargs: Any):
    """Generate to the end; see ie_lab.eager.generate.generate_stream for the arguments."""
    from .eager.generate import generate as _generate

    return _generate(model, prompt, max_new_tokens, **kwargs)


def generate_stream(model: Any, prompt: Any, max_new_tokens: int = 32, **kwargs: Any):
    """Yield one GenStep per token (greedy by default; temperature/top_k/top_p/seed to sample)."""
    from .core.steer_spec import issued_specs
    from .eager.generate import generate_stream as _stream
    from .eager.model import lm_of

    lm = lm_of(model)
    kwargs["steer"] = issued_specs(lm, kwargs.get("steer"))  # read now, where the stream is issued
    return _stream(lm, prompt, max_new_tokens, **kwargs)


def project(model: Any, prompt: Any, address: Any, directions: Any, **kwargs: Any):
    """Per-token scores [tokens, k] of one point against probes or an SAE encoder; see docs/PROJECTION.md."""
    from .eager.project import project as _project

    return _project(model, prompt, address, directions, **kwargs)


def load_sae(path: Any = None, model: Any = None, **kwargs: Any):
    """A sparse autoencoder from a SAELens folder or a safetensors dict (or a published one by release= and sae_id=),
    attached to the point its hook name means on model; see docs/SAE.md."""
    from .sae import load_sae as _load_sae

    return _load_sae(path, model, **kwargs)


def steer(model: Any, address: Any, vector: Any, method: str = "add", **kwargs: Any):
    """A steering spec: `with ie_lab.steer(lm, "resid_post.3", v, scale=4): ...` or generate(..., steer=spec)."""
    from .eager.steer import make_spec

    return make_spec(model, address, vector, method=method, **kwargs)


def cheatsheet(family_or_config: Any, backend: str = "eager", layer: int | None = None, *, var_name: str | None = None):
    """The address picker for a family name, config or ArchFacts, with no weights loaded (see ie_lab.widgets)."""
    from .widgets.picker import cheatsheet as _cheatsheet

    if backend not in ("eager", "vllm"):
        raise InputError(f"backend must be 'eager' or 'vllm', got {backend!r}.")
    return _cheatsheet(family_or_config, backend, layer, var_name=var_name)


__all__ = [
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
    "apply_chat_template",
    "attention",
    "attribution_patch",
    "capture",
    "cheatsheet",
    "fit_tuned_lens",
    "generate",
    "generate_stream",
    "gradients",
    "load",
    "logit_diff",
    "logit_lens",
    "mean_difference",
    "message_spans",
    "patch",
    "patch_sweep",
    "points",
    "project",
    "load_sae",
    "run_with_patches",
    "steer",
    "Session",
    "SessionClosed",
    "OperationCancelled",
    "sizing",
    "connect",
    "__version__",
]
