"""Orchestration: build the models once, capture ie_lab's reference, run each engine's worker, compare, write JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from . import spec as S

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "engines", "worker.py")
RESULTS = os.path.join(HERE, "results")
SEQ_LEN = 11  # equals no head count or head_dim of the fixtures, so [b,h,s,d] and [b,s,h,d] are never confused
BATCH = 2


def venvs_dir() -> str:
    return os.environ.get("IE_LAB_VALIDATOR_VENVS", os.path.join(ROOT, ".venvs"))


def engine_python(engine: str) -> tuple[str | None, str]:
    env = S.ENGINES[engine].env
    if env is None:
        return sys.executable, ""
    py = os.path.join(venvs_dir(), env, "bin", "python")
    if os.path.exists(py):
        return py, ""
    return None, (
        f"no environment at {os.path.dirname(os.path.dirname(py))}: create it with "
        f"`bash validator/envs/setup.sh {env}` (or pass --setup)"
    )


def setup_env(engine: str) -> None:
    env = S.ENGINES[engine].env
    if env is not None:
        subprocess.run(["bash", os.path.join(HERE, "envs", "setup.sh"), env], check=True)


@dataclass
class Model:
    slug: str  # file-name safe: tiny-llama, gpt2, google--gemma-2-2b
    family: str
    source: str  # a folder or an HF id
    real: bool


def default_models_dir() -> str:
    """Saved fixtures are reused across runs, keyed by tests/families.py's content and the transformers version."""
    import hashlib

    import transformers

    with open(os.path.join(ROOT, "tests", "families.py"), "rb") as f:
        h = hashlib.sha256(f.read()).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), "ie_lab_validator_models", f"{h}-tf{transformers.__version__}")


def tiny_models(families, models_dir: str) -> list[Model]:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.families import saved_model_dir

    return [Model(f"tiny-{f}", f, saved_model_dir(f, models_dir), False) for f in families]


def real_models(ids) -> list[Model]:
    return [Model(i.replace("/", "--"), "", i, True) for i in ids]


def _load_reference(m: Model, attn: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ie_lab

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    hf = AutoModelForCausalLM.from_pretrained(m.source, dtype=dt, attn_implementation=attn).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(m.source)
    except (OSError, ValueError):
        tok = None
    return ie_lab.load(hf, tok, quiet=True)


def _ids(lm) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    hi = min(lm.facts.vocab_size, 32000)
    return torch.randint(4, hi, (BATCH, SEQ_LEN), generator=g).tolist()


def _reference(lm, ids, addresses: list[str]) -> tuple[dict, dict]:
    """ie_lab's eager capture of every address (one forward; per address only where the joint capture fails)."""
    import torch

    import ie_lab

    t = torch.tensor(ids)
    try:
        cache = ie_lab.capture(lm, t, addresses)
        return {str(k): v.detach().float().cpu() for k, v in cache.items()}, {}
    except Exception:  # noqa: BLE001 - find which address broke it
        pass
    got, errors = {}, {}
    for a in addresses:
        try:
            cache = ie_lab.capture(lm, t, [a])
            got[a] = next(iter(cache.values())).detach().float().cpu()
        except Exception as e:  # noqa: BLE001
            errors[a] = f"{type(e).__name__}: {e}"[:300]
    return got, errors


def run(
    families=(),
    engines=S.DEFAULT_ENGINES,
    *,
    models=(),
    out_dir: str = RESULTS,
    models_dir: str | None = None,
    attn: str = "eager",
    device: str = "cpu",
    dtype: str = "float32",
    setup: bool = False,
    override=None,
    timeout: int = 1800,
    log=print,
) -> list[dict]:
    """Validate; write one JSON per (model, engine) into out_dir and return them.

    ``override(model, engine, asks) -> asks`` replaces the requests (the self-test uses it to inject a wrong
    mapping and check that it comes out FAIL).
    """
    from safetensors.torch import load_file

    from . import compare
    from . import plan as plan_mod

    with tempfile.TemporaryDirectory(prefix="ie_lab_validator_") as work:  # the engines' job files and tensors
        models_dir = models_dir or default_models_dir()
        todo = tiny_models(families, models_dir) + real_models(models)
        if setup:
            for e in engines:
                setup_env(e)

        # 1. ie_lab's reference, and every engine's requests, per model.
        per_model: dict[str, dict[str, Any]] = {}
        for m in todo:
            t0 = time.time()
            lm = _load_reference(m, attn, device, dtype)
            m.family = m.family or lm.facts.model_type
            ids = _ids(lm)
            p = plan_mod.addresses(lm, m.family)
            ref, ref_err = _reference(lm, ids, [a for a in p.addresses if a not in p.ie_lab_refused])
            ref_err.update(p.ie_lab_refused)
            asks = {}
            for e in engines:
                a = plan_mod.asks(lm, p, e)
                asks[e] = override(m, e, a) if override else a
            per_model[m.slug] = dict(model=m, lm_facts=lm.facts, plan=p, ids=ids, ref=ref, ref_err=ref_err, asks=asks)
            log(
                f"[ie_lab] {m.slug}: {len(ref)} reference tensors, {len(p.absent)} absent, "
                f"{len(ref_err)} refused ({time.time() - t0:.1f}s)"
            )
            del lm

        # 2. Each engine's worker over all models at once (one process per engine: imports are the slow part).
        outputs: dict[tuple[str, str], tuple[dict, dict]] = {}
        unavailable: dict[str, str] = {}
        for e in engines:
            py, why = engine_python(e)
            if py is None:
                unavailable[e] = why
                log(f"[{e}] not available: {why}")
                continue
            jobs = []
            for slug, d in per_model.items():
                reqs = [
                    {"key": str(i), "spec": a.spec}
                    for i, a in enumerate(d["asks"][e])
                    if a.spec is not None and a.address in d["ref"]
                ]
                jobs.append(
                    {
                        "family": slug,
                        "model_dir": d["model"].source,
                        "ids": d["ids"],
                        "attn_implementation": attn,
                        "dtype": dtype,
                        "device": device,
                        "requests": reqs,
                        "out": os.path.join(work, f"{e}__{slug}"),
                    }
                )
            path = os.path.join(work, f"jobs_{e}.json")
            with open(path, "w") as f:
                json.dump({"engine": e, "jobs": jobs}, f)
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            if any(d["model"].real for d in per_model.values()):
                env.pop("HF_HUB_OFFLINE", None)
            else:
                env["HF_HUB_OFFLINE"] = "1"
            env["PYTHONPATH"] = ROOT if e == "vllm" else ""
            t0 = time.time()
            proc = subprocess.run(
                [py, WORKER, path], env=env, cwd=work, capture_output=True, text=True, timeout=timeout
            )
            log(f"[{e}] worker finished in {time.time() - t0:.1f}s (rc={proc.returncode})")
            if proc.returncode != 0:
                unavailable[e] = f"the worker exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
                log(proc.stderr[-3000:])
                continue
            for j in jobs:
                with open(j["out"] + ".json") as f:
                    meta = json.load(f)
                tensors = load_file(j["out"] + ".safetensors") if os.path.exists(j["out"] + ".safetensors") else {}
                outputs[(e, j["family"])] = (meta, tensors)

        # 3. Compare and write.
        written = []
        os.makedirs(out_dir, exist_ok=True)
        for slug, d in per_model.items():
            for e in engines:
                eng = S.ENGINES[e]
                tol = S.REAL_WEIGHTS if d["model"].real else eng.tolerance
                rows = []
                meta, tensors = outputs.get((e, slug), ({"status": "unavailable", "errors": {}}, {}))
                for i, a in enumerate(d["asks"][e]):
                    row = {"address": a.address, "name": a.name}
                    key = str(i)
                    if e in unavailable:
                        row.update(verdict=S.NOT_AVAILABLE, why=unavailable[e])
                    elif a.address in d["ref_err"]:
                        row.update(verdict=S.NOT_SERVED, why=f"ie_lab: {d['ref_err'][a.address]}")
                    elif a.spec is None:
                        row.update(verdict=S.NOT_ASKED, why=a.reason)
                    elif meta.get("status") != "ok":
                        row.update(
                            verdict=S.NOT_SERVED, why=f"the engine could not run this model: {meta.get('reason')}"
                        )
                    elif key not in tensors:
                        row.update(verdict=S.NOT_SERVED, why=meta["errors"].get(key, "no tensor came back"))
                    else:
                        point = a.address.split(".")[0]
                        attention = point in ("attn_scores", "attn_probs")
                        mets, note = compare.metrics(d["ref"][a.address], tensors[key], attention)
                        if mets is None:
                            row.update(verdict=S.FAIL, why=note)
                        else:
                            verdict, why = S.judge(mets, tol)
                            row.update(verdict=verdict, why=why, **compare.rounded(mets))
                            if note:
                                row["layout"] = note
                    k = S.known(d["model"].family, a.address.split(".")[0], e)
                    if k and row["verdict"] in (S.FAIL, S.WARN):
                        row["known"] = k
                    rows.append(row)
                doc = {
                    "model": slug,
                    "family": d["model"].family,
                    "source": (
                        "tiny random-weight fixture (tests/families.py)" if not d["model"].real else d["model"].source
                    ),
                    "engine": e,
                    "engine_title": eng.title,
                    "naming": eng.naming,
                    "versions": meta.get("versions", {}),
                    "status": "not available" if e in unavailable else meta.get("status", "unavailable"),
                    "reason": unavailable.get(e) or meta.get("reason", ""),
                    "attn_implementation": attn,
                    "dtype": dtype,
                    "layers": d["plan"].layers,
                    "prompt": {"batch": BATCH, "seq": SEQ_LEN, "ids": "torch.randint(4, vocab, seed 0)"},
                    "tolerance": tol.as_dict(),
                    "absent": d["plan"].absent,
                    "rows": rows,
                }
                with open(os.path.join(out_dir, f"{slug}__{e}.json"), "w") as f:
                    json.dump(doc, f, indent=1, sort_keys=False)
                    f.write("\n")
                written.append(doc)
                counts = {v: sum(r["verdict"] == v for r in rows) for v in S.VERDICTS}
                log(f"{slug:24s} {e:8s} " + " ".join(f"{k}={n}" for k, n in counts.items() if n))
        return written
