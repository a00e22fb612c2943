"""Quantized checkpoints on the eager backend: which formats load here and how, what the load line says about them,
and what their modules mean for gradients (eager/grad_support.py asks).

A checkpoint says it is quantized in its config.json (`quantization_config`, with `quant_method`); transformers
loads it through that method's quantizer, which needs the method's own package. Measured here (CPU, torch 2.13,
transformers 5.19):
- compressed-tensors (llm-compressor's format; GPTQ and AWQ models are published in it too, as W4A16 with
  `pack-quantized`): loads on CPU. ie_lab dequantizes every weight once at load (compressed-tensors' own
  decompression), so a module computes with the dense weight its integers and scales stand for, which is what the
  quantized model computes: the points are those. A scheme that quantizes activations as well (W8A8) keeps
  quantizing them as the model runs (compressed-tensors' forward wraps each such linear), dynamically per token.
- gptq and awq (quant_method "gptq" / "awq"): transformers needs gptqmodel (and optimum for gptq); gptqmodel 7.7 is
  on PyPI as source only (70 C++/CUDA files built at install), not in ie_lab's environments. Refused with that named.
- bitsandbytes: bitsandbytes 0.50.2 installs from PyPI with a CPU backend, and transformers' quantizer also needs
  accelerate; with both, nf4 and 8-bit checkpoints (saved as safetensors) load and run on CPU, the 4-bit kernel
  computing in bfloat16 even in a float32 model (tests/test_quantized_bnb.py, where both are installed). Neither is
  in ie_lab's environments, so refused where either is missing; where both are, transformers loads it as for anyone.
- torchao (torchao 0.18, pinned in the vLLM line's environment): transformers saves and loads its tensors as
  safetensors (torchao's flattened tensor subclasses: Int8Tensor, IntxUnpackedToInt8Tensor, Int4Tensor, Float8Tensor
  ..., their integers and scales as plain tensors and their layout in the file's metadata). On CPU int8 weight-only
  (Int8WeightOnlyConfig) and int4/intx weight-only unpacked to int8 (IntxWeightOnlyConfig) run; torchao's int4
  packings (Int4WeightOnlyConfig) need CUDA or mslk and fail at load here, named in transformers' words. The
  weights stay torchao tensors (no dequantization at load): each linear computes with them as torchao does, so
  the points are what the quantized model computes, and a weight-only linear's input keeps its gradient (exact:
  the int8 weights times their scales, a plain matmul). A config that quantizes activations too
  (Int8DynamicActivationInt8WeightConfig) computes an int8 matmul with no backward: grad_support names it.
  Checkpoints saved before safetensors support (pytorch_model.bin, pickles of the tensor subclasses) are refused by
  ie_lab's safetensors-only rule (loading.py), with how to convert them.
"""

from __future__ import annotations

import contextlib
import unittest.mock
from typing import Any

from ..errors import CapabilityUnsupported

# quant_method -> the packages transformers needs for it, and what it is on CPU (the module docstring's findings)
NEEDS: dict[str, tuple[str, str]] = {
    "gptq": (
        "gptqmodel and optimum",
        "gptqmodel 7.7 is on PyPI as source only (gptqmodel-7.7.0.tar.gz, 70 C++/CUDA files built at install), so "
        "ie_lab's environments do not carry it",
    ),
    "awq": (
        "gptqmodel",
        "gptqmodel 7.7 is on PyPI as source only (gptqmodel-7.7.0.tar.gz, 70 C++/CUDA files built at install), so "
        "ie_lab's environments do not carry it",
    ),
    "bitsandbytes": (
        "bitsandbytes and accelerate",
        "bitsandbytes 0.50.2 has a CPU backend and with accelerate 1.16 its nf4 and 8-bit checkpoints load here "
        "(pip install bitsandbytes==0.50.2 accelerate==1.16.0)",
    ),
    "torchao": (
        "torchao",
        "torchao 0.18's int8 weight-only and intx (unpacked to int8) tensors run on CPU (pip install torchao==0.18.0); "
        "its int4 packings need CUDA",
    ),
}
CT = "compressed-tensors"
_INSTEAD = (
    "install what transformers asks for and load again (ie_lab then runs what transformers loads), or load a "
    "compressed-tensors copy of the model (W4A16 / W8A8, as llm-compressor writes them: GPTQ and AWQ models are "
    "often published so), or the unquantized checkpoint"
)


def method_of(config: Any) -> str | None:
    """The checkpoint's quant_method ('compressed-tensors', 'gptq', ...), or None where it is not quantized."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method") or "unknown"
    return str(getattr(method, "value", method)).lower()  # a loaded config holds transformers' QuantizationMethod


def refuse_unloadable(method: str, src: str, error: Exception) -> None:
    """transformers could not load a quantized checkpoint here (its quantizer's package or hardware is missing): say
    which and why, in transformers' own words too."""
    said = f"{type(error).__name__}: {str(error).strip()[:200]}"
    if method in NEEDS:
        need, why = NEEDS[method]
        because = f"transformers needs {need} for it ({said}); on CPU: {why}."
    else:
        because = f"transformers' {method} quantizer cannot load it on this machine ({said})."
    raise CapabilityUnsupported(f"loading the {method}-quantized checkpoint {src!r}", because, _INSTEAD + ".") from None


def dequantize(model: Any) -> None:
    """compressed-tensors leaves packed weights for a hook to decompress on the first forward; do it now, so the
    model ie_lab hands out holds the dense weights it will compute with (and no extra hook of its own)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if hasattr(model, "ct_decompress_hook") and quantizer is not None and hasattr(quantizer, "compressor"):
        with bars_off():
            quantizer.compressor.decompress_model(model)


def bars_off(method: str | None = CT):
    """compressed-tensors draws a tqdm bar over the modules it (de)compresses while transformers loads: iterate
    them plainly instead (ie_lab shows its own bar). And one model in this process is (de)compressed here alone:
    where torch.distributed is up (an in-process vLLM engine starts it) compressed-tensors would share the work
    out across that process group's ranks, with a bar of its own. Nothing for another method (or none)."""
    if method != CT:
        return contextlib.nullcontext()
    try:
        import compressed_tensors.compressors.model_compressors.model_compressor  # noqa: F401
    except ImportError:
        return contextlib.nullcontext()
    where = "compressed_tensors.compressors.model_compressors.model_compressor"
    stack = contextlib.ExitStack()
    stack.enter_context(unittest.mock.patch(f"{where}.tqdm", lambda items, **_: items))
    stack.enter_context(unittest.mock.patch(f"{where}.is_distributed", lambda: False))
    return stack


def _args_words(kind: str, args: Any) -> str:
    strategy = str(getattr(args.strategy, "value", args.strategy))
    how = f"group {args.group_size}" if strategy == "group" else f"per {strategy}"
    extra = ", dynamic" if args.dynamic else ""
    extra += "" if args.symmetric else ", asymmetric"
    return f"{kind} {args.type}{args.num_bits} ({how}{extra})"


def schemes(model: Any) -> dict[str, list[str]]:
    """compressed-tensors' scheme per quantized module, in words ('weights int4 (group 128)' ...) -> module names."""
    out: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        parts = [_args_words("weights", scheme.weights)] if scheme.weights is not None else []
        if scheme.input_activations is not None:
            parts.append(_args_words("inputs", scheme.input_activations))
        if scheme.output_activations is not None:
            parts.append(_args_words("outputs", scheme.output_activations))
        out.setdefault(", ".join(parts) or "nothing quantized", []).append(name)
    return out


def torchao_dtype(method: str | None, config: Any, asked: Any, default: Any, src: str) -> Any:
    """The dtype to load a checkpoint in: a torchao checkpoint's own. Its weights stay torchao tensors in the dtype
    they were saved in while transformers casts the rest, so another dtype leaves a linear multiplying a float32
    input by bfloat16 weights (RuntimeError: expected m1 and m2 to have the same dtype) on the first forward."""
    import torch

    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    if method != "torchao" or not isinstance(saved, torch.dtype):
        return default
    if asked is None or asked == saved:
        return saved
    name = str(saved).replace("torch.", "")
    raise CapabilityUnsupported(
        f"loading the torchao checkpoint {src!r} in {str(asked).replace('torch.', '')}",
        f"its torchao weights keep the dtype they were saved in ({name}) while transformers would cast the rest, "
        "so the first linear would multiply tensors of two dtypes",
        f"leave dtype= out or pass dtype=torch.{name}.",
    )


def load_words(model: Any) -> str | None:
    """The load line's words for a quantized model, or None."""
    method = method_of(model.config)
    if method is None:
        return None
    if method == "torchao":
        shown = "; ".join(f"{len(names)} linears {words}" for words, names in torchao_weights(model).items())
        return f"quantized (torchao: {shown}), torchao's tensors as transformers loads them"
    if method != CT:
        return f"quantized ({method}), as transformers loads it"
    found = schemes(model)
    shown = "; ".join(f"{len(names)} linears {words}" for words, names in found.items())
    return f"quantized (compressed-tensors: {shown}), weights dequantized once at load"


def _torchao_acts(weight: Any) -> bool:
    """A torchao weight whose linear quantizes its input as it runs (Int8Tensor's act_quant_kwargs,
    IntxUnpackedToInt8Tensor's activation_quantization)."""
    return (
        getattr(weight, "act_quant_kwargs", None) is not None
        or getattr(weight, "activation_quantization", None) is not None
    )


def torchao_weights(model: Any) -> dict[str, list[str]]:
    """torchao's tensor per quantized module, in words ('Int8Tensor: int8 weights, blocks of 1x128') -> names."""
    out: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if w is None or not type(w).__module__.startswith("torchao"):
            continue
        bits = str(getattr(w, "target_dtype", "int8" if hasattr(w, "qdata") else "?")).replace("torch.", "")
        block = "x".join(str(b) for b in getattr(w, "block_size", ()) or ()) or "?"
        acts = ", int8 activations (dynamic)" if _torchao_acts(w) else ""
        out.setdefault(f"{type(w).__name__}: {bits} weights, blocks of {block}{acts}", []).append(name)
    return out


def activation_quantized(model: Any) -> list[str]:
    """Modules that quantize their activations as the model runs (compressed-tensors' W8A8, torchao's dynamic
    activation configs, and the like)."""
    return [
        name
        for name, m in model.named_modules()
        if (
            getattr(m, "quantization_scheme", None) is not None
            and (
                m.quantization_scheme.input_activations is not None
                or m.quantization_scheme.output_activations is not None
            )
        )
        or _torchao_acts(getattr(m, "weight", None))
    ]


def pickle_words(config_path: str) -> str:
    """Extra words for a folder with no safetensors whose config.json says torchao: such checkpoints were written
    as pickles before torchao's tensors could be stored in safetensors."""
    import json

    try:
        with open(config_path) as f:
            qc = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return ""
    if str(qc.get("quant_method", "")).lower() != "torchao":
        return ""
    return (
        " It is a torchao checkpoint saved as a pickle (pytorch_model.bin, as torchao wrote them before its tensors "
        "could be stored in safetensors): unpickling runs whatever code the file names, which ie_lab never does. "
        "Where you trust its source, convert it once with torchao>=0.14 installed: AutoModelForCausalLM."
        "from_pretrained(path).save_pretrained(new_path, safe_serialization=True) (Int8Tensor, Int4Tensor, "
        "IntxUnpackedToInt8Tensor and Float8Tensor weights convert; torchao's older AffineQuantizedTensor does not: "
        "quantize the unquantized model again with transformers' TorchAoConfig), or look for a safetensors copy."
    )


def bookkeeping(model: Any) -> set[str]:
    """Integer parameters compressed-tensors keeps beside a decompressed weight (its shape, zero points, group
    order) for compressing it again: no kernel reads them, the forward computes with the dense weight."""
    out: set[str] = set()
    for name, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        status = str(getattr(getattr(m, "quantization_status", None), "value", ""))
        if status not in ("decompressed", "frozen"):
            continue
        for p_name, p in m.named_parameters(recurse=False):
            if not p.is_floating_point() and p_name != "weight":
                out.add(f"{name}.{p_name}" if name else p_name)
    return out


__all__ = [
    "CT",
    "NEEDS",
    "activation_quantized",
    "bars_off",
    "bookkeeping",
    "dequantize",
    "load_words",
    "method_of",
    "pickle_words",
    "refuse_unloadable",
    "schemes",
    "torchao_dtype",
    "torchao_weights",
]
