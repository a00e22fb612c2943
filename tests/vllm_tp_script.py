"""Every served point at tensor_parallel_size=2, in hook mode and in graph mode, equals eager's on the same saved
weights (run by test_vllm_tp.py); greedy and steered tokens too. A hybrid family is a tiny instance built as
tests/test_vllm_hybrids*.py and tests/test_vllm_zamba2.py build it.

A script, not a test module: vLLM spawns its tensor-parallel workers, which re-import __main__, so the work
sits under ``if __name__ == "__main__"``. Prints one JSON line of verdicts per family.
"""

from __future__ import annotations

import json
import os
import sys


def hybrid_configs() -> dict:
    """family -> config overrides of the hybrid families the vLLM hybrid tests serve."""
    from tests import test_vllm_hybrids, test_vllm_hybrids2, test_vllm_zamba2

    mods = (test_vllm_hybrids, test_vllm_hybrids2, test_vllm_zamba2)
    return {f: v[0] for m in mods for f, v in m.SERVED.items()}


def near(a, b) -> bool:
    """close() at b's own scale (a mixer's output on a tiny random instance is ~1e-4)."""
    from tests.vllm_helpers import close

    s = float(b[b.isfinite()].abs().max()) if b.isfinite().any() else 1.0
    return close(a / (s or 1.0), b / (s or 1.0))


def main(family: str, root: str) -> dict:
    import torch

    import ie_lab
    from ie_lab import coverage
    from ie_lab.eager.steer import make_spec
    from tests.families import saved_model_dir
    from tests.vllm_helpers import TEXT, close, served_addresses

    hybrids = hybrid_configs()
    if family in hybrids:
        coverage.OVERRIDES[family] = {**coverage.OVERRIDES.get(family, {}), **hybrids[family]}
        model = coverage.build_tiny(family)
        path = os.path.join(root, family)
        model.save_pretrained(path)
        coverage._tokenizer().save_pretrained(path)
    else:
        path = saved_model_dir(family, root)
    # The reference is eager on the saved weights (the kernel that applies soft-capping and sinks as vLLM does), not
    # a tensor_parallel_size=1 engine: TP=1 equals eager on every served point (tests/test_vllm_parity.py and the
    # hybrid tests), and an engine start is the costliest thing the gate does.
    eager = ie_lab.load(path, attn_implementation="eager", quiet=True)
    d = eager.facts.d_model
    last = f"resid_post.{eager.facts.n_layers - 1}"
    v = torch.linspace(-3.0, 3.0, d)
    from ie_lab.errors import CapabilityUnsupported

    def eager_ids(n: int) -> list[int]:
        """Greedy tokens on eager; where ie_lab's decode loop does not carry the model's cache (Mamba 2's recurrent
        state), transformers' own generate() under the same `with spec:` hooks."""
        try:
            return ie_lab.generate(eager, TEXT, n).ids
        except CapabilityUnsupported:
            ids = eager.tokenizer(TEXT, return_tensors="pt").input_ids
            out = eager.hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return out[0, ids.shape[1] :].tolist()

    g1 = eager_ids(10)

    def eager_steered(addr, n, **kw):
        with make_spec(eager, addr, v, **kw):
            return eager_ids(n)

    def steered_ids(s):  # one request per site, concurrently: each steered by its own spec
        import asyncio

        async def both():
            return await asyncio.gather(
                *(s.agenerate(TEXT, 6, steer=s.steer(a, v, **kw)) for a, kw in steer_at.items())
            )

        return [g.ids for g in asyncio.run(both())]

    def contained(s) -> str:
        """Issue 28 at TP=2: a request whose steering overflows (1e38 x 1e10 at resid_post.0, its generated positions)
        fails alone, naming the site, and the next requests (other prompts) equal their solo runs, token for token
        and logprob for logprob, greedy and sampled: nothing it wrote stayed in a cache block they reuse. '' when
        so, else what differed."""
        others = ["the cat", "Mary went"]  # short: they live among the freed slots
        bad = s.steer("resid_post.0", torch.full((d,), 1e38), scale=1e10, positions="generated")
        for kw in ({}, {"temperature": 0.9, "seed": 3}):

            def runs(kw=kw):
                out = [s.generate(p, 6, ignore_eos=True, **kw) for p in others]
                return [(r.ids, [st.logprob for st in r.steps]) for r in out]

            solo = runs()
            try:
                s.generate("John gave a drink to", 6, ignore_eos=True, steer=bad, **kw)
                return f"the overflowing request did not fail ({kw})"
            except ie_lab.IELabError as e:
                if "steering made resid_post.0 non-finite" not in str(e):
                    return f"failed with another message ({kw}): {str(e)[:300]}"
            after = runs()
            if after != solo:
                return f"after it ({kw}) {after} != solo {solo}"
        return ""

    two = ie_lab.Session(path, backend="vllm", engine="async", tensor_parallel_size=2, progress=False, replace=False)
    try:
        addrs = served_addresses(two)
        c1 = ie_lab.capture(eager, TEXT, addrs)
        # a mixer-only trunk (Mamba 2) has no MLP: its second layer's mixer output is swapped instead
        second = "mlp_out.1" if "mlp_out.1" in addrs else "mixer_out.1"
        steer_at = {"resid_post.0": {"scale": 4.0}, second: {"method": "swap", "target": 2.0}}
        st1 = [eager_steered(a, 6, **kw) for a, kw in steer_at.items()]
        c2 = two.capture(TEXT, addrs)
        g2 = two.generate(TEXT, 10).ids
        steered = two.generate(TEXT, 6, steer=two.steer("resid_post.0", torch.ones(d) * 2.0)).ids
        if family in hybrids:  # steer the first mixer's output (each rank's out_proj holds part of it before its sum)
            with two.steer("mixer_out.0", v, scale=2.0):
                steered_last = two.capture(TEXT, [last])[last]
        isolated = contained(two)
        state = two.worker_state()
        tp = two._lm.info["tp_size"]
    finally:
        two.close()
    # graph mode at TP=2: each rank's static buffers hold its shard; the gather runs after the compiled forward
    graph_pts = [
        a
        for a in addrs
        if a.split(".")[0]
        in ("z", "value", "mlp_act", "mlp_pre", "mlp_pre_linear", "q_norm_out", "k_norm_in", "resid_post")
        + ("mixer_in", "mixer_out", "mixer_out_post")
    ]
    three = ie_lab.Session(
        path,
        backend="vllm",
        engine="async",
        tensor_parallel_size=2,
        progress=False,
        replace=False,
        graph_points=graph_pts,
        steer_points=list(steer_at),
    )
    try:
        c3 = three.capture(TEXT, graph_pts)
        g3 = three.generate(TEXT, 10).ids
        st3 = steered_ids(three)  # graph-mode steering: each rank fills its own buffers, the same rows
        graph_isolated = contained(three)
    finally:
        three.close()
    # close() must leave no worker or engine-core process behind
    import time

    import psutil

    def leftovers():
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "resource_tracker" not in cmd:  # Python's own helper for spawn, lives until this process exits
                out.append(cmd[:120])
        return out

    deadline = time.time() + 20
    while leftovers() and time.time() < deadline:
        time.sleep(0.5)
    orphans = leftovers()
    # a hybrid's mixer output is ~1e-4 on a tiny random instance: compared at the tensor's own scale
    same = near if family in hybrids else close
    # a hybrid: TP=2's hook steering of the first mixer's output against eager's steered stream
    eager_differ: list[str] = []
    if family in hybrids:
        with make_spec(eager, "mixer_out.0", v, scale=2.0):
            want = ie_lab.capture(eager, TEXT, [last])[last]
        if not (near(steered_last, want) and not near(steered_last, c1[last])):
            eager_differ.append(f"steered {last}")
    return {
        "family": family,
        "tp_size": tp,
        "addresses": addrs,
        "orphans": orphans,
        "differ": [a for a in addrs if not same(c2[a], c1[a])],
        "shapes_equal": all(c1[a].shape == c2[a].shape for a in addrs),
        "greedy_equal": g1 == g2,
        "steered_len": len(steered),
        "graph_points": graph_pts,
        "graph_differ": [a for a in graph_pts if not same(c3[a], c1[a])],
        "graph_greedy_equal": g1 == g3,
        "graph_steered_equal": st1 == st3 and st1 != [g1[:6]] * 2,
        "workers_idle": all(not s["specs"] for s in state),
        "eager_differ": eager_differ,
        "n_workers": len(state),
        "contained": isolated,
        "graph_contained": graph_isolated,
    }


if __name__ == "__main__":
    # usage: vllm_tp_script.py ROOT FAMILY [FAMILY ...]. One process for several families: vLLM and ie_lab are
    # imported once (each family's TP=2 engines are spawned afresh as always). Each family's verdicts, or the error that stopped it, are one JSON line; one family's failure does
    # not stop the next.
    import traceback

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = sys.argv[1]
    for fam in sys.argv[2:]:
        try:
            out = main(fam, root)
        except Exception:  # noqa: BLE001 - reported on the family's own line, asserted by its test
            out = {"family": fam, "error": traceback.format_exc()[-3000:]}
        print("IE_LAB_TP_RESULT " + json.dumps(out), flush=True)
