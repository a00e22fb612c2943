"""Quantized checkpoints on the eager backend (docs/LOADING.md, Quantized checkpoints): a compressed-tensors
checkpoint written here (tests/families.saved_quantized_dir: attention W8A8, MLP W4A16) loads, its points are what
the quantized model computes (recomputed by hand from the integers and scales on disk), the gradient verdict says
what the quantization blocks, the sizer's bytes per weight agree with the file, and a checkpoint whose package is
missing is refused by name."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("compressed_tensors")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ie_lab  # noqa: E402
from tests.families import make_model, make_tokenizer, saved_quantized_dir  # noqa: E402

TEXT = "the cat sat on the mat and Mary went to the store"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = saved_quantized_dir(tmp_path_factory.mktemp("quantized"))
    return path, load_file(os.path.join(path, "model.safetensors")), ie_lab.load(path, quiet=True)


def _int4(sd: dict, name: str) -> torch.Tensor:
    """A pack-quantized weight rebuilt by hand: eight 4-bit values per int32 along each row, lowest bits first,
    stored as value + 8; one scale per output row and group of 128 inputs; zero points (where asymmetric) packed
    the same way down the output rows."""

    def nibbles(packed: torch.Tensor) -> torch.Tensor:
        return torch.stack([(packed >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(packed.shape[0], -1)

    q, scale = nibbles(sd[f"{name}.weight_packed"]) - 8, sd[f"{name}.weight_scale"]
    zp = sd.get(f"{name}.weight_zero_point")
    zero = torch.zeros_like(scale) if zp is None else nibbles(zp.T.contiguous()).T - 8  # [out, groups]
    return ((q.unflatten(1, (-1, 128)) - zero[..., None]) * scale[..., None]).flatten(1).float()


def _int8_linear(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """W8A8 by hand: int8 weights times their per-row scale; the input quantized to int8 per token (scale = the
    token's largest magnitude / 127.5, compressed-tensors' symmetric range) and back."""
    w = sd[f"{name}.weight"].float() * sd[f"{name}.weight_scale"]
    s = x.abs().amax(-1, keepdim=True) / 127.5
    return (torch.clamp(torch.round(x / s), -128, 127) * s) @ w.T


def test_points_are_what_the_quantized_model_computes(mixed):
    _, sd, lm = mixed
    c = ie_lab.capture(lm, TEXT, ["mlp_in.1", "mlp_out.1", "z.0", "attn_out.0"])
    x = c["mlp_in.1"][0]
    pre = "model.layers.1.mlp"
    assert f"{pre}.down_proj.weight_zero_point" in sd and f"{pre}.up_proj.weight_zero_point" not in sd
    gate, up, down = (_int4(sd, f"{pre}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert torch.allclose(c["mlp_out.1"][0], want, atol=1e-5, rtol=1e-5)
    # the same MLP with the original float weights computes something else: the quantization is in effect
    orig = make_model("llama").model.layers[1].mlp
    with torch.no_grad():
        assert (orig(x) - want).abs().max() > 100 * 1e-5
    # attention's output projection quantizes its input too: without that the recomputation misses
    z = c["z.0"][0]
    got = c["attn_out.0"][0]
    assert torch.allclose(got, _int8_linear(sd, "model.layers.0.self_attn.o_proj", z), atol=1e-5, rtol=1e-5)
    w = sd["model.layers.0.self_attn.o_proj.weight"].float() * sd["model.layers.0.self_attn.o_proj.weight_scale"]
    assert (z @ w.T - got).abs().max() > 100 * 1e-5
    # and the whole model's stream is not the unquantized model's
    plain = ie_lab.load(make_model("llama"), make_tokenizer(), quiet=True)
    got, before = (ie_lab.capture(m, TEXT, ["resid_post.1"])["resid_post.1"] for m in (lm, plain))
    assert (got - before).abs().max() > 1e-3


def test_load_dequantizes_and_says_so(mixed, capsys):
    path, _, lm = mixed
    assert not hasattr(lm.hf, "ct_decompress_hook")  # dense weights now, no hook left for the first forward
    assert lm.hf.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    ie_lab.load(path)
    line = capsys.readouterr().out
    assert (
        "quantized (compressed-tensors: 8 linears weights int8 (per channel), inputs int8 (per token, dynamic)" in line
    )
    assert "4 linears weights int4 (group 128)" in line and "2 linears weights int4 (group 128, asymmetric)" in line


def test_gradient_verdict_weight_only_allows_and_is_exact(tmp_path):
    path = saved_quantized_dir(tmp_path, {"W4A16": ["Linear"]}, name="w4a16")
    with ie_lab.Session(path, progress=False) as s:
        hf = s._lm.hf
        assert any(not p.is_floating_point() for p in hf.parameters())  # compressed-tensors' weight_shape
        assert s.grad_support().available, s.grad_support()
        # autograd through the dequantized weights equals central differences in a random direction
        emb = hf.get_input_embeddings()(torch.tensor([[5, 9, 17, 33]])).detach()
        d = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))

        def f(e):
            return hf(inputs_embeds=e).logits[0, -1, 7]

        e = emb.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f(e), e)
        with torch.no_grad():
            fd = (f(emb + 1e-3 * d) - f(emb - 1e-3 * d)) / 2e-3
        assert torch.isclose((g * d).sum(), fd, rtol=2e-2, atol=1e-4)


def test_gradient_verdict_names_activation_quantization(mixed):
    path, _, lm = mixed
    with ie_lab.Session(path, progress=False) as s:
        v = s.grad_support()
    assert not v.available
    assert "model.layers.0.self_attn.q_proj" in str(v) and "activations" in str(v) and "W4A16" in str(v)
    # what the verdict says: the input of a W8A8 linear is cut from the graph; a W4A16 linear's is not
    x = torch.randn(1, 3, 128, requires_grad=True)
    assert not lm.hf.model.layers[0].self_attn.q_proj(x).requires_grad
    assert lm.hf.model.layers[0].mlp.up_proj(x).requires_grad


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_sizer_bytes_per_weight_agree_with_the_file(tmp_path, scheme):
    """int4 plus one bfloat16 scale per group of 128 (and a packed int4 zero point where asymmetric), exactly."""
    from ie_lab.sizing import count_params, quantization, resolve_config

    path = saved_quantized_dir(tmp_path, {scheme: ["Linear"]}, name="bf16", dtype=torch.bfloat16)
    cfg = json.load(open(os.path.join(path, "config.json")))
    q = quantization(cfg["quantization_config"])
    sd = load_file(os.path.join(path, "model.safetensors"))
    on_disk = sum(
        t.numel() * t.element_size() for k, t in sd.items() if k.endswith(("_packed", "_scale", "_zero_point"))
    )
    assert count_params(resolve_config(path)).quantizable * q.bits_per_weight / 8 == on_disk


@pytest.mark.parametrize(
    "qc,package",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptqmodel"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "accelerate"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8 quantizer cannot load it"),
    ],
)
def test_a_checkpoint_whose_package_is_missing_is_refused_by_name(tmp_path, qc, package):
    path = str(tmp_path / "m")
    make_model("llama").save_pretrained(path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    json.dump({**cfg, "quantization_config": qc}, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ie_lab.CapabilityUnsupported, match=package) as e:
        ie_lab.load(path, make_tokenizer(), quiet=True)
    assert "compressed-tensors" in str(e.value)
