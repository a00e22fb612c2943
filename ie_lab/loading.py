"""load(): from an HF id, a local folder or a model object to a backend model."""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import CapabilityUnsupported, InputError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    raise InputError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))} or a torch dtype.")


def pick_device(device: Any = None, *, announce: bool = True) -> tuple[torch.device, str]:
    """The device ladder: CUDA, then MPS, then CPU, with one sentence saying why."""
    if device is not None:
        d = torch.device(device)
        if d.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"device {device!r} was asked for but torch sees no CUDA device here "
                             f"(torch {torch.__version__}); pass device='cpu', or install a CUDA build of torch.")
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


def load(model_or_path: Any, tokenizer: Any = None, backend: str = "eager", device: Any = None, dtype: Any = None,
         *, trust_remote_code: bool = False, quiet: bool = False):
    """Wrap a raw transformers causal LM for ie_lab.

    model_or_path: an HF id, a local folder, or an already-built model object (pass its tokenizer too).
    Weights load from safetensors only; remote code runs only with trust_remote_code=True.
    """
    from .eager.model import EagerModel

    if backend not in ("eager", "vllm", "auto"):
        raise InputError(f"unknown backend {backend!r}; use 'eager', 'vllm' or 'auto'.")
    if backend == "vllm":
        # vLLM loads its own weights inside its workers: the handle is a Session on the vLLM backend.
        if isinstance(model_or_path, torch.nn.Module):
            raise CapabilityUnsupported(
                "a model object on backend='vllm'", "vLLM loads the weights itself from a folder or HF id.",
                "pass the folder or id (save_pretrained first), or use backend='eager'.")
        from .session import Session

        return Session(model_or_path, backend="vllm", device=device, dtype=dtype, tokenizer=tokenizer,
                       trust_remote_code=trust_remote_code, progress=not quiet)
    torch_dtype = resolve_dtype(dtype)
    if isinstance(model_or_path, torch.nn.Module):
        model = model_or_path
        if device is not None or torch_dtype is not None:
            dev, _ = pick_device(device) if device is not None else (None, "")
            model = model.to(device=dev, dtype=torch_dtype)
        model.eval()
        if not quiet:
            p = next(model.parameters())
            print(f"ie_lab: model object on {p.device}, {str(p.dtype).replace('torch.', '')}"
                  + (" (as asked)" if device is not None or torch_dtype is not None else " (kept as given)"))
        return EagerModel(model, tokenizer)
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise InputError(f"expected an HF id, a folder path or a model object, got {type(model_or_path).__name__}.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.fspath(model_or_path)
    looks_local = src.startswith((".", "/", "~")) or os.sep in src and not src.count("/") == 1
    if looks_local and not os.path.isdir(os.path.expanduser(src)):
        raise InputError(f"no folder at {src!r}: check the path (it should hold config.json and *.safetensors).")
    if os.path.isdir(os.path.expanduser(src)):
        src = os.path.expanduser(src)
        if not any(f.endswith(".safetensors") for f in os.listdir(src)):
            raise InputError(f"{src!r} holds no .safetensors weights; ie_lab loads safetensors only "
                             "(convert with model.save_pretrained(path, safe_serialization=True)).")
    dev, why = pick_device(device)
    torch_dtype = torch_dtype or default_dtype(dev)
    if not quiet:
        print(f"ie_lab: {why}; dtype {str(torch_dtype).replace('torch.', '')}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise InputError(f"could not load {src!r}: {e}. Check the id or path; offline, the weights must already be "
                         "in the local HF cache or a folder.") from None
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise InputError(f"{src!r} needs custom code from its repository; ie_lab runs none unless you pass "
                             "trust_remote_code=True after reading that code.") from None
        raise
    model.to(dev).eval()
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tokenizer = None
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer), trust_remote_code=trust_remote_code)
    return EagerModel(model, tokenizer, name=os.fspath(model_or_path))
