"""vLLM's data parallelism (Session(..., backend="vllm", data_parallel_size=2)) on this CPU: two engine processes
behind one Session, ie_lab's hooks installed on both, each registered request pinned to one rank and read back from
it. A harvest and steered generations with captures equal eager's prompt by prompt, and both ranks served some of
them (each worker counts the registered requests it ran a forward of: a rank that had lost its hooks would come back
empty and fail the comparison, and one that served nothing fails the count). close() leaves no engine process.

One DP=2 engine for the module (its start is nearly all of this file's time: a coordinator and two engine processes,
each importing torch and vLLM); the refusals need no engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

pytest.importorskip("vllm")

import ie_lab  # noqa: E402
from ie_lab.errors import CapabilityUnsupported, InputError  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402
from tests.vllm_helpers import PROMPTS, close, eager_for  # noqa: E402

ADDRS = ["resid_post.1", "mlp_out.0", "z.1.head-2"]


def _engine_processes(before: set[int]) -> list[str]:
    """This process's live descendants started since `before` (Python's resource tracker aside: it lives until the
    process exits)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid in before or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in cmd:
            out.append(f"{p.pid} {cmd[:100]}")
    return out


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    import psutil

    path = saved_model_dir("llama", tmp_path_factory.mktemp("dp_models"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    s = ie_lab.Session(path, backend="vllm", progress=False, replace=False, data_parallel_size=2)
    yield s, before
    s.close()


def _ran(s) -> dict[int, int]:
    """dp rank -> registered requests its worker ran, with every worker idle."""
    state = s.worker_state()
    assert all(w["specs"] == [] and not w["rows_in_flight"] and w["installed"] for w in state), state
    return {w["dp_rank"]: w["requests_run"] for w in state}


def test_refused_combinations_name_the_fix(tmp_path):
    path = saved_model_dir("llama", tmp_path)
    for bad in (0, True, 1.5):
        with pytest.raises(InputError, match="positive integer"):
            ie_lab.Session(path, backend="vllm", data_parallel_size=bad)
    with pytest.raises(InputError, match="engine='auto'"):
        ie_lab.Session(path, backend="vllm", data_parallel_size=2, engine="inproc")
    with pytest.raises(CapabilityUnsupported, match="tensor_parallel_size"):
        ie_lab.Session(path, backend="vllm", data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(CapabilityUnsupported, match="mode='hooks'"):
        ie_lab.Session(path, backend="vllm", data_parallel_size=2, graph_points=["resid_post.0"])
    with pytest.raises(CapabilityUnsupported, match=r"Session\(\.\.\., data_parallel_size=\.\.\.\)"):
        ie_lab.Session(path, backend="vllm", engine_kwargs={"data_parallel_size": 2})
    # a mixture of experts: vLLM's ranks run its layers together (refused from the config, before any engine)
    with pytest.raises(CapabilityUnsupported, match="mixture of experts"):
        ie_lab.Session(saved_model_dir("mixtral", tmp_path), backend="vllm", progress=False, data_parallel_size=2)


def test_requests_go_to_the_least_busy_rank_and_in_turn_when_tied():
    from ie_lab.vllm.engine import AsyncDriver

    d = AsyncDriver(None, dp=2)  # no engine: the bookkeeping alone
    one_at_a_time = []
    for i in range(4):
        d.assign(f"s{i}")
        one_at_a_time.append(d.rank_of[f"s{i}"])
        d.release(f"s{i}")
    assert one_at_a_time == [0, 1, 0, 1] and d.busy == [0, 0] and d.rank_of == {}
    for i in range(3):
        d.assign(f"c{i}")
    d.release("c1")  # rank 1 now has none in flight, rank 0 two
    d.assign("c3")
    assert [d.rank_of[k] for k in ("c0", "c2", "c3")] == [0, 0, 1] and d.busy == [2, 1]


def test_harvest_on_two_ranks_equals_eager_prompt_by_prompt(dp, tmp_path_factory):
    s, _ = dp
    assert s.engine_kind == "async" and "data parallel 2" in s.describe()
    was = _ran(s)
    assert sorted(was) == [0, 1]  # one worker per rank, each with ie_lab's hooks installed
    eager = ie_lab.harvest(eager_for("llama"), PROMPTS, ADDRS, tmp_path_factory.mktemp("eager"), progress=False)
    got = s.harvest(PROMPTS, ADDRS, tmp_path_factory.mktemp("dp"), batch_size=8, progress=False)
    ran = _ran(s)
    # both ranks served prompts, and between them every prompt once
    assert ran[0] > was[0] and ran[1] > was[1], (was, ran)
    assert ran[0] + ran[1] - was[0] - was[1] == len(PROMPTS)
    assert got.n_prompts == len(PROMPTS) == eager.n_prompts
    for col in ("token_ids", "prompt_ids", "positions"):
        assert (getattr(got, col) == getattr(eager, col)).all(), col
    for i in range(len(PROMPTS)):
        rows = eager.rows_of(i)
        for a in ADDRS:
            assert close(got[a][got.rows_of(i)], eager[a][rows]), (i, a)
    # a neighbour fails: another point's rows, the next prompt's rows
    assert not close(got["resid_post.1"][:], eager["mlp_out.0"][:])
    n = min(len(eager.rows_of(1)), len(eager.rows_of(2)))
    assert not close(got["resid_post.1"][got.rows_of(1)][:n], eager["resid_post.1"][eager.rows_of(2)][:n])


def test_steered_generations_with_captures_equal_eager_on_both_ranks(dp):
    """Steering reaches each rank's hooks, and a capture's follow-up forward (the last token's rows) runs on the rank
    its generation ran on."""
    from ie_lab.eager.steer import make_spec

    s, _ = dp
    eager = eager_for("llama")
    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(4)) * 3
    caps = ["resid_post.1", "attn_out.0"]
    was = _ran(s)

    async def together():
        spec = s.steer("resid_mid.1", v, scale=2.0)
        return await asyncio.gather(*(s.agenerate(p, 5, capture=caps, steer=spec) for p in PROMPTS[:4]))

    got = asyncio.run(together())
    ran = _ran(s)
    assert ran[0] > was[0] and ran[1] > was[1], (was, ran)
    with make_spec(eager, "resid_mid.1", v, scale=2.0):
        want = [ie_lab.generate(eager, p, 5, capture=caps) for p in PROMPTS[:4]]
    plain = ie_lab.generate(eager, PROMPTS[0], 5, capture=caps)
    for p, g, w in zip(PROMPTS, got, want):
        assert g.ids == w.ids, p
        for a in caps:
            assert close(g.cache[a], w.cache[a]), (p, a)
    assert not close(got[0].cache["resid_post.1"], plain.cache["resid_post.1"])  # the steering did change it


def test_graph_mode_refused_then_close_leaves_no_engine_process(dp):
    s, before = dp
    with pytest.raises(CapabilityUnsupported, match="mode='hooks'"):
        s.set_mode(graph_points=["resid_post.0"], reload=True)
    s.generate(PROMPTS[0], 3)  # refused before anything was closed: the engines still serve
    assert _engine_processes(before), "the engines' processes should be running before close"
    s.close()
    deadline = time.time() + 30
    while _engine_processes(before) and time.time() < deadline:
        time.sleep(0.5)
    assert _engine_processes(before) == []
