import pytest
import torch

import ie_lab
from ie_lab import Address, AddressError, tiny
from ie_lab.mappers import ENGINES, from_engine, table, to_engine
from tests.conftest import SUPPORTED, ids, lm_for


@pytest.mark.parametrize(
    "fam,expected",
    [
        ("llama", "mlp_out.5"),
        ("gpt2", "mlp_out.5"),
        ("gemma2", "mlp_out_post.5"),
        ("olmo2", "mlp_out_post.5"),
        ("gemma3_text", "mlp_out_post.5"),
    ],
)
def test_hook_mlp_out_is_model_aware(fam, expected):
    assert str(from_engine("blocks.5.hook_mlp_out", fam)) == expected  # a family name: any layer
    live = expected.replace(".5", ".1")  # the fixture has 2 layers, and a loaded model range-checks
    assert str(from_engine("blocks.1.hook_mlp_out", lm_for(fam))) == live
    with pytest.raises(AddressError, match="out of range"):
        from_engine("blocks.5.hook_mlp_out", lm_for(fam))


def test_model_aware_by_measurement_on_a_multiplier_family():
    # Granite scales each sublayer's contribution: TransformerLens' block-level name is the scaled one.
    lm = lm_for("granite")
    assert from_engine("blocks.0.hook_attn_out", lm) == Address("attn_out_post", 0)
    with pytest.raises(AddressError, match="post-sublayer"):
        to_engine("attn_out.0", lm)


def test_raw_mlp_out_on_gemma2_has_no_legacy_name_but_a_bridge_name():
    with pytest.raises(AddressError, match="mlp_out_post.3"):
        to_engine("mlp_out.3", "gemma2", "transformerlens")
    assert to_engine("mlp_out.3", "gemma2", "transformerlens_bridge") == "blocks.3.mlp.hook_out"
    assert to_engine("mlp_out_post.3", "gemma2", "transformerlens_bridge") == "blocks.3.ln2_post.hook_out"
    assert to_engine("mlp_out.3", "gemma2", "nnterp") == "mlps_output[3]"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fam", ["llama", "gemma2", "gpt2", "qwen3", "mixtral", "olmo2"])
def test_round_trip_every_translatable_point(engine, fam):
    lm = lm_for(fam)
    n = 0
    for row in table(lm, layer=1):
        name = row[engine]
        if not name:
            continue
        back = from_engine(name, lm, engine)
        a = Address.parse(row["address"])
        if back != a:
            # Only allowed where the two points are the same tensor on this family; prove it.
            c = ie_lab.capture(lm, ids(), [a, back])
            torch.testing.assert_close(c[a], c[back])
        n += 1
    assert n >= 5


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("blocks.2.ln1.hook_normalized", "before the norm's own weight"),
        ("blocks.2.hook_mlp_in", "pre-norm residual"),
        ("blocks.2.attn.hook_rot_q", "post-RoPE queries"),
        ("hook_pos_embed", "positional embeddings"),
        ("blocks.2.mlp.hook_expert_weights", "softmax over all experts"),
        ("blocks.2.hook_resid_psot", "Did you mean"),
    ],
)
def test_refusals_explain(name, fragment):
    with pytest.raises(AddressError) as e:
        from_engine(name, "llama")
    assert fragment in str(e.value)


def test_hook_result_is_attn_result_with_its_head_axis():
    """TransformerLens' hook_result ([batch, pos, head, d_model], z times each head's W_O, no b_O) is attn_result."""
    assert from_engine("blocks.1.attn.hook_result", lm_for("gpt2")) == Address("attn_result", 1)
    assert to_engine("attn_result.1", lm_for("gpt2")) == "blocks.1.attn.hook_result"


def test_parallel_family_has_no_resid_mid():
    with pytest.raises(AddressError, match="parallel"):
        from_engine("blocks.0.hook_resid_mid", lm_for("gpt_neox"))


def test_bridge_gate_hook_is_router_on_moe_layers():
    assert from_engine("blocks.0.mlp.gate.hook_out", lm_for("mixtral"), "transformerlens_bridge") == Address(
        "router_logits", 0
    )
    assert from_engine("blocks.0.mlp.gate.hook_out", lm_for("llama"), "transformerlens_bridge") == Address("mlp_pre", 0)
    assert from_engine("blocks.0.mlp.in.hook_out", lm_for("llama"), "transformerlens_bridge") == Address(
        "mlp_pre_linear", 0
    )
    assert from_engine("blocks.0.mlp.in.hook_out", lm_for("gpt2"), "transformerlens_bridge") == Address("mlp_pre", 0)


def test_hook_q_only_names_a_point_on_qk_norm_families():
    assert from_engine("blocks.1.attn.hook_q", lm_for("qwen3")) == Address("q_norm_in", 1)
    with pytest.raises(AddressError, match="no QK-norm"):
        from_engine("blocks.1.attn.hook_q", lm_for("llama"))


@pytest.mark.parametrize(
    "family,address,engine,fragment",
    [
        ("granite", "embeddings", "transformerlens_bridge", "embedding multiplier"),
        ("bloom", "embeddings", "transformerlens", "after the embedding norm"),
        ("bloom", "mlp_out.0", "nnterp", "add the residual themselves"),
        ("bloom", "attn_out.1", "transformerlens_bridge", "add the residual themselves"),
        ("opt", "attn_scores.0", "transformerlens", "post-softmax"),
        ("gptj", "attn_scores.1", "transformerlens_bridge", "post-softmax"),
        ("hunyuan_v1_dense", "q_norm_in.0", "transformerlens", "after RoPE"),
        ("deepseek_v3", "value.1", "transformerlens_bridge", "latent attention"),
    ],
)
def test_validator_findings_are_refused(family, address, engine, fragment):
    # Each case is a comparison validator/ found failing: the other engine's name holds a different tensor there.
    with pytest.raises(AddressError, match=fragment):
        to_engine(address, lm_for(family if family != "bloom" else "bloom"), engine)


def test_validator_findings_map_to_what_the_names_really_hold():
    assert from_engine("embed.hook_out", lm_for("granite"), "transformerlens_bridge") == Address("resid_pre", 0)
    assert from_engine("hook_embed", lm_for("bloom")) == Address("resid_pre", 0)
    assert from_engine("embed.hook_out", lm_for("bloom"), "transformerlens_bridge") == Address("embeddings")
    assert from_engine("blocks.1.attn.hook_out", lm_for("bloom"), "transformerlens_bridge") == Address("resid_mid", 1)
    assert from_engine("mlps_output[0]", lm_for("bloom"), "nnterp") == Address("resid_post", 0)
    assert to_engine("resid_mid.1", lm_for("olmo2"), "transformerlens_bridge") == "blocks.1.mlp.hook_in"
    # and these mappings are true on ie_lab's own captures
    c = ie_lab.capture(lm_for("granite"), ids(), ["embeddings", "resid_pre.0"])
    torch.testing.assert_close(c["embeddings"] * lm_for("granite").facts.embedding_multiplier, c["resid_pre.0"])


def _answer(fn, *args):
    """A translation's outcome: the name, 'refused', or 'depends' (a family name alone cannot settle it)."""
    try:
        return str(fn(*args))
    except AddressError as e:
        return "depends" if "depends on the checkpoint's config" in str(e) else "refused"


@pytest.mark.parametrize("fam", SUPPORTED)
def test_family_name_and_config_translate_as_the_live_model_does(fam):
    # Issue 13.2: without a model, a family name resolves through transformers' config class and the quirks
    # table; where the checkpoint's config decides (residual_multiplier, use_parallel_residual, MoE layer
    # pattern, ...) it refuses instead of guessing. A config (here the fixture's own) settles those: then every
    # answer equals the live model's, names and refusals alike.
    from tests.families import _SPECS, make_config

    lm, family, config = lm_for(fam), _SPECS[fam][0], make_config(fam)
    equal = 0
    for row in table(lm, layer=1):
        for engine in ENGINES:
            live_to = row[engine] or "refused"
            assert _answer(to_engine, row["address"], config, engine) == live_to, (row["address"], engine)
            by_name = _answer(to_engine, row["address"], family, engine)
            assert by_name in (live_to, "depends"), (row["address"], engine, live_to, by_name)
            equal += by_name == live_to
            if row[engine]:
                live_from = _answer(from_engine, row[engine], lm, engine)
                assert _answer(from_engine, row[engine], config, engine) == live_from, row[engine]
                by_name = _answer(from_engine, row[engine], family, engine)
                assert by_name in (live_from, "depends"), (row[engine], engine, live_from, by_name)
                equal += by_name == live_from
    assert equal >= 100  # most names do not hang on the checkpoint: the family name answers them


@pytest.mark.parametrize(
    "family,fragment",
    [
        (
            "glm4",
            "has not measured the block structure",
        ),  # a real model_type whose norm placement ie_lab never measured
        ("totally_made_up", "unknown model family"),
        ("lama", "Did you mean 'llama'"),
    ],
)
def test_families_it_cannot_resolve_refuse_and_say_to_pass_the_model(family, fragment):
    for call in (lambda: from_engine("blocks.5.hook_mlp_out", family), lambda: to_engine("mlp_out.5", family)):
        with pytest.raises(AddressError) as e:
            call()
        assert fragment in str(e.value) and "Pass the loaded model" in str(e.value)


def test_checkpoint_dependent_answers_name_the_config_key():
    with pytest.raises(AddressError, match="residual_multiplier"):
        from_engine("blocks.5.hook_mlp_out", "granite")
    with pytest.raises(AddressError, match="first_k_dense_replace"):
        from_engine("blocks.1.mlp.gate.hook_out", "deepseek_v3", "transformerlens_bridge")
    with pytest.raises(AddressError, match="use_parallel_residual"):
        from_engine("blocks.1.hook_resid_mid", "gpt_neox")
    # the same questions answered from a config, and they match what the loaded fixture measures
    from tests.families import make_config

    assert from_engine("blocks.1.hook_mlp_out", make_config("granite")) == Address("mlp_out_post", 1)
    assert (
        from_engine("blocks.1.mlp.gate.hook_out", make_config("deepseek_v3"), "transformerlens_bridge")
        == from_engine("blocks.1.mlp.gate.hook_out", lm_for("deepseek_v3"), "transformerlens_bridge")
        == Address("router_logits", 1)
    )


def test_bad_model_and_engine_arguments_are_refused():
    with pytest.raises(ie_lab.InputError, match="family name"):
        from_engine("blocks.0.hook_resid_post", 3)
    with pytest.raises(ie_lab.InputError, match="engine must be one of"):
        to_engine("resid_post.0", "llama", "tl")
    with pytest.raises(ie_lab.InputError, match="as a string"):
        from_engine(["blocks.0.hook_resid_post"], "llama")


def test_a_session_is_accepted_wherever_a_model_is():
    s = ie_lab.Session(lm_for("gemma2").hf, tokenizer=lm_for("gemma2").tokenizer, progress=False)
    try:
        assert from_engine("blocks.1.hook_mlp_out", s) == Address("mlp_out_post", 1)
        assert to_engine("mlp_out.1", s, "nnterp") == "mlps_output[1]"
    finally:
        s.close()


@pytest.mark.parametrize("fam", SUPPORTED)
def test_attention_in_module_quirk_matches_the_binder(fam):
    from ie_lab.arch import quirks
    from tests.families import _SPECS

    measured = not any(lb.uses_attention_interface for lb in lm_for(fam).binding.layers)
    assert (_SPECS[fam][0] in quirks.ATTENTION_IN_MODULE) == measured
    assert _SPECS[fam][0] in quirks.STRUCTURE_MEASURED


def test_the_reported_glm4_case_answers_only_from_the_model():
    # Issue 13.2: from_engine("blocks.5.hook_mlp_out", "glm4") said mlp_out.5, but GLM-4 normalises each sublayer's
    # output, so a loaded GLM-4 says mlp_out_post. A name (or config) of a family ie_lab never measured refuses.
    from transformers import CONFIG_MAPPING

    from tests.families import make_tokenizer

    cfg = CONFIG_MAPPING["glm4"](
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    lm = ie_lab.load(tiny.build(cfg), make_tokenizer())
    assert from_engine("blocks.1.hook_mlp_out", lm) == Address("mlp_out_post", 1)
    for ref in ("glm4", cfg):
        with pytest.raises(AddressError, match="has not measured the block structure of 'glm4'"):
            from_engine("blocks.1.hook_mlp_out", ref)
