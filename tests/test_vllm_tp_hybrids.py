"""Tensor parallelism 2, second half of the families (tests/test_vllm_tp.py says what is checked): a module of its
own so that the two test workers each run one half's engines."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests import test_vllm_tp as tp  # noqa: E402

FAMILIES = ("falcon_h1", "granitemoehybrid", "lfm2_moe", "zamba2")


def test_the_two_modules_cover_every_family_once():
    assert sorted(FAMILIES + tp.FAMILIES) == sorted(tp.MUST)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return tp.run_tp_script(FAMILIES, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_served_point_at_tp2_equals_eager(family, tp_results):
    tp.check_tp_result(family, tp_results)
