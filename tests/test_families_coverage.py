"""The family coverage table (docs/FAMILIES.md): every causal-LM model type transformers maps, surveyed.

The survey of the installed transformers is re-run here (a tiny instance per model type, ~30 s on one core) and
must equal the committed JSON; the other versions' JSONs are checked for shape only (their environment is not
this one)."""

import json
import os

import pytest
import torch

import ie_lab
from ie_lab import coverage, tiny
from ie_lab.errors import IELabError
from tests.conftest import numbers_differ


@pytest.fixture(scope="module")
def fresh():
    torch.set_num_threads(1)
    return coverage.survey()


def _committed(version):
    path = coverage.data_path(version)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.slow
def test_survey_of_the_installed_transformers_matches_the_committed_table(fresh):
    committed = _committed(fresh["transformers"])
    want = {r["model_type"]: r for r in committed["rows"]}
    got = {r["model_type"]: r for r in fresh["rows"]}
    assert sorted(got) == sorted(want), "the causal-LM mapping changed: run `python -m ie_lab.coverage --write`"
    changed = {mt: why for mt in got if (why := _row_differs(want[mt], got[mt]))}
    assert not changed, f"re-run `python -m ie_lab.coverage --write` and `python -m ie_lab.docs_gen`: {changed}"


def _row_differs(want: dict, got: dict) -> str | None:
    """A surveyed row against the committed one: every field equal, except that a reason's measured numbers (the
    causality probe's leak, printed `.3g`: BERT's and ERNIE's "by up to 0.00346" read 0.00347 on another machine) are
    compared as numbers, within one unit of their last printed digit (tests/conftest.py numbers_differ says why)."""
    if want.keys() != got.keys():
        return f"fields {sorted(want)} against {sorted(got)}"
    for k in want:
        if k == "reason" and isinstance(want[k], str) and isinstance(got[k], str):
            why = numbers_differ(want[k], got[k], cut=True)  # coverage._first_line cuts at 300 characters
            if why:
                return f"reason: {why}"
        elif want[k] != got[k]:
            return f"{k}: {want[k]!r} against {got[k]!r}"
    return None


def test_every_model_type_in_the_mapping_has_a_row():
    rows = {r["model_type"] for r in _committed(coverage.installed_version())["rows"]}
    assert rows == set(coverage.causal_lm_types())
    text = open("docs/FAMILIES.md", encoding="utf-8").read()
    for mt in coverage.causal_lm_types():
        assert f"| `{mt}` |" in text


@pytest.mark.slow
def test_no_load_crashes_outside_ielaberror(fresh):
    """Item 2 of issue 20: a family ie_lab does not bind is refused with an IELabError, never another crash."""
    crashed = {
        r["model_type"]: r["reason"]
        for r in fresh["rows"]
        if r["status"] == "defect" and r["reason"].startswith("load crashed")
    }
    assert not crashed


def test_surveys_cover_two_versions_and_every_row_is_classified():
    surveys = coverage.load_surveys()
    assert len(surveys) >= 2, "the pinned and the newest transformers are both surveyed"
    for s in surveys:
        for r in s["rows"]:
            assert r["status"] in ("bound", "refused", "defect", "untested"), r
            assert r["category"] == coverage.category(r)
            if r["status"] != "bound":
                assert r["reason"], r


def test_invariants_check_fails_on_a_wrong_binding():
    """The survey's invariant check is discriminating: a binding whose z is read one module too early fails it."""
    lm = ie_lab.load(coverage.build_tiny("llama"), coverage._tokenizer(), quiet=True)
    coverage.check_invariants(lm)  # the honest binding passes
    lb = lm.binding.layers[0]
    real = lb.o_proj
    # q_proj of the same layer: its input and output have z's and attn_out's shapes (hidden 64 = 4 heads x 16), so
    # only the values can tell it from the output projection
    lb.o_proj = lb.attn.q_proj
    try:
        with pytest.raises(AssertionError):
            coverage.check_invariants(lm)
    finally:
        lb.o_proj = real


def test_attention_output_transformed_before_o_proj_is_refused():
    """An unmeasured step between the kernel and o_proj is refused, naming it: the binder used to serve o_proj's
    input as z, which attn_probs @ value does not explain. (An output gate or a sub-norm is measured and bound
    instead: tests/test_families_hybrid.py; DiffLlama's two kernel calls: tests/test_families_differential.py.) The
    kernel's output is what the first call returned, so a second call combined with it is caught the same way."""
    model = coverage.build_tiny("llama")
    attn = model.model.layers[1].self_attn
    attn.o_proj.register_forward_pre_hook(lambda m, a: (a[0].tanh(),))  # a step no module boundary names
    with pytest.raises(ie_lab.StructureError, match="layer 1: the attention kernel's output is transformed before"):
        ie_lab.load(model, coverage._tokenizer(), quiet=True)


def test_final_norm_rescaled_by_the_logit_divisor_binds():
    """MiniCPM 3 divides the final norm's output by logits_scaling before its bias-free unembedding (it was refused):
    the binder measures that scale, so lm_head is the head module's output (the model's logits; the divisor acts
    before the head, so none is left after it), and the logit lens of the last layer gives the logits. W_U·final_norm
    (the unscaled norm through the head, a shape-correct wrong answer) is not lm_head (tests/test_head_input_scale.py)."""
    from ie_lab.eager.lens import decode_residual
    from ie_lab.ops.lens import postprocess_logits

    lm = ie_lab.load(coverage.build_tiny("minicpm3"), coverage._tokenizer(), quiet=True)
    assert lm.binding.head_input_scale == pytest.approx(lm.hf.config.dim_model_base / lm.hf.config.hidden_size)
    assert lm.facts.logit_divisor is None
    coverage.check_invariants(lm)
    x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
    last = f"resid_post.{lm.facts.n_layers - 1}"
    c = ie_lab.capture(lm, x, ["final_norm", "lm_head", last])
    with torch.no_grad():
        logits = lm.hf(input_ids=x, use_cache=False).logits
        torch.testing.assert_close(c["lm_head"], logits, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(decode_residual(lm, c[last]), logits, atol=2e-4, rtol=1e-4)
        unscaled = lm.binding.lm_head(c["final_norm"])
        assert not torch.allclose(unscaled, c["lm_head"], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(postprocess_logits(lm.facts, c["lm_head"]), logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["bart", "whisper", "marian"])
def test_encoder_decoder_decoders_are_refused_by_config(model_type):
    with pytest.raises(ie_lab.ArchitectureUnsupported, match="encoder-decoder"):
        ie_lab.load(coverage.build_tiny(model_type), coverage._tokenizer(), quiet=True)


def test_xglm_binds():
    """XGLM states its head count as attention_heads: it crashed on load with a plain ValueError."""
    lm = ie_lab.load(coverage.build_tiny("xglm"), coverage._tokenizer(), quiet=True)
    coverage.check_invariants(lm)


def test_per_layer_mlp_widths_are_refused_with_ielaberror_not_a_typeerror():
    """Gemma 3n lists one MLP width per layer: reading it crashed load with a TypeError."""
    with pytest.raises(IELabError):
        ie_lab.load(coverage.build_tiny("gemma3n_text"), coverage._tokenizer(), quiet=True)


def test_expert_points_without_routing_arguments_are_refused_not_crashed():
    """Llama 4's experts module is called without (indices, weights): capturing expert_weights raised StopIteration.
    Its router hands the weights out dense, so expert_weights is read there (tests/test_points_refused_served.py);
    the selection is refused."""
    lm = ie_lab.load(coverage.build_tiny("llama4_text"), coverage._tokenizer(), quiet=True)
    L = next(lb.index for lb in lm.binding.layers if lb.sparse_moe)
    with pytest.raises(ie_lab.CapabilityUnsupported, match="routing weights"):
        ie_lab.capture(lm, "the a", [f"expert_indices.{L}"])
    assert ie_lab.capture(lm, "the a", [f"expert_weights.{L}"])[f"expert_weights.{L}"].shape[-1] == lm.facts.n_experts


@pytest.mark.parametrize("model_type", ["llama4_text", "mixtral", "qwen2_moe", "olmoe"])
def test_router_logits_are_the_routers_linear_map_before_top_k(model_type):
    """router_logits is the router's logits before top-k selection. Llama 4's router returns its top-1 sigmoid scores
    scattered into zeros first and the logits second: eager read the scores (the first n_experts-wide tensor), which
    the other engines and vLLM do not. The binder now measures which returned tensor is the linear map."""
    lm = ie_lab.load(coverage.build_tiny(model_type), coverage._tokenizer(), quiet=True)
    moe = [lb for lb in lm.binding.layers if lb.sparse_moe]
    assert moe
    for lb in moe:
        c = ie_lab.capture(lm, "the cat sat on the mat", [f"router_logits.{lb.index}", f"mlp_in.{lb.index}"])
        w = lb.router.weight.detach()
        expected = c[f"mlp_in.{lb.index}"] @ w.T.to(c[f"mlp_in.{lb.index}"].dtype)
        torch.testing.assert_close(c[f"router_logits.{lb.index}"], expected, atol=1e-5, rtol=1e-4)
        if model_type == "llama4_text":
            # the scores eager used to return are shape-correct and must not pass
            top = expected.topk(lm.facts.experts_per_token, dim=-1)
            scores = torch.full_like(expected, float("-inf")).scatter(-1, top.indices, top.values).sigmoid()
            assert not torch.allclose(scores, c[f"router_logits.{lb.index}"], atol=1e-3)


def test_router_returning_two_tensors_neither_its_logits_is_refused():
    """Where a router returns several n_experts-wide tensors and none is its linear map, ie_lab cannot tell which are
    its logits: router_logits is refused naming why, not guessed."""
    from transformers.models.llama4 import modeling_llama4

    class TwoScores(modeling_llama4.Llama4Router):
        def forward(self, hidden_states):
            logits = super().forward(hidden_states)[1]
            return logits.sigmoid(), logits.tanh()

    model = coverage.build_tiny("llama4_text")
    for layer in model.model.layers:
        router = layer.feed_forward.router
        swapped = TwoScores(model.config)
        swapped.load_state_dict(router.state_dict())
        layer.feed_forward.router = swapped
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    L = next(lb.index for lb in lm.binding.layers if lb.sparse_moe)
    assert lm.binding.layers[L].router_output == -1
    with pytest.raises(ie_lab.CapabilityUnsupported, match="cannot tell which are its logits"):
        ie_lab.capture(lm, "the a", [f"router_logits.{L}"])
    assert ie_lab.capture(lm, "the a", [f"mlp_in.{L}"])[f"mlp_in.{L}"].shape[-1] == lm.facts.d_model


def test_gpt_neo_binds_through_its_attention_wrapper():
    """GPT-Neo's layer.attn wraps the attention proper (attn.attention holds out_proj): it was refused as having no
    output projection. On eager its own probabilities must reproduce z from the bound value."""

    lm = ie_lab.load(coverage.build_tiny("gpt_neo"), coverage._tokenizer(), quiet=True)
    coverage.check_invariants(lm)
    eager = tiny.build(coverage.tiny_config("gpt_neo"), attn_implementation="eager")
    lm = ie_lab.load(eager, coverage._tokenizer(), quiet=True)
    x = torch.randint(4, 512, (1, 7), generator=torch.Generator().manual_seed(0))
    f = lm.facts
    for L in range(f.n_layers):
        c = ie_lab.capture(lm, x, [f"attn_probs.{L}", f"value.{L}", f"z.{L}"])
        v = c[f"value.{L}"].reshape(1, 7, f.n_heads, f.head_dim).transpose(1, 2)
        z = (c[f"attn_probs.{L}"] @ v).transpose(1, 2).reshape(1, 7, -1)
        torch.testing.assert_close(z, c[f"z.{L}"], atol=2e-4, rtol=1e-4)


# Config-only answers the binder contradicts, each with why it stays (the picker and vLLM read the config).
_CONFIG_STRUCTURE_GAPS = {
    # Llama 4 normalises q and k with one parameter-free L2 norm module the binder does not bind as a QK-norm pair,
    # so the live model refuses q_norm_in / k_norm_in although the config states use_qk_norm.
    "llama4": "qk_norm",
    "llama4_text": "qk_norm",
    # AXK2 states q_lora_rank, but no query up-projection reads its compressed query (it feeds the sparse indexer
    # and the query gate), so the binder measures no q_latent point (the norm whose output q_b_proj reads).
    "axk2": "q_latent",
}


@pytest.mark.slow
def test_config_only_structure_equals_the_measured_one_on_every_bound_family():
    """What the cheat sheet and vLLM read from a config (points.Structure.from_facts: QK-norm, gate, parallel block,
    gated MLP, MoE layers, mixer layers) is what the binder measures on the tiny instance, for every family the
    survey binds; the family-survey quirks in arch/quirks.py and the MoE placement keys were found this way."""
    from ie_lab import points

    torch.set_num_threads(1)
    bound = [r["model_type"] for r in _committed(coverage.installed_version())["rows"] if r["status"] == "bound"]
    wrong = {}
    for mt in bound:
        lm = ie_lab.load(coverage.build_tiny(mt), coverage._tokenizer(), quiet=True)
        measured = points.Structure.from_binding(lm.binding)
        config = points.Structure.from_facts(lm.facts, final_norm=measured.final_norm)
        diff = {k for k in measured.__dataclass_fields__ if getattr(config, k) != getattr(measured, k)}
        diff -= {_CONFIG_STRUCTURE_GAPS.get(mt)}
        if diff:
            wrong[mt] = {k: (getattr(config, k), getattr(measured, k)) for k in diff}
    assert not wrong, wrong


def test_sink_scaled_kernel_output_serves_the_pattern_that_mixed_the_values():
    """GraniteSWA's eager kernel returns plain softmax weights but scales its output by a per-row sink factor: ie_lab
    served those weights as attn_probs (attn_probs @ value != z, a defect row). The binder measures that the weights
    do not explain the output, and the pattern is rebuilt with the sink (rows sum below 1) instead."""
    lm = ie_lab.load(coverage.build_tiny("granite_swa"), coverage._tokenizer(), quiet=True)
    assert not lm.binding.layers[0].kernel_weights_ok
    coverage.check_invariants(lm)
    x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
    c = ie_lab.capture(lm, x, ["attn_probs.0", "value.0", "z.0"])
    assert torch.all(c["attn_probs.0"].sum(-1) < 1)
    with torch.no_grad():
        kernel_weights = lm.hf(input_ids=x, use_cache=False, output_attentions=True).attentions[0]
    f = lm.facts
    v = c["value.0"].reshape(1, 7, -1, f.head_dim).transpose(1, 2).repeat_interleave(f.n_heads // f.n_kv_heads, 1)
    wrong = (kernel_weights @ v).transpose(1, 2).reshape(1, 7, -1)
    assert not torch.allclose(wrong, c["z.0"], atol=2e-4, rtol=1e-4)


def test_codegen_value_blocks_are_measured_per_head():
    """CodeGen's fused QKV interleaves q, v and k per model-parallel shard, none of the named layouts: it was refused
    on transformers before 5.24 (which reads its value from the attention call). The binder now finds each head's
    value block by the head's own probabilities; the eager kernel's probabilities must reproduce z from that value,
    and the neighbouring head's block (same width) must not."""

    model = tiny.build(coverage.tiny_config("codegen"), attn_implementation="eager")
    lm = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    coverage.check_invariants(lm)
    x = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))
    f = lm.facts
    for L in range(f.n_layers):
        c = ie_lab.capture(lm, x, [f"attn_probs.{L}", f"value.{L}", f"z.{L}"])
        v = c[f"value.{L}"].reshape(1, 7, f.n_heads, f.head_dim).transpose(1, 2)
        z = (c[f"attn_probs.{L}"] @ v).transpose(1, 2).reshape(1, 7, -1)
        torch.testing.assert_close(z, c[f"z.{L}"], atol=2e-4, rtol=1e-4)
        rolled = (c[f"attn_probs.{L}"] @ v.roll(1, dims=1)).transpose(1, 2).reshape(1, 7, -1)
        assert not torch.allclose(rolled, c[f"z.{L}"], atol=2e-4, rtol=1e-4)


def test_every_bound_hybrid_or_moe_trunk_has_a_vllm_verdict():
    """Issue 20 item 5: each hybrid, state-space or MoE trunk eager binds on the line vLLM runs with (5.19) is served
    on vLLM or refused there with vLLM's own reason (or what ie_lab's worker lacks, or how vLLM computes it
    differently): none falls through to the generic "not verified" refusal. Binding a new such family without
    probing it on vLLM fails here."""
    from ie_lab.arch import quirks
    from ie_lab.arch.config_facts import ArchFacts

    path = os.path.join(os.path.dirname(coverage.__file__), "coverage_data", "transformers-5.19.json")
    rows = json.load(open(path, encoding="utf-8"))["rows"]
    tables = (quirks.VLLM_VERIFIED, quirks.VLLM_CANNOT_RUN, quirks.VLLM_RUNS_UNBOUND, quirks.VLLM_DIFFERS)
    missing, checked = [], 0
    for r in rows:
        if r["status"] != "bound":
            continue
        facts = ArchFacts.from_config(coverage.tiny_config(r["model_type"]))
        if "mixer layers" not in r.get("note", "") and not facts.n_experts:
            continue
        checked += 1
        if not any(facts.model_type in t for t in tables):
            missing.append(r["model_type"])
    assert checked >= 50  # the hybrids and MoE families really were found
    assert missing == []
