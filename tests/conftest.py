import functools
import os
import re
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


# A number as ie_lab prints one in a message: an integer, a decimal, or either with an exponent; not a digit inside a
# name (qwen3, layer_0) or after a dot (the parts of 5.19.0 after the first).
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d+|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.]*\d)")


def _last_digit(text: str) -> float:
    """One unit in the last printed digit of a decimal (0.00346 -> 1e-05, 32.7 -> 0.1, 1.5e-03 -> 1e-04)."""
    mantissa, _, exp = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (-decimals + (int(exp) if exp else 0))


def numbers_differ(want: str, got: str, cut: bool = False) -> str | None:
    """Compare two messages as text and numbers: None when they say the same, else what differs.

    The text between numbers must be equal, integers (counts, layer indices, shapes) exactly. A decimal is a measured
    value printed rounded (binder.py prints `{leak:.3g}`, `{factor:.4g}`): two machines' float32 runs differ in their
    last bits (another reduction order, SIMD width or kernel), which moves the printed value by one unit in its last
    digit when the two true values sit either side of a rounding boundary ("0.00346" against "0.00347"). Two printed
    decimals are the same measurement when they differ by at most one unit in the last digit of the finer one (the
    finer: `g` drops trailing zeros, so "0.0035" is 0.00350): the real difference between machines is ~1e-5 of the
    value or less (float32 rounding through a few layers) and one unit of a 3-significant-digit print is 1e-3 of it
    or more, so one unit absorbs the rounding and nothing else; a change the message is about (another leak, a
    factor the config does not state) still fails.
    `cut`: the messages may have been cut to one length (a printed number one character longer or shorter then
    shifts where the tail is cut): when their lengths are equal, the last text part of one need only start the other's."""
    wn, gn = _NUMBER.findall(want), _NUMBER.findall(got)
    wt, gt = _NUMBER.split(want), _NUMBER.split(got)
    if len(wn) != len(gn):
        return f"{len(wn)} numbers against {len(gn)}: {want!r} / {got!r}"
    both_cut = cut and len(want) == len(got)
    for i, (a, b) in enumerate(zip(wt, gt)):
        shifted = both_cut and i == len(wt) - 1 and (a.startswith(b) or b.startswith(a))
        if a != b and not shifted:
            return f"text differs ({a!r} / {b!r}): {want!r} / {got!r}"
    for a, b in zip(wn, gn):
        decimal = any(c in a + b for c in ".eE")
        if not decimal:
            if a != b:
                return f"{a} against {b}: {want!r} / {got!r}"
        elif abs(float(a) - float(b)) > min(_last_digit(a), _last_digit(b)) * (1 + 1e-9):
            return f"{a} against {b} (more than one unit in the last printed digit): {want!r} / {got!r}"
    return None


# The longest modules start first: test files are handed to the workers whole (`--dist loadfile`), and `./dev test`
# passes `--no-loadscope-reorder` so they go out in collection order (xdist otherwise reorders them by their number of
# tests, which sent the four-test tensor-parallel modules, the longest of all, out last: the run's tail, one worker
# busy while the others idled). The order is longest-first by each module's measured seconds on the gate
# (tests/module_seconds.json, written by `python scripts/test_durations.py` from a run with IE_LAB_RECORD_DURATIONS
# set): a greedy longest-first packing, which keeps every worker busy to the end. A module not measured yet counts
# as UNMEASURED_S; the order of tests inside a module is unchanged.
MODULE_SECONDS_PATH = os.path.join(ROOT, "tests", "module_seconds.json")
UNMEASURED_S = 30.0


def _module_seconds() -> dict[str, float]:
    import json

    try:
        with open(MODULE_SECONDS_PATH, encoding="utf-8") as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def _module_of(item) -> str:
    return os.path.relpath(str(item.fspath), ROOT).replace(os.sep, "/")


def pytest_collection_modifyitems(session, config, items):
    seconds = _module_seconds()
    items.sort(key=lambda item: -seconds.get(_module_of(item), UNMEASURED_S))  # stable: a module's tests keep order


# IE_LAB_RECORD_DURATIONS=DIR: each process appends its tests' seconds (setup, call and teardown) to a file there;
# scripts/test_durations.py sums them per module into tests/module_seconds.json.
_RECORD = os.environ.get("IE_LAB_RECORD_DURATIONS")


def pytest_runtest_logreport(report):
    if not _RECORD or getattr(report, "node", None) is not None:  # (xdist's controller sees its workers' reports)
        return
    path = os.path.join(_RECORD, f"durations-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.tsv")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{report.nodeid.split('::', 1)[0]}\t{report.duration:.3f}\n")
