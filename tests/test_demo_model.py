"""Re-measure the bundled demo model's behaviours with plain transformers.

The model is built by ``scripts/train_demo_model.py``; measurement helpers live
in ``scripts/demo_model_metrics.py``. Thresholds are the training targets.
"""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import demo_model_metrics as dm  # noqa: E402
import train_demo_model as tdm  # noqa: E402

MODEL_DIR = REPO_ROOT / "ie_lab" / "demo_model"
SEED = 4242  # differs from the seeds used in training / the training report


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model.eval()
    return model, tokenizer


def test_files_and_size():
    names = {p.name for p in MODEL_DIR.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "training_report.json",
    ):
        assert required in names
    assert not any(n.endswith(".bin") for n in names)
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) <= 20 * 1024 * 1024


def test_tokenizer_roundtrip(loaded):
    _, tok = loaded
    ids = tok("When Mary and John went to the store , John gave a drink to")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.unk_token_id not in ids
    assert all(tok.convert_tokens_to_ids(n) != tok.unk_token_id for n in tdm.NAMES)


def test_induction(loaded):
    model, tok = loaded
    special = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    cand = sorted(set(tok.get_vocab().values()) - special)
    m = dm.induction_metrics(model, cand, tok.bos_token_id, n_seq=32, seq_len=25, seed=SEED)
    assert m["loss_ratio"] <= 0.5, m["loss_ratio"]
    assert m["best_head"]["score"] > 0.3, m["best_head"]


def test_ioi_heldout_names(loaded):
    model, tok = loaded
    rng = random.Random(SEED)
    examples = [tdm.ioi_example(rng, names=tdm.HELDOUT_NAMES) for _ in range(200)]
    assert all(ex["io"] in tdm.HELDOUT_NAMES and ex["s"] in tdm.HELDOUT_NAMES for ex in examples)
    m = dm.ioi_metrics(model, tok, examples)
    assert m["logit_diff_mean"] > 1.0, m
    assert m["accuracy"] > 0.9, m


def test_mood_steering(loaded):
    model, tok = loaded
    report = json.loads((MODEL_DIR / "training_report.json").read_text())
    coef = report["metrics"]["mood_steering"]["coef"]
    layer = report["metrics"]["mood_steering"]["layer"]
    rng = random.Random(SEED)
    happy = [tdm.story(rng, "happy") for _ in range(64)]
    sad = [tdm.story(rng, "sad") for _ in range(64)]
    prompts = [tdm.sad_prompt(rng) for _ in range(24)]
    direction = dm.mood_direction(model, tok, happy, sad, layer)
    res = {}
    for name, c in (("unsteered", 0.0), ("steered", coef)):
        conts = dm.generate_steered(model, tok, prompts, layer, direction, c, n_new=16, seed=SEED)
        res[name] = dm.mood_word_counts(conts, tok, tdm.HAPPY_WORDS, tdm.SAD_WORDS)
    assert res["unsteered"]["sad_fraction"] > 0.7, res
    assert res["steered"]["happy_fraction"] > 0.6, res
    assert res["steered"]["happy_fraction"] - res["unsteered"]["happy_fraction"] > 0.4, res
