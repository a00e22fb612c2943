"""The cheat sheet's position labels against the module tree, on every family the committed coverage survey binds
(for the installed transformers): a layer drawn "RoPE" must belong to a model that builds a rotary embedding, and
one that builds sinusoidal positions must not be drawn with RoPE (CTRL and XGLM were; so were the NoPE attention
layers of Jamba, Nemotron-H, Kimi-linear, Zamba and Granite-MoE-hybrid)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from ie_lab import coverage
from ie_lab.arch.config_facts import ArchFacts
from ie_lab.widgets.picker import _positions, attention_label


def _bound() -> list[str]:
    with open(coverage.data_path(coverage.installed_version()), encoding="utf-8") as f:
        return [r["model_type"] for r in json.load(f)["rows"] if r["status"] == "bound"]


def _built_positions(config) -> tuple[bool, bool]:
    """(rotary, sinusoidal): what the model built from this config holds (on the meta device: no weights)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    names = [type(m).__name__ for m in model.modules()]
    rotary = any("Rotary" in n or "RoPE" in n for n in names) or any(
        getattr(m, "rotary_dim", None) for m in model.modules()
    )
    sinusoidal = (
        any("Sinusoidal" in n for n in names)
        or any("pos_encoding" in n for n, _ in model.named_buffers())
        or any(hasattr(m, "pos_encoding") for m in model.modules())
    )
    return rotary, sinusoidal


def test_position_labels_match_what_the_model_builds():
    bad = []
    for t in _bound():
        config = coverage.tiny_config(t)
        drawn = set(_positions(ArchFacts.from_config(config)))
        rotary, sinusoidal = _built_positions(config)
        says_rope = any(p.startswith("rope") for p in drawn)
        if says_rope != rotary or ("sinusoidal" in drawn) != sinusoidal:
            bad.append(f"{t}: drawn {sorted(drawn)}, module tree rotary={rotary} sinusoidal={sinusoidal}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "family,position,label",
    [
        ("ctrl", "sinusoidal", "attention (q·kᵀ, softmax)"),
        ("xglm", "sinusoidal", "attention (q·kᵀ, softmax)"),
        ("jamba", "none", "attention (NoPE, q·kᵀ, softmax)"),
        ("nemotron_h", "none", "attention (NoPE, q·kᵀ, softmax)"),
        ("llama", "rope", "attention (RoPE, q·kᵀ, softmax)"),
    ],
)
def test_the_reported_families(family, position, label):
    f = ArchFacts.from_config(coverage.tiny_config(family))
    assert set(_positions(f)) == {position}
    assert attention_label(position, f.head_dim) == label
