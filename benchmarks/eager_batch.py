"""Batched generation on the eager backend, as ratios against bare transformers' batched generate in the same run.

    python benchmarks/eager_batch.py [--model bench20m|demo] [--repeats 5] [--threads 2]

Model (--model): bench20m, the ~20M random Llama of capture_overhead.py (hidden 512, 8 layers, fp32), or demo,
the trained model shipped in the package (ie_lab/demo_model: hidden 128, 4 layers, context 128, fp32), whose
steps are so small that the loop around the forward weighs most. Eight ragged prompts (8 to 64 tokens), 32
greedy tokens each (EOS ignored, so every variant makes the same 256 tokens).
Variants, interleaved: HF `generate` on the left-padded batch (the baseline); `ie_lab.generate` on the list
of prompts (one batch); the same with a capture of the middle layer's residual; the same batch with a
steering vector; the old way, a loop of one-prompt `ie_lab.generate` calls; and on a Session, eight concurrent
`await s.agenerate(prompt)` calls (`session_generate_x8`: they share one decode loop, ie_lab/eager/batcher.py)
and the same eight each steered differently (`session_steer_x8`: seven methods, layers, scales and positions,
one unsteered). Before timing, every prompt's tokens must equal HF's and its solo run's (a steered request's:
its solo steered run), or the script reports nothing.
After timing, each variant runs once more for its peak memory (`peak_rss_growth_mb`, see peak_rss_growth).

Across processes (`cross_process`, `--cross-rounds 3`; 0 skips it): the same 8 prompts, each variant in a process
of its own, as a user's script or the side-by-side cell runs it (the model loaded on the main thread, then one
warm-up and `--cross-repeats` timed runs), the processes alternating for `--cross-rounds` rounds:
`hf_batched_generate` (the baseline), `session_generate_list` (a Session's plain `s.generate(prompts)`: one batch
computed on the caller's thread), `session_generate_x8` (eight concurrent `await s.agenerate(p)`, computed on the
session's loop thread) and `session_generate_x8_two_pools` (the same with the Session's OpenMP pool hand-back
switched off). Why the last one: torch's OpenMP runtime (libgomp on Linux) keeps a pool of workers per thread that
ran a parallel op; the load leaves one on the main thread, the awaited requests make a second on the loop thread,
and with more pool threads than CPUs libgomp cuts its spin-waits short, so every small op of a decode step pays a
futex wake-up (measured before the hand-back: 1.39x bare on bench20m, 3.56x on the demo model, 2 threads on 2 CPUs;
1.06x / 1.11x at one thread). The Session now hands the caller's pool back when it hands work to its loop, and the
loop's back once no awaited operation is left (ie_lab/session.py, `_OmpPool`); the two-pools row keeps that cost
visible. In one process the pools outlive a variant, which is why these rows need processes of their own.

Writes benchmarks/results/eager_batch-cpu.json (bench20m; the name the README cites) or
eager_batch-<model>-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from capture_overhead import build_model  # noqa: E402
from timing import interleaved_times, parser, write_result  # noqa: E402

N_PROMPTS, NEW = 8, 32
MODELS = ("bench20m", "demo")


def load_model(name: str) -> tuple[torch.nn.Module, str]:
    """(the model, eval and EOS-free, so a run always makes its full length; its description)."""
    if name == "bench20m":
        model = build_model()
        desc = "random Llama, hidden 512, 8 layers"
    else:
        from transformers import AutoModelForCausalLM

        from ie_lab.core.demo import DEMO_MODEL

        model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
        desc = "ie_lab demo model (trained Llama, hidden 128, 4 layers, context 128)"
    # HF generate's min_new_tokens only masks EOS; with no EOS at all HF and ie_lab (ignore_eos) agree even
    # where the trained demo model would pick EOS.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    n_params = sum(p.numel() for p in model.parameters())
    return model, f"{desc}, {n_params / 1e6:.1f}M params, fp32"


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_rss_growth(fn) -> float | None:
    """MB the process's resident set rose above its level before `fn` at its highest point during `fn`.

    Fair between variants run one after another in one process because every variant starts from the same
    kind of floor: garbage collected, glibc's free heap handed back to the kernel (malloc_trim, so memory a
    previous variant freed but glibc kept resident is not reused "for free" by the next one), and the kernel's
    high-water mark reset to the current RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0). So the figure
    is what this variant itself needed at its peak, on every thread (a Session's decode loop included), torch
    tensors and Python objects alike, which tracemalloc (Python allocations only) would not see. ru_maxrss
    cannot be reset, so in one process it would credit a variant only with growth beyond every earlier peak.
    None where the kernel does not allow the reset."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _rss_kb("VmRSS")
    except OSError:
        return None
    fn()
    return round(max(0, _rss_kb("VmHWM") - before) / 1024, 1)


def prompt_batch(vocab: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Generator]:
    """The 8 ragged prompts (8 .. 64 tokens), their left-padded batch and its mask, and the generator they were
    drawn from (the in-process variants draw their steering vector from it next)."""
    g = torch.Generator().manual_seed(0)
    lens = [8 + (56 * i) // (N_PROMPTS - 1) for i in range(N_PROMPTS)]
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]
    width = max(lens)
    ids = torch.zeros(N_PROMPTS, width, dtype=torch.long)
    mask = torch.zeros(N_PROMPTS, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return prompts, ids, mask, g


def hf_batched_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Bare transformers' batched generate on the left-padded batch: the baseline of every ratio here."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )


CROSS = ("hf_batched_generate", "session_generate_list", "session_generate_x8", "session_generate_x8_two_pools")


def child(model_key: str, variant: str, repeats: int) -> dict:
    """One cross-process variant in this fresh process: load on the main thread, warm up, time `repeats` runs."""
    model, _ = load_model(model_key)
    vocab = model.config.vocab_size
    prompts, ids, mask, _ = prompt_batch(vocab)
    width = ids.shape[1]
    if variant == "hf_batched_generate":

        def run() -> list:
            return hf_batched_generate(model, ids, mask)[:, width:].tolist()

    else:
        import ie_lab
        from ie_lab import session as session_module

        if variant == "session_generate_x8_two_pools":  # the Session as it was: no pool handed back
            session_module._OmpPool.release = classmethod(lambda cls: None)  # type: ignore[method-assign]
        s = ie_lab.Session(model, progress=False)

        if variant == "session_generate_list":

            def run() -> list:
                return [r.ids for r in s.generate(prompts, NEW, ignore_eos=True, keep_logits=False)]

        else:

            async def eight() -> list:
                return await asyncio.gather(*(s.agenerate(p, NEW, ignore_eos=True, keep_logits=False) for p in prompts))

            def run() -> list:
                return [r.ids for r in asyncio.run(eight())]

    tokens = run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "times_s": times, "tokens": tokens, "peak_rss_mb": _rss_kb("VmHWM") / 1024}


def cross_process(model_key: str, threads: int, repeats: int, rounds: int, ref: list) -> dict:
    """Each CROSS variant in processes of its own, alternating for `rounds` rounds; tokens checked against ref."""
    times: dict[str, list[float]] = {k: [] for k in CROSS}
    peak: dict[str, list[float]] = {k: [] for k in CROSS}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for _ in range(rounds):
        for variant in CROSS:
            cmd = [sys.executable, os.path.abspath(__file__), "--model", model_key, "--threads", str(threads)]
            cmd += ["--repeats", str(repeats), "--child", variant]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if r.returncode != 0:
                raise RuntimeError(f"cross-process {variant} failed:\n{r.stderr[-2000:]}")
            got = json.loads(r.stdout.strip().splitlines()[-1])
            if got["tokens"] != ref:
                raise RuntimeError(f"cross-process {variant}: tokens differ from HF batched generate")
            times[variant] += got["times_s"]
            peak[variant].append(got["peak_rss_mb"])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rounds": rounds,
        "repeats_per_process": repeats,
        "median_s": med,
        "ratio_vs_hf_batched": {k: med[k] / med["hf_batched_generate"] for k in med},
        "process_peak_rss_mb": {k: round(statistics.median(v), 1) for k, v in peak.items()},
        "times_s": times,
    }


def main() -> int:
    ap = parser(repeats=5)
    ap.add_argument("--model", choices=MODELS, default="bench20m")
    ap.add_argument("--cross-rounds", type=int, default=3, help="rounds of the cross-process variants (0: skip)")
    ap.add_argument("--cross-repeats", type=int, default=3, help="timed runs in each cross-process variant's process")
    ap.add_argument("--child", choices=CROSS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.model, args.child, args.repeats)))
        return 0

    import ie_lab

    model, model_desc = load_model(args.model)
    lm = ie_lab.load(model)
    prompts, ids, mask, g = prompt_batch(lm.facts.vocab_size)
    width = ids.shape[1]
    mid = lm.facts.n_layers // 2
    v = torch.randn(lm.facts.d_model, generator=g)
    spec = ie_lab.steer(lm, f"resid_post.{mid}", v, scale=2.0)

    def hf_batched():
        return hf_batched_generate(model, ids, mask)

    def ie_batched():
        return ie_lab.generate(lm, prompts, NEW, ignore_eos=True, keep_logits=False)

    def ie_batched_capture():
        return ie_lab.generate(lm, prompts, NEW, ignore_eos=True, keep_logits=False, capture=[f"resid_post.{mid}"])

    def ie_batched_steered():
        return ie_lab.generate(lm, prompts, NEW, ignore_eos=True, keep_logits=False, steer=spec)

    def ie_loop():
        return [ie_lab.generate(lm, [p], NEW, ignore_eos=True, keep_logits=False)[0] for p in prompts]

    # Eight concurrent requests on a Session: what a notebook's tasks (or a panel) issue at once.
    session = ie_lab.Session(model, progress=False)
    slm = session._lm
    unit = v / v.norm()
    last = lm.facts.n_layers - 1
    steers = [
        None,
        session.steer(f"resid_post.{mid}", v, scale=2.0),
        session.steer("resid_post.1", v, scale=-1.0, positions="generated"),
        session.steer(f"resid_pre.{mid}", unit, method="ablate"),
        session.steer("mlp_out.2", unit, method="orthogonal", scale=0.5),
        session.steer(f"resid_post.{last}", unit, method="cap", max=0.5),
        session.steer("attn_out.3", unit, method="norm_scaled_add", scale=0.2, positions="prompt"),
        session.steer(f"resid_mid.{mid}", unit, method="swap", target=1.0),
    ]

    def session_x8(steer):
        async def main():
            return await asyncio.gather(
                *(
                    session.agenerate(p, NEW, ignore_eos=True, keep_logits=False, steer=sp)
                    for p, sp in zip(prompts, steer)
                )
            )

        return asyncio.run(main())

    def session_generate_x8():
        return session_x8([None] * N_PROMPTS)

    def session_steer_x8():
        return session_x8(steers)

    # Correctness inside the benchmark: each prompt's batched tokens are HF's and its solo run's.
    ref = hf_batched()[:, width:].tolist()
    ours = [r.ids for r in ie_batched()]
    solo = [r.ids for r in ie_loop()]
    x8 = [r.ids for r in session_generate_x8()]
    steered = [r.ids for r in session_steer_x8()]
    steered_solo = [
        ie_lab.generate(slm, [p], NEW, ignore_eos=True, keep_logits=False, steer=sp)[0].ids
        for p, sp in zip(prompts, steers)
    ]
    if ours != ref or ours != solo or x8 != ref or steered != steered_solo:
        print(
            "batched tokens differ from HF batched generate or from the solo runs: refusing to report speed",
            file=sys.stderr,
        )
        return 1

    variants = {
        "hf_batched_generate": hf_batched,
        "ie_batched": ie_batched,
        "ie_batched_capture": ie_batched_capture,
        "ie_batched_steered": ie_batched_steered,
        "ie_loop_of_solo": ie_loop,
        "session_generate_x8": session_generate_x8,
        "session_steer_x8": session_steer_x8,
    }
    # Every round's time is kept: on a shared machine the fastest round of each variant (the least disturbed) is
    # the steadier figure, so both it and the median are reported. No warm-up round: the correctness checks above
    # already ran the HF, batched and loop paths.
    times = interleaved_times(variants, args.repeats, warm=False)
    # memory after timing, one variant at a time, so the measuring never sits inside a timed round
    base_rss_mb = round(_rss_kb("VmRSS") / 1024, 1)
    peak = {k: peak_rss_growth(fn) for k, fn in variants.items()}
    med = {k: statistics.median(t) for k, t in times.items()}
    best = {k: min(t) for k, t in times.items()}
    result = {
        "benchmark": "eager_batch",
        "model": model_desc,
        "model_key": args.model,
        "prompts": f"{N_PROMPTS} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {NEW} new "
        "greedy tokens each",
        "threads": args.threads,
        "repeats": args.repeats,
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "median_s": med,
        "best_s": best,
        "ratio_vs_hf_batched": {k: med[k] / med["hf_batched_generate"] for k in med},
        "best_ratio_vs_hf_batched": {k: best[k] / best["hf_batched_generate"] for k in best},
        "rss_before_mb": base_rss_mb,
        "peak_rss_growth_mb": peak,
        "target": {
            "ie_batched": 1.25,
            "ie_batched_steered": 1.35,
            "session_generate_x8": 1.25,
            "session_steer_x8": 1.35,
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    session.close()
    if args.cross_rounds:
        result["cross_process"] = cross_process(args.model, args.threads, args.cross_repeats, args.cross_rounds, ref)
        result["target"]["cross_process session_generate_x8"] = 1.25
    return write_result(
        args.out,
        "eager_batch-cpu" if args.model == "bench20m" else f"eager_batch-{args.model}-cpu",
        result,
        {
            "model": args.model,
            "median": result["ratio_vs_hf_batched"],
            "best": result["best_ratio_vs_hf_batched"],
            "peak_rss_growth_mb": peak,
            "cross_process": {k: result["cross_process"][k] for k in ("ratio_vs_hf_batched", "process_peak_rss_mb")}
            if args.cross_rounds
            else None,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
