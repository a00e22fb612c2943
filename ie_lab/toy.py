"""Tiny random-weight models built locally from transformers config classes, for docs and offline trials.

They compute nothing meaningful (ie_lab/tiny.py builds them, as it builds every tiny model), but every point, shape and refusal behaves as on a real checkpoint of
the same family, and they build in a fraction of a second with no download.
"""

from __future__ import annotations

from typing import Any

_WORDS = (
    "the a an and or but when then after before because so of to in on at for with from into over under "
    "Mary John Alice Bob Carol Dave Emma Frank went gave took saw found made said store park school house garden "
    "drink book ball apple letter gift key happy sad angry calm day night morning evening was were is are had has "
    "it he she they we you I his her their our my one two three red blue green big small old new good bad "
    "user assistant system"
).split()
_PUNCT = [".", ",", "!", "?", "'", '"', ":", ";"]

# Every toy: vocabulary 512 (the tokenizer's), the tokenizer's special ids.
_TOKENS: dict[str, Any] = dict(vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# The Llama-style configs' shared sizes: 2 layers, hidden 128, 4 heads of 32 (GPT-2 states its own, in its own keys).
_SIZES: dict[str, Any] = dict(
    _TOKENS, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=32, max_position_embeddings=256
)

# family -> (model_type, the config's keys)
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(_SIZES, intermediate_size=256, num_key_value_heads=2)),
    "gemma2": (
        "gemma2",
        dict(
            _SIZES,
            intermediate_size=256,
            num_key_value_heads=2,
            query_pre_attn_scalar=32,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gpt2": ("gpt2", dict(_TOKENS, n_embd=128, n_layer=2, n_head=4, n_positions=256, n_inner=256)),
    "qwen3": ("qwen3", dict(_SIZES, intermediate_size=256, num_key_value_heads=2)),
    "mixtral": (
        "mixtral",
        dict(_SIZES, intermediate_size=128, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    ),
}
FAMILIES = tuple(_CONFIGS)


def tokenizer(size: int = 512, max_len: int = 256):
    """A word-level tokenizer over a small English vocabulary, filled up to `size` ids with placeholder words
    w<i> (unknown words map to <unk>); benchmarks/gpu_bench.py sizes it to a real config's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + _PUNCT + _WORDS)}
    if size < len(vocab):
        raise ValueError(f"tokenizer(size={size}): the English vocabulary alone has {len(vocab)} ids")
    for i in range(len(vocab), size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_len,
    )


def tiny_model(family: str = "llama", seed: int = 0):
    """(model, tokenizer): 2 layers, hidden 128, 4 heads of 32, vocabulary 512, fp32, eval mode; built by the one
    tiny-model builder (ie_lab.tiny.build) from this module's configs."""
    from transformers import CONFIG_MAPPING

    from .tiny import build

    if family not in _CONFIGS:
        raise ValueError(f"no toy config for {family!r}; choose one of {FAMILIES}")
    model_type, keys = _CONFIGS[family]
    config = CONFIG_MAPPING[model_type](**keys)
    return build(config, seed=seed), tokenizer()
