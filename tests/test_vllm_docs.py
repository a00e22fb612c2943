"""docs/VLLM.md's backend table is generated from the registry and current."""

import os

from ie_lab.vllm import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vllm_doc_table_is_generated_from_the_registry():
    text = open(os.path.join(ROOT, "docs", "VLLM.md"), encoding="utf-8").read()
    assert docs.section() in text, "run `python -m ie_lab.vllm.docs`"


def test_gptj_attn_scores_are_expected_on_vllm_and_falcons_are_not():
    """What `ie-lab points` says a vLLM session would serve: GPT-J's scores are checked against eager's (read from
    its attention step), Falcon's have nothing to be checked against."""
    from ie_lab import points
    from ie_lab.cli_points import expected_on_vllm

    p = points.get("attn_scores")
    assert expected_on_vllm(p, True, "", "gptj") == (True, "")
    ok, why = expected_on_vllm(p, True, "", "falcon")
    assert not ok and "not checked against transformers" in why
