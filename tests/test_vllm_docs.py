"""docs/VLLM.md's backend table is generated from the registry and current."""

import os

from ie_lab.vllm import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vllm_doc_table_is_generated_from_the_registry():
    text = open(os.path.join(ROOT, "docs", "VLLM.md"), encoding="utf-8").read()
    assert docs.section() in text, "run `python -m ie_lab.vllm.docs`"
