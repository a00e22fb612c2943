import asyncio

import numpy as np
import pytest
import torch

import ie_lab
from ie_lab.ops import steering as ops
from tests.conftest import assert_clean, lm_for

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _h(seed=0, shape=(2, 5, 16)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_each_method_formula():
    h, v = _h(), _h(1, (16,))
    u = v / v.norm()
    p = (h @ u)[..., None]
    torch.testing.assert_close(ops.add(h, v, scale=2.0), h + 2 * v)
    torch.testing.assert_close(ops.add(h, v, scale=2.0, normalize=True), h + 2 * u)
    torch.testing.assert_close(ops.orthogonal(h, v, scale=0.5), h - 0.5 * p * u)
    torch.testing.assert_close(ops.ablate(h, v) @ u, torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(ops.orthogonal(h, v, scale=0.0), ops.ablate(h, v))
    torch.testing.assert_close(ops.orthogonal(h, v, scale=1.0), h)
    capped = ops.cap(h, v, min=-0.1, max=0.2) @ u
    assert capped.min() >= -0.1 - 1e-5 and capped.max() <= 0.2 + 1e-5
    torch.testing.assert_close(ops.swap(h, v, target=3.0) @ u, torch.full((2, 5), 3.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(ops.norm_scaled_add(h, v, scale=0.5), h + 0.5 * h.norm(dim=-1, keepdim=True) * u)
    # the component orthogonal to v is untouched by every projection method
    for out in (ops.cap(h, v, max=0.0), ops.swap(h, v, target=1.0), ops.ablate(h, v)):
        torch.testing.assert_close(out - (out @ u)[..., None] * u, h - p * u, atol=1e-5, rtol=0)
    mask = torch.tensor([[True, False, True, False, False]] * 2)
    out = ops.add(h, v, scale=1.0, mask=mask)
    torch.testing.assert_close(out[~mask], h[~mask])


@pytest.mark.parametrize("fam", ["llama", "gemma2", "granite", "gpt_neox", "opt", "bloom"])
@pytest.mark.parametrize("point", ["resid_pre", "resid_mid", "resid_post", "attn_out_post", "mlp_out", "mlp_in"])
def test_steering_sets_the_point_to_the_formula(fam, point):
    lm = lm_for(fam)
    if point == "resid_mid" and lm.binding.layers[1].parallel:
        with pytest.raises(ie_lab.PointAbsent):
            with ie_lab.steer(lm, f"{point}.1", torch.ones(lm.facts.d_model)):
                pass
        assert_clean(lm)
        return
    addr = f"{point}.1"
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(1))
    before = ie_lab.capture(lm, PROMPT, [addr])[addr]
    with ie_lab.steer(lm, addr, v, method="swap", target=2.5):
        after = ie_lab.capture(lm, PROMPT, [addr, "resid_post.1"])
    # The captured point (read downstream of the write) holds exactly the steered value.
    torch.testing.assert_close(after[addr], ops.swap(before, v, target=2.5), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before, after[addr])
    assert_clean(lm)


def test_steering_resid_mid_changes_the_stream_not_just_the_mlp_input():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model)
    base = ie_lab.capture(
        lm, PROMPT, ["resid_pre.1", "attn_out_post.1", "resid_mid.1", "mlp_out_post.1", "resid_post.1"]
    )
    with ie_lab.steer(lm, "resid_mid.1", v, scale=2.0):
        st = ie_lab.capture(lm, PROMPT, ["resid_mid.1", "mlp_out_post.1", "resid_post.1"])
    torch.testing.assert_close(st["resid_mid.1"], base["resid_mid.1"] + 2.0 * v, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st["resid_post.1"], st["resid_mid.1"] + st["mlp_out_post.1"], atol=1e-4, rtol=1e-4)


def test_positions_prompt_generated_and_list():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model) * 5
    base = ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"]
    with ie_lab.steer(lm, "resid_post.0", v, positions=[1, 3]):
        st = ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"]
    changed = (st - base).abs().amax(-1)[0] > 1e-5
    assert changed.tolist() == [False, True, False, True, False, False]
    # generated-only steering leaves the prompt's forward untouched, so the first token cannot change.
    plain = ie_lab.generate(lm, PROMPT, 6, capture=["resid_post.0"])
    gen_only = ie_lab.generate(
        lm, PROMPT, 6, capture=["resid_post.0"], steer=ie_lab.steer(lm, "resid_post.0", v * 10, positions="generated")
    )
    n = PROMPT.shape[1]
    torch.testing.assert_close(gen_only.cache["resid_post.0"][:, :n], plain.cache["resid_post.0"][:, :n])
    assert gen_only.ids[0] == plain.ids[0]
    assert not torch.allclose(gen_only.cache["resid_post.0"][:, n:], plain.cache["resid_post.0"][:, n:])


def test_several_layers_at_once_and_restoration():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model) * 4
    with torch.no_grad():
        logits = lm.hf(input_ids=PROMPT).logits
    spec = ie_lab.steer(lm, ["resid_post.0", "resid_post.1"], v)
    with spec:
        with torch.no_grad():
            steered = lm.hf(input_ids=PROMPT).logits
    assert not torch.allclose(logits, steered)
    with torch.no_grad():
        torch.testing.assert_close(lm.hf(input_ids=PROMPT).logits, logits, atol=0, rtol=0)
    assert_clean(lm)


def test_steered_generation_equals_context_and_per_call():
    lm = lm_for("gemma2")
    v = torch.randn(lm.facts.d_model) * 8
    spec = ie_lab.steer(lm, "resid_post.0", v)
    per_call = ie_lab.generate(lm, PROMPT, 8, steer=spec)
    with spec:
        ctx = ie_lab.generate(lm, PROMPT, 8)
    plain = ie_lab.generate(lm, PROMPT, 8)
    assert per_call.ids == ctx.ids != plain.ids
    assert_clean(lm)


@pytest.mark.parametrize(
    "vector,kwargs,fragment",
    [
        (torch.ones(7), {}, "d_model = 128"),
        (torch.full((128,), float("nan")), {}, "NaN or inf"),
        (torch.zeros(128), {"normalize": True}, "all zeros"),
        (torch.zeros(128), {"method": "ablate"}, "all zeros"),
        (torch.ones(128), {"method": "cap"}, "min, max"),
        (torch.ones(128), {"method": "cap", "min": 2.0, "max": 1.0}, "above max"),
        (torch.ones(128), {"method": "rotate"}, "unknown steering method"),
        (torch.ones(128), {"positions": "middle"}, "unknown positions"),
        (torch.ones(128), {"positions": [-1]}, "non-negative"),
        (torch.ones(128), {"scale": float("inf")}, "finite"),
    ],
)
def test_bad_steering_is_refused_before_any_hook(vector, kwargs, fragment):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match=fragment):
        ie_lab.steer(lm, "resid_post.0", vector, **kwargs)
    assert_clean(lm)


def test_unsteerable_points_and_out_of_range_positions():
    lm = lm_for("llama")
    with pytest.raises(ie_lab.AddressError, match="cannot be steered"):
        ie_lab.steer(lm, "mlp_act.0", torch.ones(128))
    spec = ie_lab.steer(lm, "resid_post.0", torch.ones(128), positions=[40])
    with pytest.raises(ie_lab.InputError, match="reach past"):
        ie_lab.generate(lm, PROMPT, 4, steer=spec)
    assert_clean(lm)


def test_context_manager_and_per_call_agree_on_generated_positions():
    lm = lm_for("llama")
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(5)) * 8
    spec = ie_lab.steer(lm, "resid_post.0", v, positions="generated")
    per_call = ie_lab.generate(lm, PROMPT, 6, steer=spec, capture=["resid_post.0"])
    with spec:
        ctx = ie_lab.generate(lm, PROMPT, 6, capture=["resid_post.0"])
        # after the loop, a plain forward inside the block is all prompt again: nothing generated to steer
        plain_inside = ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"]
    assert per_call.ids == ctx.ids
    torch.testing.assert_close(per_call.cache["resid_post.0"], ctx.cache["resid_post.0"])
    torch.testing.assert_close(plain_inside, ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"])
    assert_clean(lm)


# ---- steering inputs are read as written, or refused naming the argument and the fix -------------------


def _changed_positions(lm, **kwargs):
    v = torch.randn(lm.facts.d_model, generator=torch.Generator().manual_seed(7)) * 5
    base = ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"]
    with ie_lab.steer(lm, "resid_post.0", v, **kwargs):
        st = ie_lab.capture(lm, PROMPT, ["resid_post.0"])["resid_post.0"]
    return [i for i, c in enumerate(((st - base).abs().amax(-1)[0] > 1e-5).tolist()) if c]


@pytest.mark.parametrize(
    "positions",
    [
        torch.tensor([True, False, False, True]),
        [True, False, False, True],
        np.array([True, False, False, True]),
        torch.tensor([[True, False, False, True]]),  # one row of a [1, seq] mask
        [0, 3],
        (3, 0),
        torch.tensor([0, 3]),
        np.array([0, 3]),
    ],
)
def test_masks_and_index_lists_steer_the_positions_they_name(positions):
    lm = lm_for("llama")
    assert _changed_positions(lm, positions=positions) == [0, 3]
    assert_clean(lm)


@pytest.mark.parametrize(
    "positions,fragment",
    [
        ([1, 0, 0, 1], "repeat an index"),  # a 0/1 mask written as integers: ambiguous
        (torch.tensor([1, 0, 0, 1]), "repeat an index"),
        (torch.tensor([1, 0, 0, 1], dtype=torch.uint8), "uint8"),
        (torch.tensor([1.0, 0.0, 0.0, 1.0]), "not integers"),
        ([0.5, 3.7], "not integers"),
        (np.array([0.0, 3.0]), "not integers"),
        ([True, 2], "not token indices"),
        (3, "not a list"),
        (torch.ones(2, 4, dtype=torch.bool), "1-D"),
        ([[0, 3]], "flat list"),
    ],
)
def test_ambiguous_or_lossy_positions_are_refused(positions, fragment):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match=fragment) as e:
        ie_lab.steer(lm, "resid_post.0", torch.ones(128), positions=positions)
    assert "positions" in str(e.value)
    assert_clean(lm)


def test_a_mask_reaching_past_the_call_is_refused():
    lm = lm_for("llama")
    mask = torch.zeros(40, dtype=torch.bool)
    mask[30] = True
    with pytest.raises(ie_lab.InputError, match="past the 10 tokens"):
        ie_lab.generate(lm, PROMPT, 4, steer=ie_lab.steer(lm, "resid_post.0", torch.ones(128), positions=mask))
    assert_clean(lm)


@pytest.mark.parametrize(
    "vector",
    [
        torch.ones(128, dtype=torch.complex64),
        np.ones(128, dtype=np.complex128),
        torch.ones(128, dtype=torch.bool),
        ["a"] * 128,
    ],
)
def test_vectors_that_would_change_silently_are_refused(vector):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match="vector"):
        ie_lab.steer(lm, "resid_post.0", vector)
    assert_clean(lm)


@pytest.mark.parametrize("scale", [np.float32(2), np.float64(2), np.int64(2), torch.tensor(2.0), np.array(2.0), 2])
def test_numpy_scalars_and_0d_tensors_are_numbers(scale):
    lm = lm_for("llama")
    v = torch.randn(128, generator=torch.Generator().manual_seed(8))
    want = ie_lab.generate(
        lm, PROMPT, 4, steer=ie_lab.steer(lm, "resid_post.0", v, scale=2.0), capture=["resid_post.0"]
    )
    got = ie_lab.generate(
        lm, PROMPT, 4, steer=ie_lab.steer(lm, "resid_post.0", v, scale=scale), capture=["resid_post.0"]
    )
    assert got.ids == want.ids and torch.equal(got.cache["resid_post.0"], want.cache["resid_post.0"])
    spec = ie_lab.steer(lm, "resid_post.0", v, method="cap", min=np.float32(-1), max=torch.tensor(1.0))
    assert (spec.min, spec.max) == (-1.0, 1.0)
    assert_clean(lm)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"scale": float("nan")}, "scale must be finite"),
        ({"scale": np.float32("inf")}, "scale must be finite"),
        ({"scale": torch.tensor(float("nan"))}, "scale must be finite"),
        ({"scale": True}, "scale must be a real number"),
        ({"scale": "2"}, "scale must be a real number"),
        ({"scale": 1 + 2j}, "scale must be a real number"),
        ({"scale": torch.tensor([2.0])}, "0-d"),
        ({"method": "swap", "target": float("inf")}, "target must be finite"),
        ({"method": "cap", "min": float("nan")}, "min must be finite"),
        ({"normalize": "yes"}, "normalize must be True or False"),
    ],
)
def test_bad_numbers_are_refused_naming_the_argument(kwargs, fragment):
    lm = lm_for("llama")
    with pytest.raises(ie_lab.InputError, match=fragment):
        ie_lab.steer(lm, "resid_post.0", torch.ones(128), **kwargs)
    assert_clean(lm)


def test_steer_that_is_not_a_spec_is_refused_naming_s_steer():
    from ie_lab.toy import tiny_model

    lm = lm_for("llama")
    calls = [
        lambda st: ie_lab.generate(lm, PROMPT, 3, steer=st),
        lambda st: ie_lab.generate_stream(lm, PROMPT, 3, steer=st),
        lambda st: ie_lab.capture(lm, PROMPT, ["resid_post.0"], steer=st),
    ]
    other = ie_lab.steer(lm_for("gemma2"), "resid_post.0", torch.ones(lm_for("gemma2").facts.d_model))
    for call in calls:
        for bad in ("resid_post.1", ["resid_post.1"], torch.ones(128)):
            with pytest.raises(ie_lab.InputError, match=r"steer=.*s\.steer\("):
                call(bad)
        with pytest.raises(ie_lab.InputError, match="another model"):
            call(other)
        assert_clean(lm)
    m, t = tiny_model("llama")
    with ie_lab.Session(m, tokenizer=t, progress=False) as s:
        for call in (
            lambda: s.generate("Mary", 3, steer="resid_post.1"),
            lambda: s.generate_stream("Mary", 3, steer="resid_post.1"),
            lambda: s.capture("Mary", ["resid_post.0"], steer="resid_post.1"),
            lambda: asyncio.run(s.agenerate("Mary", 3, steer="resid_post.1")),
            lambda: s.steer("resid_post.0", torch.ones(128), positions=[0.5, 3.7]),
            lambda: s.steer("resid_post.0", torch.ones(128), scale=float("nan")),
        ):
            with pytest.raises(ie_lab.InputError):
                call()
            assert_clean(s._lm)
        assert len(s.generate("Mary", 3).ids) == 3


def test_method_help_is_the_one_explanation_and_agrees_with_the_docs_table():
    # issue 33: the steering panel explains each method from ops.steering.METHOD_HELP (written once); the formula it
    # gives is docs/STEERING.md's, method by method
    import os
    import re

    from ie_lab.ops.steering import METHOD_HELP, METHODS

    assert tuple(METHOD_HELP) == METHODS
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "STEERING.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)`", f.read(), re.M))
    for m, text in METHOD_HELP.items():
        name, formula = re.match(r"(\w+): (.+?)\. ", text).groups()
        assert name == m and rows[m] == formula, (m, formula, rows.get(m))
        assert len(text) > len(name) + len(formula) + 20  # a sentence of what it does, not the formula alone
