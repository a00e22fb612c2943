"""patch_sweep over layer x position reuses the corrupted run's cached prefix (issue 16): a forward whose cells patch
positions >= p runs positions p.. only. Its grid must equal one full forward per cell (run_with_patches, the
unbatched sweep) on every model, and where the trick is not valid (sliding window, a hybrid's mixer layers, steering
in force) the sweep must fall back to whole-prompt forwards and still be equal.

Tolerance 1e-5 (absolute and relative, on metrics of order 0.01-10): a cached forward multiplies the same fp32
numbers as the full one in another grouping (attention over a cache of p keys plus the suffix's, a [rows, seq - p]
matmul instead of [rows, seq]), so the two differ by float rounding only, measured at <= 1e-6 here; the wrong
answers below (the neighbouring position, the clean run's prefix, a prefix of zeros) miss by 1e-3 or more.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab.core.inputs import prepare
from ie_lab.eager import sweep
from tests.conftest import assert_clean, lm_for
from tests.families import FAMILIES, make_model, make_tokenizer

TOL = dict(atol=1e-5, rtol=1e-5)
SEQ = 10


def _demo():
    from ie_lab.core.demo import DEMO_MODEL

    return ie_lab.load(DEMO_MODEL, quiet=True)


def _load(name: str):
    torch.set_num_threads(1)
    if name == "demo":
        return _demo()
    if name == "qwen3_next":  # hybrid: gated delta-net layer, then attention
        return ie_lab.load(make_model(name), make_tokenizer(), quiet=True)
    return lm_for(name, attn_implementation="eager" if name == "gemma2" else None)


_CACHE: dict[str, object] = {}


def _lm(name: str):
    if name not in _CACHE:
        _CACHE[name] = _load(name)
    return _CACHE[name]


def _prompts(lm):
    g = torch.Generator().manual_seed(1)
    vocab = min(lm.facts.vocab_size, 500)
    clean = torch.randint(4, vocab, (1, SEQ), generator=g)
    corrupt = clean.clone()
    corrupt[0, [1, 6]] = torch.randint(4, vocab, (2,), generator=g)  # an early and a late difference
    return clean, corrupt


def _last(logits):
    return (logits[:, -1, 3] - logits[:, -1, 4]).mean()


def _every_position(logits):
    # reads the positions before the patched one too: the metric must see the corrupted run's logits there
    return logits[:, :, 3].sum() - 0.5 * logits[:, :, 7].sum()


def _reference(lm, clean, corrupt, metric, point="resid_pre"):
    """One full forward per (layer, position) cell: run_with_patches, as the unbatched sweep ran it."""
    layers = range(lm.facts.n_layers)
    src = ie_lab.capture(lm, clean, [f"{point}.{L}" for L in layers])
    return torch.tensor(
        [
            [
                float(
                    metric(ie_lab.run_with_patches(lm, corrupt, {f"{point}.{L}": src[f"{point}.{L}"]}, positions=[j]))
                )
                for j in range(corrupt.shape[1])
            ]
            for L in layers
        ]
    )


class _Lengths:
    """The input lengths of the forwards run inside the block (a plain torch hook on the raw model, removed after)."""

    def __init__(self, lm):
        self.lm, self.seen = lm, []

    def __enter__(self):
        def hook(mod, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.seen.append(tuple(ids.shape))

        self.h = self.lm.hf.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.h.remove()


PREFIX_MODELS = ["gpt2", "llama", "demo"]
FALLBACK_MODELS = ["gemma2", "qwen3_next"]


@pytest.mark.parametrize("name", PREFIX_MODELS + FALLBACK_MODELS)
@pytest.mark.parametrize("metric", [_last, _every_position], ids=["last", "every_position"])
def test_sweep_equals_one_full_forward_per_cell(name, metric):
    lm = _lm(name)
    clean, corrupt = _prompts(lm)
    want = _reference(lm, clean, corrupt, metric)
    assert want.std() > 1e-3  # cells differ, so a cell computed at the wrong place would show
    reuses = name in PREFIX_MODELS
    assert sweep._prefix_reusable(lm) == reuses
    for bs in (None, 1, 3, 7):  # 3: below 4 layers (the demo's), one position's layers over two forwards
        with _Lengths(lm) as seen:
            grid = ie_lab.patch_sweep(lm, clean, corrupt, metric, progress=False, batch_size=bs)
        torch.testing.assert_close(grid.values, want, **TOL)
        shorter = [s for s in seen.seen if s[1] < SEQ]
        # the prefix path did run (forwards of the suffix only), or the fallback ran whole prompts only; with the
        # automatic size a short grid may fit one forward from position 0, which is no shorter
        assert bool(shorter) == reuses or bs is None, (bs, seen.seen)
    assert_clean(lm)


@pytest.mark.parametrize("name", ["llama", "demo"])
def test_neighbouring_answers_fail_the_comparison(name):
    """The plausible wrong answers of the prefix path miss the per-cell grid by far more than the tolerance: an
    off-by-one offset in the suffix's hook (each cell patched at the next position), the clean run's prefix under
    the corrupted suffix (the real prefix machinery fed the wrong base run), and zero logits before the suffix."""
    lm = _lm(name)
    clean, corrupt = _prompts(lm)
    want = _reference(lm, clean, corrupt, _last)
    next_position = torch.cat([want[:, 1:], want[:, -1:]], dim=1)
    assert not torch.allclose(next_position, want, **TOL)

    c_ids, x_ids = prepare(lm, clean)[0], prepare(lm, corrupt)[0]
    addrs = [ie_lab.Address("resid_pre", L) for L in range(lm.facts.n_layers)]
    src = ie_lab.capture(lm, c_ids, [str(a) for a in addrs])
    good, wrong = sweep._prefix_base(lm, x_ids), sweep._prefix_base(lm, c_ids)
    assert good is not None and wrong is not None
    for p in (2, 7):  # after the early difference (position 1): the clean prefix differs from the corrupted one
        chunk = [(i, j) for j in range(p, SEQ) for i in range(len(addrs))]
        right = sweep._prefix_batch(lm, good, x_ids, src, addrs, chunk)
        bad = sweep._prefix_batch(lm, wrong, x_ids, src, addrs, chunk)
        got = torch.tensor([float(_last(v)) for v in right])
        torch.testing.assert_close(got, torch.tensor([float(want[i, j]) for i, j in chunk]), **TOL)
        off = torch.tensor([float(_last(v)) for v in bad])
        assert (off - got).abs().max() > 1e-3
        # the positions before p come from the base run: zeros there would change a metric that reads them
        every = torch.tensor([float(_every_position(v)) for v in right])
        zeroed = torch.tensor([float(_every_position(torch.cat([0 * v[:, :p], v[:, p:]], 1))) for v in right])
        assert (every - zeroed).abs().max() > 1e-3
    assert_clean(lm)


def test_a_batched_prompt_reuses_each_rows_own_prefix():
    lm = _lm("llama")
    clean, corrupt = _prompts(lm)
    clean2, corrupt2 = clean.repeat(2, 1), torch.cat([corrupt, clean.flip(1)])
    want = _reference(lm, clean2, corrupt2, _last)
    for bs in (None, 3):
        with _Lengths(lm) as seen:
            grid = ie_lab.patch_sweep(lm, clean2, corrupt2, _last, progress=False, batch_size=bs)
        torch.testing.assert_close(grid.values, want, **TOL)
        assert any(s[1] < SEQ for s in seen.seen)
    assert_clean(lm)


def test_other_points_and_a_layer_subset_reuse_the_prefix():
    lm = _lm("demo")
    clean, corrupt = _prompts(lm)
    for point in ("attn_out", "mlp_out", "resid_post"):
        want = _reference(lm, clean, corrupt, _last, point=point)
        grid = ie_lab.patch_sweep(lm, clean, corrupt, _last, point=point, progress=False)
        torch.testing.assert_close(grid.values, want, **TOL)
    full = ie_lab.patch_sweep(lm, clean, corrupt, _last, progress=False)
    sub = ie_lab.patch_sweep(lm, clean, corrupt, _last, layers=[3, 1], progress=False, batch_size=5)
    torch.testing.assert_close(sub.values, full.values[[3, 1]], **TOL)
    assert sub.rows == ["resid_pre.3", "resid_pre.1"]
    assert_clean(lm)


def test_steering_in_force_falls_back_and_is_steered_alike():
    """A `with` block's steering counts its positions from the prompt's start, so the sweep runs whole prompts."""
    lm = _lm("demo")
    clean, corrupt = _prompts(lm)
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(3))
    with ie_lab.steer(lm, "resid_post.0", v, scale=2.0, positions=[4]):
        want = _reference(lm, clean, corrupt, _last)
        assert not sweep._prefix_reusable(lm)
        with _Lengths(lm) as seen:
            grid = ie_lab.patch_sweep(lm, clean, corrupt, _last, progress=False)
    assert all(s[1] == SEQ for s in seen.seen)
    torch.testing.assert_close(grid.values, want, **TOL)
    unsteered = ie_lab.patch_sweep(lm, clean, corrupt, _last, progress=False)
    assert not torch.allclose(unsteered.values, want, **TOL)  # the steering did change the grid
    assert_clean(lm)


@pytest.mark.parametrize("name", ["gemma2", "mistral_sliding"])
def test_the_measured_cache_refuses_sliding_layers_even_if_the_facts_did_not(name):
    """Besides the facts, the cache that comes back is checked: a sliding-window layer (which drops positions)
    is not transformers' plain DynamicLayer, so _plain_kv refuses it; llama's is accepted."""
    from ie_lab.eager.generate import _cache_keyword

    for fam, ok in ((name, False), ("llama", True)):
        lm = _lm(fam) if fam in ("gemma2", "llama") else lm_for(fam)
        x = _prompts(lm)[1]
        with torch.no_grad():
            out = lm.hf(input_ids=x, use_cache=True)
        assert (sweep._plain_kv(getattr(out, _cache_keyword(lm.hf)), tuple(x.shape)) is not None) == ok


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_whole_prompt_grid(family):
    """On every family of tests/families.py the sweep (prefix reused where valid: the dense, MoE, ALiBi and
    learned-position ones; whole prompts on the sliding-window ones and the hybrid) equals whole-prompt forwards,
    one per cell, with a metric that reads every position."""
    lm = ie_lab.load(make_model(family), make_tokenizer(), quiet=True)
    clean, corrupt = _prompts(lm)

    def metric(logits):
        return _last(logits) + 0.1 * _every_position(logits)

    want = sweep._patch_sweep(
        lm,
        clean,
        corrupt,
        metric,
        point="resid_pre",
        over="layer_position",
        layers=None,
        progress=False,
        batch_size=1,
        reuse_prefix=False,
    )
    assert want.values.std() > 1e-4
    sliding = any(k == "sliding" for k in lm.facts.layer_kinds)
    assert sweep._prefix_reusable(lm) == (not sliding and not any(lb.mixer_kind for lb in lm.binding.layers))
    grid = ie_lab.patch_sweep(lm, clean, corrupt, metric, progress=False, batch_size=3)
    torch.testing.assert_close(grid.values, want.values, **TOL)
    assert_clean(lm)
