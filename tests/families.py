"""Tiny random-weight causal LMs for many transformers families (built locally, no hub).

Usage::

    from tests.families import FAMILIES, make_config, make_model, make_tokenizer, saved_model_dir

Every fixture is deliberately *discriminating*: norm gains are re-drawn far from 1 (for
Gemma-style ``(1 + weight)`` norms the *effective* gain is), and every bias parameter is
re-drawn random and nonzero, so that e.g. a norm's input and output differ strongly, a
pre-norm and a post-norm cannot be confused, and a binder that forgets a bias is caught.

All models: vocab 512 (the local tokenizer's vocab), max_position_embeddings 256, fp32,
2 decoder layers (3 for families mixing sliding-window and global layers), head_dim >= 32,
GQA wherever the family supports it, MoE with 4 experts / top-2.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ie_lab import tiny

VOCAB_SIZE = 512
MAX_POS = 256
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SLIDING_WINDOW = 4  # small, so that with ~12-token prompts the window actually bites

_COMMON_TOKEN_IDS = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)

# Shared sizes. 4 query heads x 32, 2 KV heads (GQA), hidden 128.
_H, _NH, _NKV, _HD, _FF = 128, 4, 2, 32, 256

_LLAMA_LIKE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=_H,
    intermediate_size=_FF,
    num_hidden_layers=2,
    num_attention_heads=_NH,
    num_key_value_heads=_NKV,
    head_dim=_HD,
    max_position_embeddings=MAX_POS,
)

_SW3 = ["sliding_attention", "sliding_attention", "full_attention"]

# family -> (model_type for CONFIG_MAPPING, kwargs)
_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # ---------------- classic / fused-qkv / alibi families ----------------
    "gpt2": (
        "gpt2",
        dict(
            vocab_size=VOCAB_SIZE,
            n_positions=MAX_POS,
            n_embd=_H,
            n_layer=2,
            n_head=_NH,
            n_inner=_FF,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "gpt_neox": (
        "gpt_neox",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            num_hidden_layers=2,
            num_attention_heads=_NH,
            intermediate_size=_FF,
            max_position_embeddings=MAX_POS,
            use_parallel_residual=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    "gptj": (
        "gptj",
        dict(
            vocab_size=VOCAB_SIZE,
            n_positions=MAX_POS,
            n_embd=_H,
            n_layer=2,
            n_head=_NH,
            rotary_dim=16,
            n_inner=_FF,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    "bloom": ("bloom", dict(vocab_size=VOCAB_SIZE, hidden_size=_H, n_layer=2, n_head=_NH)),
    "opt": (
        "opt",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            num_hidden_layers=2,
            ffn_dim=_FF,
            num_attention_heads=_NH,
            max_position_embeddings=MAX_POS,
            word_embed_proj_dim=_H,
            dropout=0.0,
            do_layer_norm_before=True,
        ),
    ),
    # falcon-40b/180b style: new_decoder_architecture, GQA (num_kv_heads), ln_attn + ln_mlp, parallel block
    "falcon": (
        "falcon",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            num_hidden_layers=2,
            num_attention_heads=_NH,
            num_kv_heads=_NKV,
            new_decoder_architecture=True,
            parallel_attn=True,
            bias=True,
            alibi=False,
            ffn_hidden_size=_FF,
            max_position_embeddings=MAX_POS,
        ),
    ),
    # falcon-7b style: multi-query (1 kv head), parallel attn, one shared input_layernorm
    "falcon_mqa": (
        "falcon",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            num_hidden_layers=2,
            num_attention_heads=_NH,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            bias=False,
            alibi=False,
            ffn_hidden_size=_FF,
            max_position_embeddings=MAX_POS,
        ),
    ),
    # ---------------- llama-like ----------------
    "llama": ("llama", dict(_LLAMA_LIKE)),
    "mistral": ("mistral", dict(_LLAMA_LIKE, sliding_window=None)),
    "mistral_sliding": ("mistral", dict(_LLAMA_LIKE, sliding_window=SLIDING_WINDOW)),
    "mixtral": ("mixtral", dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2": ("qwen2", dict(_LLAMA_LIKE)),  # q/k/v biases always on in qwen2
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            _LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=_FF,
            decoder_sparse_step=1,
            norm_topk_prob=False,
        ),
    ),
    "qwen3": ("qwen3", dict(_LLAMA_LIKE)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            _LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
    ),
    "gemma": ("gemma", dict(_LLAMA_LIKE)),
    "gemma2": (
        "gemma2",
        dict(
            _LLAMA_LIKE,
            query_pre_attn_scalar=48,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=2.0,
            attn_logit_softcapping=0.5,
        ),
    ),  # small caps that bite
    "gemma3_text": (
        "gemma3_text",
        dict(
            _LLAMA_LIKE,
            num_hidden_layers=3,
            query_pre_attn_scalar=48,
            sliding_window=SLIDING_WINDOW,
            layer_types=list(_SW3),
        ),
    ),
    "olmo": ("olmo", dict(_LLAMA_LIKE)),
    "olmo2": ("olmo2", dict(_LLAMA_LIKE)),
    "olmoe": ("olmoe", dict(_LLAMA_LIKE, intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
    "phi": ("phi", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("phi3", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=MAX_POS)),
    "granite": (
        "granite",
        dict(
            _LLAMA_LIKE,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=8.0,
        ),
    ),
    "granitemoe": (
        "granitemoe",
        dict(
            _LLAMA_LIKE,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=8.0,
        ),
    ),
    "stablelm": ("stablelm", dict(_LLAMA_LIKE, use_qkv_bias=True)),
    "starcoder2": ("starcoder2", dict(_LLAMA_LIKE, use_bias=True, sliding_window=None)),
    "cohere": ("cohere", dict(_LLAMA_LIKE, logit_scale=0.25)),
    "cohere2": (
        "cohere2",
        dict(_LLAMA_LIKE, num_hidden_layers=3, logit_scale=0.25, sliding_window=SLIDING_WINDOW, layer_types=list(_SW3)),
    ),
    "glm": ("glm", dict(_LLAMA_LIKE)),
    "helium": ("helium", dict(_LLAMA_LIKE)),
    "smollm3": ("smollm3", dict(_LLAMA_LIKE, num_hidden_layers=2, no_rope_layers=[1, 0])),
    "exaone4": (
        "exaone4",
        dict(_LLAMA_LIKE, num_hidden_layers=3, sliding_window=SLIDING_WINDOW, layer_types=list(_SW3)),
    ),
    "ministral": (
        "ministral",
        dict(_LLAMA_LIKE, sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    "seed_oss": ("seed_oss", dict(_LLAMA_LIKE, attention_dropout=0.0, residual_dropout=0.0)),
    "arcee": ("arcee", dict(_LLAMA_LIKE)),
    "apertus": ("apertus", dict(_LLAMA_LIKE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "olmo3": ("olmo3", dict(_LLAMA_LIKE, num_hidden_layers=3, sliding_window=SLIDING_WINDOW, layer_types=list(_SW3))),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(_LLAMA_LIKE)),
    # ---------------- bound through measured wrappers (issue 20) ----------------
    # DBRX: the input norm, attention, residual add and pre-MLP norm sit in one norm_attn_norm module; the attention,
    # KV heads and experts are sized in nested configs; released checkpoints clip q, k, v at 8
    "dbrx": (
        "dbrx",
        dict(
            vocab_size=VOCAB_SIZE,
            d_model=_H,
            n_heads=_NH,
            n_layers=2,
            max_seq_len=MAX_POS,
            attn_config={"kv_n_heads": _NKV, "clip_qkv": 8.0, "rope_theta": 10000.0},
            ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        ),
    ),
    # GPT-NeoX-Japanese: the last layer's attention returns its output bias for the layer to add (skip-bias-add)
    "gpt_neox_japanese": (
        "gpt_neox_japanese",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            num_hidden_layers=2,
            num_attention_heads=_NH,
            intermediate_multiple_size=2,
            max_position_embeddings=MAX_POS,
        ),
    ),
    # CTRL: attention called as (x, x, x), an nn.Sequential MLP, a final norm named layernorm
    "ctrl": (
        "ctrl",
        dict(vocab_size=VOCAB_SIZE, n_embd=_H, n_layer=2, n_head=_NH, dff=_FF, n_positions=MAX_POS, resid_pdrop=0.0),
    ),
    # ---------------- MLA / hybrid ----------------
    "gpt_oss": (
        "gpt_oss",
        dict(
            _LLAMA_LIKE,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=_H,
            intermediate_size=_FF,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=_NH,
            num_key_value_heads=_NH,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=32,
            q_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            max_position_embeddings=MAX_POS,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            _LLAMA_LIKE,
            head_dim=_HD * 2,
            num_attention_heads=2,
            num_key_value_heads=1,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
}

# Families bound through measured wrappers (DBRX's norm_attn_norm, CTRL's Sequential MLP, GPT-NeoX-Japanese's
# skip-bias add): tests/test_families_wrapped.py checks those structures; the all-family sweeps run them too.
WRAPPED_FAMILIES: list[str] = ["dbrx", "ctrl", "gpt_neox_japanese"]
FAMILIES: list[str] = list(_SPECS)


# Variants of a family for one backend's tests (not in FAMILIES, so the all-family sweeps skip them).
# vLLM's Falcon sizes its MLP as 4 x hidden_size, as every released Falcon is, whatever ffn_hidden_size says.
VARIANTS = {
    "falcon_4h": ("falcon", {"ffn_hidden_size": 4 * _H}),
    "falcon_mqa_4h": ("falcon_mqa", {"ffn_hidden_size": 4 * _H}),
    # vLLM serves Cohere 2 only within its sliding window; a window that holds a test prompt and its generation
    "cohere2_w32": ("cohere2", {"sliding_window": 32}),
}


def make_config(family: str):
    """Return the (tiny, fp32) config object for ``family`` (a key of _SPECS or VARIANTS)."""
    from transformers import CONFIG_MAPPING

    base, over = VARIANTS.get(family, (family, {}))
    model_type, kwargs = _SPECS[base]
    kwargs = dict(kwargs, **over)
    for k, v in _COMMON_TOKEN_IDS.items():
        kwargs.setdefault(k, v)
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**kwargs)
    config.dtype = torch.float32
    # keep layer_types consistent with num_hidden_layers when the class derived it itself
    lt = getattr(config, "layer_types", None)
    if isinstance(lt, list) and len(lt) != config.num_hidden_layers:
        config.layer_types = lt[: config.num_hidden_layers]
    return config


# --------------------------------------------------------------------------------------
# Discriminating re-initialisation
# --------------------------------------------------------------------------------------
# The discriminating re-initialisation is the one tiny-model builder's (ie_lab.tiny, gains="discriminating"):
# these names stay here for the tests that check it.
_is_one_plus_weight_norm = tiny.is_one_plus_weight_norm
is_norm_module = tiny.is_norm_module


def make_model(family: str, attn_implementation: str | None = None):
    """Tiny random model (``torch.manual_seed(0)``) in eval mode, with discriminating norms/biases."""
    return tiny.build(make_config(family), gains="discriminating", attn_implementation=attn_implementation)


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3 == PAD_ID, BOS_ID, EOS_ID, UNK_ID

_NAMES = (
    "Mary John Alice Bob Tom Sarah James Emma Michael Anna David Laura Paul Kate Peter Lucy Mark Jane "
    "Daniel Rachel Chris Amy Steve Lisa Sam Nora Ben Eve Max Ida Leo Zoe"
).split()
_WORDS = (
    "the a an and or but if then when while after before because so as of to in on at by for with from "
    "into onto over under about between through during without within up down out off near far "
    "The A An And Or But If Then When While After Before Because So As In On At For With From "
    "I you he she it we they me him her us them my your his its our their this that these those "
    "He She It We They You This That These Those There Here What Who Where Why How Which "
    "is are was were be been being am has have had do does did will would can could shall should may might must "
    "not no yes all some any each every many much more most few less other another same such own "
    "went go goes going gone came come comes coming gave give gives giving given took take takes taken "
    "made make makes said say says told tell tells saw see sees seen got get gets found find finds "
    "wanted want wants liked like likes loved love loves knew know knows thought think thinks "
    "walked walk ran run sat sit stood stand looked look asked ask called call bought buy sold sell "
    "put brought bring left leave met meet played play read write wrote ate eat drank drink "
    "store shop school park house home garden office church market restaurant library station "
    "hospital beach city town street road room kitchen table door window car bus train book letter "
    "drink ball gift present cake apple bread water milk coffee tea dog cat bird fish horse tree "
    "flower money key phone computer picture song game friend mother father sister brother teacher "
    "doctor child children man woman boy girl people family team day night morning evening week year "
    "time today tomorrow yesterday good bad big small new old long short high low great little young "
    "happy sad hot cold red blue green black white first last next early late one two three four five "
    "six seven eight nine ten hundred thousand very really just also only still even again never always "
    "often sometimes now soon here there together alone capital country France Paris Germany Berlin "
    "Italy Rome Spain Madrid England London Japan Tokyo China Beijing Eiffel Tower located famous "
    "answer question true false number word name language English French German Spanish color "
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June "
    "July August September October November December"
).split()
_PUNCT = list(".,;:!?'\"()-") + ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]


@functools.lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for tok in _SPECIALS + _PUNCT + _NAMES + _WORDS:
        if tok not in vocab:
            vocab[tok] = len(vocab)
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    i = 0
    while len(vocab) < VOCAB_SIZE:  # pad to exactly VOCAB_SIZE with reserved tokens
        vocab[f"<extra_{i}>"] = len(vocab)
        i += 1
    return vocab


@functools.lru_cache(maxsize=1)
def make_tokenizer():
    """Word-level ``PreTrainedTokenizerFast`` with exactly 512 tokens (ids 0-3: <pad> <s> </s> <unk>).

    Whitespace pre-tokenization (words and punctuation runs), case-sensitive, unknown words -> <unk>.
    No BOS is added automatically (GPT-2-like); prepend ``tokenizer.bos_token_id`` yourself if wanted.
    Cached: the same object is returned on every call (don't mutate it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, tidies punctuation
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MAX_POS,
        padding_side="right",
    )


def saved_model_dir(family: str, tmp_root: str | os.PathLike, attn_implementation: str | None = None) -> str:
    """Save ``make_model(family)`` + tokenizer (safetensors) under ``tmp_root/family`` and return the path."""
    path = os.path.join(os.fspath(tmp_root), family)
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    model = make_model(family, attn_implementation=attn_implementation)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# A mixed checkpoint, so one engine serves every scheme vLLM's CPU build has a kernel for: attention's linears W8A8
# (int8 weights per channel, int8 activations per token as the model runs), the MLP's W4A16 (int4 weights per group
# of 128), symmetric for gate and up (vLLM fuses them, so they share a scheme), with zero points for down.
MIXED_SCHEMES = {
    "W8A8": [r"re:.*self_attn\.[qkvo]_proj$"],
    "W4A16": [r"re:.*mlp\.(gate|up)_proj$"],
    "W4A16_ASYM": [r"re:.*mlp\.down_proj$"],
}


def saved_quantized_dir(tmp_root, schemes=None, name: str = "llama_quantized", dtype=None) -> str:
    """``make_model("llama")`` written as a compressed-tensors checkpoint (``tiny.save_quantized``, MIXED_SCHEMES
    unless given) + tokenizer under ``tmp_root/name``; dtype: cast the model first (the scales are then stored in
    it)."""
    path = os.path.join(os.fspath(tmp_root), name)
    model = make_model("llama")
    tiny.save_quantized(model if dtype is None else model.to(dtype), path, schemes or MIXED_SCHEMES)
    make_tokenizer().save_pretrained(path)
    return path


__all__ = [
    "FAMILIES",
    "MIXED_SCHEMES",
    "saved_quantized_dir",
    "VOCAB_SIZE",
    "MAX_POS",
    "SLIDING_WINDOW",
    "make_config",
    "make_model",
    "make_tokenizer",
    "saved_model_dir",
    "is_norm_module",
]
