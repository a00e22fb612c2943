import os

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, ids
from tests.families import make_model, make_tokenizer, saved_model_dir

# transformers >= 5.21 refuses sdpa on Gemma 2 (it would drop the softcap) and builds it eager: there is then no
# silently different kernel to warn about or to compare against.
_GEMMA2_SDPA = __import__("transformers").Gemma2PreTrainedModel._supports_sdpa
_no_gemma2_sdpa = pytest.mark.skipif(not _GEMMA2_SDPA, reason="this transformers refuses sdpa on Gemma 2")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_model_dir("qwen3", tmp_path_factory.mktemp("models"))


def test_load_from_a_local_folder_equals_the_object(saved):
    from_disk = ie_lab.load(saved, quiet=True)
    in_memory = ie_lab.load(make_model("qwen3"), make_tokenizer())
    assert from_disk.tokenizer is not None
    x = ids()
    a = ie_lab.capture(from_disk, x, ["resid_post.1", "q_norm_out.0"])
    b = ie_lab.capture(in_memory, x, ["resid_post.1", "q_norm_out.0"])
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    assert_clean(from_disk)


def test_text_input_uses_the_tokenizer(saved):
    lm = ie_lab.load(saved, quiet=True)
    c = ie_lab.capture(lm, "When Mary and John went to the store", ["resid_post.0"])
    assert (
        c.str_tokens[0][:3] == lm.tokenizer.convert_ids_to_tokens(lm.tokenizer("When Mary and John")["input_ids"])[:3]
    )
    assert c["resid_post.0"].shape[1] == len(c.str_tokens[0])


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(ie_lab.InputError, match="no folder at"):
        ie_lab.load(str(tmp_path / "nope"))


def test_pickle_only_folder_is_refused(tmp_path, saved):
    import shutil

    d = tmp_path / "pickled"
    shutil.copytree(saved, d)
    os.remove(d / "model.safetensors")
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(ie_lab.InputError, match="safetensors only"):
        ie_lab.load(str(d))


def test_unknown_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ie_lab.InputError, match="could not load"):
        ie_lab.load("nobody-here/not-a-model", quiet=True)


def test_missing_device_and_bad_dtype(saved):
    if not torch.cuda.is_available():
        with pytest.raises(ie_lab.InputError, match="no CUDA device"):
            ie_lab.load(saved, device="cuda", quiet=True)
    with pytest.raises(ie_lab.InputError, match="unknown dtype"):
        ie_lab.load(saved, dtype="float8", quiet=True)


def test_dtype_by_name(saved):
    lm = ie_lab.load(saved, dtype="bfloat16", quiet=True)
    assert lm.dtype == torch.bfloat16
    c = ie_lab.capture(lm, ids(), ["resid_post.0"])
    assert c["resid_post.0"].dtype == torch.bfloat16


def test_vllm_backend_refuses_a_model_object():
    # vLLM builds its own copy of the weights from a folder or id; an in-memory object cannot be handed over.
    with pytest.raises(ie_lab.CapabilityUnsupported, match="vLLM"):
        ie_lab.load(make_model("llama"), backend="vllm")


def test_raw_hf_model_is_accepted_directly():
    m = make_model("gpt2")
    c = ie_lab.capture(m, ids(), ["resid_post.0"])
    assert c["resid_post.0"].shape == (2, 11, 128)


# ---- the answer: the attention kernel is chosen from the model's facts -----------------------------------------


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _raw(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    return saved_model_dir("gemma2", tmp_path_factory.mktemp("gemma2"))


def test_gemma2_folder_computes_its_attention_softcap(gemma2_dir, capsys):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ie_lab.ComputeDiffersWarning)  # the chosen kernel drops nothing
        lm = ie_lab.load(gemma2_dir)
    line = capsys.readouterr().out
    assert "attention eager" in line and "attn_logit_softcapping" in line, line
    x = ids()
    got = _logits(lm.hf, x)
    torch.testing.assert_close(got, _logits(_raw(gemma2_dir, attn_implementation="eager"), x), rtol=0, atol=1e-6)
    # the plausible wrong answer (what sdpa, transformers' default on 5.19, computes) is caught by that comparison
    if _GEMMA2_SDPA:
        assert (got - _logits(_raw(gemma2_dir, attn_implementation="sdpa"), x)).abs().max() > 1e-3
    # and ie_lab's own captures come from that forward
    c = ie_lab.capture(lm, x, ["lm_head"])
    torch.testing.assert_close(c["lm_head"], lm.hf.lm_head(lm.hf.model(x).last_hidden_state), rtol=0, atol=1e-6)
    assert_clean(lm)


def test_session_on_a_gemma2_folder_uses_the_same_kernel(gemma2_dir):
    with ie_lab.Session(gemma2_dir, backend="eager", progress=False) as s:
        got = s.run(lambda lm: _logits(lm.hf, ids()))
    torch.testing.assert_close(got, _logits(_raw(gemma2_dir, attn_implementation="eager"), ids()), rtol=0, atol=1e-6)


@_no_gemma2_sdpa
def test_forcing_sdpa_on_gemma2_warns_and_names_the_difference(gemma2_dir):
    with pytest.warns(ie_lab.ComputeDiffersWarning, match="attn_logit_softcapping"):
        lm = ie_lab.load(gemma2_dir, attn_implementation="sdpa", quiet=True)
    # what was asked for is what runs: the raw model with the same option
    torch.testing.assert_close(
        _logits(lm.hf, ids()), _logits(_raw(gemma2_dir, attn_implementation="sdpa"), ids()), rtol=0, atol=1e-6
    )


@_no_gemma2_sdpa
def test_a_user_built_sdpa_object_is_detected_and_warned_about():
    import warnings

    with pytest.warns(ie_lab.ComputeDiffersWarning, match="set_attn_implementation"):
        ie_lab.load(make_model("gemma2"), make_tokenizer(), quiet=True)
    with pytest.warns(ie_lab.ComputeDiffersWarning, match="sdpa"):
        ie_lab.capture(make_model("gemma2"), ids(), ["resid_post.0"])  # a raw object handed to an operation
    with warnings.catch_warnings():
        warnings.simplefilter("error", ie_lab.ComputeDiffersWarning)
        ie_lab.load(make_model("gemma2", attn_implementation="eager"), quiet=True)
        ie_lab.load(make_model("llama"), quiet=True)  # sdpa drops nothing there


def test_attn_implementation_on_a_model_object_is_refused_with_the_fix():
    with pytest.raises(ie_lab.CapabilityUnsupported, match="set_attn_implementation"):
        ie_lab.load(make_model("llama"), attn_implementation="eager")


# ---- the caller's object is never changed behind their back ---------------------------------------------------


def test_dtype_on_a_model_object_works_on_a_copy(capsys):
    m = make_model("llama")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    lm = ie_lab.load(m, make_tokenizer(), dtype="bfloat16")
    assert "copy" in capsys.readouterr().out
    assert lm.hf is not m and lm.dtype == torch.bfloat16
    for k, v in m.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    # the copy computes what the raw model cast to bfloat16 computes
    import copy

    ref = copy.deepcopy(m).to(torch.bfloat16)
    assert torch.equal(_logits(lm.hf, ids()), _logits(ref, ids()))


def test_same_dtype_and_device_keeps_the_object():
    m = make_model("llama")
    lm = ie_lab.load(m, dtype="float32", device="cpu", quiet=True)
    assert lm.hf is m


def _modes(m):
    return {name: sub.training for name, sub in m.named_modules()}


def test_training_mode_is_restored_by_release(capsys):
    m = make_model("llama").train()
    m.model.layers[0].eval()  # a mixed state must come back exactly, module by module
    want = _modes(m)
    lm = ie_lab.load(m, make_tokenizer())
    assert "release" in capsys.readouterr().out
    assert not any(_modes(m).values())  # dropout off while ie_lab works
    lm.release()
    assert _modes(m) == want


def test_training_mode_is_restored_at_session_close():
    m = make_model("llama").train()
    want = _modes(m)
    s = ie_lab.Session(m, backend="eager", tokenizer=make_tokenizer(), progress=False)
    assert not m.training
    s.close()
    assert _modes(m) == want


# ---- families the binder does not bind are refused with what is missing and what to do instead ----------------

_S = dict(vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_UNBOUND = {
    # config class name -> (kwargs, a word the refusal must name)
    # (RWKV was the example here until its recurrent blocks bound: tests/test_families_rwkv.py)
    "OpenAIGPTConfig": (dict(n_embd=64, n_layer=2, n_head=4, n_positions=64), "post-norm"),
    "BartConfig": (
        dict(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4),
        "encoder-decoder",
    ),
}


def _unbound_model(name):
    import transformers
    from transformers import AutoModelForCausalLM

    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cls(**_S, **_UNBOUND[name][0]), dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(_UNBOUND))
def test_unbound_family_is_refused_with_an_instead(name):
    model = _unbound_model(name)
    with pytest.raises(ie_lab.IELabError) as e:
        ie_lab.load(model, quiet=True)
    text = str(e.value)
    assert _UNBOUND[name][1] in text, text
    assert "Instead:" in text and "register_forward_hook" in text, text


def test_nemotron_h_binds_from_the_legacy_pattern_names():
    """Nemotron-H was refused here (a single-sublayer trunk); it binds now, also from a config that spells its block
    types the legacy way (mamba / attention, as hybrid_override_pattern's M and *): a Mamba-only block, then an
    attention-only block, neither with resid_mid (tests/test_families_hybrid.py covers the points per kind)."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = transformers.NemotronHConfig(
        **_S,
        **dict(
            hidden_size=64,
            layers_block_type=["mamba", "attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            ssm_state_size=8,
            chunk_size=16,
            n_routed_experts=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
    )
    lm = ie_lab.load(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), quiet=True)
    # a Mamba-only block (a mixer, no MLP), then an attention-only block (no mixer, no MLP)
    assert [(bool(lb.mixer_kind), lb.has_mlp) for lb in lm.binding.layers] == [(True, False), (False, False)]
    for L, point in ((0, "z"), (1, "mixer_out"), (0, "resid_mid"), (1, "mlp_out")):
        with pytest.raises(ie_lab.PointAbsent):
            ie_lab.capture(lm, ids(1, 6), [f"{point}.{L}"])


def test_unbound_folder_is_refused_before_weights_are_read(tmp_path):
    # (Mamba, then RWKV, were the example here until their trunks bound: tests/test_families_hybrid.py and
    # tests/test_families_rwkv.py; an encoder-decoder's decoder stack is refused from its config alone.)
    path = str(tmp_path / "bart")
    _unbound_model("BartConfig").save_pretrained(path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"not weights")  # reading them would fail differently
    with pytest.raises(ie_lab.ArchitectureUnsupported, match="encoder-decoder.* Instead:"):
        ie_lab.load(path, quiet=True)


def test_linear_attention_layers_are_named_where_attention_points_are_refused():
    """Qwen3-Next's linear-attention layers bind as mixer layers (they were refused at load): an attention point
    asked of one is refused naming the layer's kind (tests/test_families_hybrid.py covers the points served)."""
    lm = ie_lab.load(make_model("qwen3_next"), quiet=True)
    with pytest.raises(ie_lab.PointAbsent, match="layer 0 is a linear_attention mixer layer"):
        ie_lab.capture(lm, ids(1, 6), ["attn_out.0"])


# ---- a tokenizer that is custom code is refused, or loaded when trusted; never silently replaced ---------------

_TOKENIZER_CODE = """
open({marker!r}, "w").write("imported")
from transformers import PreTrainedTokenizerFast


class FolderTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture
def custom_tokenizer_dir(tmp_path, saved):
    import json
    import shutil

    d = tmp_path / "custom_tok"
    shutil.copytree(saved, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tok_code.FolderTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "CODE_RAN"
    (d / "tok_code.py").write_text(_TOKENIZER_CODE.format(marker=str(marker)))
    return str(d), marker


def test_custom_code_tokenizer_is_refused_before_any_code_runs(custom_tokenizer_dir):
    path, marker = custom_tokenizer_dir
    with pytest.raises(ie_lab.InputError, match="trust_remote_code=True"):
        ie_lab.load(path, quiet=True)
    with pytest.raises(ie_lab.InputError, match="FolderTokenizer"):
        ie_lab.load(make_model("qwen3"), tokenizer=path, quiet=True)  # the same folder named as tokenizer=
    assert not marker.exists()


def test_custom_code_tokenizer_loads_when_trusted(custom_tokenizer_dir, monkeypatch, tmp_path):
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # keep the copied module in tmp
    path, marker = custom_tokenizer_dir
    lm = ie_lab.load(path, trust_remote_code=True, quiet=True)
    assert type(lm.tokenizer).__name__ == "FolderTokenizer" and marker.exists()


def test_a_folder_without_a_tokenizer_says_so(tmp_path, capsys):
    path = str(tmp_path / "no_tok")
    make_model("qwen3").save_pretrained(path)
    lm = ie_lab.load(path)
    assert lm.tokenizer is None and "no tokenizer found" in capsys.readouterr().out
    with pytest.raises(ie_lab.InputError, match="without a tokenizer"):
        ie_lab.capture(lm, "some text", ["resid_post.0"])
