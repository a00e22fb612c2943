"""Smoke tests for the tiny family fixtures in tests/families.py."""

import pytest
import torch

from tests.families import (
    FAMILIES,
    VOCAB_SIZE,
    _is_one_plus_weight_norm,
    is_norm_module,
    make_config,
    make_model,
    make_tokenizer,
    saved_model_dir,
)

torch.set_num_threads(1)

BATCH, SEQ = 2, 12
ALL = FAMILIES  # every fixture, the ones bound through measured wrappers too


def _ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, VOCAB_SIZE, (BATCH, SEQ), generator=g)


@pytest.mark.parametrize("family", ALL)
def test_forward_and_norms_discriminating(family):
    model = make_model(family)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32

    records = []

    def hook(mod, args, out):
        x = args[0] if args else None
        y = out[0] if isinstance(out, tuple) else out
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape:
            rel = ((y.float() - x.float()).norm() / x.float().norm().clamp_min(1e-12)).item()
            records.append((type(mod).__name__, rel))

    handles = [m.register_forward_hook(hook) for m in model.modules() if is_norm_module(m)]
    try:
        with torch.no_grad():
            out = model(_ids())
    finally:
        for h in handles:
            h.remove()

    logits = out.logits
    assert logits.shape == (BATCH, SEQ, VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert records, f"{family}: no norm module was called"
    assert max(r for _, r in records) > 0.5, records


@pytest.mark.parametrize("family", ALL)
def test_config_shape_rules(family):
    cfg = make_config(family).get_text_config()
    assert cfg.vocab_size == VOCAB_SIZE
    assert cfg.num_hidden_layers in (2, 3, 4)
    model = make_model(family)
    head_dims = {
        getattr(m, "head_dim", None) or getattr(m, "head_size", None)
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and (hasattr(m, "head_dim") or hasattr(m, "head_size"))
    } - {None}
    if head_dims:
        assert min(head_dims) >= 32, head_dims


@pytest.mark.parametrize("family", ALL)
def test_norm_gains_and_biases_far_from_defaults(family):
    model = make_model(family)
    for name, m in model.named_modules():
        if not is_norm_module(m):
            continue
        w = getattr(m, "weight", None)
        if isinstance(w, torch.nn.Parameter):
            gain = (1.0 + w) if _is_one_plus_weight_norm(type(m)) else w
            assert ((gain - 1).abs() > 0.3).float().mean() > 0.9, name
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert (p != 0).all(), name


def test_tokenizer():
    tok = make_tokenizer()
    assert tok is make_tokenizer()  # cached
    assert len(tok) <= VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    enc = tok("When Mary and John went to the store")
    assert len(enc.input_ids) == 8
    assert tok.unk_token_id not in enc.input_ids
    batch = tok(["When Mary and John went to the store", "Mary"], padding=True, return_tensors="pt")
    assert batch.input_ids.shape == (2, 8)
    assert batch.attention_mask[1].tolist() == [1] + [0] * 7
    assert tok.decode(enc.input_ids) == "When Mary and John went to the store"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "qwen3_moe"])
def test_saved_model_dir_roundtrip(family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = saved_model_dir(family, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert (
        tok("When Mary and John went to the store").input_ids
        == make_tokenizer()("When Mary and John went to the store").input_ids
    )
    ref = make_model(family)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("family", ALL)
def test_eager_matches_default_attention(family):
    """The default (usually sdpa) and eager fixtures are the same weights and agree on non-pad positions."""
    ids = _ids()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding on the second row
    default, eager = make_model(family), make_model(family, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    if getattr(default.config, "attn_logit_softcapping", None) and default.config._attn_implementation == "sdpa":
        pytest.skip("transformers' sdpa kernel ignores the attention softcap, so the two genuinely differ")
    with torch.no_grad():
        a = default(ids, attention_mask=mask).logits
        b = eager(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-4, rtol=1e-4)
