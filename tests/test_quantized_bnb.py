"""bitsandbytes checkpoints on the eager backend, where bitsandbytes and accelerate are installed (ie_lab's
environments carry neither: docs/LOADING.md, Quantized checkpoints): an nf4 checkpoint saved as safetensors loads
on CPU, and its points are what the quantized model computes (recomputed by hand from the 4-bit codes, the code
table and the per-block absmax in the file, within bfloat16 rounding: bitsandbytes' CPU kernel computes in
bfloat16), not the unquantized model's."""

from __future__ import annotations

import os

import pytest

for _package in ("bitsandbytes", "accelerate"):
    pytest.importorskip(_package, reason="needs pip install bitsandbytes==0.50.2 accelerate==1.16.0")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ie_lab  # noqa: E402
from tests.families import make_model, make_tokenizer  # noqa: E402

TEXT = "the cat sat on the mat and Mary went to the store"


def _nf4(sd: dict, name: str, shape: tuple[int, int]) -> torch.Tensor:
    """Two 4-bit codes per byte, high nibble first, each an index into the file's 16-value code table, times the
    absmax of its block of 64 (no double quantization: absmax stored as float32)."""
    packed = sd[f"{name}.weight"].flatten()
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).flatten().long()
    values = sd[f"{name}.weight.quant_map"][codes]
    return (values.unflatten(0, (-1, 64)) * sd[f"{name}.weight.absmax"][:, None]).flatten().reshape(shape)


def test_nf4_points_are_what_the_quantized_model_computes(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base, path = str(tmp_path / "base"), str(tmp_path / "nf4")
    make_model("llama").save_pretrained(base)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg, dtype=torch.float32).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    lm = ie_lab.load(path, quiet=True)
    c = ie_lab.capture(lm, TEXT, ["mlp_in.1", "mlp_out.1"])
    x = c["mlp_in.1"][0]
    pre, h, f = "model.layers.1.mlp", 128, 256
    gate, up = (_nf4(sd, f"{pre}.{p}", (f, h)) for p in ("gate_proj", "up_proj"))
    down = _nf4(sd, f"{pre}.down_proj", (h, f))
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    # bitsandbytes' CPU kernel computes in bfloat16 (its quant_state's dtype) even in a float32 model: the points
    # equal the hand dequantization within bfloat16's rounding, and the unquantized MLP is far further away
    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(c["mlp_out.1"][0], want) < 1e-2
    orig = make_model("llama").model.layers[1].mlp
    with torch.no_grad():
        assert rel(orig(x), want) > 10 * rel(c["mlp_out.1"][0], want)
