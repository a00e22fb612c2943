"""The point registry owns every per-point fact, and each consumer answers from it.

Whether a point exists on a structure is said once (``points.absence``); eager resolution, the config-only
picker and the points table must give the same answer in the same words, and the config's structure must be
the one the binder measures (vLLM and the config-only picker only have the config).
"""

from __future__ import annotations

import pytest

from ie_lab import points
from ie_lab.address import Address
from ie_lab.eager.taps import resolve
from ie_lab.errors import CapabilityUnsupported, PointAbsent
from tests.conftest import SUPPORTED, lm_for


def _addresses(p: points.Point, n_layers: int) -> list[Address]:
    return [Address(p.name, None)] if p.scope is points.Scope.TRUNK else [Address(p.name, L) for L in range(n_layers)]


@pytest.mark.parametrize("family", SUPPORTED)
def test_a_point_resolves_on_eager_iff_the_registry_finds_nothing_missing(family):
    lm = lm_for(family)
    structure = points.Structure.from_binding(lm.binding)
    wrong = []
    for p in points.all_points():
        for a in _addresses(p, lm.facts.n_layers):
            want = points.absence(p, structure, a.layer)
            try:
                resolve(lm, a)
                got = None
            except PointAbsent as e:
                got = (e.why, e.instead)
            except CapabilityUnsupported:  # present, but this backend will not read it: not an absence
                got = None
            if got != (None if want is None else (want.why, want.instead)):
                wrong.append((str(a), want, got))
    assert not wrong, wrong


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_config_says_what_the_binder_measures(family):
    lm = lm_for(family)
    measured = points.Structure.from_binding(lm.binding)
    assert points.Structure.from_facts(lm.facts, final_norm=measured.final_norm) == measured


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2", "qwen3", "mixtral", "qwen2_moe", "olmoe"])
def test_the_config_only_picker_greys_what_the_loaded_model_lacks(family):
    """The cheat sheet (config only) and the picker on a loaded model (points table, eager resolution) grey the
    same structurally absent points on the same layers, with the same reason."""
    from ie_lab.widgets.picker import describe

    lm = lm_for(family)
    config = {p["name"]: p for p in describe(lm.facts, "eager")["points"]}
    live = {p["name"]: p for p in describe(lm.facts, "eager", lm=lm)["points"]}
    assert config.keys() == live.keys()
    for name in config:
        if points.get(name).needs:
            assert config[name]["served"] == live[name]["served"], name
            assert config[name]["why"] == live[name]["why"], name


def test_the_points_table_shows_router_points_where_the_model_routes():
    from ie_lab.eager.points_table import points_table

    lm = lm_for("qwen2_moe")
    moe = points.Structure.from_binding(lm.binding).moe_layers
    rows = {r.name: r for r in points_table(lm, layer=0).rows}
    for p in points.all_points():
        if points.Needs.MOE in p.needs:
            assert rows[p.name].example == str(Address(p.name, moe[0]))


def test_eager_writes_exactly_the_points_the_registry_marks_writable():
    from ie_lab.eager.writers import Writers

    lm = lm_for("qwen3")  # has QK-norm, so every single-stream point exists
    edit = lambda t, offset: t  # noqa: E731
    for p in points.all_points():
        if p.multi_stream_only:
            continue
        a = Address(p.name, None if p.scope is points.Scope.TRUNK else 0)
        try:
            Writers(lm, [(a, edit)])
            writable = True
        except CapabilityUnsupported:
            writable = False
        assert writable == p.writable, p.name


def test_absence_names_the_first_missing_feature_with_the_layer():
    s = points.Structure("toy", gated_mlp=False, moe_layers=(1,))
    assert points.absence("mlp_pre_linear", s, 0).need is points.Needs.GATED_MLP
    moe = points.absence("mlp_pre_linear", s, 1)  # a MoE layer: no single MLP, gated or not
    assert moe.need is points.Needs.DENSE_MLP and "layer 1" in moe.why and "mlp_pre_linear" in moe.why
    assert points.absence("router_logits", s, 0).instead == "MoE layers of this model: [1]."
    assert points.absent_reason("router_logits", s, 1) is None
    assert points.absent_reason("resid_mid", points.Structure("toy", parallel=True), 0).startswith(
        "this family runs attention and the MLP in parallel"
    )
    with pytest.raises(PointAbsent, match="no QK-norm"):
        points.require_present("q_norm_in", s, 0)


def test_steering_reads_the_registry():
    """Steering adds a d_model vector to a per-layer point; the tappable set is what vLLM reads by hook."""
    assert {p.name for p in points.all_points() if p.steerable and not p.multi_stream_only} == {
        "resid_pre",
        "attn_in",
        "attn_out",
        "attn_out_post",
        "mixer_in",
        "mixer_out",
        "mixer_out_post",
        "resid_mid",
        "mlp_in",
        "mlp_out",
        "mlp_out_post",
        "resid_post",
    }
    assert set(points.tappable()) == {p.name for p in points.all_points() if p.vllm.verdict is points.Verdict.SERVED}
    assert not any(p.tappable for p in points.all_points() if p.recomputed)
    assert {p.name for p in points.all_points() if p.is_attention} == {"attn_scores", "attn_probs"}
