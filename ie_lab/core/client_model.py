"""The model handle of a backend whose weights live elsewhere (a vLLM engine, a remote server).

Such a client holds only the model's facts and tokenizer, yet ie_lab's neutral checks (input preparation, steering
specs, head slicing) take a model handle. One class for both backends, so they read tokens the same way.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .inputs import prepare, str_tokens


class ClientModel:
    """Facts, tokenizer and dtype of a model computed elsewhere; results land on the client's CPU."""

    backend = ""  # the backend's name, set by each subclass
    hf = None  # no transformers module in this process
    binding = None  # no measured binding here either: the backend binds where the weights are

    def __init__(self, name: str, facts: Any, tokenizer: Any, dtype: torch.dtype) -> None:
        self.name, self.facts, self.tokenizer, self.dtype = name, facts, tokenizer, dtype
        self.device = torch.device("cpu")  # where results land on the client
        self.lock = threading.RLock()

    @property
    def family(self) -> str:
        return self.facts.model_type

    @property
    def _lm(self) -> ClientModel:  # ie_lab's handle checks (make_spec, input checks) accept it as is
        return self

    def to_tokens(self, text: Any) -> torch.Tensor:
        return prepare(self, text)[0]

    def to_str_tokens(self, tokens_or_text: Any):
        ids = prepare(self, tokens_or_text)[0]
        out = str_tokens(self, ids)
        single = isinstance(tokens_or_text, str) or (
            isinstance(tokens_or_text, torch.Tensor) and tokens_or_text.dim() == 1
        )
        return out[0] if single else out
