"""ie_lab.to_saelens (docs/HARVEST.md): a harvest written as SAELens' cached activations is read back by SAELens'
own ActivationsStore as exactly the harvested rows, in order, with their token ids (a row shifted by one fails).

SAELens and `datasets` live in .venvs/saelens (``bash validator/envs/setup.sh saelens``), not in ie_lab's
environment: the harvest runs here, the export and SAELens' read run there (ie_lab imported from this checkout).
CI does not build that environment, so that test skips there. The refusals run here, where `datasets` is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ie_lab
from ie_lab.mappers import to_engine
from tests.conftest import lm_for
from validator import sae as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [  # lengths 6, 2, 7, 1, ...: windows of 8 tokens cross prompt boundaries, and 3 rows are left over
    "the cat sat on the mat",
    "a dog",
    "one two three four five six seven",
    "x",
    "Mary went to the store and",
    "John gave a book to Alice",
    "blue sky",
    "the old man walked to the station",
]
ADDRS = ["resid_post.0", "mlp_out.1"]
CONTEXT = 8

# Runs in .venvs/saelens: the export, then each column read by SAELens' ActivationsStore the way its training
# reads cached activations (from_cache_activations: the public constructor over a cached_activations_path).
WORKER = r"""
import json, sys, torch
import ie_lab
from sae_lens import ActivationsStore, CacheActivationsRunnerConfig
harvest, out, result = sys.argv[1:4]
exp = ie_lab.to_saelens(harvest, out, context_size=%(ctx)d, model="llama")
got = {"export": {k: v for k, v in vars(exp).items()}}
tensors = {}
for address, hook in exp.hook_names.items():
    cfg = CacheActivationsRunnerConfig(
        dataset_path="never/read", model_name="tiny", model_batch_size=1, hook_name=hook, d_in=exp.d_in[address],
        training_tokens=exp.rows_written, context_size=exp.context_size, new_cached_activations_path=out,
        device="cpu", dtype="float32", buffer_size_gb=exp.rows_written * exp.d_in[address] * 4 / 1e9,
    )  # a buffer of the whole cache (the default, 2 GB, would cycle these few rows for minutes to fill it)
    store = ActivationsStore.from_cache_activations(None, cfg)
    acts, toks = [], []
    while True:
        try:
            a, t = store.get_raw_llm_batch(raise_on_epoch_end=True)
        except StopIteration:
            break
        acts.append(a); toks.append(t)
    tensors[address] = torch.cat(acts)
    tensors[address + ":token_ids"] = torch.cat(toks)
    tensors[address + ":train_batch"] = next(store)  # a training batch: shuffled rows of the cache
torch.save(tensors, result + ".pt")
json.dump(got, open(result, "w"))
"""


@pytest.fixture(scope="module")
def harvested(tmp_path_factory):
    lm = lm_for("llama")
    out = tmp_path_factory.mktemp("harvest")
    acts = ie_lab.harvest(lm, TEXTS, ADDRS, out, batch_size=4, shard_rows=10, progress=False)
    return lm, acts


def test_saelens_reads_the_export_as_the_harvested_rows(harvested, tmp_path):
    py, why = V.saelens_python()
    if py is None:
        pytest.skip(why)
    lm, acts = harvested
    out, result = tmp_path / "cache", str(tmp_path / "result.json")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run(
        [py, "-c", WORKER % {"ctx": CONTEXT}, str(acts.dirs[0]), str(out), result],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    with open(result) as f:
        exp = json.load(f)["export"]
    got = torch.load(result + ".pt")
    n = len(acts) // CONTEXT * CONTEXT
    assert exp["windows"] == len(acts) // CONTEXT and exp["rows_written"] == n
    assert exp["rows_dropped"] == len(acts) - n and 0 < exp["rows_dropped"] < CONTEXT
    # the columns are the TransformerLens names of the loaded model's points
    assert exp["hook_names"] == {a: to_engine(a, lm, "transformerlens") for a in ADDRS}
    assert exp["hook_names"]["resid_post.0"] == "blocks.0.hook_resid_post"
    # windows cross prompt boundaries: some window holds rows of two prompts
    assert any(len(set(acts.prompt_ids[w : w + CONTEXT].tolist())) > 1 for w in range(0, n, CONTEXT))
    for a in ADDRS:
        rows = acts[a][:]
        loaded = got[a]
        assert loaded.shape == (n, acts.widths[a])
        assert torch.equal(loaded, rows[:n]), a  # every row, in order, bit for bit (float32 both sides)
        assert not torch.allclose(loaded, rows[1 : n + 1], atol=1e-3), a  # a neighbour's rows fail the check
        assert torch.equal(got[a + ":token_ids"], acts.token_ids[:n])
        # SAELens' training batch (its mixing buffer shuffles) holds harvested rows only
        batch = got[a + ":train_batch"]
        assert batch.shape[1] == acts.widths[a] and len(batch) > 0
        assert bool((batch[:, None, :] == rows[None, :n, :]).all(-1).any(1).all())


def test_refusals_name_the_fix(harvested, tmp_path, monkeypatch):
    _, acts = harvested
    with pytest.raises(ie_lab.InputError, match="model="):
        ie_lab.to_saelens(acts, tmp_path / "a", context_size=CONTEXT)
    with pytest.raises(ie_lab.InputError, match="fewer than one window"):
        ie_lab.to_saelens(acts, tmp_path / "a", context_size=len(acts) + 1, model="llama")
    with pytest.raises(ie_lab.InputError, match="was not harvested"):
        ie_lab.to_saelens(acts, tmp_path / "a", address="resid_post.1", model="llama")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ie_lab.InputError, match="not an empty directory"):
        ie_lab.to_saelens(acts, tmp_path / "full", context_size=CONTEXT, model="llama")
    # without `datasets` (as in ie_lab's own environment) the error names the install, and nothing is written
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ie_lab.InputError, match="pip install datasets"):
        ie_lab.to_saelens(acts.dirs[0], tmp_path / "a", context_size=CONTEXT, model="llama")
    assert not (tmp_path / "a").exists()
