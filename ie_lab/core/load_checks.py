"""The checks of a load's arguments that every backend reads (dtype, device, flags, the tokenizer argument): plain
torch and no backend, so the vLLM backend and the Session check what the eager load checks, in the same words."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import InputError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# A model computes in floating point; an integer or complex dtype would either fail inside torch or change the answer.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in _FLOAT_DTYPES:
            raise InputError(
                f"dtype {dtype} is not a floating-point type a model computes in; use float32, bfloat16 or float16."
            )
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    raise InputError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or a torch dtype.")


def check_flags(**flags: Any) -> None:
    """Switches are booleans: a string such as "no" would read as True."""
    for name, v in flags.items():
        if not isinstance(v, bool) and type(v).__name__ != "bool_":
            raise InputError(f"{name} must be True or False, got {v!r}.")


def check_tokenizer_arg(tokenizer: Any) -> None:
    """None (find it beside the weights), a folder / HF id, or a tokenizer object that can encode."""
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise InputError(
            f"tokenizer must be a tokenizer object (with encode / decode), a folder or an HF id, or "
            f"None to load the one beside the weights; got {type(tokenizer).__name__}."
        )


def pick_device(device: Any = None, *, announce: bool = True) -> tuple[torch.device, str]:
    """The device ladder: CUDA, then MPS, then CPU, with one sentence saying why."""
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise InputError(
                f"device must be a name such as 'cpu' or 'cuda:0', an index or a torch.device, got {device!r}."
            )
        if isinstance(device, int) and device < 0:
            raise InputError(f"device index {device} is negative; pass 'cpu', 'cuda' or a CUDA index >= 0.")
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise InputError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'.") from None
        if d.type not in ("cpu", "cuda", "mps"):
            raise InputError(f"device {device!r} is not one ie_lab runs on; use 'cpu', 'cuda', 'cuda:N' or 'mps'.")
        if d.type == "cuda" and not torch.cuda.is_available():
            raise InputError(
                f"device {device!r} was asked for but torch sees no CUDA device here "
                f"(torch {torch.__version__}); pass device='cpu', or install a CUDA build of torch."
            )
        if d.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise InputError(f"device {device!r} was asked for but MPS is not available; pass device='cpu'.")
        if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
            raise InputError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible.")
        return d, f"using {d} (as asked)"
    if torch.cuda.is_available():
        return torch.device("cuda"), f"using cuda ({torch.cuda.get_device_name(0)})"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps"), "using mps (Apple GPU; no CUDA device found)"
    return torch.device("cpu"), "using cpu: no CUDA or MPS device is visible to torch"


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32
