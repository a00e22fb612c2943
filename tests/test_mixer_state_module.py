"""Mixer states kept outside transformers' DynamicCache (issue 20 item 3): RecurrentGemma keeps its RG-LRU state and
its convolution state on the mixer module, xLSTM its mLSTM state in a cache of its own that the forward returns.

mixer_state / mixer_conv_state there are the tensors the model holds after the forward, read where the binder
measured them (arch.mixer_states), not recomputed. Each is checked against the model's own state after a forward run
here, independently of ie_lab, and against a decode step started from it (which must give the full forward's
logits); the previous mixer layer's state and the state one token earlier (shape-correct neighbours) must fail.
The measurement that replaced reading the mixer's source is checked on every cache family too.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ie_lab
from ie_lab import coverage, points, tiny
from ie_lab.errors import CapabilityUnsupported, PointAbsent
from tests.conftest import assert_clean
from tests.test_families_hybrid import _load
from tests.test_mixer_state_points import FAMILIES as CACHE_FAMILIES
from tests.test_mixer_state_points import MORE as MORE_CACHE_FAMILIES

X = torch.randint(4, 500, (1, 9), generator=torch.Generator().manual_seed(0))
NEXT = torch.tensor([[7]])
TOL = dict(atol=2e-4, rtol=1e-4)


def _recurrent_gemma():
    """Two recurrent layers, then attention (the released pattern), so a previous recurrent layer exists."""
    cfg = coverage.tiny_config("recurrent_gemma")
    cfg.block_types = ["recurrent", "recurrent", "attention"]
    cfg.num_hidden_layers = 3
    # gains away from 1 and biases away from 0, as coverage.build_tiny draws them
    model = tiny.build(cfg, gains="survey", quiet=True)
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


def _cache_kw(hf) -> str:
    params = inspect.signature(hf.forward).parameters
    return next(k for k in ("cache", "past_key_values", "cache_params") if k in params)


def _returned(out):
    """xLSTM hands its cache back as cache_params (transformers 5.19) or cache (5.24)."""
    return getattr(out, "cache", None) or getattr(out, "cache_params", None)


# family -> (loader, the state points its mixer layers have, where the model keeps them after a forward)
def _rg_states(lm, L: int) -> dict[str, torch.Tensor]:
    block = lm.binding.layers[L].layer.temporal_block
    return {"mixer_state": block.rg_lru.recurrent_states, "mixer_conv_state": block.conv1d_state}


FAMILIES = {
    "recurrent_gemma": (_recurrent_gemma, ("mixer_state", "mixer_conv_state")),
    "xlstm": (lambda: _load("xlstm"), ("mixer_state",)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request):
    torch.set_num_threads(1)
    return request.param, FAMILIES[request.param][0]()


def _mixers(lm) -> list[int]:
    return [lb.index for lb in lm.binding.layers if lb.mixer_kind]


def _own_states(family: str, lm, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], object]:
    """The model's own states after a cached forward over ids, read off the model (not through ie_lab), and the
    cache the next step continues from."""
    kw = _cache_kw(lm.hf)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        if family == "xlstm":
            cache = _returned(lm.hf(input_ids=ids, use_cache=True))
            for L in _mixers(lm):
                out[f"mixer_state.{L}"] = cache.rnn_state[L][0].clone()
            return out, cache
        from transformers import DynamicCache

        cache = DynamicCache(config=lm.hf.config)  # the attention layer's keys and values; the mixers keep theirs
        lm.hf(input_ids=ids, use_cache=True, **{kw: cache})
        for L in _mixers(lm):
            out.update({f"{p}.{L}": t.clone() for p, t in _rg_states(lm, L).items()})
        return out, cache


def _set_state(family: str, lm, cache, name: str, t: torch.Tensor) -> None:
    p, L = name.split(".")
    if family == "xlstm":
        cache.rnn_state[int(L)][0].copy_(t)
    else:
        _rg_states(lm, int(L))[p].copy_(t)


def _names(family: str, lm) -> list[str]:
    return [f"{p}.{L}" for L in _mixers(lm) for p in FAMILIES[family][1]]


def _neighbours(lm, c, c_short, name: str) -> list[torch.Tensor]:
    """The same layer's state one token earlier, and the previous mixer layer's state (same shape)."""
    p, L = name.split(".")
    prev = [i for i in _mixers(lm) if i < int(L)]
    return [c_short[name]] + ([c[f"{p}.{prev[-1]}"]] if prev else [])


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() > 1e-3 * b.abs().max())


def test_the_states_are_measured_where_the_model_keeps_them(fam):
    family, lm = fam
    s = points.Structure.from_binding(lm.binding)
    want = FAMILIES[family][1]
    assert len(_mixers(lm)) == 2
    assert s.state_layers == tuple(_mixers(lm))
    assert s.conv_state_layers == (tuple(_mixers(lm)) if "mixer_conv_state" in want else ())
    where = {lb.index: lb.mixer_states for lb in lm.binding.layers if lb.mixer_kind}
    if family == "xlstm":
        assert all(w == {"recurrent": "rnn_state:0"} for w in where.values())
    else:
        assert all(
            w == {"recurrent": "module:rg_lru.recurrent_states", "conv": "module:conv1d_state"} for w in where.values()
        )


def test_the_state_is_what_the_model_holds_after_the_forward(fam):
    family, lm = fam
    names = _names(family, lm)
    c = ie_lab.capture(lm, X, names)
    c_short = ie_lab.capture(lm, X[:, :-1], names)
    own, _ = _own_states(family, lm, X)
    n_wrong = 0
    for name in names:
        assert c[name].shape == own[name].shape and c[name].dtype == own[name].dtype and c[name].shape[0] == 1
        torch.testing.assert_close(c[name], own[name], atol=1e-6, rtol=1e-6)
        for wrong in _neighbours(lm, c, c_short, name):
            assert wrong.shape == own[name].shape
            assert _differs(wrong, own[name]), name
            n_wrong += 1
    assert n_wrong >= len(names) + len(names) // 2  # every state one token earlier, and the later layers' previous
    assert_clean(lm)


def test_a_decode_step_started_from_the_state_gives_the_full_forwards_logits(fam):
    family, lm = fam
    names = _names(family, lm)
    c = ie_lab.capture(lm, X, names)
    c_short = ie_lab.capture(lm, X[:, :-1], names)
    kw = _cache_kw(lm.hf)
    with torch.no_grad():
        full = lm.hf(input_ids=torch.cat([X, NEXT], 1), use_cache=False).logits[:, -1]

    def step(replace: dict[str, torch.Tensor]) -> torch.Tensor:
        _, cache = _own_states(family, lm, X)
        for name, t in replace.items():
            _set_state(family, lm, cache, name, t)
        # RecurrentGemma counts positions from its first cache layer, a recurrent one that holds no keys: say it
        pos = {} if family == "xlstm" else {"position_ids": torch.tensor([[X.shape[1]]])}
        with torch.no_grad():
            return lm.hf(input_ids=NEXT, use_cache=True, **{kw: cache}, **pos).logits[:, -1]

    torch.testing.assert_close(step({}), full, **TOL)
    torch.testing.assert_close(step({n: c[n] for n in names}), full, **TOL)
    for name in names:
        for wrong in _neighbours(lm, c, c_short, name):
            assert not torch.allclose(step({name: wrong}), full, **TOL), name


def test_the_mixer_modules_are_left_as_they_were_even_after_an_error():
    """RecurrentGemma's cached forward leaves its states on the module: capture puts every attribute back, also when
    the forward is interrupted."""
    torch.set_num_threads(1)
    lm = _recurrent_gemma()
    blocks = [lm.binding.layers[L].layer.temporal_block for L in _mixers(lm)]
    marks = [(torch.full((1, 64), 3.0), torch.full((1, 64, 3), 4.0)) for _ in blocks]
    for b, (r, cv) in zip(blocks, marks):
        b.rg_lru.recurrent_states, b.conv1d_state = r, cv
    c = ie_lab.capture(lm, X, ["mixer_state.1", "resid_post.2"])
    assert not torch.equal(c["mixer_state.1"], marks[1][0])
    for b, (r, cv) in zip(blocks, marks):
        assert b.rg_lru.recurrent_states is r and b.conv1d_state is cv

    def boom(m, a, o):
        raise KeyboardInterrupt

    h = lm.binding.layers[2].layer.register_forward_hook(boom)
    try:
        with pytest.raises(KeyboardInterrupt):
            ie_lab.capture(lm, X, ["mixer_conv_state.0"])
    finally:
        h.remove()
    for b, (r, cv) in zip(blocks, marks):
        assert b.rg_lru.recurrent_states is r and b.conv1d_state is cv
    assert_clean(lm)


def test_a_list_of_prompts_gets_each_prompts_own_final_state_and_writing_is_refused(fam):
    family, lm = fam
    name = f"{FAMILIES[family][1][-1]}.{_mixers(lm)[-1]}"
    both = ie_lab.capture(lm, [X, X[:, :5]], [name])
    for got, ids in zip(both, (X, X[:, :5])):
        torch.testing.assert_close(got[name], ie_lab.capture(lm, ids, [name])[name], atol=1e-6, rtol=1e-6)
    assert _differs(both[1][name], both[0][name])
    with pytest.raises(CapabilityUnsupported, match="capture only"):
        ie_lab.capture(lm, X, [name], grad=True)
    with pytest.raises(ie_lab.IELabError):
        with ie_lab.steer(lm, name, torch.zeros(lm.facts.d_model)):
            pass
    assert_clean(lm)


def test_refused_where_the_model_keeps_no_such_state(fam):
    family, lm = fam
    s = points.Structure.from_binding(lm.binding)
    for lb in lm.binding.layers:
        L = lb.index
        for p in ("mixer_state", "mixer_conv_state"):
            if not lb.mixer_kind:
                with pytest.raises(PointAbsent, match=rf"layer {L} is an attention layer.*{s.mixers_text()}"):
                    ie_lab.capture(lm, X, [f"{p}.{L}"])
            elif p not in FAMILIES[family][1]:
                with pytest.raises(PointAbsent, match=rf"mixer \({lb.mixer_kind}\) hands no convolution state"):
                    ie_lab.capture(lm, X, [f"{p}.{L}"])
    assert_clean(lm)


@pytest.mark.parametrize("family", sorted(set(CACHE_FAMILIES) | set(MORE_CACHE_FAMILIES)))
def test_the_cache_families_measured_layers_are_those_a_cached_forward_writes(family):
    """Which layers serve the state points is measured (a cached probe forward), not read off the mixer's source:
    exactly the layers whose cache entries a cached forward of the model's own writes."""
    from transformers import DynamicCache

    torch.set_num_threads(1)
    lm = _load(family)
    cache = DynamicCache(config=lm.hf.config)
    with torch.no_grad():
        lm.hf(input_ids=X, use_cache=True, **{_cache_kw(lm.hf): cache})
    written = {
        fld: tuple(
            i
            for i, layer in enumerate(cache.layers)
            if any(isinstance(t, torch.Tensor) for t in (getattr(layer, fld, None) or {}).values())
        )
        for fld in ("recurrent_states", "conv_states")
    }
    s = points.Structure.from_binding(lm.binding)
    assert s.state_layers == written["recurrent_states"]
    assert s.conv_state_layers == written["conv_states"]
    assert s.conv_state_layers  # every one of these mixers has a convolution
