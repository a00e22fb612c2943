"""The sizer (ie_lab.sizing.size, `ie-lab size`, the sizing panel) against references a wrong formula fails:
meta-device instantiations of every model type in the coverage table, hand arithmetic over real configs, the cache
transformers actually allocates on tiny models, and published totals of well-known checkpoints."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import ie_lab
from ie_lab import coverage, sizing
from ie_lab.errors import InputError
from ie_lab.sizing.gpus import GIB
from ie_lab.sizing.recommend import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, OVERHEAD_BYTES

# Qwen3-32B's config.json (huggingface.co/Qwen/Qwen3-32B), the keys that size it.
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 25600,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def _meta_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def _survey_types() -> list[str]:
    path = coverage.data_path(coverage.installed_version())
    with open(path, encoding="utf-8") as fh:
        return [r["model_type"] for r in json.load(fh)["rows"]]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every model type of the coverage table: its reference size (the config class's defaults; the survey's
    small instance where the defaults do not build), counted by an independent meta instantiation and by the
    sizer reading the config.json written from it (the path a user's folder takes). Encoder-decoder types are
    counted too; size() itself refuses them, as ie_lab does."""
    from transformers import CONFIG_MAPPING

    root = tmp_path_factory.mktemp("configs")
    out: dict[str, tuple[int, sizing.ParamCount, object]] = {}
    unbuildable: dict[str, str] = {}
    for mt in _survey_types():
        config = None
        for make in (CONFIG_MAPPING[mt], lambda mt=mt: coverage.tiny_config(mt)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    candidate = make()
                    ref = _meta_count(candidate)
                config = candidate
                break
            except Exception as e:  # noqa: BLE001 - transformers itself cannot build this instance
                unbuildable[mt] = f"{type(e).__name__}: {e}"
        if config is None:
            continue
        unbuildable.pop(mt, None)
        folder = root / mt
        folder.mkdir()
        config.save_pretrained(folder)
        out[mt] = (ref, sizing.count_params(sizing.resolve_config(str(folder))), config)
    return out, unbuildable


def test_parameter_count_equals_meta_instantiation_on_every_coverage_type(sweep):
    counted, unbuildable = sweep
    # the table's types transformers cannot build at all (musicgen needs a text encoder, gemma3n needs timm)
    assert len(unbuildable) <= 6, unbuildable
    assert len(counted) >= 170
    wrong = {
        mt: (ref, p.total, p.source)
        for mt, (ref, p, _) in counted.items()
        if abs(p.total - ref) > 0.01 * ref or not p.source.startswith("meta-device")
    }
    assert not wrong, wrong
    for mt, (_, p, _) in counted.items():  # the breakdown partitions the total
        assert p.embedding + p.lm_head + p.quantizable <= p.total, mt
        assert 0 <= p.experts <= p.quantizable and p.active <= p.total, mt


def test_parameter_counts_match_published_totals(sweep):
    """The families the old arithmetic got wrong, against what their authors publish."""
    counted, _ = sweep
    # DeepSeek-V3 technical report: 671B total, 37B activated per token (the MTP module's 14B are not built by
    # transformers; the sizer reports them apart)
    p = counted["deepseek_v3"][1]
    assert p.total == pytest.approx(671e9, rel=0.005) and p.active == pytest.approx(37e9, rel=0.03)
    assert p.mtp_layers == 1 and p.mtp_params == pytest.approx(11.6e9, rel=0.05)
    # Mixtral 8x7B (mistral.ai/news/mixtral-of-experts): 46.7B total, 12.9B active
    p = counted["mixtral"][1]
    assert p.total == pytest.approx(46.7e9, rel=0.005) and p.active == pytest.approx(12.9e9, rel=0.01)
    # Mamba 2's default config is the 8B of the Mamba 2 paper's hybrid line at 64 layers: counted, not estimated
    assert counted["mamba2"][1].total == counted["mamba2"][0]
    # tied embeddings have no separate head; untied ones do
    assert counted["gemma2"][1].lm_head == 0 and counted["llama"][1].lm_head == 32000 * 4096


# The trunks the config-arithmetic fallback must size exactly (it answers for model types transformers cannot build
# here, e.g. trust_remote_code checkpoints): dense, MoE with shared experts and dense prefixes, latent attention,
# Mamba, Mamba 2, and the hybrids whose parts it knows. The arithmetic before issue 30 was 8.8x off on DeepSeek-V3
# and 1.81x on Mamba 2.
ARITHMETIC_EXACT = (
    "llama mistral qwen2 qwen3 gemma2 phi3 granite mixtral qwen2_moe qwen3_moe olmoe glm4_moe gpt_oss deepseek_v2 "
    "deepseek_v3 mamba mamba2 jamba falcon_h1 qwen3_next"
).split()


def test_config_arithmetic_within_one_percent_of_the_meta_count(sweep):
    from ie_lab.arch.config_facts import ArchFacts
    from ie_lab.sizing.params import arithmetic_count

    counted, _ = sweep
    off = {}
    for mt in ARITHMETIC_EXACT:
        ref, _, config = counted[mt]
        n = arithmetic_count(ArchFacts.from_config(config))
        if abs(n - ref) > 0.01 * ref:
            off[mt] = round(n / ref, 3)
    assert not off, off


def test_quantized_weights_bytes_from_quantization_config():
    cfg = dict(QWEN3_32B, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
    s = sizing.size(cfg)
    d, L, dm = 5120, 64, 25600
    matrices = L * (d * (8192 + 2 * 1024) + 8192 * d + 3 * d * dm)  # q, k, v, o, gate, up, down: GPTQ packs these
    rest = s.params.total - matrices  # embedding, head, norms: bf16
    # 4 bits per weight, one fp16 scale and one packed 4-bit zero per group of 128 inputs
    assert s.weights_bytes == pytest.approx(rest * 2 + matrices * (4 + 20 / 128) / 8, rel=1e-9)
    assert s.params.quantizable == matrices
    # a wrong reading (embeddings packed too, or scales left out) is off by more than this
    assert sizing.size(cfg, dtype="bfloat16").weights_bytes == s.params.total * 2


def test_modules_a_quantization_config_keeps_unquantized():
    """compressed-tensors' `ignore` ("re:" patterns) and GPTQ's modules_to_not_convert (names, globs) leave those
    matrices at 16 bits: here the MoE routers."""
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["qwen3_moe"]().to_dict()
    scheme = {"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}}
    routers = cfg["num_hidden_layers"] * cfg["hidden_size"] * cfg["num_local_experts"]  # mlp.gate: d -> experts
    bpw = 4 + 16 / 128
    full = sizing.size(
        dict(cfg, quantization_config={"quant_method": "compressed-tensors", "config_groups": {"g": scheme}})
    )
    for qc in (
        {"quant_method": "compressed-tensors", "config_groups": {"g": scheme}, "ignore": ["lm_head", "re:.*mlp.gate$"]},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "modules_to_not_convert": ["mlp.gate"]},
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "modules_to_not_convert": ["*.mlp.gate"]},
    ):
        s = sizing.size(dict(cfg, quantization_config=qc))
        bits = bpw if qc["quant_method"] == "compressed-tensors" else 4 + 20 / 128
        packed = s.params.quantizable - routers
        assert s.weights_bytes == pytest.approx((s.params.total - packed) * 2 + packed * bits / 8, rel=1e-12), qc
    assert full.weights_bytes < s.weights_bytes


def test_mxfp4_packs_the_experts_only():
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["gpt_oss"]().to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    s = sizing.size(cfg)
    p = s.params
    assert p.experts > 0.9 * p.total
    assert s.weights_bytes == pytest.approx((p.total - p.experts) * 2 + p.experts * (4 + 8 / 32) / 8, rel=1e-9)
    # gpt-oss-120b's published checkpoint: ~60.8 GiB of safetensors (openai/gpt-oss-120b model card: "fits on a
    # single 80GB GPU")
    assert 55 * GIB < s.weights_bytes < 66 * GIB


# ---- KV cache: hand arithmetic over reference configs -----------------------------------------------------------


def test_kv_per_token_dense_gqa():
    s = sizing.size(QWEN3_32B)
    assert s.kv_bytes_per_token == 64 * 8 * 128 * 2 * 2  # layers x kv heads x head_dim x (K, V) x bf16
    assert s.kv_bytes(1000) == 1000 * s.kv_bytes_per_token


def test_kv_latent_attention_caches_the_latent_not_k_and_v():
    s = sizing.size("deepseek_v3")
    assert s.layout.latent and s.layout.counts() == {"latent": 61}
    # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x bf16; K and V per head would be 61 x 128 x (192 + 128)
    assert s.kv_bytes_per_token == 61 * (512 + 64) * 2


def test_kv_sliding_windows_bound_their_layers():
    s = sizing.size("gemma2")  # 26 layers alternating sliding (window 4096) and global; 4 KV heads of 256
    per_layer = 4 * (256 + 256) * 2
    assert s.kv_bytes(1000) == 26 * 1000 * per_layer
    assert s.kv_bytes(10_000) == 13 * 10_000 * per_layer + 13 * 4095 * per_layer
    assert s.kv_bytes_per_token == 13 * per_layer  # past the window only the global layers grow


def test_kv_state_space_and_linear_attention_are_fixed_per_sequence():
    m = sizing.size("mamba")  # 32 layers, inner 1536, state 16, conv 4
    assert m.kv_bytes_per_token == 0
    assert m.kv_bytes(10) == m.kv_bytes(100_000) == 32 * (1536 * 4 + 1536 * 16) * 2
    q = sizing.size("qwen3_next")  # 3 of every 4 layers Gated DeltaNet, the rest gated attention
    assert q.layout.counts() == {"state": 36, "attention": 12}
    assert q.kv_bytes_per_token == 12 * 2 * 256 * 2 * 2
    # conv over q, k (16 heads x 128) and v (32 heads x 128), kernel 4; a 32 x 128 x 128 recurrent state
    assert q.state_bytes == 36 * ((2 * 16 * 128 + 32 * 128) * 4 + 32 * 128 * 128) * 2


def _cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for name in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, name, None) or {}).values())
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize(
    "model_type,keys",
    [
        ("llama", {}),
        ("gemma2", {"sliding_window": 8}),  # sliding and global layers
        ("gpt_oss", {"sliding_window": 8}),
        ("deepseek_v3", {}),  # latent attention
        ("mamba", {}),
        ("mamba2", {}),
        ("qwen3_next", {}),  # Gated DeltaNet + attention
        ("jamba", {}),  # Mamba + attention
        ("falcon_h1", {}),  # Mamba 2 beside attention in every layer
        ("zamba2", {}),  # Mamba 2 + a shared attention block
        ("nemotron_h", {}),  # single-sublayer blocks: Mamba 2, attention, MLP
        ("kimi_linear", {}),  # Kimi Delta Attention + latent attention
        ("lfm2", {}),  # short convolutions + attention
    ],
)
def test_kv_equals_the_cache_transformers_allocates(model_type, keys):
    """A forward of 5 and of 12 tokens (past the window of 8) on the survey's tiny instance: the sizer's bytes
    for that config equal the bytes of every tensor the returned cache holds."""
    model = coverage.build_tiny(model_type, **keys).eval()
    s = sizing.size(model.config, dtype="float32", kv_dtype="float32")
    for n in (5, 12):
        with torch.no_grad():
            out = model(torch.arange(1, n + 1)[None], use_cache=True)
        cache = getattr(out, "past_key_values", None) or out.cache_params
        assert s.kv_bytes(n) == _cache_bytes(cache), (model_type, n, s.layout)


# ---- roofline and recommendation ---------------------------------------------------------------------------------


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    s = sizing.size(QWEN3_32B, tokens=4096)
    h100 = sizing.find_gpu("H100")
    assert (h100.bandwidth_gbs, h100.bf16_tflops) == (3350, 989)
    # decode: every weight and the sequence's whole cache read once per token
    read = s.params.total * 2 + 4096 * 64 * 8 * 128 * 2 * 2
    assert s.decode_tokens_per_s(h100) == pytest.approx(3350e9 / read)
    # prefill: 2 FLOPs per parameter per token, plus QK^T and PV over half the prefix on average
    flops = 2 * s.params.total * 4096 + 64 * 2 * (4096 * 4096 / 2) * 64 * (128 + 128)
    assert s.prefill_seconds(h100) == pytest.approx(flops / 989e12)
    assert s.prefill_seconds(h100, tp=2) == pytest.approx(flops / 989e12 / 2)
    # a MoE reads only its active experts per decode step
    m = sizing.size("mixtral", tokens=1)
    assert m.active_weights_bytes == pytest.approx(m.weights_bytes * m.params.active / m.params.total)


def test_recommendation_qwen3_32b_on_a100_80gb():
    s = sizing.size(QWEN3_32B, gpu="A100 80GB", tokens=8192)
    plan = s.plan("A100 80GB")
    assert plan.fits and plan.tp == 1
    a100 = sizing.find_gpu("a100-80")
    act = MAX_NUM_BATCHED_TOKENS * (4 * 5120 + 8192 + 2 * 1024 + 2 * 25600) * 2 + MAX_NUM_SEQS * 151936 * 4
    budget = a100.memory_gib * GIB * 0.9 - s.params.total * 2 - act - OVERHEAD_BYTES
    assert plan.kv_tokens == int(budget // (64 * 8 * 128 * 2 * 2))
    assert 20_000 < plan.kv_tokens < 35_000  # "Qwen3-32B on one 80 GB A100 with ~30k tokens of KV cache"
    assert plan.vllm_args() == {"tensor_parallel_size": 1, "max_model_len": 8192, "gpu_memory_utilization": 0.9}
    assert "on one A100 80GB with ~" in s.verdict()
    # 64k tokens of cache no longer fit one card: two, with the KV heads split between them
    wide = sizing.size(QWEN3_32B, gpu="A100 80GB", tokens=65536).plan("A100 80GB")
    assert wide.tp == 2 and wide.fits and wide.kv_tokens > 65536
    # a 40 GB card cannot hold the 61 GiB of weights; int4 weights fit it
    assert sizing.size(QWEN3_32B).plan("A100 40GB").tp == 2
    assert sizing.size(QWEN3_32B, dtype="int4").plan("A100 40GB").tp == 1


def test_recommendation_picks_the_smallest_set_and_says_when_nothing_fits():
    s = sizing.size(QWEN3_32B, tokens=8192)
    best = s.best()
    ok = [p for p in s.plans() if p.fits]
    assert best is not None and best.tp * best.gpu.memory_gib == min(p.tp * p.gpu.memory_gib for p in ok)
    huge = sizing.size("deepseek_v3", gpu="L4", tokens=4096)
    plan = huge.plan("L4")
    assert not plan.fits and "no room" in plan.why and "does not fit" in huge.verdict()


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(InputError, match="huggingface-cli download"):
        sizing.size("someone/not-a-local-model")
    with pytest.raises(InputError, match="tokens must be a positive integer"):
        sizing.size(QWEN3_32B, tokens=0)
    with pytest.raises(InputError, match="unknown dtype"):
        sizing.size(QWEN3_32B, dtype="int3")
    with pytest.raises(InputError, match="ambiguous.*A100 40GB"):
        sizing.find_gpu("a100")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match="model_type"):
        sizing.size(str(tmp_path))


# ---- the command and the panel ------------------------------------------------------------------------------------


def test_size_command(tmp_path, capsys):
    from ie_lab.cli import main

    (tmp_path / "Qwen3-32B").mkdir()
    (tmp_path / "Qwen3-32B" / "config.json").write_text(json.dumps(QWEN3_32B))
    assert main(["size", str(tmp_path / "Qwen3-32B"), "--gpu", "a100-80", "--tokens", "8k"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-32B: 32.76B parameters" in out
    assert "Qwen3-32B on one A100 80GB with ~" in out and "--max-model-len 8192" in out
    assert f"vllm serve {tmp_path / 'Qwen3-32B'} --tensor-parallel-size 1" in out  # the folder, ready to run
    assert "H100" not in out  # --gpu: that one row
    assert main(["size", "deepseek_v3", "--dtype", "fp8", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "61 latent" in out and "8x H200 141GB" in out
    assert main(["size", str(tmp_path / "missing")]) == 2
    assert "download the config first" in capsys.readouterr().err
    assert main(["size", "bart"]) == 1  # refused as ie_lab refuses it: an encoder-decoder's decoder stack
    assert "encoder-decoder" in capsys.readouterr().err


def test_unknown_model_type_falls_back_to_config_arithmetic_and_says_so():
    """A config.json of a family this transformers does not know (a trust_remote_code model): config arithmetic,
    labelled; Llama-3-8B's shape under another name is still 8.03B."""
    d = {
        "model_type": "mystery_lm",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    }
    s = sizing.size(d, tokens=16384)
    assert s.params.source.startswith("config arithmetic") and round(s.params.total / 1e7) == 803
    assert s.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    assert s.plan("H100").max_model_len == 8192 and any("context is 8192 tokens" in n for n in s.notes())
    assert "note: the model's context is 8192" in repr(s)


def test_panel_shows_verdict_and_a_row_per_gpu():
    p = sizing.panel(QWEN3_32B, tokens=8192)
    html = p._repr_html_()
    assert "iel-sizing-verdict" in html
    assert html.count("iel-sizing-row") == len(sizing.GPU_TABLE)
    assert html.count("data-fits='1'") == sum(plan.fits for plan in p.sizing.plans())
    assert p.sizing.verdict().split(":")[0] in html
    assert ie_lab.sizing.size(QWEN3_32B)._repr_html_() == sizing.size(QWEN3_32B)._repr_html_()


def test_old_estimate_api_unchanged():
    est = sizing.estimate(QWEN3_32B, "bfloat16")
    assert isinstance(est, sizing.Estimate) and est.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert sizing.batch_size_for(QWEN3_32B, 16) >= 1


def test_size_help_and_usage_errors_import_no_torch():
    """`ie-lab size --help` and a bad command line answer before torch or transformers load, as every command's."""
    import subprocess
    import sys

    code = (
        "import contextlib, io, sys\n"
        "from ie_lab.cli import main\n"
        "codes = []\n"
        "for argv in (['size', '--help'], ['size'], ['size', 'x', '--tokens', 'lots'], ['size', 'x', '--dtype', 'q3']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            codes.append(main(argv))\n"
        "        except SystemExit as e:\n"
        "            codes.append(e.code or 0)\n"
        "print(codes, sorted({'torch', 'transformers'} & {m.split('.')[0] for m in sys.modules}))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[0, 2, 2, 2] []"
