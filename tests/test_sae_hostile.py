"""Hostile SAE folders (issue 28, "no foreign exceptions"): every way a SAELens folder can be wrong is refused by
load_sae, up front and before anything is attached, with an IELabError naming the file, the field, what was found
against what was expected, and the fix; never a plain Python or torch error, never a silent misreading.

One good folder (standard ReLU SAE on the tiny Llama's resid_post.0, written as SAELens lays it out) is broken one
way per case. A Hypothesis property then mutates a valid cfg.json's values and types at random: load_sae either
loads an SAE that encodes finite numbers, or raises an IELabError; and no hook is left on the model either way."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import ie_lab
from ie_lab.errors import IELabError
from ie_lab.sae import load_sae
from tests.conftest import assert_clean, hook_count
from tests.families import make_model, make_tokenizer

N = 16  # the good SAE's d_sae
HOOK = "blocks.0.hook_resid_post"


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(make_model("llama"), tokenizer=make_tokenizer(), progress=False, replace=False)
    yield sess
    sess.close()


def _good(d: int, n: int = N, threshold: bool = False) -> tuple[dict, dict]:
    """(cfg, weights) of a valid SAELens standard SAE of width d (JumpReLU with threshold=True)."""
    g = torch.Generator().manual_seed(0)
    w = {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "W_dec": torch.randn(n, d, generator=g) / n**0.5,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }
    cfg: dict = {
        "architecture": "standard",
        "hook_name": HOOK,
        "d_in": d,
        "d_sae": n,
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "dtype": "float32",
        "model_name": "tiny-llama",
    }
    if threshold:
        w["threshold"] = torch.rand(n, generator=g) * 0.2
        cfg["architecture"] = "jumprelu"
    return cfg, w


def _write(folder, cfg, weights: dict | None) -> str:
    """A SAELens folder: cfg.json (a dict is dumped; str/bytes are written as they are) and sae_weights.safetensors
    (bytes are written as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(weights, bytes):
        (folder / "sae_weights.safetensors").write_bytes(weights)
    elif weights is not None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "sae_weights.safetensors"))
    text = cfg if isinstance(cfg, str) else json.dumps(cfg)
    (folder / "cfg.json").write_text(text)
    return str(folder)


def _without(w: dict, *names: str) -> dict:
    return {k: v for k, v in w.items() if k not in names}


def _poison(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = value
    return t


def _sized(d: int) -> dict:
    return _good(d)[1]


CFG, WTS = "cfg.json", "sae_weights.safetensors"

# (id, how to break the good (cfg, weights) -> (cfg, weights), fragment the message holds, file it names).
# d is the model's width (the point's); N the SAE's number of features.
CASES = [
    # shapes
    ("W_enc transposed", lambda c, w, d: (c, w | {"W_enc": w["W_enc"].T}), "transposed", WTS),
    ("W_enc 1-D", lambda c, w, d: (c, w | {"W_enc": w["W_enc"].flatten()}), "W_enc", WTS),
    ("W_enc no features", lambda c, w, d: (c | {"d_sae": 1}, w | {"W_enc": torch.zeros(d, 0)}), "feature", WTS),
    ("W_dec transposed", lambda c, w, d: (c, w | {"W_dec": w["W_dec"].T}), "W_dec", WTS),
    ("b_enc too short", lambda c, w, d: (c, w | {"b_enc": w["b_enc"][:-1]}), "b_enc", WTS),
    ("b_dec too short", lambda c, w, d: (c, w | {"b_dec": w["b_dec"][:5]}), "b_dec", WTS),
    ("b_enc 2-D", lambda c, w, d: (c, w | {"b_enc": w["b_enc"][None]}), "b_enc", WTS),
    (
        "threshold wrong length",
        lambda c, w, d: (c | {"architecture": "jumprelu"}, w | {"threshold": torch.full((N + 1,), 0.1)}),
        "threshold",
        WTS,
    ),
    ("d_in not the point width", lambda c, w, d: (c | {"d_in": 7}, _sized(7)), "7-wide", CFG),
    # dtypes and values
    ("W_enc int", lambda c, w, d: (c, w | {"W_enc": (w["W_enc"] * 10).to(torch.int32)}), "int32", WTS),
    ("b_enc bool", lambda c, w, d: (c, w | {"b_enc": w["b_enc"] > 0}), "bool", WTS),
    ("W_enc NaN", lambda c, w, d: (c, w | {"W_enc": _poison(w["W_enc"], math.nan)}), "NaN", WTS),
    ("b_dec inf", lambda c, w, d: (c, w | {"b_dec": _poison(w["b_dec"], math.inf)}), "inf", WTS),
    (
        "float64 beyond float32",
        lambda c, w, d: (c, w | {"W_dec": _poison(w["W_dec"].double(), 1e300)}),
        "float32",
        WTS,
    ),
    # missing and extra tensors
    ("no W_enc", lambda c, w, d: (c, _without(w, "W_enc")), "W_enc", WTS),
    ("no b_enc", lambda c, w, d: (c, _without(w, "b_enc")), "b_enc", WTS),
    ("no b_dec but applied", lambda c, w, d: (c, _without(w, "b_dec")), "b_dec", WTS),
    ("extra tensor", lambda c, w, d: (c, w | {"scaling_factor": torch.ones(N)}), "scaling_factor", WTS),
    ("threshold on a ReLU SAE", lambda c, w, d: (c, w | {"threshold": torch.full((N,), 0.1)}), "threshold", WTS),
    ("jumprelu without threshold", lambda c, w, d: (c | {"architecture": "jumprelu"}, w), "threshold", WTS),
    (
        "negative threshold",
        lambda c, w, d: (c | {"architecture": "jumprelu"}, w | {"threshold": torch.full((N,), -0.5)}),
        "negative",
        WTS,
    ),
    (
        "NaN threshold",
        lambda c, w, d: (c | {"architecture": "jumprelu"}, w | {"threshold": torch.full((N,), math.nan)}),
        "NaN",
        WTS,
    ),
    (
        "weights not safetensors",
        lambda c, w, d: (c, b"\x00garbage, not a safetensors header"),
        "readable safetensors",
        WTS,
    ),
    ("weights empty", lambda c, w, d: (c, b""), "readable safetensors", WTS),
    # the config
    ("cfg a list", lambda c, w, d: ([c], w), "JSON object", CFG),
    ("cfg a string", lambda c, w, d: ('"standard"', w), "JSON object", CFG),
    ("cfg not JSON", lambda c, w, d: ("{architecture: standard", w), "not valid JSON", CFG),
    ("cfg nested too deep", lambda c, w, d: ("[" * 100_000 + "]" * 100_000, w), "too deeply", CFG),
    ("architecture unknown", lambda c, w, d: (c | {"architecture": "standrad"}, w), "'standard'", CFG),
    ("architecture not a string", lambda c, w, d: (c | {"architecture": 7}, w), "architecture", CFG),
    ("architecture gated", lambda c, w, d: (c | {"architecture": "gated"}, w), "gated", CFG),
    ("activation tanh-relu", lambda c, w, d: (c | {"activation_fn_str": "tanh-relu"}, w), "activation_fn_str", CFG),
    ("activation_fn a list", lambda c, w, d: (c | {"activation_fn": ["relu"]}, w), "activation_fn", CFG),
    ("d_sae zero", lambda c, w, d: (c | {"d_sae": 0}, w), "d_sae", CFG),
    ("d_sae a string", lambda c, w, d: (c | {"d_sae": "16"}, w), "d_sae", CFG),
    ("d_sae a float", lambda c, w, d: (c | {"d_sae": 16.5}, w), "d_sae", CFG),
    ("d_in true", lambda c, w, d: (c | {"d_in": True}, w), "d_in", CFG),
    ("d_sae disagrees", lambda c, w, d: (c | {"d_sae": 2 * N}, w), "d_sae", CFG),
    ("d_in disagrees", lambda c, w, d: (c | {"d_in": d + 1}, w), "d_in", CFG),
    ("hook_name names no point", lambda c, w, d: (c | {"hook_name": "blocks.0.hook_nonsense"}, w), "hook_name", CFG),
    ("hook_name beyond the model", lambda c, w, d: (c | {"hook_name": "blocks.9.hook_resid_post"}, w), "layer", CFG),
    ("hook_name a number", lambda c, w, d: (c | {"hook_name": 5}, w), "hook_name", CFG),
    ("hook_name empty", lambda c, w, d: (c | {"hook_name": "  "}, w), "hook_name", CFG),
    ("no hook_name", lambda c, w, d: (_without(c, "hook_name"), w), "address=", CFG),
    (
        "hook_name twice, disagreeing",
        lambda c, w, d: (c | {"metadata": {"hook_name": "blocks.1.hook_resid_post"}}, w),
        "metadata.hook_name",
        CFG,
    ),
    ("hook_head_index", lambda c, w, d: (c | {"hook_head_index": 2}, w), "hook_head_index", CFG),
    ("metadata a list", lambda c, w, d: (c | {"metadata": [HOOK]}, w), "metadata", CFG),
    ("apply_b_dec_to_input a string", lambda c, w, d: (c | {"apply_b_dec_to_input": "false"}, w), "apply_b_dec", CFG),
    ("apply_b_dec_to_input 0", lambda c, w, d: (c | {"apply_b_dec_to_input": 0}, w), "apply_b_dec", CFG),
    ("normalize_activations", lambda c, w, d: (c | {"normalize_activations": "layer_norm"}, w), "normalize", CFG),
    ("topk without k", lambda c, w, d: (c | {"architecture": "topk"}, w), "needs its k", CFG),
    ("topk k zero", lambda c, w, d: (c | {"architecture": "topk", "k": 0}, w), "'k'", CFG),
    ("topk k above d_sae", lambda c, w, d: (c | {"architecture": "topk", "k": N + 1}, w), "'k'", CFG),
    ("topk k a string", lambda c, w, d: (c | {"architecture": "topk", "k": "4"}, w), "'k'", CFG),
    ("topk k not whole", lambda c, w, d: (c | {"architecture": "topk", "k": 4.5}, w), "'k'", CFG),
    (
        "topk k twice, disagreeing",
        lambda c, w, d: (c | {"architecture": "topk", "k": 4, "activation_fn_kwargs": {"k": 5}}, w),
        "activation_fn_kwargs",
        CFG,
    ),
    ("k on a ReLU SAE", lambda c, w, d: (c | {"k": 4}, w), "'k'", CFG),
    (
        "activation_fn_kwargs a list",
        lambda c, w, d: (c | {"activation_fn_kwargs": [4]}, w),
        "activation_fn_kwargs",
        CFG,
    ),
]


@pytest.mark.parametrize("case,breaks,fragment,file", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_folder_is_refused_naming_the_file_and_what_is_wrong(s, tmp_path, case, breaks, fragment, file):
    d = s.facts.d_model
    cfg, w = breaks(*_good(d), d)
    folder = _write(tmp_path / "sae", cfg, w)
    with pytest.raises(IELabError) as e:
        load_sae(folder, s)
    msg = str(e.value)
    assert fragment in msg, msg
    assert os.path.join(folder, file) in msg, msg  # the file, by its path
    assert_clean(s._lm)


def test_the_good_folder_loads_and_float64_or_bfloat16_weights_are_converted(s, tmp_path):
    d = s.facts.d_model
    cfg, w = _good(d)
    sae = load_sae(_write(tmp_path / "good", cfg, w), s)
    assert str(sae.address) == "resid_post.0" and sae.d_sae == N
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        cast = {k: v.to(dtype) for k, v in w.items()}
        sae = load_sae(_write(tmp_path / str(dtype), cfg, cast), s)
        assert all(t.dtype == torch.float32 for t in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
        assert torch.equal(sae.W_enc, cast["W_enc"].float())
    # a folder written before cfg.json named its architecture: standard, or JumpReLU where a threshold is saved
    jcfg, jw = _good(d, threshold=True)
    sae = load_sae(_write(tmp_path / "old", _without(jcfg, "architecture"), jw), s)
    assert sae.activation == "jumprelu"
    # a zero threshold (a JumpReLU that is a ReLU on some features) and k = d_sae are at the edge, and load
    assert load_sae(_write(tmp_path / "jr0", jcfg, jw | {"threshold": torch.zeros(N)}), s).activation == "jumprelu"
    assert load_sae(_write(tmp_path / "tk", cfg | {"architecture": "topk", "k": N}, w), s).k == N
    # a count written as a whole float (some writers save k as 32.0) is that integer
    tk = load_sae(_write(tmp_path / "tk2", cfg | {"architecture": "topk", "k": 4.0, "d_sae": float(N)}, w), s)
    assert tk.k == 4 and isinstance(tk.k, int)
    assert_clean(s._lm)


def test_a_plain_safetensors_dict_is_checked_the_same_way(s, tmp_path):
    d = s.facts.d_model
    _, w = _good(d)
    path = str(tmp_path / "enc.safetensors")
    save_file(w | {"W_enc": _poison(w["W_enc"], math.nan)}, path)
    with pytest.raises(IELabError, match="NaN") as e:
        load_sae(path, s, address="resid_post.0")
    assert path in str(e.value)
    save_file(_sized(7), path)
    with pytest.raises(IELabError, match="-wide"):  # a width that is not the point's, by address= too
        load_sae(path, s, address="resid_post.0")
    with pytest.raises(IELabError, match="path"):
        load_sae(12, s)
    assert_clean(s._lm)


# ---- property: random changes of a valid cfg.json's values and types --------------------------------------------

KEYS = [
    "architecture",
    "hook_name",
    "hook_head_index",
    "d_in",
    "d_sae",
    "k",
    "activation_fn_str",
    "activation_fn",
    "activation_fn_kwargs",
    "apply_b_dec_to_input",
    "normalize_activations",
    "metadata",
    "dtype",
    "device",
]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 4, N, N + 1, 128, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "standard",
            "jumprelu",
            "topk",
            "relu",
            "gated",
            "none",
            "TopK",
            HOOK,
            "blocks.1.hook_resid_pre",
            "blocks.1.hook_mlp_out",
            "blocks.0.attn.hook_pattern",
            "blocks.0.attn.hook_z",
            "blocks.7.hook_resid_post",
            "hook_embed",
            "blocks.0.hook_resid_post.x",
        ]
    ),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS + ["x"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def folders(s, tmp_path_factory):
    """Three valid folders (standard, JumpReLU, TopK), whose cfg.json the property overwrites."""
    d = s.facts.d_model
    root = tmp_path_factory.mktemp("saes")
    cfg, w = _good(d)
    jcfg, jw = _good(d, threshold=True)
    return [
        (_write(root / "relu", cfg, w), cfg),
        (_write(root / "jumprelu", jcfg, jw), jcfg),
        (_write(root / "topk", cfg | {"architecture": "topk", "k": 4}, w), cfg | {"architecture": "topk", "k": 4}),
    ]


@settings(max_examples=40)
@given(
    which=st.integers(0, 2),
    changes=st.lists(st.tuples(st.sampled_from(KEYS), st.booleans(), _json), min_size=1, max_size=3),
    whole=st.integers(0, 7).flatmap(lambda i: _json if i == 0 else st.none()),  # 1 in 8: a whole other document
)
def test_a_mutated_config_loads_or_is_refused_never_a_foreign_error(s, folders, which, changes, whole):
    folder, good = folders[which]
    cfg = dict(good)
    for key, drop, value in changes:
        if drop:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    written = cfg if whole is None else whole
    with open(os.path.join(folder, "cfg.json"), "w") as f:
        json.dump(written, f)  # NaN and Infinity are written as JSON's readers (Python's too) take them
    before = hook_count(s._lm.hf)
    try:
        sae = load_sae(folder, s)
    except IELabError:
        pass
    except Exception as e:  # noqa: BLE001 - the property under test
        pytest.fail(f"cfg.json {written!r} raised a foreign {type(e).__name__}: {e}")
    else:
        assert sae.address is not None and sae.activation in ("relu", "jumprelu", "topk")
        out = sae.encode(torch.randn(3, s.facts.d_model))
        assert out.shape == (3, sae.d_sae) and bool(torch.isfinite(out).all())
    assert hook_count(s._lm.hf) == before == 0
