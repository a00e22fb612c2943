"""torchao checkpoints (docs/LOADING.md, Quantized checkpoints): transformers writes them as safetensors (torchao's
tensors flattened into their integers and scales), ie_lab loads them as transformers does, and the points are what
the quantized model computes (recomputed by hand from the int8 weights and scales on disk), not the unquantized
model's; the gradient verdict says what the quantization blocks, measured; the sizer's bytes per weight agree with
the file; a pickled torchao checkpoint is refused by the safetensors-only rule. On vLLM (one engine, on the same
int8 weight-only checkpoint) every point equals eager's within float32's rounding; what vLLM is not checked on is
refused before the engine.

The cases of tests/test_quantized_torchao.py, imported there where torchao is importable (see there why it is
usually a child process)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import ie_lab
from tests.families import make_model, make_tokenizer

TEXT = "the cat sat on the mat and Mary went to the store"


def _save(root, name: str, config, dtype=torch.float32) -> str:
    """make_model('llama') quantized by transformers' TorchAoConfig and saved as safetensors, with the tokenizer."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    base, path = os.path.join(root, "base"), os.path.join(root, name)
    if not os.path.isdir(base):
        make_model("llama").save_pretrained(base)
    q = AutoModelForCausalLM.from_pretrained(base, quantization_config=TorchAoConfig(config), dtype=dtype)
    q.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    from torchao.quantization import Int8WeightOnlyConfig

    path = _save(tmp_path_factory.mktemp("torchao"), "int8wo", Int8WeightOnlyConfig())
    return path, load_file(os.path.join(path, "model.safetensors")), ie_lab.load(path, quiet=True)


def _weight(sd: dict, name: str) -> torch.Tensor:
    """An Int8Tensor weight rebuilt by hand: int8 values times one scale per output row (symmetric: zero points 0)."""
    assert not sd[f"{name}._weight_zero_point"].any()
    return sd[f"{name}._weight_qdata"].float() * sd[f"{name}._weight_scale"]


def test_int8_points_are_what_the_quantized_model_computes(int8):
    path, sd, lm = int8
    assert json.load(open(os.path.join(path, "config.json")))["quantization_config"]["quant_method"] == "torchao"
    assert sd["model.layers.1.mlp.up_proj._weight_qdata"].dtype == torch.int8
    c = ie_lab.capture(lm, TEXT, ["mlp_in.1", "mlp_out.1"])
    x = c["mlp_in.1"][0]
    gate, up, down = (_weight(sd, f"model.layers.1.mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert torch.allclose(c["mlp_out.1"][0], want, atol=1e-5, rtol=1e-5)
    # the original float weights compute something else: the quantization is in effect
    orig = make_model("llama").model.layers[1].mlp
    with torch.no_grad():
        assert (orig(x) - want).abs().max() > 100 * 1e-5
    plain = ie_lab.load(make_model("llama"), make_tokenizer(), quiet=True)
    got, before = (ie_lab.capture(m, TEXT, ["resid_post.1"])["resid_post.1"] for m in (lm, plain))
    assert (got - before).abs().max() > 1e-3


def test_load_line_names_torchao_tensors(int8, capsys):
    path, _, lm = int8
    assert type(lm.hf.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"  # torchao's, as loaded
    ie_lab.load(path)
    line = capsys.readouterr().out
    assert "quantized (torchao: 12 linears Int8Tensor: int8 weights, blocks of 1x128; 2 linears Int8Tensor" in line


def test_weight_only_gradient_is_exact(int8):
    path, _, _ = int8
    with ie_lab.Session(path, progress=False) as s:
        assert s.grad_support().available, s.grad_support()
        hf = s._lm.hf
        emb = hf.get_input_embeddings()(torch.tensor([[5, 9, 17, 33]])).detach()
        d = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))

        def f(e):
            return hf(inputs_embeds=e).logits[0, -1, 7]

        e = emb.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(e), e)
        with torch.no_grad():
            fd = (f(emb + 1e-3 * d) - f(emb - 1e-3 * d)) / 2e-3
        assert torch.isclose((g * d).sum(), fd, rtol=2e-2, atol=1e-4)


def test_dynamic_activation_quantization_blocks_the_gradient(tmp_path):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    path = _save(tmp_path, "w8a8", Int8DynamicActivationInt8WeightConfig())
    with ie_lab.Session(path, progress=False) as s:
        v = s.grad_support()
        up = s._lm.hf.model.layers[0].mlp.up_proj
    assert not v.available
    assert "model.layers.0.self_attn.q_proj" in str(v) and "torchao's int8" in str(v)
    assert "Int8WeightOnlyConfig" in str(v)
    # what the verdict says: the linear's output is cut from its input
    assert not up(torch.randn(1, 3, 128, requires_grad=True)).requires_grad


def test_int4_intx_loads_and_sizer_bytes_agree_with_the_file(tmp_path):
    """int4 weight-only on CPU is IntxWeightOnlyConfig (torchao's Int4WeightOnlyConfig packings need CUDA): each
    int4 value stored as an int8, with a bfloat16 scale and an int8 zero point per group of 32, exactly."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    from ie_lab.sizing import count_params, quantization, resolve_config

    cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    path = _save(tmp_path, "int4", cfg, dtype=torch.bfloat16)
    sd = load_file(os.path.join(path, "model.safetensors"))
    q = sd["model.layers.0.mlp.up_proj._weight_qdata"]
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    on_disk = sum(t.numel() * t.element_size() for k, t in sd.items() if "._weight_" in k)
    qc = quantization(json.load(open(os.path.join(path, "config.json")))["quantization_config"])
    assert count_params(resolve_config(path)).quantizable * qc.bits_per_weight / 8 == on_disk
    lm = ie_lab.load(path, quiet=True)  # in the checkpoint's bfloat16: its torchao weights keep that dtype
    assert type(lm.hf.model.layers[0].mlp.up_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert lm.hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ie_lab.capture(lm, TEXT, ["resid_post.1"])["resid_post.1"].isfinite().all()
    with pytest.raises(ie_lab.CapabilityUnsupported, match="dtype=torch.bfloat16"):
        ie_lab.load(path, dtype=torch.float32, quiet=True)


def test_a_pickled_torchao_checkpoint_is_refused_by_the_safetensors_rule(tmp_path):
    path = str(tmp_path / "pickled")
    make_model("llama").config.save_pretrained(path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = {
        "quant_method": "torchao",
        "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}},
    }
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()  # never opened: refused before any file is read
    with pytest.raises(ie_lab.InputError, match="safetensors only") as e:
        ie_lab.load(path, make_tokenizer(), quiet=True)
    assert "torchao checkpoint saved as a pickle" in str(e.value) and "safe_serialization=True" in str(e.value)


# vLLM in float32, the checkpoint's dtype (torchao's tensors run in it, unlike compressed-tensors' kernels on
# vLLM): the two engines sum in other orders (vLLM's fused qkv / gate_up matmuls, its attention and norm kernels),
# a few float32 roundings (6e-8 each) per operation over two layers; measured, every point within 6e-7 of its size
# (root mean squares), so 1e-5 allows 15x that, and is 1000x below how far the unquantized model's points are
# (1.5-2.5% on the tiny Llama: int8 per-row rounding) or a neighbouring layer's.
VLLM_REL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_vllm_serves_int8_weight_only_as_eager_computes_it(int8):
    """One engine on the int8 weight-only checkpoint; the points equal eager's on the same checkpoint (which the
    first test rebuilt by hand from the file), the unquantized model's are far outside, and so is the neighbouring
    layer's; greedy tokens and their log-probabilities equal eager's."""
    pytest.importorskip("vllm")
    path, _, lm = int8
    addrs = ["attn_out.1", "mlp_in.1", "mlp_out.0", "mlp_out.1", "resid_post.1", "final_norm"]
    with ie_lab.Session(path, backend="vllm", progress=False, replace=False) as s:
        c = s.capture(TEXT, addrs)
        gen = s.generate(TEXT, 4)
    ce = ie_lab.capture(lm, TEXT, addrs)
    plain = ie_lab.load(make_model("llama"), make_tokenizer(), quiet=True)
    cp = ie_lab.capture(plain, TEXT, addrs)
    far = {a: _rel(c[a], ce[a]) for a in addrs if _rel(c[a], ce[a]) > VLLM_REL}
    assert not far, f"vLLM differs from eager on the same torchao checkpoint: {far}"
    # plausible wrong answers: the unquantized model's points, the neighbouring layer's MLP
    for a in ["mlp_out.1", "resid_post.1", "final_norm"]:
        assert _rel(cp[a], ce[a]) > 100 * VLLM_REL, (a, _rel(cp[a], ce[a]))
    assert _rel(c["mlp_out.0"], ce["mlp_out.1"]) > 100 * VLLM_REL
    want = ie_lab.generate(lm, TEXT, 4)
    assert gen.ids == want.ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(gen.steps, want.steps)) < 1e-5


def test_vllm_refuses_the_torchao_configs_it_does_not_serve(int8):
    """Read from the config before any engine starts (ie_lab/vllm/quantized.py), each naming why and what to use."""
    from transformers import LlamaConfig

    from ie_lab.vllm.quantized import check_quantized

    def quant_type(kind: str, **data) -> dict:
        return {"quant_method": "torchao", "quant_type": {"default": {"_type": kind, "_data": data}}}

    cases = [
        (quant_type("Int8DynamicActivationInt8WeightConfig"), "up to 2%"),
        (quant_type("Int4WeightOnlyConfig"), "need CUDA"),
        (quant_type("FqnToConfig"), "merged modules"),
        (quant_type("IntxWeightOnlyConfig", intx_packing_format={"_data": "OPAQUE"}), "packing OPAQUE"),
        ({**quant_type("Int8WeightOnlyConfig"), "modules_to_not_convert": ["model.layers.0.mlp.up_proj"]}, "merged"),
        ({"quant_method": "bitsandbytes"}, "no bitsandbytes method"),
    ]
    for qc, why in cases:
        with pytest.raises(ie_lab.CapabilityUnsupported, match=why) as e:
            check_quantized(LlamaConfig(quantization_config=qc, dtype="float32"), torch.float32)
        assert "backend='eager'" in str(e.value)
    served = quant_type("IntxWeightOnlyConfig", intx_packing_format={"_data": "UNPACKED_TO_INT8"})
    assert check_quantized(LlamaConfig(quantization_config=served, dtype="float32"), torch.float32)
    # another dtype than the checkpoint's: eager loads it in its own only
    with pytest.raises(ie_lab.CapabilityUnsupported, match="dtype=torch.float32"):
        ie_lab.Session(int8[0], backend="vllm", dtype=torch.bfloat16, progress=False)
