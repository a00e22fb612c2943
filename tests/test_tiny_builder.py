"""The one tiny-model builder (ie_lab.tiny.build): the toy, the survey and the tests' fixtures all draw through it,
so a model is a function of its config, seed and gains recipe alone."""

import pytest
import torch

from ie_lab import coverage, tiny, toy
from tests import families


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_config_and_seed_give_one_model_and_another_seed_another():
    cfg = coverage.tiny_config("llama")
    a, b, c = tiny.build(cfg), tiny.build(cfg), tiny.build(cfg, seed=1)
    assert not a.training and next(a.parameters()).dtype == torch.float32
    assert _equal(_weights(a), _weights(b))
    assert not _equal(_weights(a), _weights(c))


def test_each_recipe_moves_the_norm_gains_its_own_way():
    cfg = coverage.tiny_config("llama")
    gains = {g: tiny.build(cfg, gains=g).model.norm.weight for g in tiny.GAINS}
    assert torch.all(gains["none"] == 1)  # transformers' own initialisation
    assert torch.all((gains["survey"] >= 0.5) & (gains["survey"] <= 1.5)) and not torch.any(gains["survey"] == 1)
    assert torch.all((gains["discriminating"] - 1).abs() >= 0.35 - 1e-6)  # far from 1, as the fixtures need


def test_the_survey_toy_and_fixtures_are_what_the_builder_draws():
    assert _equal(
        _weights(coverage.build_tiny("llama")), _weights(tiny.build(coverage.tiny_config("llama"), gains="survey"))
    )
    model, _ = toy.tiny_model("llama", seed=3)
    assert _equal(_weights(model), _weights(tiny.build(model.config, seed=3)))
    fixture = families.make_model("llama")
    assert _equal(_weights(fixture), _weights(tiny.build(families.make_config("llama"), gains="discriminating")))


def test_an_unknown_recipe_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="gains='random'.*'none', 'survey', 'discriminating'"):
        tiny.build(coverage.tiny_config("llama"), gains="random")
