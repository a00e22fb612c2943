"""Tensor parallelism 2 on this CPU: every served point equals eager's on the same weights (real spawned workers),
in the default eager-hook mode and in graph mode. Eager is the reference that tensor_parallel_size=1 is checked
against (tests/test_vllm_parity.py and the hybrid tests); comparing TP=2 with it directly saves an engine start per
family. The hybrid families vLLM serves (a Mamba 2 trunk, Falcon-H1's mixer beside attention, Granite-MoE-hybrid,
LFM2's short convolutions, Zamba 2) run at TP=2 too: each rank's mixer holds a slice of its heads and channels, and
its out_proj all-reduces them, so the mixer's input and output, the residual points and steering a mixer's output
equal eager's.

One family per distinct tensor-parallel code path (TP_COVERED_BY says which family stands for the two that are not
started here, and why nothing of theirs goes unchecked): two TP=2 engines per family are the costliest thing the gate
does.

Runs tests/vllm_tp_script.py in a subprocess (vLLM spawns its workers, which re-import __main__).
About two minutes per family on a quiet 2-core machine, nearly all of it the two AsyncLLM engines' start-ups (hook
mode, then graph mode; each spawns an engine core and two workers pinned one core each); the requests take seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What each run must cover. GPT-OSS: each rank holds its heads' attention-sink logits, so the attention
# read-out (on rank 0, over every head) needs all of them; the MoE router is replicated.
MUST = {
    "gpt_oss": (
        {"attn_probs.0", "attn_probs.1", "attn_scores.1", "router_logits.0", "value.1", "z.0"},
        {"z.0", "value.1", "resid_post.1"},
    ),
    "mamba2": (
        {"mixer_in.0", "mixer_out.1", "mixer_out_post.0", "resid_pre.1", "resid_post.1"},
        {"mixer_in.1", "mixer_out.0", "mixer_out_post.1", "resid_post.0"},
    ),
    "falcon_h1": (
        {"mixer_in.1", "mixer_out.0", "mixer_out_post.1", "attn_out_post.0", "z.1", "mlp_out_post.0", "resid_mid.1"},
        {"mixer_in.0", "mixer_out.1", "mixer_out_post.0", "z.1", "mlp_act.0", "resid_post.1"},
    ),
    "granitemoehybrid": (
        {"mixer_in.0", "mixer_out.0", "mixer_out_post.0", "attn_out.1", "router_logits.1", "mlp_out_post.0"},
        {"mixer_in.0", "mixer_out.0", "z.1", "resid_post.1"},
    ),
    # LFM2 also stands for Qwen 3 and LFM2-MoE (TP_COVERED_BY): its attention layer's QK-norm, value and z and its
    # dense layers' gate / up halves are the sharded sites Qwen 3 had checked
    "lfm2": (
        {"mixer_in.0", "mixer_out.1", "mixer_out_post.1", "q_norm_out.2", "attn_probs.2", "mlp_act.0", "resid_mid.2"}
        | {"q_norm_in.2", "k_norm_out.2", "value.2", "z.2", "mlp_pre.0", "mlp_pre_linear.1"},
        {"mixer_in.1", "mixer_out.0", "k_norm_in.2", "mlp_act.2", "resid_post.2"}
        | {"z.2", "value.2", "q_norm_out.2", "mlp_pre.0", "mlp_pre_linear.1"},
    ),
    # Zamba 2: the shared transformer block's attention heads and MLP split over ranks too, before its output joins
    # the mixer's input on each hybrid layer
    "zamba2": (
        {"mixer_in.1", "mixer_out.3", "mixer_out_post.2", "resid_pre.3", "resid_post.0", "final_norm"},
        {"mixer_in.3", "mixer_out.1", "mixer_out_post.0", "resid_post.2"},
    ),
}
HYBRIDS = ("mamba2", "falcon_h1", "granitemoehybrid", "lfm2", "zamba2")

# Families vLLM serves at TP=2 that are not started here: every tensor-parallel code path they would run is run by
# the family named, on the same ie_lab sites (a sharded site is gathered by the same worker code whatever the family;
# replicated sites such as router_logits are read as on one rank). Each is still checked at TP=1 against eager
# (tests/test_vllm_parity.py, tests/test_vllm_hybrids2.py) and allowed at TP=2 (nothing in quirks.VLLM_SINGLE_RANK).
TP_COVERED_BY = {
    # Llama-like attention (sharded value and z, attention read-out over gathered q / k, the same heads and KV
    # heads as Qwen 3's tiny instance) on GPT-OSS; QK-norm and a merged gate_up_proj's sharded halves on LFM2
    "qwen3": ("gpt_oss", "lfm2"),
    # the same layer binding as LFM2 (short convolution, QK-norm attention); its MoE block's router is replicated
    # and its output all-reduced inside vLLM's block, as on Granite-MoE-hybrid and GPT-OSS
    "lfm2_moe": ("lfm2", "granitemoehybrid", "gpt_oss"),
}


def run_tp_script(families, tmp_root) -> dict:
    """tests/vllm_tp_script.py over these families in one process: family -> its verdicts."""
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "vllm_tp_script.py"), str(tmp_root), *families],
        capture_output=True,
        text=True,
        timeout=480 * len(families),
        env=env,
        cwd=ROOT,
    )
    out = {}
    for x in p.stdout.splitlines():
        if x.startswith("IE_LAB_TP_RESULT "):
            r = json.loads(x.split(" ", 1)[1])
            out[r["family"]] = r
    out["_output"] = p.stdout[-3000:] + p.stderr[-3000:]
    return out


def check_tp_result(family: str, results: dict) -> None:
    r = results.get(family)
    assert r is not None, results["_output"]
    assert "error" not in r, r["error"]
    points, graph = MUST[family]
    assert r["tp_size"] == 2 and r["n_workers"] == 2
    assert points <= set(r["addresses"])
    assert r["shapes_equal"], r
    assert r["differ"] == [], r
    assert r["greedy_equal"] and r["workers_idle"], r
    # graph mode (compiled trunk, static taps) at TP=2 gathers the same shards
    assert graph <= set(r["graph_points"])
    assert r["graph_differ"] == [] and r["graph_greedy_equal"], r
    # graph-mode steering at TP=2 (every rank steers its replicated rows from its own buffers) equals eager's
    assert r["graph_steered_equal"], r
    # a request whose steering overflows fails alone at TP=2, hooks and graph mode (issue 28; tests/test_vllm_isolation.py
    # at TP=1): the next requests equal their solo runs
    assert r["contained"] == "" and r["graph_contained"] == "", r
    assert r["orphans"] == [], f"processes left after Session.close(): {r['orphans']}"
    if family in HYBRIDS:
        # TP=2's stream steered at mixer_out.0 equals eager's at the tensor's own scale
        assert r["eager_differ"] == [], r


# This module's families; tests/test_vllm_tp_hybrids.py runs the rest (two modules: the two test workers take one
# each, three families apiece).
FAMILIES = ("gpt_oss", "lfm2", "mamba2")


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return run_tp_script(FAMILIES, tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_served_point_at_tp2_equals_eager(family, tp_results):
    check_tp_result(family, tp_results)
