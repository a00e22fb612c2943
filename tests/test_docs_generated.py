"""Generated docs tables must match the code they are generated from."""

import os

import pytest

from ie_lab import docs_gen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("rel", sorted(docs_gen.GENERATED))
def test_generated_doc_is_current(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        on_disk = f.read()
    assert on_disk == docs_gen.GENERATED[rel](), f"{rel} drifted from the code: run `python -m ie_lab.docs_gen`"


def test_every_registry_point_is_in_the_points_doc():
    from ie_lab.points import NAMES

    text = open(os.path.join(ROOT, "docs/POINTS.md"), encoding="utf-8").read()
    for name in NAMES:
        assert f"| `{name}` |" in text
