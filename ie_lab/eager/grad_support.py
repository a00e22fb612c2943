"""The eager backend's gradient verdict: what in the loaded model would stop autograd, read from its parameters and
modules before any forward (Session.grad_support, and the check fit_jacobian_lens makes before it runs).

Known blockers, each named in the verdict:
- parameters that hold integer, quantized or float8 values (packed GPTQ/AWQ weights, torch's quantized tensors,
  FP8 checkpoints): their kernels have no backward. bitsandbytes' 4-bit and 8-bit parameters are the exception
  (QLoRA trains through them: their matmuls carry a backward for the input), and so are the integers
  compressed-tensors keeps beside a weight ie_lab dequantized at load (its shape, zero points): the forward
  computes with the dense weight, so gradients through weight-only schemes (W4A16, W8A16) are exact
  (tests/test_quantized.py checks one against finite differences), and torchao's weight-only tensors are floats
  to autograd (Int8Tensor and IntxUnpackedToInt8Tensor report their scales' dtype) whose linear is a plain matmul
  with the integers times their scales: the input's gradient is exact (tests/test_quantized_torchao.py);
- linears that quantize their activations as they run (compressed-tensors' W8A8 and the like, torchao's
  Int8DynamicActivationInt8WeightConfig): compressed-tensors' fake quantization runs under torch.no_grad() and
  torchao's int8 matmul has no backward, so their input is cut from the graph and a gradient would silently
  miss every path through them (the residual stream's would still arrive, which is worse than none);
- parameters made under torch.inference_mode(): autograd refuses to save inference tensors for a backward, and
  the calling thread itself inside torch.inference_mode(), where no graph is recorded at all (torch.enable_grad()
  does not lift it);
- a module whose forward is decorated with torch.no_grad() or torch.inference_mode() (a custom kernel's wrapper):
  nothing flows back through it. Left out are the modules transformers itself decorates so whose output carries
  no derivative anyway: rotary and sinusoidal position embeddings (cos, sin or a table of positions alone, never a
  function of an activation) and sparse attention's indexers (DeepSeek V3.2's: a top-k choice of keys, discrete;
  the attention over the chosen keys keeps its gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from ..capabilities import GradSupport, table_grad_support
from . import quantized as _quantized
from .model import lm_of

_FLOAT8 = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)
# bitsandbytes' parameter classes: stored as uint8 / int8, with matmuls whose backward reaches the input
_DIFFERENTIABLE_QUANTIZED = ("Params4bit", "Int8Params")
_SHOWN = 3  # names listed per reason; the rest counted
# class-name parts of the no_grad-decorated modules whose output has no derivative to lose (the module docstring)
_NO_DERIVATIVE = ("Rotary", "Positional", "Indexer")


def _listed(what: str, items: list[str]) -> str:
    """'parameter a' or 'parameters a, b, c and 4 more'."""
    shown = ", ".join(items[:_SHOWN]) + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
    return f"{what}{'s' if len(items) > 1 else ''} {shown}"


def _no_grad_forward(module: torch.nn.Module) -> str | None:
    """'torch.no_grad()' or 'torch.inference_mode()' where the module's forward is wrapped in one (torch's
    context decorator keeps the context manager in its closure), else None."""
    fn: Any = getattr(module.forward, "__func__", module.forward)
    for _ in range(8):  # decorators stacked on one forward
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                ctx = getattr(cell.cell_contents, "__self__", cell.cell_contents)
            except ValueError:  # an empty cell
                continue
            if isinstance(ctx, torch.no_grad):
                return "torch.no_grad()"
            if isinstance(ctx, torch.inference_mode) and getattr(ctx, "mode", True):
                return "torch.inference_mode()"
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return None


def grad_support(model: Any) -> GradSupport:
    """Whether gradients with respect to activations can be taken on this model, and what blocks them (no forward
    runs: the parameters, the modules' forwards and the calling thread's autograd mode are read)."""
    lm = lm_of(model)
    backend = getattr(lm, "backend", "eager")
    if backend != "eager":
        return table_grad_support(backend)
    reasons: list[str] = []
    instead: list[str] = []
    quantized, inference = [], []
    kept = _quantized.bookkeeping(lm.hf)
    for name, p in lm.hf.named_parameters():
        if type(p).__name__ in _DIFFERENTIABLE_QUANTIZED or name in kept:
            continue
        if not p.is_floating_point() or p.dtype in _FLOAT8:
            quantized.append(f"{name} ({str(p.dtype).replace('torch.', '')})")
        elif p.is_inference():
            inference.append(name)
    for name, b in lm.hf.named_buffers():
        # packed quantized weights are buffers (GPTQ/AWQ qweight); integer buffers otherwise hold positions or masks
        if "weight" in name.rsplit(".", 1)[-1] and (not b.is_floating_point() or b.dtype in _FLOAT8):
            quantized.append(f"{name} ({str(b.dtype).replace('torch.', '')})")
    if quantized:
        reasons.append(
            f"{_listed('parameter', quantized)} {'holds' if len(quantized) == 1 else 'hold'} integer or quantized "
            "values, which the kernels reading them compute without a backward"
        )
        instead.append("load the model unquantized (dtype=torch.float32 or torch.bfloat16)")
    cut = _quantized.activation_quantized(lm.hf)
    if cut:
        reasons.append(
            f"{_listed('module', cut)} {'quantizes its' if len(cut) == 1 else 'quantize their'} activations as "
            "the model runs (compressed-tensors' fake quantization runs under torch.no_grad(); torchao's int8 "
            "matmul has no backward), so nothing flows back "
            "through their inputs and a gradient would miss every path through them"
        )
        instead.append(
            "load a weight-only quantization of the model (W4A16, W8A16, torchao's Int8WeightOnlyConfig: their "
            "linears keep the input's gradient), "
            "or the unquantized checkpoint"
        )
    if inference:
        reasons.append(
            f"{_listed('parameter', inference)} {'was' if len(inference) == 1 else 'were'} made under "
            "torch.inference_mode(), and autograd does not save inference tensors for a backward"
        )
        instead.append("build or load the model outside torch.inference_mode()")
    blocked = []
    for name, m in lm.hf.named_modules():
        ctx = _no_grad_forward(m)
        if ctx is not None and not any(part in type(m).__name__ for part in _NO_DERIVATIVE):
            blocked.append((name or "the model", type(m).__name__, ctx))
    if blocked:
        ctxs = sorted({c for _, _, c in blocked})
        reasons.append(
            f"{_listed('module', [f'{n} ({t})' for n, t, _ in blocked])} "
            f"{'runs its' if len(blocked) == 1 else 'run their'} forward under {' / '.join(ctxs)}, so nothing "
            "flows back through it"
        )
        instead.append("use a model whose modules compute with autograd (the family's plain transformers code)")
    if torch.is_inference_mode_enabled():
        reasons.append(
            "this thread is inside torch.inference_mode(), where no autograd graph is recorded (torch.enable_grad() "
            "does not lift it)"
        )
        instead.append("call it outside the `with torch.inference_mode():` block")
    return GradSupport(not reasons, tuple(reasons), "eager", "; ".join(instead))


__all__ = ["grad_support"]
