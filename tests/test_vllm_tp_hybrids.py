"""Tensor parallelism 2, second half of the families (tests/test_vllm_tp.py says what is checked, and which
families stand for the two not started at TP=2): a module of its own so that the two test workers each run one
half's engines."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests import test_vllm_tp as tp  # noqa: E402

FAMILIES = ("falcon_h1", "granitemoehybrid", "zamba2")


def test_the_two_modules_cover_every_family_once():
    assert sorted(FAMILIES + tp.FAMILIES) == sorted(tp.MUST)


def test_a_family_left_out_at_tp2_has_started_stand_ins_on_its_own_binding():
    """tests/test_vllm_tp.py's TP_COVERED_BY: the families not started at TP=2 name families that are, and LFM2-MoE's
    layers still bind as LFM2's (one binding, dense or MoE): were it given a binding of its own, its TP=2 path would
    no longer be LFM2's and would need its engines back here."""
    from ie_lab.vllm.layer_binding import LAYER_KINDS

    for family, stand_ins in tp.TP_COVERED_BY.items():
        assert family not in tp.MUST and set(stand_ins) <= set(tp.MUST), family

    def kind(cls_name: str) -> str:
        layer = type(cls_name, (), {})()
        return next(k.layers for k in LAYER_KINDS if k.matches(layer))

    for moe, dense in (
        ("Lfm2MoeShortConvDecoderLayer", "Lfm2ShortConvDecoderLayer"),
        ("Lfm2MoeAttentionDecoderLayer", "Lfm2AttentionDecoderLayer"),
    ):
        assert kind(moe) == kind(dense) == "LFM2 and LFM2-MoE"


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return tp.run_tp_script(FAMILIES, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_served_point_at_tp2_equals_eager(family, tp_results):
    tp.check_tp_result(family, tp_results)
