"""The corpus harvest (docs/HARVEST.md): rows on disk equal the capture of each prompt, padding never leaks, a run
stopped by an interrupt or killed mid-shard resumes to exactly the uninterrupted harvest, and a directory holding
another harvest is never mixed into."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, lm_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# lengths 6, 2, 7, 1, ...: every batch of three mixes lengths, so a shorter prompt sits beside padding
TEXTS = [
    "the cat sat on the mat",
    "a dog",
    "one two three four five six seven",
    "x",
    "Mary went to the store and",
    "John gave a book to Alice",
    "blue sky",
    "the old man walked to the station",
    "red sun up",
    "Paris is the capital",
]
ADDRS = ["resid_post.0", "mlp_out.1", "z.1.head-2", "final_norm"]


@pytest.fixture(scope="module")
def lm():
    return lm_for("llama")


@pytest.fixture(scope="module")
def whole(lm, tmp_path_factory):
    """The uninterrupted harvest every other one is compared with: batches of 3, a shard every ~12 rows."""
    out = tmp_path_factory.mktemp("whole")
    return ie_lab.harvest(lm, TEXTS, ADDRS, out, batch_size=3, shard_rows=12, progress=False)


def _same(a: ie_lab.Activations, b: ie_lab.Activations) -> None:
    assert len(a) == len(b) and a.n_prompts == b.n_prompts and a.addresses == b.addresses
    for col in ("token_ids", "prompt_ids", "positions"):
        assert torch.equal(getattr(a, col), getattr(b, col)), col
    for addr in a.addresses:
        assert torch.equal(a[addr][:], b[addr][:]), addr


def test_rows_equal_each_prompts_own_capture(lm, whole):
    acts = whole
    assert acts.n_prompts == len(TEXTS) and acts.addresses == ADDRS and len(acts.manifest["shards"]) > 2
    alone = [ie_lab.capture(lm, t, ADDRS) for t in TEXTS]
    batched = ie_lab.capture(lm, TEXTS[:3], ADDRS)  # the same right-padded forward as the harvest's first batch
    assert len(acts) == sum(c.tokens.shape[1] for c in alone)
    for i, c in enumerate(alone):
        r = acts.rows_of(i)
        n = c.tokens.shape[1]
        assert len(r) == n
        assert torch.equal(acts.token_ids[r.start : r.stop], c.tokens[0])
        assert torch.equal(acts.positions[r.start : r.stop], torch.arange(n))
        assert torch.equal(acts.prompt_ids[r.start : r.stop], torch.full((n,), i))
        for a in ADDRS:
            got = acts[a][r]
            assert got.shape == c[a][0].shape and torch.allclose(got, c[a][0], atol=1e-5, rtol=1e-5), (i, a)
            if i < 3:
                assert torch.equal(got, batched[i][a][0]), (i, a)
    # a neighbour fails: the next layer's point, the same point one row along
    other = ie_lab.capture(lm, TEXTS[0], ["resid_post.1"])["resid_post.1"][0]
    r = acts.rows_of(0)
    assert not torch.allclose(acts["resid_post.0"][r], other, atol=1e-3)
    shifted = acts["resid_post.0"][range(r.start + 1, r.stop + 1)]
    assert not torch.allclose(shifted, alone[0]["resid_post.0"][0], atol=1e-3)
    assert_clean(lm)


def test_rows_index_like_a_tensor_and_read_with_safetensors(whole):
    from safetensors import safe_open

    x = whole["mlp_out.1"]
    full = torch.cat([t for _, t in x.chunks()])
    assert x.shape == tuple(full.shape) == (len(whole), 128) and x.dtype == torch.float32
    idx = torch.tensor([len(whole) - 1, 0, 17, 5])
    assert torch.equal(x[idx], full[idx]) and torch.equal(x[3], full[3]) and torch.equal(x[:, 7], full[:, 7])
    assert torch.equal(x[5:40, 2:4], full[5:40, 2:4])
    mask = whole.positions == 0
    assert torch.equal(x[mask], full[mask]) and int(mask.sum()) == whole.n_prompts
    shard = whole.dirs[0] / whole.manifest["shards"][1]["file"]
    base = whole.manifest["shards"][0]["rows"]
    with safe_open(str(shard), "pt") as f:  # the shards are plain safetensors files
        rows = f.get_tensor("act:mlp_out.1")
        assert torch.equal(rows, full[base : base + rows.shape[0]])
        assert torch.equal(f.get_tensor("token_ids"), whole.token_ids[base : base + rows.shape[0]])


def test_several_runs_read_as_one(lm, whole, tmp_path):
    second = ie_lab.harvest(lm, TEXTS[:4], ADDRS, tmp_path, batch_size=4, progress=False)
    both = ie_lab.Activations([whole.dirs[0], tmp_path])
    assert both.n_prompts == len(TEXTS) + 4 and len(both) == len(whole) + len(second)
    r = both.rows_of(len(TEXTS) + 2)  # the second run's prompt 2
    assert torch.equal(both["resid_post.0"][r], whole["resid_post.0"][whole.rows_of(2)])
    assert torch.equal(both.prompt_ids[len(whole) :], second.prompt_ids + len(TEXTS))


def test_progress_bar_counts_tokens_per_second(lm, tmp_path, capfd):
    ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "a", batch_size=4, progress=False)
    assert "harvest" not in capfd.readouterr().err
    ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "b", batch_size=4)
    err = capfd.readouterr().err
    assert "harvest resid_post.0" in err and "tok/s" in err and "/10 prompts" in err, err


def test_resume_after_an_interrupt_equals_the_uninterrupted_harvest(lm, whole, tmp_path, monkeypatch):
    from ie_lab.eager import harvest as eager_harvest

    real = eager_harvest._capture_ids
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eager_harvest, "_capture_ids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ie_lab.harvest(lm, TEXTS, ADDRS, tmp_path, batch_size=3, shard_rows=12, progress=False)
    done = json.loads((tmp_path / "manifest.json").read_text())
    assert 0 < done["prompts_done"] < len(TEXTS) and not done["complete"]
    assert_clean(lm)
    monkeypatch.setattr(eager_harvest, "_capture_ids", real)
    _same(ie_lab.harvest(lm, TEXTS, ADDRS, tmp_path, batch_size=3, shard_rows=12, progress=False), whole)


KILLED = """
import sys
from tests.conftest import lm_for
import ie_lab
from tests.test_harvest import ADDRS, TEXTS
ie_lab.harvest(lm_for("llama"), TEXTS, ADDRS, sys.argv[1], batch_size=3, shard_rows=12, progress=False)
"""


def test_resume_after_a_kill_mid_shard_equals_the_uninterrupted_harvest(lm, whole, tmp_path):
    """The process SIGKILLs itself once shard 1 is on disk and its manifest entry is not: the next run drops that
    shard, keeps shard 0, and ends equal to the harvest that was never stopped."""
    env = {**os.environ, "IE_LAB_HARVEST_KILL": "shard_written:1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], cwd=ROOT, env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    done = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["file"] for s in done["shards"]] == ["shard-00000.safetensors"]
    assert (tmp_path / "shard-00001.safetensors").exists()  # written, never committed
    _same(ie_lab.harvest(lm, TEXTS, ADDRS, tmp_path, batch_size=3, shard_rows=12, progress=False), whole)


class Columns:
    """What a datasets.Dataset offers a reader (column_names, len, a slice as a dict of columns), nothing more."""

    column_names = ["id", "body"]

    def __init__(self, texts):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, key):
        return {"id": list(range(len(self.texts)))[key], "body": self.texts[key]}


def test_a_dataset_with_a_text_column(lm, whole, tmp_path):
    with pytest.raises(ie_lab.InputError, match=r"no column 'text'.*\['id', 'body'\].*text_column="):
        ie_lab.harvest(lm, Columns(TEXTS), ADDRS, tmp_path, progress=False)
    acts = ie_lab.harvest(lm, Columns(TEXTS), ADDRS, tmp_path, text_column="body", batch_size=3, progress=False)
    _same(acts, whole)


def test_bad_input_is_refused_naming_the_fix(lm, whole, tmp_path):
    out = whole.dirs[0]
    with pytest.raises(ie_lab.AddressError, match="resid_postt"):
        ie_lab.harvest(lm, TEXTS, ["resid_postt.0"], tmp_path / "x", progress=False)
    with pytest.raises(ie_lab.AddressError, match="per-token point"):
        ie_lab.harvest(lm, TEXTS, ["attn_probs.0"], tmp_path / "x", progress=False)
    with pytest.raises(ie_lab.InputError, match="wrap it in a list"):
        ie_lab.harvest(lm, TEXTS[0], ADDRS, tmp_path / "x", progress=False)
    with pytest.raises(ie_lab.InputError, match=r"another harvest \(addresses.*give a new out_dir"):
        ie_lab.harvest(lm, TEXTS, ["resid_post.1"], out, progress=False)
    with pytest.raises(ie_lab.InputError, match=r"another harvest \(model.*give a new out_dir"):
        ie_lab.harvest(lm_for("gpt2"), TEXTS, ADDRS, out, progress=False)
    with pytest.raises(ie_lab.InputError, match="harvest of other inputs"):
        ie_lab.harvest(lm, TEXTS[::-1], ADDRS, out, batch_size=3, progress=False)
    with pytest.raises(ie_lab.InputError, match="shard_rows must be a positive integer"):
        ie_lab.harvest(lm, TEXTS, ADDRS, tmp_path / "x", shard_rows=0, progress=False)
    with pytest.raises(ie_lab.InputError, match="holds no harvest"):
        ie_lab.Activations(tmp_path)
    _same(ie_lab.Activations(out), whole)  # nothing was mixed in
    assert_clean(lm)


def test_prepend_bos_reaches_the_texts_and_other_weights_are_refused(lm, whole, tmp_path):
    """prepend_bos follows the door's rule (the call's keyword, else the Session's) on every text harvest reads; a
    model of the same name and architecture with other weights never resumes into a harvest folder."""
    import copy

    from tests.families import make_model, make_tokenizer

    texts, at = TEXTS[:4], ["resid_post.0"]
    bos = lm.tokenizer.bos_token_id
    with ie_lab.Session(make_model("llama"), make_tokenizer(), prepend_bos=True, progress=False) as s:
        with_bos = s.harvest(texts, at, tmp_path / "bos", batch_size=3, progress=False)  # the Session's True
        plain = s.harvest(texts, at, tmp_path / "plain", batch_size=3, progress=False, prepend_bos=False)
        for i, t in enumerate(texts):
            a, b = with_bos.rows_of(i), plain.rows_of(i)
            assert len(a) == len(b) + 1 and int(with_bos.token_ids[a.start]) == bos
            assert torch.equal(with_bos.token_ids[a.start + 1 : a.stop], plain.token_ids[b.start : b.stop])
            assert torch.allclose(with_bos[at[0]][a], s.capture(t, at)[at[0]][0], atol=1e-5)  # the door's ids
            assert torch.allclose(plain[at[0]][b], s.capture(t, at, prepend_bos=False)[at[0]][0], atol=1e-5)
        # the BOS changes every later row too (attention reads it), so the rows are not the plain ones shifted
        assert not torch.allclose(with_bos[at[0]][a][1:], plain[at[0]][b], atol=1e-3)
        assert with_bos.manifest["prepend_bos"] is True and plain.manifest["prepend_bos"] is False
        with pytest.raises(ie_lab.InputError, match=r"another harvest \(prepend_bos"):
            s.harvest(texts, at, tmp_path / "bos", prepend_bos=None, progress=False)
    free = ie_lab.harvest(lm, texts, at, tmp_path / "free", prepend_bos=True, progress=False)  # the free function
    assert torch.equal(free.token_ids, with_bos.token_ids)

    other = copy.deepcopy(lm.hf)  # one weight moved by 1e-3: the same name, architecture and tokenizer
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    other_lm = ie_lab.load(other, lm.tokenizer, quiet=True)
    assert other_lm.name == lm.name and other_lm.facts == lm.facts
    with pytest.raises(ie_lab.InputError, match=r"other weights.*give a new out_dir, or load the weights"):
        ie_lab.harvest(other_lm, TEXTS, ADDRS, whole.dirs[0], progress=False)
    assert ie_lab.harvest(lm, TEXTS, ADDRS, whole.dirs[0], progress=False).manifest["weights"]["from"] == "parameters"


def test_checkpoint_files_identify_a_served_models_weights(tmp_path):
    """vLLM's weights are in its engine's process: they are identified by the checkpoint files (a hub download by
    its blob's SHA-256 name, read from the link, not the bytes); an eager harvest cannot be checked against them."""
    from ie_lab.corpus import identity

    (tmp_path / "m").mkdir()
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(b"weights one")
    one = identity.files_hash(str(tmp_path / "m"))
    f.write_bytes(b"weights two")
    assert identity.files_hash(str(tmp_path / "m")) != one and identity.files_hash(str(tmp_path / "none")) is None
    blob = tmp_path / "blobs" / ("ab" * 32)  # a hub cache: the link's target is named by the file's SHA-256
    blob.parent.mkdir()
    blob.write_bytes(b"weights one")
    f.unlink()
    f.symlink_to(blob)
    linked = identity.files_hash(str(tmp_path / "m"))
    blob.write_bytes(b"weights two")  # the name is trusted, the bytes not read again
    assert identity.files_hash(str(tmp_path / "m")) == linked != one
    why = identity.check_weights("out", {"from": "parameters", "hash": "x"}, {"from": "files", "hash": "x"})
    assert "continue it on the backend it was started on" in why
    assert identity.check_weights("out", None, {"from": "files", "hash": "x"}) is None  # a harvest from before


def _sae():
    from ie_lab.sae import SAE

    g = torch.Generator().manual_seed(3)
    W = torch.randn(128, 48, generator=g) / 8
    return SAE(
        W,
        torch.randn(48, generator=g) / 4 - 0.3,
        None,
        torch.randn(128, generator=g) / 10,
        "relu",
        address=ie_lab.Address.parse("resid_post.1"),
    )


def test_sae_features_are_the_projection_kept_sparse_with_each_features_top_rows(lm, tmp_path, monkeypatch):
    from ie_lab.eager import harvest as eager_harvest

    sae = _sae()
    kw = dict(batch_size=3, shard_rows=12, progress=False, sae=sae, top_k=4)
    acts = ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "whole", **kw)
    assert acts.sae["d_sae"] == 48 and acts.addresses == ["resid_post.0"]  # the SAE's point was captured, not kept
    dense = acts.features(slice(None))
    assert dense.shape == (len(acts), 48) and 0 < int((dense != 0).sum()) < dense.numel()
    assert torch.equal(acts.features([30, 0, 30]), dense[[30, 0, 30]]) and torch.equal(acts.features(7), dense[7])
    for i, t in enumerate(TEXTS):  # each prompt's features are s.project's scores with the SAE's encoder
        want = ie_lab.project(lm, t, "resid_post.1", sae.encoder(), activation="relu").scores
        assert torch.allclose(acts.features(acts.rows_of(i)), want, atol=1e-5), i
    other = ie_lab.project(lm, TEXTS[0], "resid_post.0", sae.encoder(), activation="relu").scores
    assert not torch.allclose(acts.features(acts.rows_of(0)), other, atol=1e-3)  # another point's fails
    for f in (0, 7, 47):  # the kept top rows are the corpus's largest active rows of that feature
        vals, rows = acts.top_rows(f)
        col = dense[:, f]
        n = min(4, int((col > 0).sum()))
        assert len(rows) == n and torch.equal(vals, col[rows])
        assert torch.equal(vals, col.topk(n).values)
    # interrupted after its first shard, then resumed: the same features and top rows
    real, calls = eager_harvest._capture_ids, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eager_harvest, "_capture_ids", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "resumed", **kw)
    monkeypatch.setattr(eager_harvest, "_capture_ids", real)
    again = ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "resumed", **kw)
    assert torch.equal(again.features(slice(None)), dense)
    assert all(torch.equal(again.top_rows(f)[1], acts.top_rows(f)[1]) for f in range(48))
    with pytest.raises(ie_lab.InputError, match=r"another harvest \(sae"):
        ie_lab.harvest(lm, TEXTS, ["resid_post.0"], tmp_path / "whole", **{**kw, "top_k": 5})
    assert_clean(lm)


def test_a_remote_session_refuses_by_name():
    from ie_lab.core import calls
    from ie_lab.remote.client import RemoteBackend
    from ie_lab.remote.ops import OPS

    assert "harvest" not in OPS  # a server has no such operation to call
    call = calls.Harvest.build((TEXTS, ADDRS, "/tmp/x"))
    with pytest.raises(ie_lab.CapabilityUnsupported, match="harvest on a remote Session.*where the model is"):
        RemoteBackend.harvest(None, call)  # the client refuses before any request
