"""ie_lab.harvest_on_ray on a local two-worker Ray cluster (docs/HARVEST.md, "Past one machine"): the prompts split
into contiguous parts, one harvest task per part in Ray's worker processes, the parts read as one Activations equal to
a single-process harvest row for row; a rerun skips finished parts and resumes a partial one; a rerun split another
way is refused. With sae=, the parts' features and per-feature top-k read back as the one-process harvest's. One
ray.init for the module (two CPUs, tasks of one CPU each: both parts run at once).

backend="vllm" reaches each task's Session (checked here by an engine keyword the vLLM backend refuses before any
engine starts); a real vLLM engine per part was run by hand (docs/HARVEST.md, "Past one machine"): two engines under
Ray on this CI's two cores cost more than the gate has to spare."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ie_lab
from ie_lab import harvest_ray
from ie_lab.corpus import shards as S
from tests.test_harvest import ADDRS, TEXTS, _sae

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    # Ray gives its node 30 s to come up (a constant in ray/_private/node.py) while its agent processes import; on
    # a machine already loaded by the rest of the gate that is sometimes not enough the first time (warm imports
    # then start it in seconds), so a node that timed out is started again, at most twice more.
    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception as e:
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.families import saved_model_dir

    return saved_model_dir("llama", tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def whole(model_dir, tmp_path_factory):
    """The reference: one process, one Session, the same model folder."""
    with ie_lab.Session(model_dir, progress=False) as s:
        return s.harvest(TEXTS, ADDRS, tmp_path_factory.mktemp("whole"), batch_size=3, progress=False, **SAE)


SAE = {"sae": _sae(), "top_k": 4}  # resid_post.1's features, each feature's 4 largest rows


def _same(a: ie_lab.Activations, b: ie_lab.Activations) -> None:
    assert len(a) == len(b) and a.n_prompts == b.n_prompts and a.addresses == b.addresses
    for col in ("token_ids", "prompt_ids", "positions"):
        assert torch.equal(getattr(a, col), getattr(b, col)), col
    for addr in a.addresses:
        # batches differ between the parts and the one process (other neighbours, other padding): equal to float
        # rounding, while a neighbouring prompt's or token's row is nowhere near
        assert torch.allclose(a[addr][:], b[addr][:], atol=1e-5, rtol=1e-4), addr
    # the SAE's features row for row, and each feature's top rows: the parts' shards' top-k merged by the reader
    # equal one harvest's (a part's shard keeps only its own rows' top 4)
    assert a.sae == b.sae
    dense = b.features(slice(None))
    assert torch.allclose(a.features(slice(None)), dense, atol=1e-5) and int((dense != 0).sum()) > 0
    for f in range(dense.shape[1]):
        (va, ra), (vb, rb) = a.top_rows(f), b.top_rows(f)
        assert torch.equal(ra, rb) and torch.allclose(va, vb, atol=1e-5), f


def test_parts_on_two_workers_read_as_the_single_process_harvest(cluster, model_dir, whole, tmp_path):
    out = tmp_path / "parts"
    acts = harvest_ray.harvest_on_ray(model_dir, TEXTS, ADDRS, out, shards=3, batch_size=2, shard_rows=8, **SAE)
    assert harvest_ray.part_ranges(len(TEXTS), 3) == [(0, 4), (4, 7), (7, 10)]
    _same(acts, whole)
    assert sorted(p.name for p in out.iterdir()) == ["part-00000", "part-00001", "part-00002", "parts.json"]
    # each part is an ordinary harvest of its own range (prompt ids from 0 in it)
    part1 = ie_lab.Activations(out / "part-00001")
    assert part1.n_prompts == 3 and int(part1.prompt_ids.max()) == 2
    assert torch.equal(part1["mlp_out.1"][part1.rows_of(0)], acts["mlp_out.1"][acts.rows_of(4)])
    # the neighbour check the comparison rests on: prompt 5's rows are not prompt 4's
    assert not torch.allclose(acts["resid_post.0"][acts.rows_of(4)][:2], acts["resid_post.0"][acts.rows_of(5)][:2])

    # a rerun: part 0 finished (left alone), part 1 gone (run again), part 2 cut back to its first shard (resumed)
    stamp = {f: f.stat().st_mtime_ns for f in (out / "part-00000").iterdir()}
    shutil.rmtree(out / "part-00001")
    m = S.read_manifest(out / "part-00002")
    assert len(m["shards"]) > 1
    first = m["shards"][0]
    m.update(shards=[first], prompts_done=first["prompts"][1], rows=first["rows"], complete=False)
    (out / "part-00002" / S.MANIFEST).write_text(json.dumps(m))
    again = harvest_ray.harvest_on_ray(model_dir, TEXTS, ADDRS, out, shards=3, batch_size=2, shard_rows=8, **SAE)
    _same(again, whole)
    assert {f: f.stat().st_mtime_ns for f in (out / "part-00000").iterdir()} == stamp

    with pytest.raises(ie_lab.InputError, match="split"):  # the same out_dir split another way
        harvest_ray.harvest_on_ray(model_dir, TEXTS, ADDRS, out, shards=2)
    with pytest.raises(ie_lab.InputError, match="other inputs"):  # finished parts are never taken for other texts
        harvest_ray.harvest_on_ray(model_dir, TEXTS[::-1], ADDRS, out, shards=3)


def test_bad_input_is_refused_before_any_task(tmp_path, model_dir):
    with pytest.raises(ie_lab.InputError, match="save the model"):
        harvest_ray.harvest_on_ray(object(), TEXTS, ADDRS, tmp_path, shards=2)
    with pytest.raises(ie_lab.InputError, match="shards must be"):
        harvest_ray.harvest_on_ray(model_dir, TEXTS, ADDRS, tmp_path, shards=0)
    with pytest.raises(ie_lab.InputError, match="list of texts"):
        harvest_ray.harvest_on_ray(model_dir, iter(TEXTS), ADDRS, tmp_path, shards=2)
    with pytest.raises(ie_lab.InputError, match="sae= takes an ie_lab SAE"):
        harvest_ray.harvest_on_ray(model_dir, TEXTS, ADDRS, tmp_path, shards=2, sae=object())
    assert not (tmp_path / harvest_ray.PLAN).exists()
    assert harvest_ray.part_ranges(2, 5) == [(0, 1), (1, 2)]  # never an empty part


def test_the_backend_and_session_keywords_reach_each_tasks_session(cluster, model_dir, tmp_path):
    """backend="vllm" and session_kwargs travel to the Session each task opens: the vLLM backend refuses this engine=
    in the task, before importing vLLM or starting an engine (a real engine per part: docs/HARVEST.md)."""
    with pytest.raises(ie_lab.InputError, match="unknown engine 'bogus'"):
        harvest_ray.harvest_on_ray(
            model_dir, TEXTS, ADDRS, tmp_path / "v", shards=2, backend="vllm", session_kwargs={"engine": "bogus"}
        )
    assert not (tmp_path / "v" / "part-00000" / S.MANIFEST).exists()
