"""Checks that need a CUDA device (marked `gpu`; each skips itself elsewhere).

Run on a lent machine with: python -m pytest -m gpu tests/test_gpu.py
Graph mode here means what it is for: a compiled trunk replayed from CUDA graphs (PIECEWISE), with the
static taps recorded in the graphs; every declared point must equal the default eager-hook vLLM mode.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import ie_lab

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT = "the cat sat on the mat and Mary went to the store"
PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "one two three four five six seven",
    "John gave a book to",
    "the dog ran in the park",
    "Alice and Bob went to the beach",
    "Paris is the capital of",
    "the old man walked to the",
]
POINTS = [
    "embeddings",
    "resid_pre.0",
    "z.0",
    "value.1",
    "mlp_pre.0",
    "mlp_pre_linear.1",
    "mlp_act.1",
    "q_norm_out.1",
    "k_norm_in.0",
    "resid_mid.1",
    "mlp_out.0",
    "resid_post.1",
    "final_norm",
]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> bool:
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.families import saved_model_dir

    return saved_model_dir("qwen3", tmp_path_factory.mktemp("gpu_qwen3"))


def test_eager_backend_on_cuda_equals_cpu(model_dir):
    on_gpu = ie_lab.Session(model_dir, device="cuda", dtype="float32", progress=False, replace=False)
    on_cpu = ie_lab.Session(model_dir, device="cpu", dtype="float32", progress=False, replace=False)
    try:
        a = on_gpu.capture(TEXT, ["resid_post.1", "z.0"])
        b = on_cpu.capture(TEXT, ["resid_post.1", "z.0"])
        assert all(_close(a[k].cpu(), b[k], 1e-3) for k in ("resid_post.1", "z.0"))
        assert on_gpu.generate(TEXT, 12).ids == on_cpu.generate(TEXT, 12).ids
    finally:
        on_gpu.close()
        on_cpu.close()


def test_graph_mode_with_cuda_graphs_equals_eager_hook_mode(model_dir):
    pytest.importorskip("vllm")
    kw = dict(
        backend="vllm", dtype="float16", progress=False, replace=False, engine_kwargs={"gpu_memory_utilization": 0.3}
    )
    ref = ie_lab.Session(model_dir, **kw)
    try:
        want = ref.capture(TEXT, POINTS)
        want_gen = ref.generate(TEXT, 16, capture=["resid_post.1"], ignore_eos=True)
        want_many = [ref.capture(p, ["resid_post.1"])["resid_post.1"] for p in PROMPTS]
    finally:
        ref.close()
    g = ie_lab.Session(model_dir, graph_points=POINTS, **kw)
    try:
        cc = g._backend._driver.engine.vllm_config.compilation_config
        assert str(cc.cudagraph_mode).endswith("PIECEWISE") and cc.cudagraph_capture_sizes
        got = g.capture(TEXT, POINTS)
        bad = [p for p in POINTS if not _close(got[p], want[p])]
        assert not bad, bad
        gen = g.generate(TEXT, 16, capture=["resid_post.1"], ignore_eos=True)
        assert gen.ids == want_gen.ids
        assert _close(gen.cache["resid_post.1"], want_gen.cache["resid_post.1"])

        async def many():
            return await asyncio.gather(*[g.acapture(p, ["resid_post.1"]) for p in PROMPTS])

        for c, w in zip(asyncio.run(many()), want_many):
            assert _close(c["resid_post.1"], w)
    finally:
        g.close()
