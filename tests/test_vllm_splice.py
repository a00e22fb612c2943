"""SAE splicing on vLLM (issue 31 item 2): the worker replaces the SAE's point by its reconstruction with the eager
hooks' arithmetic (ops/splice.py), so a spliced capture, its features ('sae.<name>.acts') and a spliced greedy
generation equal eager's (tests/test_vllm_parity.py's tolerance); error=True leaves the run as it was; a `with` block
splices its own requests only. One engine for the module."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import ie_lab  # noqa: E402
from ie_lab.errors import InputError  # noqa: E402
from tests.vllm_helpers import TEXT, close, eager_for, vllm_session  # noqa: E402

FAMILY = "llama"
POINT = "resid_post.0"


@pytest.fixture(scope="module")
def eager():
    return eager_for(FAMILY)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    with vllm_session(FAMILY, tmp_path_factory.mktemp("vllm_splice")) as s:
        yield s


@pytest.fixture(scope="module")
def path(eager, tmp_path_factory):
    d, n = eager.facts.d_model, 48
    g = torch.Generator().manual_seed(0)
    w = {
        "W_enc": torch.randn(d, n, generator=g) / d**0.5,
        "b_enc": torch.randn(n, generator=g) * 0.1,
        "W_dec": torch.randn(n, d, generator=g) / n**0.5,
        "b_dec": torch.randn(d, generator=g) * 0.1,
    }
    p = str(tmp_path_factory.mktemp("sae") / "r0.safetensors")
    save_file(w, p)
    return p


def test_a_spliced_capture_and_its_features_equal_eager(session, eager, path):
    sv = ie_lab.load_sae(path, session, address=POINT)
    se = ie_lab.load_sae(path, eager, address=POINT)
    assert sv.name == "r0"
    pts = ["resid_post.1", POINT, "sae.r0.acts"]
    for make in (lambda sp: sp, lambda sp: sp.clamp([3, 11], 2.5).ablate(7)):
        got = session.capture(TEXT, pts, splice=make(session.splice(sv)))
        want = ie_lab.capture(eager, TEXT, pts, splice=make(ie_lab.splice(eager, se)))
        for a in pts:
            assert close(got[a], want[a]), a
    plain = session.capture(TEXT, ["resid_post.1", "resid_post.0"])
    spliced = session.capture(TEXT, ["resid_post.1"], splice=session.splice(sv))
    assert not close(spliced["resid_post.1"], plain["resid_post.1"], atol=1e-2)  # the splice acts on vLLM
    kept = session.capture(TEXT, ["resid_post.1"], splice=session.splice(sv, error=True))
    assert close(kept["resid_post.1"], plain["resid_post.1"])
    acts = session.capture(TEXT, ["sae.r0.acts"], splice=session.splice(sv))["sae.r0.acts"]
    assert close(acts, se.encode(plain["resid_post.0"]))
    assert not close(acts, se.encode(plain["resid_post.1"]), atol=1e-2)  # the neighbouring layer's point differs
    with pytest.raises(InputError, match="no SAE of that name"):
        session.capture(TEXT, ["sae.r1.acts"], splice=session.splice(sv))


def test_a_spliced_generation_and_a_with_block_equal_eager(session, eager, path):
    sv = ie_lab.load_sae(path, session, address=POINT)
    se = ie_lab.load_sae(path, eager, address=POINT)
    got = session.generate(TEXT, 8, splice=session.splice(sv).clamp([5], 4.0))
    want = ie_lab.generate(eager, TEXT, 8, splice=ie_lab.splice(eager, se).clamp([5], 4.0))
    assert got.ids == want.ids
    plain = session.generate(TEXT, 8)
    assert session.generate(TEXT, 8, splice=session.splice(sv, error=True)).ids == plain.ids
    with session.splice(sv):
        inside = session.capture(TEXT, ["resid_post.1"])["resid_post.1"]
    alone = session.capture(TEXT, ["resid_post.1"], splice=session.splice(sv))["resid_post.1"]
    assert close(inside, alone)
    assert close(
        session.capture(TEXT, ["resid_post.1"])["resid_post.1"],
        ie_lab.capture(eager, TEXT, ["resid_post.1"])["resid_post.1"],
    )
    state = session.worker_state()[0]
    assert state["specs"] == [] and state["steering"] == 0  # nothing of the splices is left in the worker
