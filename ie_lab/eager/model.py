"""EagerModel: the raw transformers model, its tokenizer, its facts and its bound structure."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..arch.binder import Binding, bind
from ..arch.config_facts import ArchFacts


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
        # One operation at a time per model: hooks and steering are per-model state.
        self.lock = threading.RLock()

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
        from .inputs import prepare

        return prepare(self, text)[0]

    def to_str_tokens(self, tokens_or_text: Any) -> list[str] | list[list[str]]:
        from .inputs import prepare, str_tokens

        ids = prepare(self, tokens_or_text)[0]
        out = str_tokens(self, ids)
        return out[0] if (isinstance(tokens_or_text, str) or (isinstance(tokens_or_text, torch.Tensor) and tokens_or_text.dim() == 1)) else out

    def __repr__(self) -> str:
        f = self.facts
        return (f"EagerModel({self.name!r}, family={f.model_type}, layers={f.n_layers}, d_model={f.d_model}, "
                f"heads={f.n_heads}/{f.n_kv_heads}kv, device={self.device.type}, dtype={str(self.dtype).replace('torch.', '')})")
