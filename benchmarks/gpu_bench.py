"""The GPU benchmark, self-contained: random-weight models of real sizes built on the device from the configs in
benchmarks/configs/ (transformers config classes + from_config; nothing from the hub), then bare transformers, ie_lab
eager, ie_lab vLLM (hooks mode) and ie_lab vLLM graph mode (compiled trunk, CUDA graphs on), and the peers
(TransformerLens, nnsight) where their environments exist, each engine in a process of its own.

    python benchmarks/gpu_bench.py OUT [--dry-run] [--peer-python tl=PATH --peer-python nnsight=PATH]
    python benchmarks/gpu_bench.py OUT --phase PHASE --model NAME [--dry-run]      # one phase (what the driver runs)

OUT gets models/<name>/ (the saved random checkpoint and a word-level tokenizer of the model's vocabulary), one
phase-<model>-<engine>.json per process, results.json (every row, with the machine, date and versions) and
results.md (the tables). --dry-run (or IE_LAB_GPU_DRY_RUN=1): tiny sizes of the same configs, CPU, float32, fewer
tokens and repeats; the same code path otherwise (tests/test_gpu_bench_dry_run.py runs it in the gate).

Operations (each row is the median of --repeats runs after a warm-up, its tok/s where it generates, and its ratio
to bare transformers: timed in the same process, interleaved, for ie_lab eager and the peers; across processes,
marked so, for vLLM):
  forward        one forward over the long prompt (bare only: the floor the captures are compared with)
  capture_all    the same forward capturing every layer's resid_post
  generate       one prompt, greedy tokens, no EOS
  generate_x8    8 prompts at once (eager: one batched call; vLLM: 8 concurrent requests, batched by the engine)
  steer          greedy tokens with a vector added to resid_post at two layers
  project_k16    16 probe directions projected at the middle layer where the activation is
  sae_encode     a random ReLU SAE (8 x d_model features) encoded there (ie_lab.sae.SAE.project)
Every engine's tokens are compared with bare transformers' (the fraction of equal positions is kept as `agree`:
random bf16 weights give near-tied logits, so on a GPU a few differing positions are expected and reported, never
hidden; the dry run in float32 must agree exactly).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

MODELS = {"llama-3.1-8b": "llama-3.1-8b.json", "qwen3-moe": "qwen3-moe.json"}
# The dry run's sizes: the same configs shrunk to a few hundred thousand parameters (every field the config
# classes read for shapes is overridden; the rest, rope scaling and MoE routing included, stays as committed).
DRY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "max_window_layers": 2,
}
ENGINES = ["bare", "ie_eager", "ie_vllm", "ie_vllm_graph", "tl", "nnsight"]
# The dry run starts vLLM for the Llama only (hooks mode and graph mode): each engine start costs the gate's 2 CPU
# cores 20-40 s, and the driver's code path is the same for both models (the MoE is built from its config and
# measured on bare transformers and ie_lab eager; ie_lab's vLLM MoE support has its own tests).
DRY_SKIP = {
    ("qwen3-moe", "ie_vllm"): "dry run: vLLM is started for llama-3.1-8b only (gate time)",
    ("qwen3-moe", "ie_vllm_graph"): "dry run: vLLM is started for llama-3.1-8b only (gate time)",
}
PEERS = ("tl", "nnsight")
OPS = {
    "bare": ["forward", "capture_all", "generate", "generate_x8", "steer"],
    "ie_eager": ["capture_all", "generate", "generate_x8", "steer", "project_k16", "sae_encode"],
    "ie_vllm": ["capture_all", "generate", "generate_x8", "steer", "project_k16", "sae_encode"],
    "ie_vllm_graph": ["capture_all", "generate", "generate_x8", "steer", "project_k16", "sae_encode"],
    "tl": ["capture_all", "generate", "steer"],
    "nnsight": ["capture_all", "generate", "steer"],
}
GENERATING = {"generate": 1, "generate_x8": 8, "steer": 1}
DAGGER = "\u2020"


def sizes(dry: bool) -> dict:
    if dry:
        return {"fwd": 32, "prompt": 16, "new": 8, "repeats": 2}
    return {"fwd": 512, "prompt": 128, "new": 64, "repeats": 3}


def shape(cfg, dry: bool) -> dict:
    L = cfg.num_hidden_layers
    sz = sizes(dry)
    return {
        **sz,
        "n_layers": L,
        "mid": L // 2,
        "steer_layers": [L // 4, (5 * L) // 8],
        "d_model": cfg.hidden_size,
        "vocab": cfg.vocab_size,
    }


def load_config(name: str, dry: bool):
    from transformers import AutoConfig

    raw = json.load(open(os.path.join(HERE, "configs", MODELS[name])))
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    if dry:
        raw.update({k: v for k, v in DRY.items() if k in raw})
        if raw.get("rope_scaling", {}) and raw["rope_scaling"].get("original_max_position_embeddings"):
            raw["rope_scaling"] = dict(raw["rope_scaling"], original_max_position_embeddings=64)
    # the word-level tokenizer's ids (make_tokenizer): <pad> 0, <s> 1; no EOS, generation runs its length
    raw.update(bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model_type = raw.pop("model_type")
    raw.pop("torch_dtype", None)
    return AutoConfig.for_model(model_type, **raw)


def device_dtype(dry: bool):
    import torch

    if dry:
        return "cpu", torch.float32
    return "cuda", torch.bfloat16


def make_tokenizer(vocab: int, max_len: int):
    """A word-level tokenizer covering every id of the model's vocabulary (the engines decode what they generate):
    ie_lab's toy tokenizer filled up to it. The benchmark feeds token ids, so the words themselves do not matter."""
    from ie_lab.toy import tokenizer

    return tokenizer(vocab, max_len)


def build(name: str, out: str, dry: bool) -> dict:
    """Random weights of the config's shapes, initialised on the device and saved (safetensors) with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(name, dry)
    dev, dtype = device_dtype(dry)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    init_s = time.perf_counter() - t0
    path = os.path.join(out, "models", name)
    t0 = time.perf_counter()
    model.save_pretrained(path)
    make_tokenizer(cfg.vocab_size, cfg.max_position_embeddings).save_pretrained(path)
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "init_s": round(init_s, 2),
        "save_s": round(time.perf_counter() - t0, 2),
        "config": MODELS[name],
        "layers": cfg.num_hidden_layers,
        "d_model": cfg.hidden_size,
    }
    del model
    return info


def inputs(s: dict):
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "fwd": torch.randint(3, s["vocab"], (1, s["fwd"]), generator=g),
        "prompt": torch.randint(3, s["vocab"], (1, s["prompt"]), generator=g),
        "prompts8": torch.randint(3, s["vocab"], (8, s["prompt"]), generator=g),
        "steer_vec": torch.randn(s["d_model"], generator=g),
        "dirs": torch.randn(16, s["d_model"], generator=g),
    }


def random_sae(d: int, point: str):
    import torch

    import ie_lab
    from ie_lab.sae import SAE

    g = torch.Generator().manual_seed(1)
    n = 8 * d
    return SAE(
        W_enc=torch.randn(d, n, generator=g) / d**0.5,
        b_enc=torch.zeros(n),
        W_dec=torch.randn(n, d, generator=g) / n**0.5,
        b_dec=torch.zeros(d),
        activation="relu",
        address=ie_lab.Address.parse(point),
    )


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fns: dict, repeats: int) -> dict:
    """Interleaved: each round runs every variant once in turn, after one warm-up run each (CUDA synchronised)."""
    for fn in fns.values():
        fn()
    _sync()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[k].append(time.perf_counter() - t0)
    return times


def agree(a, b) -> float:
    """Fraction of equal positions between two token lists (lists of lists for a batch)."""
    if a and isinstance(a[0], list):
        pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    else:
        pairs = list(zip(a, b))
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


# ---- the phases: one process each --------------------------------------------------------------------------


class Bare:
    """Bare transformers with hand-written hooks: the baseline every ratio is taken against."""

    def __init__(self, model, s, x):
        import torch

        self.m, self.s, self.dev = model, s, next(model.parameters()).device
        self.x = {k: v.to(self.dev) if k != "dirs" else v for k, v in x.items()}
        self.vec = x["steer_vec"].to(self.dev, next(model.parameters()).dtype)
        self.no_grad = torch.no_grad

    def _greedy(self, ids, n):
        with self.no_grad():
            out = self.m.generate(
                ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return out[:, ids.shape[1] :].tolist()

    def run(self, op):
        s, x, layers = self.s, self.x, self.m.model.layers
        if op == "forward":
            with self.no_grad():
                return self.m(input_ids=x["fwd"], use_cache=False).logits[0, -1]
        if op == "capture_all":
            kept = []
            hs = [
                lay.register_forward_hook(lambda m, a, o: kept.append(o[0] if isinstance(o, tuple) else o))
                for lay in layers
            ]
            try:
                with self.no_grad():
                    self.m(input_ids=x["fwd"], use_cache=False)
            finally:
                for h in hs:
                    h.remove()
            return kept
        if op == "generate":
            return self._greedy(x["prompt"], s["new"])[0]
        if op == "generate_x8":
            return self._greedy(x["prompts8"], s["new"])
        if op == "steer":

            def add(m, a, o):
                return (o[0] + self.vec, *o[1:]) if isinstance(o, tuple) else o + self.vec

            hs = [layers[L].register_forward_hook(add) for L in s["steer_layers"]]
            try:
                return self._greedy(x["prompt"], s["new"])[0]
            finally:
                for h in hs:
                    h.remove()
        raise KeyError(op)


class Eager:
    """ie_lab eager on the same in-memory model as Bare (one copy of the weights in the process)."""

    def __init__(self, model, tok, s, x):
        import ie_lab

        self.ie, self.s, self.x = ie_lab, s, x
        self.lm = ie_lab.load(model, tokenizer=tok)
        self.point = f"resid_post.{s['mid']}"
        self.sae = random_sae(s["d_model"], self.point)
        self.steer_spec = ie_lab.steer(
            self.lm, [f"resid_post.{L}" for L in s["steer_layers"]], x["steer_vec"], scale=1.0
        )

    def run(self, op):
        ie, s, x, lm = self.ie, self.s, self.x, self.lm
        if op == "capture_all":
            return ie.capture(lm, x["fwd"], [f"resid_post.{L}" for L in range(s["n_layers"])])
        if op == "generate":
            return ie.generate(lm, x["prompt"], s["new"], ignore_eos=True, keep_logits=False).ids
        if op == "generate_x8":  # eager batching: the 8 prompts in one call
            return [
                r.ids for r in ie.generate(lm, x["prompts8"].tolist(), s["new"], ignore_eos=True, keep_logits=False)
            ]
        if op == "steer":
            return ie.generate(lm, x["prompt"], s["new"], steer=self.steer_spec, ignore_eos=True, keep_logits=False).ids
        if op == "project_k16":
            return ie.project(lm, x["fwd"], self.point, x["dirs"]).scores
        if op == "sae_encode":
            return ie.project(lm, x["fwd"], self.point, self.sae.encoder(), activation="relu").scores
        raise KeyError(op)


class Vllm:
    """ie_lab vLLM: hooks mode (Python hooks, enforce_eager) or graph mode (the trunk compiled, CUDA graphs on a GPU,
    static taps at every resid_post and static steering buffers at the steered sites)."""

    def __init__(self, path, s, x, graph: bool, dtype: str):
        import ie_lab

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kw = {}
        if graph:
            kw = {
                "graph_points": [f"resid_post.{L}" for L in range(s["n_layers"])],
                "steer_points": [f"resid_post.{L}" for L in s["steer_layers"]],
            }
        self.S = ie_lab.Session(
            path, backend="vllm", dtype=dtype, progress=False, replace=False, max_model_len=s["fwd"] + 64, **kw
        )
        self.s, self.x = s, x
        self.point = f"resid_post.{s['mid']}"
        self.sae = random_sae(s["d_model"], self.point)
        self.steer_spec = self.S.steer([f"resid_post.{L}" for L in s["steer_layers"]], x["steer_vec"], scale=1.0)

    def run(self, op):
        import asyncio

        S, s, x = self.S, self.s, self.x
        p = x["prompt"][0].tolist()
        if op == "capture_all":
            return S.capture(x["fwd"][0].tolist(), [f"resid_post.{L}" for L in range(s["n_layers"])])
        if op == "generate":
            return S.generate(p, s["new"], ignore_eos=True).ids
        if op == "generate_x8":

            async def go():
                return await asyncio.gather(
                    *(S.agenerate(q.tolist(), s["new"], ignore_eos=True) for q in x["prompts8"])
                )

            return [r.ids for r in asyncio.run(go())]
        if op == "steer":
            return S.generate(p, s["new"], steer=self.steer_spec, ignore_eos=True).ids
        if op == "project_k16":
            return S.project(x["fwd"][0].tolist(), self.point, x["dirs"]).scores
        if op == "sae_encode":
            return self.sae.project(S, x["fwd"][0].tolist()).scores
        raise KeyError(op)


def _peer(engine, path, s, x, dtype):
    """A peer engine through benchmarks/cell.py's adapters (the side-by-side matrix's), on the saved checkpoint."""
    import cell
    import torch

    spec = {
        "model_dir": path,
        "workload": "capture_all",
        "device": "cpu" if dtype == "float32" else "cuda",
        "dtype": dtype,
    }
    shape = {
        "n_layers": s["n_layers"],
        "mid": s["mid"],
        "steer_layers": s["steer_layers"],
        "new_tokens": s["new"],
        "short_new": s["new"],
    }
    cx = {"fwd": x["fwd"], "prompt": x["prompt"], "prompts8": x["prompts8"], "steer_vec": x["steer_vec"]}
    cx = {k: v.to(spec["device"]) for k, v in cx.items()}
    cx["steer_vec"] = cx["steer_vec"].to(getattr(torch, dtype))  # the adapters add it as given: the model's dtype
    eng = {"tl": cell.TL, "nnsight": cell.NNsight}[engine](spec, cx, shape)
    names = {"capture_all": "capture_all", "generate": "generate", "steer": "steer"}
    return eng, lambda op: eng.run(names[op])


def phase(name: str, engine: str, out: str, dry: bool) -> dict:
    """Run one engine on one model in this process; returns (and writes) the phase's rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(out, "models", name)
    cfg = load_config(name, dry)
    s = shape(cfg, dry)
    x = inputs(s)
    dev, dtype = device_dtype(dry)
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    if dry:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows, refs_path = [], os.path.join(out, f"refs-{name}.pt")
    t0 = time.perf_counter()
    if engine in ("bare", "ie_eager"):
        # bare and ie_lab eager share one process and one in-memory model: every ie_lab time is interleaved with
        # bare transformers' time for the same operation (capture with the plain forward too)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        model.generation_config.eos_token_id = None
        tok = AutoTokenizer.from_pretrained(path)
        bare, eager = Bare(model, s, x), Eager(model, tok, s, x)
        load_s = time.perf_counter() - t0
        refs = {op: bare.run(op) for op in ("generate", "generate_x8", "steer")}
        torch.save(refs, refs_path)
        base_of = {"capture_all": "forward", "project_k16": "forward", "sae_encode": "forward"}
        for op in OPS["ie_eager"]:
            b_op = base_of.get(op, op)

            def one(op=op, b_op=b_op):
                t = timed({"bare": lambda: bare.run(b_op), "ie": lambda: eager.run(op)}, s["repeats"])
                got = eager.run(op) if op in GENERATING else None
                rows.append(_row(name, "ie_eager", op, t["ie"], s, t["bare"], "in-process", refs.get(op), got, load_s))
                if not any(r["engine"] == "bare" and r["op"] == b_op for r in rows):
                    rows.append(_row(name, "bare", b_op, t["bare"], s, None, None, None, None, load_s))

            _guarded(rows, name, "ie_eager", op, one)

        def bare_capture():
            t = timed({"bare": lambda: bare.run("capture_all")}, s["repeats"])["bare"]
            rows.append(_row(name, "bare", "capture_all", t, s, None, None, None, None, load_s))

        _guarded(rows, name, "bare", "capture_all", bare_capture)
    elif engine in ("ie_vllm", "ie_vllm_graph"):
        v = Vllm(path, s, x, graph=engine == "ie_vllm_graph", dtype=dtype_name)
        load_s = time.perf_counter() - t0
        refs = torch.load(refs_path) if os.path.exists(refs_path) else {}
        for op in OPS[engine]:

            def one(op=op):
                t = timed({op: lambda: v.run(op)}, s["repeats"])[op]
                got = v.run(op) if op in GENERATING else None
                rows.append(_row(name, engine, op, t, s, None, "across processes", refs.get(op), got, load_s))

            _guarded(rows, name, engine, op, one)
        v.S.close()
    elif engine in PEERS:
        eng, run = _peer(engine, path, s, x, dtype_name)
        bare = Bare(eng.hf, s, x)  # the peer wraps this very HF module: bare runs beside it, interleaved
        load_s = time.perf_counter() - t0
        refs = {op: bare.run(op) for op in ("generate", "steer")}
        for op in OPS[engine]:
            b_op = "forward" if op == "capture_all" else op

            def one(op=op, b_op=b_op):
                t = timed({"bare": lambda: bare.run(b_op), "peer": lambda: run(op)}, s["repeats"])
                got = run(op)["tokens"] if op in GENERATING else None
                rows.append(_row(name, engine, op, t["peer"], s, t["bare"], "in-process", refs.get(op), got, load_s))

            _guarded(rows, name, engine, op, one)
    else:
        raise KeyError(engine)
    result = {"model": name, "engine": engine, "rows": rows, "versions": _versions(engine)}
    with open(os.path.join(out, f"phase-{name}-{engine}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _guarded(rows: list, model: str, engine: str, op: str, fn) -> None:
    """Run one operation's measurement; an engine that raises gets an error row with the exception (the other
    operations still run), never a silently missing one."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded in the results, and the driver exits non-zero
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        rows.append({"model": model, "engine": engine, "op": op, "status": "error", "reason": reason, "median_s": None})
        print(f"[{model} {engine} {op}] {reason}", file=sys.stderr, flush=True)


def _row(model, engine, op, times, s, base_times, ratio_kind, ref, got, load_s) -> dict:
    med = statistics.median(times)
    row = {
        "model": model,
        "engine": engine,
        "op": op,
        "status": "ok",
        "median_s": med,
        "times_s": times,
        "tok_per_s": GENERATING[op] * s["new"] / med if op in GENERATING else None,
        "load_s": round(load_s, 2),
    }
    if base_times is not None:
        row["base_median_s"] = statistics.median(base_times)
        row["ratio_vs_bare"] = med / row["base_median_s"]
        row["ratio_kind"] = ratio_kind
    elif ratio_kind:
        row["ratio_kind"] = ratio_kind
    if ref is not None and got is not None:
        row["agree"] = agree(got, ref)
    return row


def _versions(engine: str) -> dict:
    from importlib import metadata

    out = {}
    for d in ("torch", "transformers", "ie-lab", "vllm", "transformer-lens", "nnsight"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return out


# ---- the driver ----------------------------------------------------------------------------------------------


def _machine() -> str:
    import platform

    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} ({platform.machine()}, {os.cpu_count()} CPU cores)"
    except ImportError:
        pass
    sys.path.insert(0, HERE)
    from timing import provenance

    return provenance()["machine"]


def drive(out: str, dry: bool, models: list[str], peer_python: dict[str, str], budget_s: float) -> dict:
    os.makedirs(out, exist_ok=True)
    t_start = time.time()
    result = {
        "benchmark": "gpu",
        "dry_run": dry,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "versions": _versions("ie_eager"),
        "sizes": sizes(dry),
        "models": {},
        "rows": [],
        "not_run": [],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if dry:
        env["IE_LAB_GPU_DRY_RUN"] = "1"
    for name in models:
        result["models"][name] = build(name, out, dry)
        for engine in ENGINES:
            py = peer_python.get(engine) if engine in PEERS else sys.executable
            left = budget_s - (time.time() - t_start)
            if engine == "bare":
                continue  # bare runs in ie_eager's process, beside it
            if dry and (name, engine) in DRY_SKIP:
                result["not_run"].append({"model": name, "engine": engine, "reason": DRY_SKIP[name, engine]})
                continue
            if py is None or not os.path.exists(py):
                why = f"no environment for {engine} (gpu.sh installs it beside ie_lab where the registry has it)"
                result["not_run"].append({"model": name, "engine": engine, "reason": why})
                continue
            if left < 30:
                result["not_run"].append({"model": name, "engine": engine, "reason": "the time budget ran out"})
                continue
            cmd = [py, os.path.abspath(__file__), out, "--phase", engine, "--model", name] + (
                ["--dry-run"] if dry else []
            )
            t0 = time.time()
            try:
                limit = left if math.isfinite(left) else None  # --budget inf (the dry run): no limit here
                r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit)
                ok = r.returncode == 0
                tail = (r.stderr or "").strip().splitlines()[-1:] or [""]
            except subprocess.TimeoutExpired:
                r, ok, tail = None, False, [f"timed out after {left:.0f}s"]
            print(f"[{name} {engine}] {'ok' if ok else 'FAILED'} in {time.time() - t0:.0f}s", flush=True)
            p = os.path.join(out, f"phase-{name}-{engine}.json")
            if ok and os.path.exists(p):
                ph = json.load(open(p))
                result["rows"] += ph["rows"]
                result.setdefault("engine_versions", {})[engine] = ph["versions"]
            else:
                result["not_run"].append({"model": name, "engine": engine, "reason": f"failed: {tail[0][:300]}"})
                if r is not None:
                    print(r.stderr[-3000:], file=sys.stderr)
        # vLLM rows against bare in another process (the two cannot share one GPU's memory comfortably)
        bare = {r["op"]: r["median_s"] for r in result["rows"] if r["model"] == name and r["engine"] == "bare"}
        for r in result["rows"]:
            if r["model"] == name and r.get("ratio_kind") == "across processes" and r["median_s"]:
                b = bare.get("forward" if r["op"] in ("capture_all", "project_k16", "sae_encode") else r["op"])
                if b:
                    r["ratio_vs_bare"] = r["median_s"] / b
        shutil_rm(os.path.join(out, "models", name))  # tens of GB on a GPU run: gone once measured
    result["wall_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(render(result))
    return result


def shutil_rm(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def expected_rows(models: list[str], dry: bool) -> set[tuple[str, str, str]]:
    """Every (model, engine, operation) row a run must produce (the peers' rows only where their environment
    exists, so they are not counted here)."""
    return {
        (m, e, op)
        for m in models
        for e in ENGINES
        if e not in PEERS and not (dry and (m, e) in DRY_SKIP)
        for op in OPS[e]
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def render(result: dict) -> str:
    """results.md: per model, operations x engines (median, tok/s, ratio to bare), and what did not run."""
    out = [
        f"# GPU benchmark ({'DRY RUN, CPU, tiny sizes' if result['dry_run'] else result['machine']}, {result['date']})",
        "",
        f"Machine: {result['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + f". Sizes: {result['sizes']}. Wall time {result.get('wall_s', '?')} s.",
        "",
        "(Nx): time over bare transformers' in the same process, interleaved; (Nx\u2020): over bare's in its own "
        "process. agree: fraction of generated positions equal to bare transformers' greedy tokens.",
        "",
    ]
    ix = {(r["model"], r["engine"], r["op"]): r for r in result["rows"]}
    ops = ["forward", "capture_all", "generate", "generate_x8", "steer", "project_k16", "sae_encode"]
    for name, info in result["models"].items():
        out += [
            f"## {name} ({_count(info['params'])} parameters, {info['layers']} layers, d_model {info['d_model']}, "
            f"random weights from benchmarks/configs/{info['config']})",
            "",
            "| operation | " + " | ".join(ENGINES) + " |",
            "| --- |" + " ---: |" * len(ENGINES),
        ]
        for op in ops:
            cells = []
            for e in ENGINES:
                r = ix.get((name, e, op))
                if r is None:
                    cells.append("")
                    continue
                if r["status"] != "ok":
                    cells.append(f"{r['status']}: {r.get('reason', '')}")
                    continue
                t = r["median_s"]
                c = f"{t * 1000:.1f} ms" if t < 1 else f"{t:.2f} s"
                if r.get("tok_per_s"):
                    c += f", {r['tok_per_s']:.0f} tok/s"
                if r.get("ratio_vs_bare"):
                    mark = "" if r.get("ratio_kind") == "in-process" else DAGGER
                    c += f" ({r['ratio_vs_bare']:.2f}x{mark})"
                if "agree" in r:
                    c += f", agree {r['agree']:.2f}"
                cells.append(c)
            out.append(f"| {op} | " + " | ".join(cells) + " |")
        out.append("")
    if result["not_run"]:
        out += ["Not run:", ""] + [f"- {n['model']} {n['engine']}: {n['reason']}" for n in result["not_run"]] + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--dry-run", action="store_true", default=os.environ.get("IE_LAB_GPU_DRY_RUN") == "1")
    ap.add_argument("--phase", choices=[e for e in ENGINES if e != "bare"])
    ap.add_argument("--model", action="append", choices=list(MODELS))
    ap.add_argument("--peer-python", action="append", default=[], help="ENGINE=PATH of a peer's python")
    ap.add_argument(
        "--budget", type=float, default=420.0, help="seconds for every phase together (inf: no budget, the dry run)"
    )
    args = ap.parse_args(argv)
    if args.phase:
        phase(args.model[0], args.phase, args.out, args.dry_run)
        return 0
    peers = dict(p.split("=", 1) for p in args.peer_python)
    res = drive(args.out, args.dry_run, args.model or list(MODELS), peers, args.budget)
    bad = [r for r in res["rows"] if not (isinstance(r["median_s"], float) and math.isfinite(r["median_s"]))]
    print(render(res))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
