"""The demo SAE (issue 31 item 6): shipped in the package beside the demo model, loaded by ie_lab.DEMO_SAE, and good
at its point and only there. A random SAE of the same shape, or the shipped one read at a neighbouring point,
reconstructs far worse, so a wrong file, a wrong point or an untrained SAE fails these tests."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

import ie_lab
from ie_lab.sae import SAE

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import train_demo_model as tdm  # noqa: E402

# The shipped SAE explains at least this much of resid_post.1's variance on corpus text it never saw (0.97 on these
# prompts, 0.98 held out in training_report.json). A random SAE of the same shape and k explains ~0.2, and the
# trained one read at resid_post.0 ~0.73 and at resid_post.2 ~0.49: each is held well under this.
MIN_EXPLAINED = 0.9


def _prompts() -> list[str]:
    rng = random.Random(31)  # neither the model's (0) nor the SAE's (1, 1001) stream
    return [tdm.story(rng) for _ in range(6)] + [tdm.ioi_example(rng)["text"] for _ in range(6)]


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def sae(s):
    return ie_lab.load_sae(ie_lab.DEMO_SAE, s)


def _explained(sae: SAE, s, prompts) -> float:
    return 1.0 - sae.reconstruction_error(s, prompts)


def test_the_demo_sae_ships_in_the_package_and_loads_at_its_point(sae):
    assert os.path.dirname(ie_lab.DEMO_SAE) == os.path.dirname(ie_lab.DEMO_MODEL)  # inside the package
    assert sorted(os.listdir(ie_lab.DEMO_SAE)) == ["cfg.json", "sae_weights.safetensors", "training_report.json"]
    assert sum(os.path.getsize(os.path.join(ie_lab.DEMO_SAE, f)) for f in os.listdir(ie_lab.DEMO_SAE)) < 700_000
    assert str(sae.address) == "resid_post.1" and sae.hook_name == "blocks.1.hook_resid_post"
    assert (sae.activation, sae.k, sae.d_in, sae.d_sae) == ("topk", 16, 128, 512)


def test_it_reconstructs_its_point_and_a_wrong_answer_does_not(s, sae):
    prompts = _prompts()
    good = _explained(sae, s, prompts)
    assert good > MIN_EXPLAINED, good
    g = torch.Generator().manual_seed(0)
    W = torch.randn(sae.d_sae, sae.d_in, generator=g)
    W /= W.norm(dim=1, keepdim=True)
    random_sae = SAE(W.t().contiguous(), torch.zeros(sae.d_sae), W, sae.b_dec.clone(), "topk", k=sae.k)
    random_sae.address = sae.address
    assert _explained(random_sae, s, prompts) < MIN_EXPLAINED - 0.5
    for wrong in ("resid_post.0", "resid_post.2"):
        elsewhere = ie_lab.load_sae(ie_lab.DEMO_SAE, s, address=wrong)
        assert str(elsewhere.address) == wrong
        assert _explained(elsewhere, s, prompts) < MIN_EXPLAINED - 0.1, wrong


def test_its_features_are_sparse_on_a_prompt(s, sae):
    p = sae.project(s, "One Monday , Mary went to the park . Mary felt happy and glad .")
    fired = (p.scores > 0).sum(-1)
    assert p.scores.shape[1] == 512 and int(fired.max()) <= 16 and int(fired.min()) >= 1
    # encoding here equals encoding in the hook
    x = s.capture("One Monday , Mary went to the park . Mary felt happy and glad .", ["resid_post.1"])["resid_post.1"]
    assert torch.allclose(sae.encode(x[0].float()), p.scores, atol=1e-5)


def test_the_training_report_says_what_was_measured():
    report = json.loads((Path(ie_lab.DEMO_SAE) / "training_report.json").read_text())
    held = report["held_out"]
    assert held["explained_variance"] > MIN_EXPLAINED and held["l0"] <= 16 and held["tokens"] > 10_000
    assert held["dead_features"] < 512 // 10
    assert report["recipe"]["point"] == "resid_post.1" and report["recipe"]["tokens_seen"] > 100_000
    cfg = json.loads((Path(ie_lab.DEMO_SAE) / "cfg.json").read_text())
    assert cfg["metadata"]["hook_name"] == report["recipe"]["hook_name"]
