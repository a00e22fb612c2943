import pytest
import torch

import ie_lab
from ie_lab import Address, AddressError
from ie_lab.mappers import ENGINES, from_engine, table, to_engine
from tests.conftest import SUPPORTED, lm_for, ids


@pytest.mark.parametrize("fam,expected", [
    ("llama", "mlp_out.5"), ("gpt2", "mlp_out.5"),
    ("gemma2", "mlp_out_post.5"), ("olmo2", "mlp_out_post.5"), ("gemma3_text", "mlp_out_post.5"),
])
def test_hook_mlp_out_is_model_aware(fam, expected):
    assert str(from_engine("blocks.5.hook_mlp_out", fam)) == expected
    assert str(from_engine("blocks.5.hook_mlp_out", lm_for(fam))) == expected


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


@pytest.mark.parametrize("name,fragment", [
    ("blocks.2.ln1.hook_normalized", "before the norm's own weight"),
    ("blocks.2.hook_mlp_in", "pre-norm residual"),
    ("blocks.2.attn.hook_result", "computation"),
    ("hook_pos_embed", "positional embeddings"),
    ("blocks.2.mlp.hook_expert_weights", "softmax over all experts"),
    ("blocks.2.hook_resid_psot", "Did you mean"),
])
def test_refusals_explain(name, fragment):
    with pytest.raises(AddressError) as e:
        from_engine(name, "llama")
    assert fragment in str(e.value)


def test_parallel_family_has_no_resid_mid():
    with pytest.raises(AddressError, match="parallel"):
        from_engine("blocks.0.hook_resid_mid", lm_for("gpt_neox"))


def test_bridge_gate_hook_is_router_on_moe_layers():
    assert from_engine("blocks.0.mlp.gate.hook_out", lm_for("mixtral"), "transformerlens_bridge") == Address("router_logits", 0)
    assert from_engine("blocks.0.mlp.gate.hook_out", lm_for("llama"), "transformerlens_bridge") == Address("mlp_pre", 0)
    assert from_engine("blocks.0.mlp.in.hook_out", lm_for("llama"), "transformerlens_bridge") == Address("mlp_pre_linear", 0)
    assert from_engine("blocks.0.mlp.in.hook_out", lm_for("gpt2"), "transformerlens_bridge") == Address("mlp_pre", 0)


def test_hook_q_only_names_a_point_on_qk_norm_families():
    assert from_engine("blocks.1.attn.hook_q", lm_for("qwen3")) == Address("q_norm_in", 1)
    with pytest.raises(AddressError, match="no QK-norm"):
        from_engine("blocks.1.attn.hook_q", lm_for("llama"))


@pytest.mark.parametrize("family,address,engine,fragment", [
    ("granite", "embeddings", "transformerlens_bridge", "embedding multiplier"),
    ("bloom", "embeddings", "transformerlens", "after the embedding norm"),
    ("bloom", "mlp_out.0", "nnterp", "add the residual themselves"),
    ("bloom", "attn_out.1", "transformerlens_bridge", "add the residual themselves"),
    ("opt", "attn_scores.0", "transformerlens", "post-softmax"),
    ("hunyuan_v1_dense", "q_norm_in.0", "transformerlens", "after RoPE"),
    ("deepseek_v3", "value.1", "transformerlens_bridge", "latent attention"),
])
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
