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


# ---- toy chat models: one tokenizer per chat convention (docs/GENERATION.md "Chat conventions") ----------------

# Templates written for the toys, each following one convention as the real ones do (shortened).
CHAT_TEMPLATES = {
    # gpt-oss's harmony: every message a <|start|>role<|channel|>...<|message|>...<|end|> block; reasoning on the
    # analysis channel, the answer on final, a tool call on commentary to its recipient, ended by <|call|>
    "harmony": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
        "{%- for tc in m.tool_calls or [] -%}<|start|>assistant<|channel|>commentary to=functions.{{ tc.name }} "
        "<|constrain|>json<|message|>{{ tc.arguments }}<|call|>{%- endfor -%}"
        "{%- if m.content -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}"
        "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
    ),
    # Qwen3's: the reasoning between <think> markers from a reasoning_content field, an enable_thinking switch
    "think": (
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\n' }}"
        "{%- if m.reasoning_content is string -%}"
        "{{ '<think>\n' + m.reasoning_content.strip() + '\n</think>\n\n' }}{%- endif -%}"
        "{{ m.content + '<|im_end|>\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}"
        "{%- endif -%}{%- endif -%}"
    ),
    # Llama 3's: headers, each turn ended by <|eot_id|>; no reasoning convention
    "llama3": (
        "{{ bos_token }}{%- for m in messages -%}"
        "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
    ),
}
CHAT_MARKERS = {
    "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"),
    "think": ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


def chat_tokenizer(convention: str = "harmony", max_len: int = 256):
    """A byte-level BPE tokenizer (any text has ids, as on a real checkpoint) trained here on the toy vocabulary,
    with one convention's marker tokens added as special tokens and its chat template (CHAT_TEMPLATES)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if convention not in CHAT_TEMPLATES:
        raise ValueError(f"no toy chat template for {convention!r}; choose one of {tuple(CHAT_TEMPLATES)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    text = " ".join(_WORDS) + " analysis final commentary functions weather city Paris rains umbrella"
    tok.train_from_iterator([text] * 4, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=max_len
    )
    out.add_special_tokens({"additional_special_tokens": list(CHAT_MARKERS[convention])})
    out.chat_template = CHAT_TEMPLATES[convention]
    return out


def chat_model(convention: str = "harmony", seed: int = 0):
    """(model, tokenizer): the llama toy sized to chat_tokenizer(convention)'s vocabulary."""
    from transformers import CONFIG_MAPPING

    from .tiny import build

    tok = chat_tokenizer(convention)
    model_type, keys = _CONFIGS["llama"]
    config = CONFIG_MAPPING[model_type](**dict(keys, vocab_size=len(tok)))
    return build(config, seed=seed), tok
