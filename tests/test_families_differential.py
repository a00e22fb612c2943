"""Differential attention (DiffLlama, issue 20 item 2): each layer calls the attention kernel twice with the same
queries and keys, once per half of the values, and combines the outputs as out1 - lambda * out2 (head pairs), then a
norm, before o_proj. The binder measures the two calls: z is o_proj's input, value is v_proj's output, and the pattern
points are the one pattern per head both calls share (tests/test_points_refused_served.py checks them against q·k
rebuilt from the weights). The model's own softmax maps, combined as the module combines them, reproduce the captured
z; one map times the value (what attn_probs @ value is on ordinary attention) does not.
"""

from __future__ import annotations

import pytest
import torch

import ie_lab
from ie_lab import coverage, tiny

TOL = dict(atol=2e-4, rtol=1e-4)
X = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def eager():

    torch.set_num_threads(1)
    model = tiny.build(coverage.tiny_config("diffllama"), attn_implementation="eager")
    return ie_lab.load(model, coverage._tokenizer(), quiet=True)


def test_two_kernel_calls_are_measured_and_the_invariants_hold(eager):
    assert [lb.kernel_calls for lb in eager.binding.layers] == [2, 2]
    assert all(lb.value_source == "v_proj" for lb in eager.binding.layers)
    coverage.check_invariants(eager)
    coverage.check_invariants(ie_lab.load(coverage.build_tiny("diffllama"), coverage._tokenizer(), quiet=True))


def test_z_is_the_two_maps_combined_and_not_one_map_times_the_value(eager):
    f, attn = eager.facts, eager.hf.model.layers[0].self_attn
    c = ie_lab.capture(eager, X, ["z.0", "value.0", "attn_out.0"])
    with torch.no_grad():
        maps = eager.hf(input_ids=X, output_attentions=True).attentions[0]  # [1, H, s, s], both calls' (shared q, k)
        torch.testing.assert_close(attn.o_proj(c["z.0"]), c["attn_out.0"], **TOL)
        b, s, _ = c["value.0"].shape
        v = c["value.0"].reshape(b, s, f.n_kv_heads, f.head_dim).transpose(1, 2)  # [b, KV, s, d]
        halves = [h.repeat(1, 2, 1, 1).repeat_interleave(f.n_heads // f.n_kv_heads, 1) for h in v.chunk(2, 1)]
        out = torch.cat([(maps @ h).transpose(1, 2) for h in halves], dim=-1)  # [b, s, H, 2d]
        o1, o2 = out.chunk(2, dim=2)
        lam = (
            torch.exp((attn.lambda_q1 * attn.lambda_k1).sum())
            - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
            + attn.lambda_init
        )
        z = ((1 - attn.lambda_init) * attn.groupnorm(o1 - lam * o2)).reshape(b, s, -1)
        torch.testing.assert_close(z, c["z.0"], **TOL)
        # one map mixing the value, as on ordinary attention: the same shape, another tensor
        v_all = v.repeat_interleave(f.n_heads // f.n_kv_heads, 1)
        single = (maps @ v_all).transpose(1, 2).reshape(b, s, -1)
        assert single.shape == c["z.0"].shape
        assert not torch.allclose(single, c["z.0"], **TOL)


def test_pattern_points_are_the_maps_both_calls_share(eager):
    c = ie_lab.capture(eager, X, ["attn_probs.1", "attn_scores.1"])
    with torch.no_grad():
        maps = eager.hf(input_ids=X, output_attentions=True).attentions[1]  # the first call's, as the module returns
    torch.testing.assert_close(c["attn_probs.1"], maps, **TOL)
    torch.testing.assert_close(torch.softmax(c["attn_scores.1"], -1), maps, **TOL)


def test_written_z_flows_through_o_proj(eager):
    other = torch.randint(4, 500, (1, 7), generator=torch.Generator().manual_seed(1))
    c = ie_lab.capture(eager, other, ["z.1", "attn_out.1"])
    via_z = ie_lab.run_with_patches(eager, X, {"z.1": c["z.1"]})
    via_out = ie_lab.run_with_patches(eager, X, {"attn_out.1": c["attn_out.1"]})
    torch.testing.assert_close(via_z, via_out, **TOL)
