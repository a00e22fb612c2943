import functools
import os
import signal
import sys

import pytest
import torch
from hypothesis import settings

# Property tests assert behaviour, never speed: hypothesis' default 200 ms deadline per example failed on a loaded
# 2-core machine when an example's first call imported and bound a model (FlakyFailure: DeadlineExceeded).
settings.register_profile("ie_lab", deadline=None)
settings.load_profile("ie_lab")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(1)

# vLLM on this CPU (tests/test_vllm_*.py): a 1 GiB KV cache (the default memory fraction fails on the
# sandbox's single NUMA node) and the in-process engine (loads several times faster).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from tests.families import FAMILIES, make_model, make_tokenizer  # noqa: E402

# Families the binder refuses on purpose (tested in test_arch_facts.py); everything else must bind.
UNSUPPORTED: dict[str, str] = {}  # fixture families load refuses (qwen3_next's linear-attention layers now bind)
# Hybrid trunks bind, but their mixer layers have no attention points: the all-family sweeps, which ask every layer
# for them, leave these out; tests/test_families_hybrid.py holds their own.
HYBRID = ["qwen3_next"]
SUPPORTED = [f for f in FAMILIES if f not in UNSUPPORTED and f not in HYBRID]


@functools.cache
def lm_for(family: str, attn_implementation: str | None = None):
    import ie_lab

    return ie_lab.load(make_model(family, attn_implementation=attn_implementation), make_tokenizer())


def hook_count(model: torch.nn.Module) -> int:
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_forward_hooks_with_kwargs", {}))
    return n


def assert_clean(lm) -> None:
    """No hook registered, attention registry restored: the model is exactly as before."""
    from ie_lab.arch import attention_tap

    assert hook_count(lm.hf) == 0, "a hook was left registered"
    assert not attention_tap.is_installed(), "the attention tap was left installed"


@pytest.fixture()
def ctrl_c_raises():
    """Ctrl-C as a notebook kernel or an interactive Python has it, for tests that interrupt with SIGINT. A test run
    started as a background job (`cmd &` in a script, nohup, some CI runners) inherits SIGINT ignored: a raised
    SIGINT then does nothing, the Session's deferral stays off (it defers only a callable handler), and an
    interrupt test fails with "DID NOT RAISE KeyboardInterrupt" whatever the machine's speed."""
    prev = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


@pytest.fixture()
def session():
    """A fresh eager Session on the toy Llama (2 layers, d_model 128), closed after the test."""
    import ie_lab
    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    s = ie_lab.Session(m, tokenizer=t, progress=False)
    yield s
    s.close()


@pytest.fixture(params=SUPPORTED)
def family(request):
    return request.param


def ids(batch=2, seq=11, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, seq), generator=g)
