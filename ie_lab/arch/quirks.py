"""The quirks table: the only place where a model_type selects behaviour.

Everything here is a fact a config does not state but the module tree does. On a live model the
binder measures these facts on a real block and never reads this table; config-only callers
(the cheat sheet, sizing) use it instead. tests/test_arch_facts.py checks, family by family, that
this table agrees with what the binder measures, so an entry cannot silently go stale.
"""

from __future__ import annotations

# Attention and MLP read the same layer input (no residual between the sublayers), whatever the config says.
ALWAYS_PARALLEL = frozenset({"gptj", "phi", "cohere", "cohere2"})

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

# Families whose MLP is up -> act -> down with no gate branch.
UNGATED_MLP = frozenset(
    {"gpt2", "gpt_neox", "gptj", "bloom", "opt", "falcon", "phi", "starcoder2", "gpt_bigcode", "codegen",
     "arcee", "apertus"}
)

# Families that always normalise queries and keys (others say so with a config key).
ALWAYS_QK_NORM = frozenset({"qwen3", "qwen3_moe", "olmo2", "olmo3", "olmoe", "gemma3", "gemma3_text", "exaone4",
                            "apertus", "hunyuan_v1_dense"})

# Families whose config carries a sliding_window key that the attention does not use for every layer
# (layer_types or use_sliding_window say which layers slide instead).
WINDOW_KEY_UNUSED = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
