"""Parameter counts and weight bytes: what transformers builds from the config, counted on the meta device.

Counting by arithmetic over config keys is exact on dense trunks and wrong on nearly every other (shared experts,
latent attention projections, SSM mixers, per-family norms): the meta device builds the real module tree without
allocating a byte (a 671B DeepSeek-V3 in a tenth of a second), so the count is the model's own. Config arithmetic
(ArchFacts.n_params_estimate) remains the fallback for a model type this transformers does not know, and says so.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..arch.config_facts import ArchFacts
from ..errors import InputError

# Bytes per element of the unquantized dtypes the sizer accepts.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Weight-only quantization a user may ask for instead of a checkpoint's: bits per weight including the scales
# (int4 with one fp16 scale and one 4-bit zero per group of 128 inputs, as GPTQ/AWQ store it; fp8 and int8 with
# one scale per output channel, a negligible share).
WEIGHT_ONLY = {"int4": 4 + (16 + 4) / 128, "int8": 8.0, "fp8": 8.0}
# Config keys naming multi-token-prediction layers a checkpoint holds beyond the trunk.
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_num_layers")


def resolve_config(model: Any):
    """A transformers config from what `ie-lab size` accepts: a config object, a config dict, a local folder (or
    config.json file), a model type name (its config class's defaults: the family's reference size), or a hub id
    already in the local Hugging Face cache. Nothing is downloaded."""
    from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, dict):
        mt = model.get("model_type")
        if mt in CONFIG_MAPPING:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return CONFIG_MAPPING[mt].from_dict(dict(model))
        return dict(model)  # a family this transformers does not know: config arithmetic only
    if not isinstance(model, (str, os.PathLike)):
        raise InputError(
            f"size() takes a config, a config dict, a folder with config.json or a model type name, got "
            f"{type(model).__name__}."
        )
    text = os.fspath(model)
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as e:
                raise InputError(f"{path} is not valid JSON ({e}); pass the model's config.json.") from None
        if not isinstance(d, dict) or "model_type" not in d:
            raise InputError(f"{path} states no model_type; pass the config.json of a transformers model.")
        if d["model_type"] in CONFIG_MAPPING:
            # transformers' own reader: it decodes what its writer encodes (Infinity, nested sub-configs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return CONFIG_MAPPING[d["model_type"]].from_json_file(path)
        return d  # a family this transformers does not know: config arithmetic only
    if text in CONFIG_MAPPING:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return CONFIG_MAPPING[text]()
    if "/" in text and not os.path.exists(text):
        try:  # a hub id whose config is already in the local cache; never a download
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return AutoConfig.from_pretrained(text, local_files_only=True)
        except Exception:  # noqa: BLE001 - any failure means: not cached here
            pass
    raise InputError(
        f"{text!r} is neither a folder with config.json, a config.json file, nor a model type transformers knows. "
        "The sizer reads no hub: download the config first (huggingface-cli download ORG/NAME config.json "
        "--local-dir DIR) and pass DIR, or pass a model type such as 'llama' for its reference size."
    )


def config_dict(config: Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, dict) else config.to_dict()


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the model transformers builds from the config, by what they are."""

    total: int
    embedding: int  # the input embedding table(s)
    lm_head: int  # the output projection when it is not tied to the embedding (0 when tied)
    experts: int  # routed experts' weights (not shared experts, not the router)
    quantizable: int  # weight matrices outside the embedding and head: what weight-only quantization packs
    n_experts: int = 0
    experts_per_token: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint holds and transformers does not build
    mtp_params: int = 0  # their parameters (one trunk layer each plus its projection and norms)
    source: str = ""
    # the quantizable matrices by parameter name (numel): which of them a quantization config skips is by name
    matrices: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def active(self) -> int:
        """Parameters one token runs through: every routed expert counted at experts_per_token / n_experts."""
        if not self.n_experts or not self.experts:
            return self.total
        return round(self.total - self.experts + self.experts * self.experts_per_token / self.n_experts)


def _meta_model(config: Any):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(level)


def _is_expert(name: str) -> bool:
    # routed experts: fused tensors (...mlp.experts.gate_up_proj) and per-expert lists (...experts.3.w1.weight);
    # a shared expert is dense (every token runs it) and so is the router
    return ".experts." in name and "shared" not in name


def count_params(config: Any) -> ParamCount:
    """Count on the meta device (exact: the model transformers builds); config arithmetic where it cannot."""
    d = config_dict(config)
    facts = _facts(config)
    n_mtp = next((int(d[k]) for k in _MTP_KEYS if isinstance(d.get(k), int) and d[k] > 0), 0)
    try:
        model = None if isinstance(config, dict) else _meta_model(config)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build: the arithmetic still answers
        model, why = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    else:
        why = "transformers does not know this model type"
    if model is None:
        if facts is None:
            raise InputError(
                f"cannot size model type {d.get('model_type')!r}: transformers cannot build it ({why}) and its "
                "config states no hidden size, layer count and head count the arithmetic could use."
            )
        n = arithmetic_count(facts)
        emb = facts.vocab_size * facts.d_model
        return ParamCount(
            total=n,
            embedding=emb,
            lm_head=0 if facts.tie_word_embeddings else emb,
            experts=0,
            quantizable=n - emb * (1 if facts.tie_word_embeddings else 2),
            mtp_layers=n_mtp,
            source=f"config arithmetic, approximate ({why})",
        )
    total = 0
    matrices: dict[str, int] = {}
    emb_in = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb_in.parameters()} if emb_in is not None else set()
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} - emb_ids if head is not None else set()
    embedding = lm_head = experts = quantizable = 0
    for n, p in model.named_parameters():  # tied tensors appear once
        total += p.numel()
        if id(p) in emb_ids or (p.dim() == 2 and "embed" in n and "proj" not in n):
            embedding += p.numel()  # token and position embedding tables
        elif id(p) in head_ids:
            lm_head += p.numel()
        else:
            if _is_expert(n):
                experts += p.numel()
            if p.dim() >= 2:
                quantizable += p.numel()
                matrices[n] = p.numel()
    mtp_params = 0
    if n_mtp:
        layers = _decoder_layers(model)
        if layers is not None and len(layers):
            # DeepSeek-V3's MTP module: one full trunk layer, a 2d -> d projection of [embedding; hidden], two
            # norms on its inputs and one on its output (the embedding and head are shared with the trunk)
            one = sum(p.numel() for p in layers[-1].parameters())
            dm = facts.d_model if facts else 0
            mtp_params = n_mtp * (one + 2 * dm * dm + 3 * dm)
    return ParamCount(
        total=total,
        embedding=embedding,
        lm_head=lm_head,
        experts=experts,
        quantizable=quantizable,
        n_experts=facts.n_experts if facts else 0,
        experts_per_token=facts.experts_per_token if facts else 0,
        mtp_layers=n_mtp,
        mtp_params=mtp_params,
        source=f"meta-device instantiation of {type(model).__name__}",
        matrices=matrices,
    )


def arithmetic_count(f: ArchFacts) -> int:
    """Parameters from config keys alone: the fallback for a model type transformers cannot build here.

    Covers the common trunk shapes: GQA or latent (MLA) attention with optional biases and q/k norms, gated or
    plain MLPs, routed experts with shared experts and a dense prefix, Mamba and Mamba 2 mixers, pre/sandwich
    norms, tied or untied embeddings. tests/test_sizing.py holds it to 1% of the meta-device count on Llama,
    Mistral, Qwen3, Gemma 2, Mixtral, Qwen3-MoE, DeepSeek-V3, Mamba and Mamba 2; a family with other parts
    (per-layer embeddings, hyper-connections, exotic mixers) is off by what those parts weigh."""
    d, dm = f.d_model, f.raw
    bias = bool(dm.get("attention_bias") or dm.get("qkv_bias") or dm.get("bias"))
    if f.n_heads == 0:
        attn = 0
    elif f.kv_lora_rank:
        nope, rope, v = int(dm.get("qk_nope_head_dim") or 0), int(dm.get("qk_rope_head_dim") or 0), f.value_head_dim
        qk = nope + rope
        q = d * f.q_lora_rank + f.q_lora_rank + f.q_lora_rank * f.n_heads * qk if f.q_lora_rank else d * f.n_heads * qk
        kv = d * (f.kv_lora_rank + rope) + f.kv_lora_rank + f.kv_lora_rank * f.n_heads * (nope + v)
        attn = q + kv + f.n_heads * v * d
    else:
        attn = d * (f.q_width + 2 * f.kv_width) + f.q_width * d
        attn += (f.q_width + 2 * f.kv_width + d) * bias + 2 * f.head_dim * f.qk_norm
        attn += d * f.q_width * f.attn_gate  # a gated attention's q_proj also projects the gate
    mlp_bias = bool(dm.get("mlp_bias"))

    def mlp(width: int) -> int:
        return (3 if f.gated_mlp else 2) * d * width + (2 * width + d if mlp_bias else 0)

    dense = mlp(int(dm.get("intermediate_size") or f.d_mlp))
    moe_width = int(dm.get("moe_intermediate_size") or f.d_mlp)
    shared = int(dm.get("n_shared_experts") or dm.get("num_shared_experts") or 0) * mlp(moe_width)
    if dm.get("shared_expert_intermediate_size"):
        shared += mlp(int(dm["shared_expert_intermediate_size"])) + d  # and its sigmoid gate
    routed = (
        f.n_experts * mlp(moe_width) + d * f.n_experts + (f.n_experts if dm.get("topk_method") == "noaux_tc" else 0)
    )
    mixer = _ssm_mixer_count(f, dm)
    norms = (4 if f.sandwich_norms else 2) * d
    total = 0
    moe = set(f.moe_layers)
    for i in range(f.n_layers):
        kind = f.mixer_kinds[i] if i < len(f.mixer_kinds) else ""
        sub = f.block_sublayers[i] if i < len(f.block_sublayers) else ""
        if sub:  # a single-sublayer trunk (Nemotron-H): one mixer, attention or MLP block and its norm
            total += d + {"mixer": mixer, "attention": attn}.get(sub, routed + shared if i in moe else dense)
            continue
        if kind == "state_space":  # a Mamba block: the mixer and one norm, no MLP
            total += mixer + d
            continue
        token_mixer = (attn if not kind else mixer) + (mixer if f.parallel_mixer else 0)
        total += token_mixer + norms + (routed + shared if i in moe else dense)
    emb = f.vocab_size * d
    return total + d + emb * (1 if f.tie_word_embeddings else 2)


def _ssm_mixer_count(f: ArchFacts, dm: dict[str, Any]) -> int:
    """One Mamba (selective scan), Mamba 2 (SSD) or Gated DeltaNet mixer's parameters, from the keys kv.py reads."""
    d = f.d_model
    if dm.get("linear_num_value_heads"):  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
        nk, nv = dm["linear_num_key_heads"], dm["linear_num_value_heads"]
        dk, dv, k = dm["linear_key_head_dim"], dm["linear_value_head_dim"], dm.get("linear_conv_kernel_dim") or 4
        # in_proj to (q, k, v, z) and (beta, a); depthwise conv over q, k, v; dt_bias and A_log per value head;
        # the gated norm over a head; out_proj
        return d * (2 * nk * dk + 2 * nv * dv) + d * 2 * nv + (2 * nk * dk + nv * dv) * k + 2 * nv + dv + nv * dv * d
    n = dm.get("state_size") or dm.get("mamba_d_state") or 0
    k = dm.get("conv_kernel") or dm.get("mamba_d_conv") or 4
    if not n:
        return 0
    if f.model_type == "mamba2" or dm.get("mamba_n_heads"):
        heads = int((dm.get("num_heads") if f.model_type == "mamba2" else dm.get("mamba_n_heads")) or 0)
        hd = int((dm.get("head_dim") if f.model_type == "mamba2" else dm.get("mamba_d_head")) or 0)
        inner = dm.get("mamba_d_ssm") or heads * hd
        g = dm.get("n_groups") or dm.get("mamba_n_groups") or 1
        conv = inner + 2 * g * n
        gated_norm = inner if dm.get("mamba_rms_norm", True) else 0
        # in_proj to (z, x, B, C, dt); depthwise conv with bias; dt_bias, A_log, D per head; gated norm; out_proj
        return d * (2 * inner + 2 * g * n + heads) + conv * k + conv + 3 * heads + gated_norm + inner * d
    if f.model_type in ("mamba", "falcon_mamba"):
        inner = dm.get("intermediate_size") or 2 * d
    else:  # a hybrid's intermediate_size is its MLP's
        inner = int((dm.get("mamba_expand") or dm.get("expand") or 2) * d)
    rank = dm.get("time_step_rank", dm.get("mamba_dt_rank"))
    rank = -(-d // 16) if rank in (None, "auto") else int(rank)
    # Jamba normalises dt, B and C inside its mixer (a model-type fact no config key states; sizing keeps it here
    # rather than in arch.quirks, which describes the residual stream)
    inner_norms = rank + 2 * n if f.model_type == "jamba" else 0
    # in_proj to (x, z); conv with bias; x_proj to (dt, B, C); dt_proj with bias; A_log; D; out_proj
    return (
        d * 2 * inner
        + inner * k
        + inner
        + inner * (rank + 2 * n)
        + rank * inner
        + inner
        + inner * n
        + inner
        + inner * d
        + inner_norms
    )


def _decoder_layers(model: Any):
    import torch

    best = None
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and (best is None or len(mod) > len(best)):
            best = mod
    return best


def _facts(config: Any) -> ArchFacts | None:
    try:
        return ArchFacts.from_config(config)
    except Exception:  # noqa: BLE001 - families the arithmetic cannot read (encoder-decoders, RWKV, ...)
        return None


# ---- quantization ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores its quantized weights: bits per weight (scales and zeros included), which weights."""

    method: str
    bits_per_weight: float
    experts_only: bool = False  # MXFP4 (gpt-oss) packs only the routed experts
    skip: tuple[str, ...] = ()  # module names (or "re:" patterns) kept unquantized
    note: str = ""

    def applies(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        for s in self.skip:
            if s.startswith("re:"):  # compressed-tensors' regular expressions
                if re.search(s[3:], module):
                    return False
            elif "*" in s:  # glob patterns (gpt-oss: "model.layers.*.self_attn")
                if fnmatch.fnmatchcase(module, s) or fnmatch.fnmatchcase(module, s + ".*"):
                    return False
            elif module == s or module.endswith("." + s) or ("." + s + ".") in ("." + module + "."):
                return False
        return _is_expert(name) if self.experts_only else True


def _group_bits(bits: float, group: Any, scale_bits: int = 16, zero_bits: float = 0) -> float:
    g = group if isinstance(group, int) and group > 0 else 0
    return bits + ((scale_bits + zero_bits) / g if g else 0.0)


def quantization(qc: dict[str, Any] | None) -> Quantization | None:
    """Bits per weight from a checkpoint's quantization_config (None: not quantized)."""
    if not qc:
        return None
    qc = dict(qc)
    method = str(qc.get("quant_method") or qc.get("quant_type") or "unknown").lower()
    skip = tuple(qc.get("modules_to_not_convert") or qc.get("ignore") or ())
    if method in ("gptq", "awq", "gptqmodel", "autoround", "auto-round"):
        bits = qc.get("bits") or qc.get("w_bit") or 4
        group = qc.get("group_size", qc.get("q_group_size", 128))
        sym = qc.get("sym", method == "gptq") and method != "awq"
        # one fp16 scale per group, and a packed zero point of `bits` bits unless symmetric (GPTQ still stores
        # the zeros tensor when symmetric, so count it for gptq too)
        zero = bits if (not sym or method == "gptq") else 0
        return Quantization(method, _group_bits(bits, group, 16, zero), skip=skip)
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None)
        if not weights:
            return Quantization(method, 16.0, skip=skip, note="no weight scheme in config_groups: counted at 16 bits")
        bits = weights.get("num_bits", 8)
        strategy = weights.get("strategy", "tensor")
        zero = 0 if weights.get("symmetric", True) else bits
        if strategy == "group":
            bpw = _group_bits(bits, weights.get("group_size"), 16, zero)
        elif strategy == "block":
            b = weights.get("block_structure") or [128, 128]
            bpw = bits + 32 / (b[0] * b[1])
        else:  # tensor or channel: one scale per tensor or output row, a negligible share
            bpw = float(bits)
        return Quantization(method, bpw, skip=skip)
    if method in ("fp8", "fbgemm_fp8", "finegrained_fp8"):
        block = qc.get("weight_block_size")
        bpw = 8 + (32 / (block[0] * block[1]) if block else 0.0)  # one fp32 scale per block
        return Quantization(method, bpw, skip=skip)
    if method == "mxfp4":  # 4-bit values, one 8-bit shared exponent per 32 (OCP microscaling)
        return Quantization(method, 4 + 8 / 32, experts_only=True, skip=skip)
    if method == "bitsandbytes":
        if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
            double = qc.get("bnb_4bit_use_double_quant")
            # one fp32 absmax per block of 64; double quantization stores it as 8 bits plus an fp32 per 256 blocks
            return Quantization("bitsandbytes 4-bit", 4 + (8 / 64 + 32 / (64 * 256) if double else 32 / 64), skip=skip)
        return Quantization("bitsandbytes 8-bit", 8.0, skip=skip)
    if method == "torchao":
        qt = json.dumps(qc.get("quant_type", "")).lower()
        group = re.search(r'group_size"?\W+(\d+)', qt)
        if "unpacked_to_int8" in qt:  # IntxWeightOnlyConfig's default: int1..int8 values each stored as an int8,
            # with a 16-bit scale and an int8 zero point per group (per row without a group size: negligible)
            return Quantization(method, _group_bits(8, int(group.group(1)) if group else 0, 16, 8), skip=skip)
        if "int4" in qt:
            return Quantization(method, _group_bits(4, int(group.group(1)) if group else 128, 16, 16), skip=skip)
        if "float8" in qt or "fp8" in qt:
            return Quantization(method, 8.0, skip=skip)
        return Quantization(method, 8.0, skip=skip)
    if method in ("modelopt",):
        algo = str(qc.get("quant_algo", "")).upper()
        if "FP4" in algo:  # NVFP4: 4-bit values, one fp8 scale per 16
            return Quantization(method, 4 + 8 / 16, skip=skip)
        return Quantization(method, 8.0, skip=skip)
    if method in ("bitnet",):
        return Quantization(method, 2.0, skip=skip)  # ternary weights packed four to a byte
    bits = qc.get("bits") or qc.get("num_bits")
    if isinstance(bits, (int, float)):
        return Quantization(method, _group_bits(bits, qc.get("group_size"), 16, 0), skip=skip)
    return Quantization(method, 16.0, skip=skip, note=f"quantization method {method!r} unknown to the sizer: 16 bits")


def weight_bytes(params: ParamCount, dtype: str, quant: Quantization | None) -> float:
    """Bytes of the weights: quantized matrices at their bits per weight, everything else at `dtype`."""
    b = DTYPE_BYTES[dtype]
    if quant is None:
        return params.total * b
    if params.matrices:
        packed = sum(n for name, n in params.matrices.items() if quant.applies(name))
    else:
        packed = params.experts if quant.experts_only else params.quantizable
    return (params.total - packed) * b + packed * quant.bits_per_weight / 8
