"""Session modes on the vLLM backend: 'generate' (vLLM's compiled model, no hooks) and switching modes.

Two engine starts in all (torch.compile on CPU is slow): one Session starts in generation-only mode, and the last
test switches it to hooks mode with a reload. Greedy ids are compared with eager transformers and across modes, so
a compiled model that generated differently, or a switch that kept the old engine, fails.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.errors import CapabilityUnsupported, InputError  # noqa: E402
from tests.families import saved_model_dir  # noqa: E402
from tests.vllm_helpers import TEXT, eager_for, vllm_session  # noqa: E402

PROMPTS = [
    "the cat sat on the mat",
    "Mary went to the store and",
    "one two three four five six seven",
    "John gave a book to",
]
N = 8


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    s = vllm_session("llama", tmp_path_factory.mktemp("modes_llama"), mode="generate")
    yield s
    s.close()


@pytest.fixture(scope="module")
def eager_ids():
    e = eager_for("llama")
    return {p: ie_lab.generate(e, p, N, ignore_eos=True).ids for p in PROMPTS}


def _greedy_everywhere(s) -> dict:
    """Greedy ids of every prompt by generate, generate_stream and concurrent agenerate."""

    async def many():
        return await asyncio.gather(*(s.agenerate(p, N, ignore_eos=True) for p in PROMPTS))

    return {
        "generate": {p: s.generate(p, N, ignore_eos=True).ids for p in PROMPTS},
        "stream": {p: [st.token_id for st in s.generate_stream(p, N, ignore_eos=True)] for p in PROMPTS},
        "agenerate": {p: g.ids for p, g in zip(PROMPTS, asyncio.run(many()))},
    }


def test_generate_mode_is_compiled_with_nothing_installed(gen):
    cfg = gen._backend._driver.engine.vllm_config
    assert cfg.model_config.enforce_eager is False
    assert cfg.compilation_config.mode != 0  # torch.compile traced the model
    assert gen.mode == "generate"
    assert "generation-only mode" in gen.describe()
    assert gen.worker_state()[0]["hooks"] == 0


def test_plain_generation_equals_eager(gen, eager_ids):
    got = _greedy_everywhere(gen)
    for how, ids in got.items():
        assert ids == eager_ids, how


def test_every_hook_operation_is_refused_naming_the_mode(gen):
    spec = ie_lab.steer(eager_for("llama"), "resid_post.0", torch.ones(128))
    calls = {
        "capture": lambda: gen.capture(TEXT, ["resid_post.0"]),
        "steering": lambda: gen.steer("resid_post.0", torch.ones(128)),
        "attention()": lambda: gen.attention(TEXT, [0]),
        "the logit lens": lambda: gen.logit_lens(TEXT),
        "project()": lambda: gen.project(TEXT, "resid_post.0", torch.ones(2, 128)),
        "generation with capture=": lambda: gen.generate(TEXT, 2, capture=["resid_post.0"]),
        "generation with capture= or steering": lambda: gen.generate(TEXT, 2, steer=spec),
        "generate_stream(capture=)": lambda: list(gen.generate_stream(TEXT, 2, capture=["resid_post.0"])),
        "agenerate(capture=)": lambda: asyncio.run(gen.agenerate(TEXT, 2, capture=["resid_post.0"])),
        "acapture": lambda: asyncio.run(gen.acapture(TEXT, ["resid_post.0"])),
    }
    for what, call in calls.items():
        with pytest.raises(CapabilityUnsupported) as e:
            call()
        msg = str(e.value)
        assert "mode='generate'" in msg and "set_mode('hooks', reload=True)" in msg, (what, msg)
    assert all(not r.served for r in gen.points().rows)
    assert gen.generate(TEXT, 2, ignore_eos=True).ids  # still serving plain generation


def test_bad_modes_are_refused_before_anything_starts(tmp_path):
    path = saved_model_dir("llama", tmp_path)
    for kw in (
        {"mode": "fast"},
        {"mode": "graph"},
        {"mode": "generate", "graph_points": ["resid_post.0"]},
        {"mode": "generate", "engine_kwargs": {"enforce_eager": True}},
    ):
        with pytest.raises(InputError):
            ie_lab.Session(path, backend="vllm", progress=False, replace=False, **kw)
    with pytest.raises(CapabilityUnsupported, match="mode='generate'"):
        ie_lab.Session(path, backend="vllm", progress=False, replace=False, engine_kwargs={"enforce_eager": False})


def test_switching_says_it_reloads_then_reloads_on_request(gen, eager_ids):
    gen.set_mode("generate")  # already there: nothing to do, nothing reloaded
    engine = gen._backend._driver.engine
    with pytest.raises(CapabilityUnsupported, match="reload=True"):
        gen.set_mode("hooks")
    with pytest.raises(InputError):
        gen.set_mode()
    with pytest.raises(CapabilityUnsupported):  # checked before the engine is touched
        gen.set_mode(graph_points=["lm_head"], reload=True)
    assert gen.mode == "generate" and gen._backend._driver.engine is engine
    assert gen.generate(PROMPTS[0], N, ignore_eos=True).ids == eager_ids[PROMPTS[0]]

    gen.set_mode("hooks", reload=True)
    assert gen.mode == "hooks"
    assert engine.engine_core is not gen._backend._driver.engine.engine_core
    assert gen._backend._driver.engine.vllm_config.model_config.enforce_eager is True
    got = _greedy_everywhere(gen)  # the SAME greedy ids as in generation-only mode (and eager)
    for how, ids in got.items():
        assert ids == eager_ids, how
    c = gen.capture(TEXT, ["resid_post.0"])  # hooks are back
    e = ie_lab.capture(eager_for("llama"), TEXT, ["resid_post.0"])
    assert torch.allclose(c["resid_post.0"].float(), e["resid_post.0"].float(), atol=1e-4)
    assert gen.worker_state()[0]["specs"] == []
