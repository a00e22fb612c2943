"""Counts read as English (issue 33, item 12): "1 token", not "1 tokens", wherever ie_lab prints a count with its
noun: results' reprs, panels' reprs and refusals, describe(), a steering vector's source."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ie_lab
from ie_lab.errors import plural


def test_plural():
    assert [plural(n, "token") for n in (0, 1, 2, 11)] == ["0 tokens", "1 token", "2 tokens", "11 tokens"]
    assert plural(1, "key/value head") == "1 key/value head" and plural(3, "vertex", "vertices") == "3 vertices"


def test_counts_of_one_read_singular(session):
    one = session.generate("Mary went to", 1)
    assert repr(one).startswith("GenerationResult(1 token, stop=") and "(1 token, stop:" in one._repr_html_()
    assert repr(session.generate("Mary went to", 2)).startswith("GenerationResult(2 tokens, ")
    cache = session.capture("Mary", ["resid_post.0"])
    assert repr(cache).startswith("Cache(1 tensor, ")
    att = session.attention("Mary", layers=[0])
    assert "4 heads, 1 token)" in repr(att)
    one_layer = dataclasses.replace(session.facts, n_layers=1)
    with pytest.raises(ie_lab.AddressError, match=r"this model has 1 layer \(0\.\.0\)"):
        ie_lab.Address.parse("resid_post.1").check(one_layer)


def test_a_steering_vectors_source_counts_its_prompts():
    from ie_lab.widgets.steering_vector import load_vector as _load_vector
    from ie_lab.widgets.steering_vector import mean_difference_source as _mean_difference_source

    assert _mean_difference_source("resid_post.1", ["a"], ["b"]).endswith("(1 vs 1 prompt)")
    assert _mean_difference_source("resid_post.1", ["a"] * 6, ["b"] * 6).endswith("(6 vs 6 prompts)")
    _, src = _load_vector(torch.ones(1, 8), ie_lab.Address.parse("resid_post.1"))
    assert src.endswith("(mean over 1 position)")
