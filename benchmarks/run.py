"""The side-by-side benchmark: every (model, engine, workload) cell in its own process, as JSON cells.

    python -m benchmarks.run                       # the CPU matrix (2 threads, median of 3 after 1 warm-up)
    python -m benchmarks.run --model demo --engine ie_eager --engine bare --workload generate
    python -m benchmarks.run --gpu                 # the same workloads on a real checkpoint, one GPU (see gpu.sh)
    python benchmarks/render.py                    # cells -> results-latest.md, README block, charts

Engines run with their own Python (reference engines in the validator's environments, .venvs/NAME, made by
`bash validator/envs/setup.sh NAME`); an engine without an environment gets "not run" cells with that reason.
Before any cell runs, bare transformers' outputs for every workload are computed once per model (refs.pt); each
cell checks its own output against them (benchmarks/cell.py: `check`). Cells are written to
benchmarks/results/sidebyside/<device>/<model>__<engine>__<workload>.json; cells not reached are written first as
"not run" with the reason, so a partial run is visible as such in the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cell import ENGINES, WORKLOADS, shape_for  # noqa: E402

ENV = {
    "bare": None,
    "ie_eager": None,
    "ie_vllm": None,
    "ie_vllm_graph": None,
    "interp": "interp",
    "tl": "tl",
    "tl_nocache": "tl",
    "nnsight": "nnsight",
}


def python_for(engine: str) -> str | None:
    venv = ENV[engine]
    if venv is None:
        own = os.path.join(ROOT, ".venv", "bin", "python")
        return own if os.path.exists(own) else sys.executable
    root = os.environ.get("IE_LAB_VALIDATOR_VENVS", os.path.join(ROOT, ".venvs"))
    py = os.path.join(root, venv, "bin", "python")
    return py if os.path.exists(py) else None


def build_bench20m(path: str) -> None:
    """The ~20M random Llama of capture_overhead.py, saved (with the test tokenizer) for engines that load from disk."""
    from capture_overhead import build_model

    sys.path.insert(0, ROOT)
    from tests.families import make_tokenizer

    m = build_model()
    m.generation_config.eos_token_id = None
    m.save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def model_dirs(names, tmp, hf_model=None):
    out = {}
    for n in names:
        if n == "bench20m":
            d = os.path.join(tmp, "bench20m")
            build_bench20m(d)
            out[n] = (d, "random Llama, hidden 512, 8 layers, vocab 4096 (capture_overhead.build_model), fp32")
        elif n == "demo":
            d = os.path.join(ROOT, "ie_lab", "demo_model")
            if os.path.exists(os.path.join(d, "config.json")):
                out[n] = (d, "ie_lab/demo_model (trained Llama, hidden 128, 4 layers, context 128), fp32")
        else:  # a hub id or a local checkpoint (GPU runs)
            out[n] = (hf_model or n, n)
    return out


def cell_path(out_dir, model, engine, workload):
    return os.path.join(out_dir, f"{model}__{engine}__{workload}.json")


def placeholder(model, engine, workload, device, reason, status="not run"):
    return {
        "benchmark": "sidebyside",
        "model": model,
        "engine": engine,
        "workload": workload,
        "device": device,
        "status": status,
        "reason": reason,
        "median_s": None,
        "tok_per_s": None,
        "peak_rss_mb": None,
        "date": time.strftime("%Y-%m-%d"),
    }


def widget_cells(out_dir, device):
    """The widget round trip is measured in a browser by widgets_latency.py; its result is reused, not rerun."""
    src = os.path.join(HERE, "results", "widgets-cpu.json")
    if not os.path.exists(src):
        return
    r = json.load(open(src))
    sl = r["slider_to_first_token_ms"]
    for engine in ENGINES:
        c = placeholder("widget", engine, "widget_round_trip", device, "", status="ok")
        if engine in ("ie_vllm", "ie_vllm_graph"):  # the widgets run on any Session: this one was not measured
            c["reason"] = "measured on the eager backend only (widgets_latency.py); the widgets run on vLLM too"
            c["status"] = "not run"
        elif engine != "ie_eager":
            c["status"], c["reason"], c["replay"] = "n/a", "no notebook widgets in this engine", "no_widgets"
        else:
            c.update(
                {
                    "median_s": sl["median"] / 1000,
                    "p90_s": sl["p90"] / 1000,
                    "repeats": r["repeats"],
                    "check": "slider change -> first steered token on screen (browser, widgets_latency.py)",
                    "source": "benchmarks/results/widgets-cpu.json",
                    "date": r["date"],
                    "target_s": sl["target"] / 1000,
                }
            )
        with open(cell_path(out_dir, "widget", engine, "widget_round_trip"), "w") as f:
            json.dump(c, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="bench20m, demo, or (with --gpu) a checkpoint")
    ap.add_argument("--engine", action="append", choices=ENGINES)
    ap.add_argument("--workload", action="append", choices=WORKLOADS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="device cuda, bfloat16, a real checkpoint (default meta-llama/Llama-3.2-1B or $IE_LAB_BENCH_GPU_MODEL)",
    )
    ap.add_argument("--skip-existing", action="store_true", help="keep cells that already ran (status not 'not run')")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    device = "cuda" if args.gpu else "cpu"
    dtype = "bfloat16" if args.gpu else "float32"
    models = args.model or (
        [os.environ.get("IE_LAB_BENCH_GPU_MODEL", "meta-llama/Llama-3.2-1B")] if args.gpu else ["bench20m", "demo"]
    )
    engines = args.engine or ENGINES
    workloads = args.workload or WORKLOADS
    out_dir = args.out or os.path.join(HERE, "results", "sidebyside", device)
    os.makedirs(out_dir, exist_ok=True)
    if not args.gpu:
        widget_cells(out_dir, device)
    with tempfile.TemporaryDirectory(prefix="ie_lab_sidebyside_") as tmp:  # model copies: ~120 MB a run
        dirs = model_dirs(models, tmp)

        from transformers import AutoConfig

        shapes = {}
        for model, (mdir, _desc) in dirs.items():
            cfg = AutoConfig.from_pretrained(mdir)
            cfg = getattr(cfg, "text_config", cfg)
            n_pos = getattr(cfg, "max_position_embeddings", 4096) or 4096
            shapes[model] = (cfg, shape_for(cfg.num_hidden_layers, n_pos))

        # every cell of this run is first "not run": what the run does not reach stays visible, with why
        todo = []
        for model in dirs:
            for engine in engines:
                for w in workloads:
                    p = cell_path(out_dir, model, engine, w)
                    if args.skip_existing and os.path.exists(p) and json.load(open(p)).get("status") != "not run":
                        continue
                    py = python_for(engine)
                    if py is None:
                        c = placeholder(
                            model,
                            engine,
                            w,
                            device,
                            f"no environment .venvs/{ENV[engine]} (bash validator/envs/setup.sh {ENV[engine]})",
                        )
                    else:
                        c = placeholder(
                            model, engine, w, device, "the matrix run stopped before this cell (time budget)"
                        )
                        todo.append((model, engine, w, py))
                    c["model_desc"], c["shape"] = dirs[model][1], shapes[model][1]
                    with open(p, "w") as f:
                        json.dump(c, f, indent=1)

        # the cells the targets compare run first, so a run cut short by its time budget still decides them
        first = {
            ("bare", "forward_512"),
            ("bare", "generate"),
            ("ie_eager", "capture_all"),
            ("ie_eager", "generate"),
            ("ie_eager", "capture_gen"),
            ("ie_eager", "generate_x8"),
            ("interp", "generate"),
            ("interp", "capture_gen"),
            ("interp", "capture_all"),
            ("tl", "capture_all"),
            ("nnsight", "capture_all"),
            ("ie_vllm", "generate_x8"),
            ("tl", "generate"),
            ("tl_nocache", "generate"),
        }
        todo.sort(key=lambda t: ((t[1], t[2]) not in first, list(dirs).index(t[0])))

        bases = {}
        for model, (mdir, desc) in dirs.items():
            cfg, shape = shapes[model]
            base = {
                "model": model,
                "model_desc": desc,
                "model_dir": mdir,
                "shape": shape,
                "repeats": args.repeats,
                "threads": args.threads,
                "device": device,
                "dtype": dtype,
                "vocab": cfg.vocab_size,
                "d_model": cfg.hidden_size,
                "refs": os.path.join(tmp, f"{model}.refs.pt"),
            }
            spec_path = os.path.join(tmp, f"{model}.refs.json")
            json.dump(base, open(spec_path, "w"))
            t0 = time.time()
            r = subprocess.run(
                [python_for("bare"), os.path.join(HERE, "cell.py"), "--refs", spec_path], capture_output=True, text=True
            )
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            print(
                f"[{model}] references from bare transformers in {time.time() - t0:.0f}s: {r.stdout.strip()}",
                flush=True,
            )
            bases[model] = (base, desc, shape)
        for model, engine, w, py in todo:
            if model in bases:
                base, desc, shape = bases[model]
                spec = dict(base, engine=engine, workload=w, out=cell_path(out_dir, model, engine, w))
                sp = os.path.join(tmp, f"{model}__{engine}__{w}.json")
                json.dump(spec, open(sp, "w"))
                t1 = time.time()
                env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(args.threads))
                try:
                    r = subprocess.run(
                        [py, os.path.join(HERE, "cell.py"), sp],
                        capture_output=True,
                        text=True,
                        timeout=args.timeout,
                        env=env,
                        cwd=ROOT,
                    )
                    ok = os.path.exists(spec["out"]) and json.load(open(spec["out"])).get("status") != "not run"
                    if not ok:
                        lines = [ln for ln in (r.stderr or "").splitlines() if ln.strip()]
                        c = placeholder(
                            model,
                            engine,
                            w,
                            device,
                            f"the cell process died (rc {r.returncode}): {lines[-1][:250] if lines else ''}",
                            status="error",
                        )
                        json.dump(c, open(spec["out"], "w"), indent=1)
                except subprocess.TimeoutExpired:
                    c = placeholder(model, engine, w, device, f"timed out after {args.timeout}s", status="error")
                    json.dump(c, open(spec["out"], "w"), indent=1)
                c = json.load(open(spec["out"]))
                c["model_desc"], c["shape"] = desc, shape
                json.dump(c, open(spec["out"], "w"), indent=1)
                print(
                    f"[{model} {engine} {w}] {c['status']} {c.get('median_s')} ({time.time() - t1:.0f}s) "
                    f"{c.get('check') or c.get('reason')}",
                    flush=True,
                )
        return 0


if __name__ == "__main__":
    sys.exit(main())
