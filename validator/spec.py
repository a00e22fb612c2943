"""What the validator compares, how closely, and what each verdict means. Plain Python: no torch.

Rendering (README table, heatmap) reads only this module and the committed JSON, so it never needs a model run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Verdicts. The first three are comparisons; the rest say why no comparison happened, and are never failures.
PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
NOT_SERVED = "not served"  # the engine (or ie_lab) was asked for a tensor it has a name for, and returned none
NOT_ASKED = "not asked"  # the engine has no faithful name for this point on this model, so nobody asked it
NOT_AVAILABLE = "not available"  # the whole engine cannot run here (no environment, no backend, cannot load)
VERDICTS = (PASS, WARN, FAIL, NOT_SERVED, NOT_ASKED, NOT_AVAILABLE)
COMPARED = (PASS, WARN, FAIL)


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # largest absolute elementwise difference
    cosine: float  # cosine similarity of the whole flattened tensors, at least
    worst_cosine: float  # the worst single token's (or attention row's) cosine, at least
    rel: float  # ||engine - ie_lab|| / ||ie_lab||, at most: the magnitude check cosine alone misses
    why: str
    warn_factor: float = 10.0  # within warn_factor times the tolerance: WARN, beyond it: FAIL

    def as_dict(self) -> dict:
        return asdict(self)


# Raw-HF pairs: the same transformers modules, the same weights, the same eager attention, fp32. Anything
# beyond float noise means the two engines read different tensors.
RAW_HF = Tolerance(
    max_abs=2e-3,
    cosine=0.9999,
    worst_cosine=0.999,
    rel=1e-3,
    why="same HF modules, same fp32 weights, same eager attention kernel: only summation-order noise is allowed",
)
# ie_lab's vLLM backend runs vLLM's own layers: paged attention, fused residual-add + RMSNorm, fused
# gate_up, its own rotary kernel. The same arithmetic in another order and with other kernels.
VLLM = Tolerance(
    max_abs=5e-2,
    cosine=0.999,
    worst_cosine=0.99,
    rel=2e-2,
    why="a different implementation (vLLM's fused add+norm, paged attention, fused gate_up and rotary kernels) "
    "in fp32: kernel-order differences compound through the layers",
)
# Real checkpoints in bf16/fp16 on a GPU: every engine's kernels round differently. Only for --model runs.
REAL_WEIGHTS = Tolerance(
    max_abs=1e9,
    cosine=0.999,
    worst_cosine=0.99,
    rel=2e-2,
    why="real checkpoints in half precision: absolute differences scale with activation size (Gemma residuals "
    "reach the hundreds), so only cosine and relative error are judged",
)


@dataclass(frozen=True)
class Engine:
    key: str
    title: str
    env: str | None  # the environment under validator/envs (None: ie_lab's own Python)
    tolerance: Tolerance
    naming: str  # how an ie_lab address becomes this engine's request


ENGINES: dict[str, Engine] = {
    e.key: e
    for e in (
        Engine(
            "hf",
            "transformers hooks",
            None,
            RAW_HF,
            "forward (pre-)hooks on the HF module each point is read from (module paths from ie_lab's binding, "
            "resolved here independently of ie_lab's taps), the model's own hidden_states for resid_pre / "
            "resid_post and its own attention weights for attn_probs",
        ),
        Engine(
            "tl",
            "TransformerLens 4 (Bridge)",
            "tl",
            RAW_HF,
            "TransformerBridge on unprocessed weights, compatibility mode with no_processing=True; native names "
            "from ie_lab.mappers (transformerlens_bridge) and legacy aliases (transformerlens), both asked",
        ),
        Engine(
            "nnsight",
            "nnsight 0.8",
            "nnsight",
            RAW_HF,
            "LanguageModel over the raw HF tree: module .inputs / .output at the same module paths as 'hf'",
        ),
        Engine(
            "nnterp",
            "nnterp 1.3",
            "nnterp",
            RAW_HF,
            "StandardizedTransformer accessors from ie_lab.mappers (nnterp), on nnsight 0.7",
        ),
        Engine(
            "interp",
            "interp-engine (eager)",
            "interp",
            RAW_HF,
            "interp-engine's eager backend, asked for the same address (its point names match ie_lab's, except "
            "where ENGINE_NAMES says otherwise); a reference only, run in its own environment",
        ),
        Engine(
            "vllm",
            "ie_lab vLLM",
            None,
            VLLM,
            "ie_lab.Session(path, backend='vllm') and its capture for the same address",
        ),
    )
}
DEFAULT_ENGINES = ("hf", "tl", "nnsight", "nnterp", "interp", "vllm")
# CI's subset: engines whose environments CI builds itself, on families chosen to discriminate (pre-norm,
# sandwich norms with soft-caps, learned positions + fused QKV, MoE routing).
CI_ENGINES = ("hf", "tl")
CI_FAMILIES = ("llama", "gemma2", "gpt2", "mixtral")


def layers_for(n_layers: int) -> list[int]:
    """First, middle and last layer; three-quarter depth too on trunks of 16 layers or more."""
    picks = {0, n_layers // 2, n_layers - 1}
    if n_layers >= 16:
        picks.add((3 * n_layers) // 4)
    return sorted(p for p in picks if 0 <= p < n_layers)


def judge(metrics: dict, tol: Tolerance) -> tuple[str, str]:
    """(verdict, the worst-violated limit) for one compared point."""
    checks = [
        ("max_abs", metrics["max_abs"], tol.max_abs, False),
        ("rel_err", metrics["rel_err"], tol.rel, False),
        ("cosine", 1.0 - metrics["cosine"], 1.0 - tol.cosine, True),
        ("worst_token_cosine", 1.0 - metrics["worst_token_cosine"], 1.0 - tol.worst_cosine, True),
    ]
    verdict, why = PASS, ""
    for name, value, limit, is_cos in checks:
        if value != value:  # NaN
            return FAIL, f"{name} is NaN"
        if value <= limit:
            continue
        shown = (1.0 - value) if is_cos else value
        bound = (1.0 - limit) if is_cos else limit
        rel = "<" if is_cos else ">"
        if value <= limit * tol.warn_factor:
            if verdict == PASS:
                verdict, why = WARN, f"{name} {shown:.6g} {rel} {bound:.6g}"
        else:
            return FAIL, f"{name} {shown:.6g} {rel} {bound:.6g}"
    return verdict, why


def worst(verdicts) -> str:
    order = {FAIL: 0, WARN: 1, PASS: 2, NOT_SERVED: 3, NOT_ASKED: 4, NOT_AVAILABLE: 5}
    vs = list(verdicts)
    return min(vs, key=lambda v: order[v]) if vs else NOT_ASKED


# Differences investigated and explained. The verdict stays what the numbers say; the note says whose it is.
_BLOOM = (
    "Bloom's attention and MLP modules add the residual themselves (dropout_add), so the module output is "
    "attention/MLP + residual; ie_lab reads the dense projection (the contribution alone)."
)
KNOWN: dict[tuple[str, str, str], str] = {
    **{
        ("bloom", p, e): _BLOOM
        + (
            " ie_lab.mappers bug: it translates this point to a name holding the sum."
            if e in ("tl", "nnterp")
            else " Validator's outer-module choice; not an ie_lab bug."
        )
        for p in ("attn_out", "attn_out_post", "mlp_out", "mlp_out_post")
        for e in ("hf", "nnsight", "tl", "nnterp")
    },
    ("bloom", "embeddings", "tl"): "TransformerBridge's legacy hook_embed on Bloom is taken after "
    "word_embeddings_layernorm (embed.hook_out matches): ie_lab.mappers bug.",
    ("granite", "embeddings", "tl"): "TransformerBridge's embed.hook_out / hook_embed include Granite's "
    "embedding_multiplier (ratio exactly 12, cosine 1): ie_lab.mappers bug.",
    ("granitemoe", "embeddings", "tl"): "as Granite: the bridge's embedding hooks include embedding_multiplier; "
    "ie_lab.mappers bug.",
    ("hunyuan_v1_dense", "q_norm_in", "tl"): "HunYuan applies RoPE before its QK-norm: legacy hook_q is the "
    "pre-RoPE projection, q_norm_in the rotated query (the bridge's "
    "q_norm.hook_in matches): ie_lab.mappers bug.",
    ("hunyuan_v1_dense", "k_norm_in", "tl"): "as q_norm_in: legacy hook_k is pre-RoPE: ie_lab.mappers bug.",
    ("opt", "attn_scores", "tl"): "TransformerBridge's hook_attn_scores on OPT holds the softmaxed pattern "
    "(rows sum to 1, nothing masked): an engine asymmetry; ie_lab.mappers should "
    "refuse the translation on OPT.",
}


# Found by the sweep over the coverage survey's families (`run --surveyed`): the family is the model type.
_MAMBA_HS = (
    "transformers' Mamba models put each layer's output in hidden_states from index 0 (no embedding entry), so "
    "hidden_states[L] is resid_post.L, not resid_pre.L: the hf engine's index convention, not an ie_lab bug "
    "(the module reads and interp-engine agree with ie_lab)."
)
_MPT = (
    "MPT's MLP module adds the residual itself (MptMLP(hidden, residual)), so its output is MLP + residual; "
    "ie_lab reads the down projection (the contribution alone)."
)
_DSA_MASK = (
    "DeepSeek sparse attention (indexer top-k): interp-engine and ie_lab disagree on which scores are masked; no "
    "module boundary lets plain hooks adjudicate. Open."
)
_TL_NO_MASK = (
    "TransformerBridge's hook_attn_scores holds unmasked scores on this family (every causal entry differs): "
    "the bridge's; ie_lab and interp-engine agree."
)
KNOWN.update(
    {
        **{(t, p, "hf"): _MAMBA_HS for t in ("mamba", "mamba2", "falcon_mamba") for p in ("resid_pre", "resid_post")},
        **{
            ("mpt", p, e): _MPT + " Validator's outer-module choice; not an ie_lab bug (ie_lab.mappers maps the "
            "module's names to resid_post)."
            for p in ("mlp_out", "mlp_out_post")
            for e in ("hf", "nnsight")
        },
        **{(t, "attn_scores", "interp"): _DSA_MASK for t in ("axk2", "deepseek_v32", "glm_moe_dsa")},
        **{
            (t, "attn_scores", "tl"): _TL_NO_MASK
            for t in ("afmoe", "gemma4_unified", "jamba", "laguna", "llama4", "llama4_text", "nanochat", "olmo_hybrid")
        },
        **{
            (t, "value", e): "Gemma 4 normalises values (v_norm, no scale) after v_proj: v_proj's output is not the "
            "value attention mixes. Validator's module choice; interp-engine agrees with ie_lab (ie_lab.mappers "
            "refuses hook_v / v.hook_out there)."
            for t in ("gemma4_unified", "gemma4_unified_text")
            for e in ("hf", "nnsight")
        },
        **{
            ("kolibri1_1", "value", e): "Kolibri 1.1's indexed (sparse) layers round keys and values to NVFP4 after "
            "v_proj (nvfp4_fake_quantize) before the kernel: ie_lab serves the rounded value the kernel mixes "
            "(attn_probs @ value = z, tests/test_families_structure_refusals.py), v_proj's output is the unrounded one. "
            "Validator's module choice; not an ie_lab bug."
            for e in ("hf", "nnsight")
        },
        **{
            ("mimo_v2_flash", "value", e): "MiMo-V2-Flash scales values by attention_value_scale after v_proj: ie_lab "
            "serves the scaled value attention mixes; "
            + (
                "interp-engine reads v_proj's output (its difference)."
                if e == "interp"
                else "validator's module choice."
            )
            for e in ("hf", "nnsight", "interp")
        },
        **{
            (t, "attn_gate", "interp"): "interp-engine's attn_gate is another tensor (pre-sigmoid, or per head, or "
            "the gate projection's raw width); no module boundary lets plain hooks adjudicate. Open."
            for t in (
                "afmoe",
                "hy_v4",
                "laguna",
                "qwen3_5",
                "qwen3_5_moe",
                "qwen3_5_moe_text",
                "qwen3_5_text",
                "qwen3_next",
            )
        },
    }
)
KNOWN.update(
    {
        (t, "attn_probs", e): "Granite SWA's eager kernel scales its output by sigmoid(logsumexp(scores) "
        "- sink) after the softmax (a per-head sink logit in the denominator), so the weights it returns, which "
        "plain hooks and interp-engine read, mixed with the values do not give its output. ie_lab's attn_probs is "
        "deliberately the pattern rebuilt with the sink (the returned weights times that factor, rows summing below "
        "1), so attn_probs @ value = z (tests/test_sink_scaled_kernel.py): a deliberate ie_lab choice, not a bug."
        for t in ("granite_swa", "granitemoe_swa")
        for e in ("hf", "interp", "nnsight")
    }
)
_SHARED_MLP = (
    "this Granite variant adds a shared MLP beside its MoE block (the layer sums them); ie_lab's mlp_out is the "
    "measured sum, the block_sparse_moe module's output is the MoE part alone. "
)
KNOWN.update(
    {
        **{
            (t, p, e): _SHARED_MLP
            + (
                "interp-engine reads the MoE part alone (its difference)."
                if e == "interp"
                else "Validator's outer-module choice; not an ie_lab bug."
            )
            for t in ("granitemoeshared", "granitemoe_swa", "granitemoehybrid")
            for p in ("mlp_out", "mlp_out_post")
            for e in ("hf", "nnsight", "interp")
        },
        **{
            ("gpt_neox_japanese", p, e): "GPT-NeoX-Japanese's last layer returns its attention dense bias beside the "
            "output and adds it with the residual (bias_dropout_add); ie_lab's attn_out includes it (the contribution "
            "as added). Validator's outer-module choice; not an ie_lab bug."
            for p in ("attn_out", "attn_out_post")
            for e in ("hf", "nnsight")
        },
        ("bitnet", "z", "interp"): "BitNet normalises the heads' output (attn_sub_norm) before o_proj; ie_lab's z is "
        "the kernel's output, attn_probs @ value (tested; the hf / nnsight rows read attn_sub_norm's input and agree), "
        "interp-engine reads o_proj's input, after the norm (its difference).",
        ("hy_v4", "attn_scores", "interp"): "HY-V4 (compressed-KV attention with sinks): interp-engine and ie_lab mask "
        "different score entries; no module boundary lets plain hooks adjudicate. Open.",
        **{
            (t, "attn_gate", "interp"): "a gate of one scalar per head (g_proj has n_heads outputs): ie_lab serves "
            "the factor z is multiplied by, each head's scalar repeated over its channels (attn_gate's registry width, "
            "n_heads x head_dim); interp-engine the n_heads scalars. A layout convention: the same numbers."
            for t in ("lfm3", "bailing_hybrid")
        },
        ("lfm3", "attn_out_post", "interp"): "LFM3 normalises attention's output (post_operator_norm) before the "
        "residual add: ie_lab's attn_out_post is that norm's output, which the hf and nnsight rows read at the module "
        "and agree with; interp-engine returns another tensor (its difference).",
        **{
            ("rwkv", p, "hf"): "transformers' RWKV, as its Mamba models, puts each block's output in hidden_states "
            "from index 0 (no embedding entry), and after the halving every rescale_every blocks: hidden_states[L] is "
            "resid_pre.L+1, not resid_pre.L (nor resid_post.L where the stream is halved after it). The hf engine's "
            "index convention, not an ie_lab bug (the nnsight module reads agree with ie_lab)."
            for p in ("resid_pre", "resid_post")
        },
        **{
            ("minimax", p, "interp"): "MiniMax scales each sublayer's output by its beta factor before the residual "
            "add; ie_lab's *_out_post is that product, what the add receives (as Granite's residual multiplier), and "
            "interp-engine returns the raw output (rel err 1 - 1/beta: 0.26 for the MLP's 1.35). Its difference."
            for p in ("attn_out_post", "mlp_out_post")
        },
        **{
            (t, "router_logits", "interp"): "Llama 4's router returns its top-1 sigmoid scores scattered into zeros "
            "first and its logits second; ie_lab's router_logits is the logits before top-k selection (the router's "
            "linear map of its input, measured by the binder and tested; the hf and nnsight rows read that element and "
            "agree), interp-engine reads the first element, the scores, which are ie_lab's expert_weights (compared there: "
            "ENGINE_NAMES). Its difference."
            for t in ("llama4", "llama4_text")
        },
        ("deepseek_v4", "z", "interp"): "DeepSeek-V4 rotates each head's output back (RoPE with -sin, K = V) before "
        "its grouped output projection; ie_lab's z is the kernel's output, attn_probs @ value (tested), interp-engine "
        "reads it after the rotation. No module boundary lets plain hooks adjudicate; a convention difference.",
    }
)


def known(family: str, point: str, engine: str) -> str:
    return KNOWN.get((family, point, engine), "")


# Tensors an engine serves under another point's name on a family: (family, ie_lab's point, engine) -> (the engine's
# point, why). The engine is asked for its name at the same layer and compared against ie_lab's point.
_LLAMA4_ROUTER = (
    "Llama 4's router returns its top-1 sigmoid scores scattered into zeros first and its logits second, and the "
    "experts' input is scaled by the first (measured by the binder): ie_lab's expert_weights. interp-engine's "
    "router_logits reads that first element (see the router_logits note), and its expert_weights asks the router for "
    "a third element it does not return, so its router_logits is asked for ie_lab's expert_weights."
)
ENGINE_NAMES: dict[tuple[str, str, str], tuple[str, str]] = {
    (t, "expert_weights", "interp"): ("router_logits", _LLAMA4_ROUTER) for t in ("llama4", "llama4_text")
}


def engine_name(family: str, point: str, engine: str) -> str:
    """The engine's point for ie_lab's point on this family (the same name unless ENGINE_NAMES says otherwise)."""
    return ENGINE_NAMES.get((family, point, engine), (point, ""))[0]
