"""EagerModel: the raw transformers model, its tokenizer, its facts and its bound structure."""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..arch import quirks
from ..arch.binder import Binding, bind
from ..arch.config_facts import ArchFacts
from ..core.handles import as_lm
from ..errors import ComputeDiffersWarning
from .steer_hooks import steering


def _caller_level() -> int:
    """warnings.warn's stacklevel for the first frame outside ie_lab, so a warning points at the user's line."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def attention_drops(config: Mapping[str, Any], impl: str | None) -> list[str]:
    """What attention kernel `impl` leaves out of this config's computation (quirks.ATTENTION_KERNEL_DROPS)."""
    return [
        f"{per[impl]} ({key}={config[key]})"
        for key, per in quirks.ATTENTION_KERNEL_DROPS.items()
        if config.get(key) and impl in per
    ]


def choose_attention(config: Mapping[str, Any], asked: str | None) -> tuple[str | None, str]:
    """The attn_implementation to load with and the load line's words for it.

    Unasked, a config whose features the default kernel (sdpa) would drop gets the faithful kernel; asked, the
    user's choice stands (EagerModel warns if it drops something)."""
    if asked is not None:
        drops = attention_drops(config, asked)
        return asked, f"attention {asked} (as asked" + ("; it drops: " + "; ".join(drops) if drops else "") + ")"
    drops = attention_drops(config, "sdpa")
    if drops:
        return quirks.FAITHFUL_ATTENTION, (
            f"attention {quirks.FAITHFUL_ATTENTION} (chosen because " + "; ".join(drops) + ")"
        )
    return None, ""


class EagerModel:
    """A loaded model on the eager backend. Its forward is always the transformers model's own."""

    backend = "eager"

    def __init__(self, hf_model: nn.Module, tokenizer: Any = None, name: str | None = None):
        if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
            raise TypeError(f"expected a transformers model, got {type(hf_model).__name__}")
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.name = name or getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
        self.facts: ArchFacts = ArchFacts.from_config(hf_model.config)
        self.binding: Binding = bind(hf_model, self.facts)
        self.facts = self.binding.facts  # the binder may move the logit divisor before the head (measured)
        # One operation at a time per model: hooks and steering are per-model state.
        self.lock = threading.RLock()
        # Each module's training flag as the caller handed it over, while ie_lab holds it in eval mode.
        self._modes: list[tuple[nn.Module, bool]] | None = None
        impl = getattr(hf_model.config, "_attn_implementation", None)
        drops = attention_drops(self.facts.raw, impl)
        if drops:
            warnings.warn(
                ComputeDiffersWarning(
                    f"{self.name} runs {impl!r} attention, which changes its answers: {'; '.join(drops)}. To compute "
                    f"what the model defines, load it with attn_implementation={quirks.FAITHFUL_ATTENTION!r} (a folder or "
                    f"id: ie_lab.Session(path) picks it), or call model.set_attn_implementation("
                    f"{quirks.FAITHFUL_ATTENTION!r}) on your object first."
                ),
                stacklevel=_caller_level(),
            )

    def hold_eval(self) -> bool:
        """Put the model in eval mode (dropout off) for ie_lab's deterministic forwards, remembering each module's
        flag so release() can hand it back exactly. Returns whether anything was training."""
        modes = [(m, m.training) for m in self.hf.modules()]
        if not any(t for _, t in modes):
            return False
        if self._modes is None:
            self._modes = modes
        self.hf.eval()
        return True

    def release(self) -> None:
        """Give the model back as it came: every module's training flag as before load. Session.close() calls this;
        operations after it run in whatever mode the model is then in."""
        modes, self._modes = self._modes, None
        for m, was in modes or ():
            m.training = was  # per module, not m.train(): a parent's flag must not overwrite its children's

    @property
    def family(self) -> str:
        return self.facts.model_type

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def to_tokens(self, text: str | list[str]) -> torch.Tensor:
        from ..core.inputs import prepare

        return prepare(self, text)[0]

    def to_str_tokens(self, tokens_or_text: Any) -> list[str] | list[list[str]]:
        from ..core.inputs import prepare, str_tokens

        ids = prepare(self, tokens_or_text)[0]
        out = str_tokens(self, ids)
        return (
            out[0]
            if (
                isinstance(tokens_or_text, str)
                or (isinstance(tokens_or_text, torch.Tensor) and tokens_or_text.dim() == 1)
            )
            else out
        )

    def steer_raw_forwards(self, spec: Any, gate: Any) -> Any:
        """Hooks, placed now, that steer the raw forwards (self.hf(...)) a `with spec:` block runs: those gate()
        accepts (SteerSpec.__enter__ calls this; operations carry the spec and place their own)."""
        hooks = steering(self, [spec], gate=gate)
        hooks.install()
        return hooks

    def __repr__(self) -> str:
        f = self.facts
        return (
            f"EagerModel({self.name!r}, family={f.model_type}, layers={f.n_layers}, d_model={f.d_model}, "
            f"heads={f.n_heads}/{f.n_kv_heads}kv, device={self.device.type}, dtype={str(self.dtype).replace('torch.', '')})"
        )


# Raw transformers models the eager operations were handed, each bound once (keyed weakly: the caller owns them).
_ADOPTED: "weakref.WeakKeyDictionary[Any, EagerModel]" = weakref.WeakKeyDictionary()


def _adopt(model: Any) -> EagerModel:
    try:
        return _ADOPTED[model]
    except (KeyError, TypeError):
        pass
    lm = EagerModel(model)
    _ADOPTED[model] = lm
    return lm


def lm_of(model: Any) -> Any:
    """The model an eager operation runs on: a Session's, a loaded model, or a raw transformers model bound once
    and remembered."""
    return as_lm(model, adopt=_adopt)
