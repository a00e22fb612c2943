"""project() on the eager backend: scores computed in the hook equal capture() followed by the same arithmetic
written out by hand here (exact at fp32), for probes and ReLU / JumpReLU / TopK SAE encoders; bad inputs are
refused naming the argument before any hook is placed; the model is clean after every call."""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab.errors import IELabError
from tests.conftest import assert_clean, lm_for

TEXT = "the cat sat on the mat and then it ran away"


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _capture(lm, addr, text=TEXT):
    return ie_lab.capture(lm, text, [addr])[addr][0].float()  # [tokens, d]


def _sae(d: int, n: int, seed: int = 0) -> dict:
    g = _g(seed)
    return {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }


@pytest.mark.parametrize(
    "family,addr", [("llama", "resid_post.1"), ("gpt2", "mlp_act.0"), ("qwen3", "z.1.head-2"), ("opt", "mlp_out.1")]
)
def test_probe_scores_equal_capture_then_matmul(family, addr):
    lm = lm_for(family)
    x = _capture(lm, addr)
    D = torch.randn(6, x.shape[-1], generator=_g(1))
    bias = torch.randn(6, generator=_g(2))
    p = ie_lab.project(lm, TEXT, addr, D, bias=bias)
    assert_clean(lm)
    assert p.scores.shape == (x.shape[0], 6)
    assert torch.equal(p.scores, x @ D.T + bias)
    assert torch.equal(p.tokens, ie_lab.capture(lm, TEXT, [addr]).tokens[0])


def test_a_neighbouring_layer_fails_the_comparison():
    """The comparison can fail: the same math on resid_post.0 or resid_post.2 (the same shape) differs."""
    lm = lm_for("llama")
    D = torch.randn(4, lm.facts.d_model, generator=_g(3))
    p = ie_lab.project(lm, TEXT, "resid_post.1", D)
    for wrong in ("resid_post.0", "mlp_out.1"):  # the layer before, and the branch the stream adds last
        y = _capture(lm, wrong) @ D.T
        assert y.shape == p.scores.shape
        assert not torch.allclose(p.scores, y, atol=1e-3)
    assert torch.equal(p.scores, _capture(lm, "resid_post.1") @ D.T)


def test_relu_sae_equals_capture_then_encoder():
    lm = lm_for("llama")
    sae = _sae(lm.facts.d_model, 32)
    x = _capture(lm, "resid_post.1")
    p = ie_lab.project(lm, TEXT, "resid_post.1", sae)  # a dict with b_enc and no threshold: ReLU
    assert_clean(lm)
    want = torch.relu((x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"])
    assert torch.equal(p.scores, want)
    assert bool((p.scores == 0).any()) and bool((p.scores > 0).any())  # the nonlinearity did something


def test_jumprelu_sae_with_per_feature_threshold():
    lm = lm_for("gemma2")
    d = lm.facts.d_model
    sae = _sae(d, 24, seed=4)
    x = _capture(lm, "resid_post.0")
    pre = (x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"]
    sae["threshold"] = pre.median(dim=0).values.abs()  # some rows above, some below, per feature
    p = ie_lab.project(lm, TEXT, "resid_post.0", sae)  # threshold in the dict: JumpReLU
    want = pre * (pre > sae["threshold"]).float()
    assert torch.equal(p.scores, want)
    assert bool((p.scores == 0).any()) and bool((p.scores != 0).any())
    # ReLU on the same weights gives something else: the threshold was applied
    relu = ie_lab.project(lm, TEXT, "resid_post.0", {k: v for k, v in sae.items() if k != "threshold"})
    assert not torch.equal(relu.scores, p.scores)
    assert_clean(lm)


def test_topk_sae_keeps_k_features_per_token():
    lm = lm_for("qwen3")
    sae = _sae(lm.facts.d_model, 40, seed=5)
    x = _capture(lm, "mlp_out.1")
    pre = (x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"]
    # shift so that about half the rows have a negative value among their top 3: the ReLU on the kept ones shows
    sae["b_enc"] = sae["b_enc"] - pre.sort(dim=-1, descending=True).values[:, 2].median()
    p = ie_lab.project(lm, TEXT, "mlp_out.1", sae, activation="topk", k=3)
    pre = (x - sae["b_dec"]) @ sae["W_enc"] + sae["b_enc"]
    kth = pre.sort(dim=-1, descending=True).values[:, 2:3]  # each row's third largest
    assert bool((kth < 0).any()) and bool((kth > 0).any())
    want = torch.where(pre >= kth, pre.clamp(min=0), torch.zeros_like(pre))
    assert torch.equal(p.scores, want)
    assert int((p.scores != 0).sum(-1).max()) <= 3 and bool((p.scores != 0).any())
    assert_clean(lm)


def test_safetensors_file_is_loaded_like_the_dict(tmp_path):
    from safetensors.torch import save_file

    lm = lm_for("llama")
    sae = _sae(lm.facts.d_model, 16, seed=6)
    f = tmp_path / "sae.safetensors"
    save_file(sae, str(f))
    a = ie_lab.project(lm, TEXT, "resid_post.1", str(f))
    b = ie_lab.project(lm, TEXT, "resid_post.1", sae)
    assert torch.equal(a.scores, b.scores)
    torch.save(sae, tmp_path / "sae.pt")
    with pytest.raises(IELabError, match="directions"):  # never unpickled
        ie_lab.project(lm, TEXT, "resid_post.1", str(tmp_path / "sae.pt"))
    assert_clean(lm)


def test_during_generation_scores_cover_every_token_read():
    """max_new_tokens > 0: the same tokens as generate(), and the scores of prompt + generated[:-1] equal the
    rows generate(capture=) returns, projected by hand."""
    lm = lm_for("llama")
    D = torch.randn(5, lm.facts.d_mlp, generator=_g(7))
    p = ie_lab.project(lm, TEXT, "mlp_act.1", D, max_new_tokens=6, ignore_eos=True)
    assert_clean(lm)
    g = ie_lab.generate(lm, TEXT, 6, capture=["mlp_act.1"], ignore_eos=True)
    assert p.generated == g.ids and p.text == g.text
    rows = g.cache["mlp_act.1"][0, :-1].float()  # the last generated token is never read without a capture
    assert p.scores.shape == (rows.shape[0], 5)
    P = p.tokens.shape[0] - 5
    # by hand, forward by forward as the hook sees them: the prompt's rows together, then one row per step
    want = torch.cat([rows[:P] @ D.T] + [rows[i : i + 1] @ D.T for i in range(P, rows.shape[0])])
    assert torch.equal(p.scores, want)
    assert torch.equal(p.tokens, g.cache.tokens[0, :-1])


def test_steering_in_scope_is_seen_and_session_matches_free_function():
    lm = lm_for("llama")
    d = lm.facts.d_model
    D = torch.randn(3, d, generator=_g(8))
    v = torch.randn(d, generator=_g(9))
    with ie_lab.steer(lm, "resid_post.0", v, scale=3.0):
        p = ie_lab.project(lm, TEXT, "resid_post.1", D)
        x = _capture(lm, "resid_post.1")
    assert torch.equal(p.scores, x @ D.T)
    assert not torch.allclose(p.scores, _capture(lm, "resid_post.1") @ D.T)  # unsteered differs
    assert_clean(lm)
    from tests.families import make_model, make_tokenizer

    s = ie_lab.Session(make_model("llama"), tokenizer=make_tokenizer(), progress=False)
    try:
        q = s.project(TEXT, "resid_post.1", D)
        assert torch.equal(q.scores, s.capture(TEXT, ["resid_post.1"])["resid_post.1"][0] @ D.T)
        with s.steer("resid_post.0", v, scale=3.0):
            q2 = s.project(TEXT, "resid_post.1", D)
        assert not torch.allclose(q.scores, q2.scores)
        assert_clean(s._lm)
    finally:
        s.close()


def _bad_cases(d: int, d_mlp: int):
    D = torch.randn(4, d)
    sae = _sae(d, 8)
    nan = D.clone()
    nan[1, 2] = float("nan")
    return [
        ("wrong d", dict(directions=torch.randn(4, d + 1)), "directions"),
        ("1-d directions", dict(directions=torch.randn(d)), "directions"),
        ("d of another point", dict(directions=torch.randn(4, d_mlp)), "directions"),
        ("non-finite", dict(directions=nan), "directions"),
        ("int directions", dict(directions=torch.ones(4, d, dtype=torch.long)), "directions"),
        ("bias shape", dict(directions=D, bias=torch.randn(5)), "bias"),
        ("bias nan", dict(directions=D, bias=torch.tensor([0.0, float("inf"), 0.0, 0.0])), "bias"),
        ("W_enc wrong d", dict(directions={"W_enc": torch.randn(d + 2, 8)}), "W_enc"),
        ("b_enc shape", dict(directions={**sae, "b_enc": torch.randn(9)}), "b_enc"),
        ("b_dec shape", dict(directions={**sae, "b_dec": torch.randn(d - 1)}), "b_dec"),
        ("threshold shape", dict(directions={**sae, "threshold": torch.randn(3)}), "threshold"),
        ("unknown key", dict(directions={**sae, "W_dec": torch.randn(8, d)}), "W_dec"),
        ("no W_enc", dict(directions={"b_enc": torch.randn(8)}), "W_enc"),
        ("bias with dict", dict(directions=sae, bias=torch.randn(8)), "bias"),
        ("unknown activation", dict(directions=sae, activation="gelu"), "activation"),
        ("jumprelu no threshold", dict(directions=sae, activation="jumprelu"), "threshold"),
        ("topk without k", dict(directions=sae, activation="topk"), "k="),
        ("topk k=0", dict(directions=sae, activation="topk", k=0), "k="),
        ("topk k too big", dict(directions=sae, activation="topk", k=9), "k="),
        ("k without topk", dict(directions=sae, k=2), "k="),
        ("threshold without jumprelu", dict(directions=D, threshold=0.5), "threshold"),
        ("not a tensor", dict(directions=[[1.0] * d]), "directions"),
        ("negative max_new_tokens", dict(directions=D, max_new_tokens=-1), "max_new_tokens"),
        ("unknown generation arg", dict(directions=D, capture=["resid_post.0"]), "capture"),
        ("two addresses", dict(directions=D, address=["resid_post.0", "resid_post.1"]), "address"),
        ("attention pattern", dict(directions=D, address="attn_probs.0"), "attn_probs"),
        ("two prompts", dict(directions=D, prompt=["a b c", "d e f"]), "prompt"),
    ]


@pytest.mark.parametrize("case", range(27))
def test_bad_inputs_are_refused_naming_the_argument(case):
    lm = lm_for("llama")
    name, kw, needle = _bad_cases(lm.facts.d_model, lm.facts.d_mlp)[case]
    kw = dict(kw)
    address = kw.pop("address", "resid_post.1")
    prompt = kw.pop("prompt", TEXT)
    with pytest.raises(IELabError) as ei:
        ie_lab.project(lm, prompt, address, kw.pop("directions"), **kw)
    assert needle in str(ei.value), f"{name}: {ei.value}"
    assert_clean(lm)


def test_bad_case_table_is_fully_parametrized():
    lm = lm_for("llama")
    assert len(_bad_cases(lm.facts.d_model, lm.facts.d_mlp)) == 27


def test_a_generation_argument_refused_inside_generate_leaves_no_hook():
    """temperature is checked by generate itself, after project's hooks are placed: they come off again."""
    lm = lm_for("llama")
    D = torch.randn(2, lm.facts.d_model, generator=_g(10))
    for bad, needle in ((dict(temperature=-1.0), "temperature"), (dict(stop=[123]), "stop")):
        with pytest.raises(IELabError, match=needle):
            ie_lab.project(lm, TEXT, "resid_post.1", D, max_new_tokens=3, **bad)
        assert_clean(lm)
    assert torch.equal(ie_lab.project(lm, TEXT, "resid_post.1", D).scores, _capture(lm, "resid_post.1") @ D.T)
