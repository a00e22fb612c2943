"""Shared pieces of the vLLM tests: which families, which addresses, one engine per module."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ie_lab
from ie_lab import points
from tests.families import make_model, make_tokenizer, saved_model_dir

TEXT = "the cat sat on the mat and Mary went to the store"
# Eight prompts of different lengths, for the concurrent-request tests.
PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "Paris is the capital of France and",
    "John gave a book to",
    "the dog ran in the park",
    "Alice and Bob went to the beach",
    "one two three four five",
    "the old man walked to the station",
]


def served_addresses(session) -> list[str]:
    """Every address the registry marks served on vLLM that exists on this model."""
    from ie_lab.errors import CapabilityUnsupported, PointAbsent
    from ie_lab.vllm.checks import check_served

    out = []
    f = session.facts
    for name in points.served("vllm"):
        p = points.get(name)
        if p.multi_stream_only:
            continue
        for L in [None] if p.scope is points.Scope.TRUNK else range(f.n_layers):
            a = ie_lab.Address(name, L)
            try:
                check_served(session._lm, a)
            except (PointAbsent, CapabilityUnsupported):
                continue
            out.append(str(a))
    return out


def eager_for(family: str):
    # attn_implementation="eager": the kernel that applies soft-capping, like vLLM's (sdpa ignores it)
    return ie_lab.load(make_model(family, attn_implementation="eager"), make_tokenizer(), quiet=True)


def vllm_session(family: str, tmp_root, **kw):
    return ie_lab.Session(saved_model_dir(family, tmp_root), backend="vllm", progress=False, replace=False, **kw)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4) -> bool:
    if a.shape != b.shape:
        return False
    fin = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), fin):
        return False
    return bool(torch.allclose(a[fin].float(), b[fin].float(), atol=atol, rtol=1e-4))


@contextlib.contextmanager
def tiny_session(family: str, overrides: dict, tmp_path_factory, tweak=None):
    """The coverage survey's tiny instance of a model type, with config keys set before the config derives others
    (coverage.OVERRIDES, patched for the duration of the build), saved, loaded on eager and opened on vLLM:
    (session, eager model, path). tweak(model), where given, edits the built model's weights before it is saved
    (a parameter transformers initialises to a value that would hide a difference, such as zeros)."""
    from ie_lab import coverage

    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(coverage.OVERRIDES, family, {**coverage.OVERRIDES.get(family, {}), **overrides})
        model = coverage.build_tiny(family)
    if tweak is not None:
        tweak(model)
    path = tmp_path_factory.mktemp(f"vllm_{family}")
    model.save_pretrained(path)
    coverage._tokenizer().save_pretrained(path)
    eager = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    with ie_lab.Session(str(path), backend="vllm", progress=False, replace=False) as s:
        yield s, eager, str(path)


def near(a: torch.Tensor, b: torch.Tensor) -> bool:
    """close() at b's own scale: a Mamba mixer's output on a tiny random instance is ~1e-4, where an absolute
    tolerance of 1e-4 would call any two tensors equal."""
    fin = torch.isfinite(b)
    s = float(b[fin].abs().max()) if fin.any() else 1.0
    s = s if s > 0 else 1.0
    return close(a / s, b / s)


def assert_graph_mode_equals_eager(path: str, eager, pts: list[str], same=close) -> None:
    """Graph mode (a compiled trunk with static taps on pts, one steering site, pts[0]) captures what eager does, and
    steering pts[0] gives eager's steered pts[-1], which the steering does change."""
    from ie_lab.eager.steer import make_spec

    last = pts[-1]
    v = torch.randn(eager.facts.d_model, generator=torch.Generator().manual_seed(4)) * 3
    with ie_lab.Session(
        path, backend="vllm", progress=False, replace=False, graph_points=pts, steer_points=pts[:1]
    ) as g:
        c = g.capture(TEXT, pts)
        with g.steer(pts[0], v, scale=2.0):
            got = g.capture(TEXT, [last])[last]
    ce = ie_lab.capture(eager, TEXT, pts)
    assert [p for p in pts if not same(c[p], ce[p])] == []
    with make_spec(eager, pts[0], v, scale=2.0):
        want = ie_lab.capture(eager, TEXT, [last])[last]
    assert same(got, want) and not same(got, ce[last])


def assert_steering_equals_eager(s, eager, addrs, last: str, same=close) -> None:
    """Steering each address on vLLM gives the stream `last` that eager gives under the same spec, and does change
    it; `same` compares (close by default; a scale-aware comparison where tensors are tiny)."""
    from ie_lab.eager.steer import make_spec

    v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(4)) * 3
    plain = ie_lab.capture(eager, TEXT, [last])[last]
    for addr in addrs:
        with s.steer(addr, v, scale=2.0):
            got = s.capture(TEXT, [last])[last]
        with make_spec(eager, addr, v, scale=2.0):
            want = ie_lab.capture(eager, TEXT, [last])[last]
        assert same(got, want), addr
        assert not same(got, plain), addr  # the steering did change it
    assert s.worker_state()[0]["specs"] == []


@contextlib.contextmanager
def ends_cleanly():
    """The processes a Session starts inside the block are gone when it has closed (Python's resource tracker, which
    lives as long as this process, aside), and vLLM logged no process it had to kill (its process manager waits 5 s
    for an engine core to end, then kills it with a warning; tests/test_vllm_child_exit.py)."""
    import logging

    import psutil

    def children() -> set[tuple[int, str]]:
        out = set()
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "resource_tracker" not in cmd:
                out.add((p.pid, cmd[:120]))
        return out

    class Kills(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.seen: list[str] = []

        def emit(self, record):
            text = record.getMessage()
            if "force killing" in text or "still running" in text:
                self.seen.append(text)

    before = children()
    kills = Kills()
    log = logging.getLogger("vllm")
    log.addHandler(kills)
    try:
        yield
    finally:
        log.removeHandler(kills)
    assert kills.seen == [], kills.seen
    assert children() - before == set(), "processes left after Session.close()"
