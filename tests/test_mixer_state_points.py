"""Mixer states (issue 20 item 3): mixer_state / mixer_conv_state are the recurrent and convolution states a
state-space, gated-delta or convolution mixer leaves in transformers' own cache after the prompt.

Each is checked against the cache transformers fills in a forward run here, independently of ie_lab, and against
what the next decode step reads; a shape-correct neighbour (the previous layer's state, or the state one token
earlier) must fail both. Attention layers, mixers without such a state, writing, steering and grad are refused.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ie_lab
from ie_lab import points
from ie_lab.address import Address
from ie_lab.eager.writers import Writers
from ie_lab.errors import CapabilityUnsupported, PointAbsent
from tests.conftest import assert_clean
from tests.test_families_hybrid import _load

X = torch.randint(4, 500, (1, 9), generator=torch.Generator().manual_seed(0))
NEXT = torch.tensor([[7]])
STATES = {"mixer_state": "recurrent_states", "mixer_conv_state": "conv_states"}

# family -> the state points each of its mixer layers has
FAMILIES = {
    "mamba": ("mixer_state", "mixer_conv_state"),  # selective state space: [b, d_inner, d_state] and a conv
    "mamba2": ("mixer_state", "mixer_conv_state"),  # [b, heads, head_dim, d_state]
    "qwen3_next": ("mixer_state", "mixer_conv_state"),  # gated delta net: [b, v_heads, k_dim, v_dim]
    "lfm2": ("mixer_conv_state",),  # a short convolution: no recurrent state
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request):
    torch.set_num_threads(1)
    return request.param, _load(request.param)


def _cache_kw(hf) -> str:
    params = inspect.signature(hf.forward).parameters
    return next(k for k in ("cache", "past_key_values", "cache_params") if k in params)


def _hf_cache(lm, ids):
    """transformers' own cache after a forward over ids, built and filled by the model itself."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.hf.config)
    with torch.no_grad():
        lm.hf(input_ids=ids, use_cache=True, **{_cache_kw(lm.hf): cache})
    return cache


def _mixer_layers(lm) -> list[int]:
    return [lb.index for lb in lm.binding.layers if lb.mixer_kind]


def _neighbours(lm, c, c_short, name: str, L: int) -> list[torch.Tensor]:
    """Shape-correct wrong answers: the previous mixer layer's state (where it has the same shape), and the same
    layer's state one token earlier."""
    out = [c_short[f"{name}.{L}"]]
    prev = [i for i in _mixer_layers(lm) if i < L]
    if prev and c[f"{name}.{prev[-1]}"].shape == c[f"{name}.{L}"].shape:
        out.append(c[f"{name}.{prev[-1]}"])
    return out


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Apart by more than 1e-3 of the state's own scale (a tiny random instance's states can be ~1e-5)."""
    return bool((a - b).abs().max() > 1e-3 * b.abs().max())


def test_the_state_is_what_transformers_cache_holds_after_the_forward(fam):
    family, lm = fam
    names = [f"{p}.{L}" for L in _mixer_layers(lm) for p in FAMILIES[family]]
    c = ie_lab.capture(lm, X, names)
    c_short = ie_lab.capture(lm, X[:, :-1], names)
    cache = _hf_cache(lm, X)
    n_neighbours = 0
    for L in _mixer_layers(lm):
        for p in FAMILIES[family]:
            want = getattr(cache.layers[L], STATES[p])[0]
            got = c[f"{p}.{L}"]
            assert got.shape == want.shape and got.shape[0] == 1 and got.dim() >= 3
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            for wrong in _neighbours(lm, c, c_short, p, L):
                assert wrong.shape == want.shape
                assert _differs(wrong, want)
                n_neighbours += 1
    assert n_neighbours
    assert_clean(lm)


# every other bound family whose mixers keep a state in transformers' cache (Falcon-H1's beside attention)
MORE = (
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear", "nemotron_h", "olmo_hybrid",
    "qwen3_5_text", "zamba", "zamba2",
)  # fmt: skip


@pytest.mark.parametrize("family", MORE)
def test_every_state_carrying_family_reads_its_own_layers_cache(family):
    torch.set_num_threads(1)
    lm = _load(family)
    s = points.Structure.from_binding(lm.binding)
    names = [f"mixer_state.{L}" for L in s.state_layers] + [f"mixer_conv_state.{L}" for L in s.conv_state_layers]
    assert names
    c = ie_lab.capture(lm, X, names)
    c_short = ie_lab.capture(lm, X[:, :-1], names)
    cache = _hf_cache(lm, X)
    for name in names:
        p, L = name.split(".")
        want = getattr(cache.layers[int(L)], STATES[p])[0]
        torch.testing.assert_close(c[name], want, atol=1e-6, rtol=1e-6)
        for wrong in _neighbours(lm, c, c_short, p, int(L)):
            assert wrong.shape == want.shape
            assert _differs(wrong, want), name


def test_the_state_is_what_the_next_decode_step_starts_from(fam):
    """Prefill, then one decode step: the mixer's state at the step's input (read by a pre-hook on the mixer) is the
    captured one; a decode step started from ie_lab's captured states gives the full forward's logits, and one
    started from a neighbour's does not."""
    family, lm = fam
    mixers = _mixer_layers(lm)
    names = [f"{p}.{L}" for L in mixers for p in FAMILIES[family]]
    c = ie_lab.capture(lm, X, names)
    c_short = ie_lab.capture(lm, X[:, :-1], names)
    kw = _cache_kw(lm.hf)
    with torch.no_grad():
        full = lm.hf(input_ids=torch.cat([X, NEXT], 1), use_cache=False).logits[:, -1]

    def step(replace: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cache = _hf_cache(lm, X)
        for name, t in replace.items():
            p, L = name.split(".")
            getattr(cache.layers[int(L)], STATES[p])[0].copy_(t)
        seen: dict[str, torch.Tensor] = {}
        handles = []
        for L in mixers:

            def pre(m, args, kwargs, L=L):
                layer = cache.layers[L]
                for p in FAMILIES[family]:
                    seen[f"{p}.{L}"] = getattr(layer, STATES[p])[0].clone()

            handles.append(lm.binding.layers[L].attn.register_forward_pre_hook(pre, with_kwargs=True))
        try:
            with torch.no_grad():
                logits = lm.hf(input_ids=NEXT, use_cache=True, **{kw: cache}).logits[:, -1]
        finally:
            for h in handles:
                h.remove()
        return logits, seen

    logits, seen = step({})
    for name in names:
        torch.testing.assert_close(seen[name], c[name], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits, full, atol=2e-4, rtol=1e-4)
    logits, _ = step({n: c[n] for n in names})
    torch.testing.assert_close(logits, full, atol=2e-4, rtol=1e-4)
    for name in names:
        p, L = name.split(".")
        for wrong in _neighbours(lm, c, c_short, p, int(L)):
            bad, _ = step({name: wrong})
            assert not torch.allclose(bad, full, atol=2e-4, rtol=1e-4), name


def test_a_list_of_prompts_gets_each_prompts_own_final_state(fam):
    """Prompts of different lengths: a padded batch would run the pads into the state, so each equals its solo run."""
    family, lm = fam
    L = _mixer_layers(lm)[0]
    name = f"{FAMILIES[family][0]}.{L}"
    long, short = X, X[:, :5]
    both = ie_lab.capture(lm, [long, short], [name])
    for got, ids in zip(both, (long, short)):
        torch.testing.assert_close(got[name], ie_lab.capture(lm, ids, [name])[name], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(both[0][name], both[1][name], atol=1e-4, rtol=1e-3)


def test_state_points_are_refused_on_attention_layers_and_where_the_mixer_has_none(fam):
    family, lm = fam
    s = points.Structure.from_binding(lm.binding)
    for lb in lm.binding.layers:
        L = lb.index
        for p in STATES:
            if not lb.mixer_kind:
                with pytest.raises(PointAbsent, match=rf"layer {L} is an attention layer.*{s.mixers_text()}"):
                    ie_lab.capture(lm, X, [f"{p}.{L}"])
            elif p not in FAMILIES[family]:
                with pytest.raises(PointAbsent, match=rf"mixer \({lb.mixer_kind}\) hands no"):
                    ie_lab.capture(lm, X, [f"{p}.{L}"])
    assert_clean(lm)


def test_writing_steering_and_grad_are_refused(fam):
    family, lm = fam
    L = _mixer_layers(lm)[0]
    name = f"{FAMILIES[family][0]}.{L}"
    before = ie_lab.capture(lm, X, [name, f"resid_post.{L}"])
    with pytest.raises(CapabilityUnsupported, match="capture only"):
        Writers(lm, [(Address.parse(name), lambda t, off: t)])
    with pytest.raises(ie_lab.IELabError):
        with ie_lab.steer(lm, name, torch.zeros(lm.facts.d_model)):
            pass
    with pytest.raises(CapabilityUnsupported, match="capture only"):
        ie_lab.capture(lm, X, [name], grad=True)
    assert_clean(lm)
    after = ie_lab.capture(lm, X, [name, f"resid_post.{L}"])
    for k in before:
        torch.testing.assert_close(after[k], before[k], atol=0, rtol=0)


def test_the_registry_says_eager_only_capture_only():
    for p in STATES:
        pt = points.get(p)
        assert pt.eager.verdict.ok and not pt.vllm.verdict.ok
        assert "backend='eager'" in pt.vllm.reason
        assert not pt.writable and not pt.steerable
        assert points.Needs.MIXER in pt.needs
