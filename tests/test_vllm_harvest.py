"""harvest on vLLM writes the rows (and SAE features) eager's harvest writes, within the vLLM parity tolerance (one
engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import ie_lab  # noqa: E402
from tests.vllm_helpers import PROMPTS, close, eager_for, vllm_session  # noqa: E402

ADDRS = ["resid_post.1", "mlp_out.0", "z.1.head-2"]


def test_vllm_harvest_equals_eager_harvest(tmp_path_factory):
    from tests.test_harvest import _sae

    sae = _sae()  # its point, resid_post.1, is harvested too
    eager = ie_lab.harvest(
        eager_for("llama"), PROMPTS, ADDRS, tmp_path_factory.mktemp("eager"), batch_size=3, progress=False, sae=sae
    )
    out = tmp_path_factory.mktemp("vllm")
    with vllm_session("llama", tmp_path_factory.mktemp("vllm_models")) as s:
        got = s.harvest(PROMPTS, ADDRS, out, batch_size=3, shard_rows=16, progress=False, sae=sae)
        with pytest.raises(ie_lab.AddressError, match="per-token point"):
            s.harvest(PROMPTS, ["attn_probs.0"], tmp_path_factory.mktemp("refused"), progress=False)
    assert len(got.manifest["shards"]) > 1 and got.n_prompts == len(PROMPTS) == eager.n_prompts
    for col in ("token_ids", "prompt_ids", "positions"):
        assert (getattr(got, col) == getattr(eager, col)).all(), col
    for a in ADDRS:
        assert close(got[a][:], eager[a][:]), a
    assert close(got.features(slice(None)), eager.features(slice(None)))
    r = eager.rows_of(1)  # a neighbour fails: the next prompt's rows, another point
    assert not close(got["resid_post.1"][r], eager["resid_post.1"][eager.rows_of(2)])
    assert not close(got["resid_post.1"][:], eager["mlp_out.0"][:])
