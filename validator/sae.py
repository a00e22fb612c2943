"""python -m validator sae: ie_lab.load_sae's encode against SAELens' own ``encode`` on the same weights and text.

The SAEs are written by SAELens itself (its StandardSAE / JumpReLUSAE / TopKSAE classes and ``save_model``, random
weights, in the saelens environment), so the folder is what SAELens writes, not a copy of its layout. ie_lab loads
each folder with ``load_sae`` on a tiny fixture model and encodes a text through ``project()`` at the point the hook
name resolved to. SAELens gets the activations at the tensor the hook name means, read with plain forward hooks on
the HF module TransformerLens takes it from (HOOK_MODULES below, written out per family, independent of ie_lab's
mappers), and encodes them with ``SAE.load_from_disk(folder).encode``. The two feature tensors must agree within
TOL (max abs, fp32).

The wrong mapping (Gemma 2's ``hook_mlp_out`` attached to the raw ``mlp_out`` instead of ``mlp_out_post``) is run
too and must FAIL: that is what the check would miss if it handed SAELens ie_lab's own capture.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from .external import README as README  # the README this check re-renders (tests read it here)
from .external import ExternalCheck, call_worker
from .run import HERE, RESULTS, ROOT

WORKER = os.path.join(HERE, "engines", "saelens_worker.py")
FAMILIES = ("llama", "gemma2")
ARCHS = ("standard", "jumprelu", "topk")
HOOKS = ("blocks.1.hook_mlp_out", "blocks.0.hook_resid_post")
TOL = 1e-5
D_SAE = 64
K = 8
TEXT = "the cat sat on the mat and then it ran away"

# TransformerLens hook name -> (HF module path, which output) per family: the tensor SAELens' SAE was trained on.
# Gemma 2's MLP output in TransformerLens is taken after the post-feedforward norm.
HOOK_MODULES = {
    ("llama", "hook_mlp_out"): "model.layers.{L}.mlp",
    ("gemma2", "hook_mlp_out"): "model.layers.{L}.post_feedforward_layernorm",
    ("llama", "hook_resid_post"): "model.layers.{L}",
    ("gemma2", "hook_resid_post"): "model.layers.{L}",
}


def saelens_python() -> tuple[str | None, str]:
    return CHECK.python()


def _worker(py: str, cmd: str, job: dict, work: str) -> dict:
    return call_worker(py, WORKER, cmd, job, os.path.join(work, f"{cmd}.json"), 900)


def _module_output(hf: Any, path: str, ids: Any) -> Any:
    import torch

    mod = hf.get_submodule(path)
    got = {}

    def hook(m, args, out):
        got["x"] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()

    h = mod.register_forward_hook(hook)
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        h.remove()
    return got["x"][0]


def cases() -> list[dict]:
    """Every (family, hook, architecture), plus the wrong mapping that must FAIL."""
    out = []
    for fam in FAMILIES:
        for hook in HOOKS:
            for arch in ARCHS:
                out.append({"family": fam, "hook_name": hook, "arch": arch, "address": None, "expect": "PASS"})
    for arch in ARCHS:
        out.append(
            {
                "family": "gemma2",
                "hook_name": "blocks.1.hook_mlp_out",
                "arch": arch,
                "address": "mlp_out.1",
                "expect": "FAIL",
            }
        )
    return out


def run(out_dir: str | None = RESULTS, log=print) -> dict:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import ie_lab
    from ie_lab.sae import load_sae
    from tests.families import make_model, make_tokenizer

    py, why = saelens_python()
    if py is None:
        raise RuntimeError(why)
    work = tempfile.mkdtemp(prefix="ie_lab_validator_sae_")
    todo = cases()
    models, sessions = {}, {}
    for fam in FAMILIES:
        hf = make_model(fam).float().eval()
        hf.set_attn_implementation("eager")  # Gemma 2's softcapping: the kernel that computes what the model defines
        models[fam] = hf
        sessions[fam] = ie_lab.Session(hf, tokenizer=make_tokenizer(), progress=False, replace=False)
    try:
        for i, c in enumerate(todo):
            c["folder"] = os.path.join(work, f"sae{i}-{c['family']}-{c['arch']}")
            c["seed"] = i
        built = _worker(
            py,
            "build",
            {
                "saes": [
                    {
                        "folder": c["folder"],
                        "arch": c["arch"],
                        "d_in": sessions[c["family"]].facts.d_model,
                        "d_sae": D_SAE,
                        "k": K,
                        "hook_name": c["hook_name"],
                        "seed": c["seed"],
                        "model_name": f"tiny-{c['family']}",
                    }
                    for c in todo
                ]
            },
            work,
        )
        for i, c in enumerate(todo):
            s, hf = sessions[c["family"]], models[c["family"]]
            sae = load_sae(c["folder"], s, address=c["address"])
            c["resolved"] = str(sae.address)
            c["activation"] = sae.activation
            ids = torch.tensor([s.tokenizer(TEXT)["input_ids"]])
            c["ie_lab"] = sae.project(s, TEXT).scores.float()
            L, point = c["hook_name"].split(".")[1], c["hook_name"].split(".")[2]
            x = _module_output(hf, HOOK_MODULES[(c["family"], point)].format(L=L), ids)
            # the activations at the resolved point as ie_lab captures them: equal to x when the mapping is right
            mine = s.capture(TEXT, [c["resolved"]])[c["resolved"]][0].float()
            c["point_max_abs"] = float((mine - x).abs().max()) if mine.shape == x.shape else None
            c["acts"] = os.path.join(work, f"acts{i}.safetensors")
            c["out"] = os.path.join(work, f"feat{i}.safetensors")
            save_file({"x": x.contiguous()}, c["acts"])
        enc = _worker(py, "encode", {"saes": [{k: c[k] for k in ("folder", "acts", "out")} for c in todo]}, work)
    finally:
        for s in sessions.values():
            s.close()
    rows = []
    for c in todo:
        ref = load_file(c["out"])["f"]
        got = c["ie_lab"]
        ok_shape = tuple(ref.shape) == tuple(got.shape)
        max_abs = float((ref - got).abs().max()) if ok_shape else float("inf")
        verdict = "PASS" if ok_shape and max_abs <= TOL else "FAIL"
        row = {
            "family": c["family"],
            "architecture": c["arch"],
            "hook_name": c["hook_name"],
            "resolved": c["resolved"],
            "forced_address": c["address"],
            "tokens": int(got.shape[0]),
            "d_sae": D_SAE,
            "k": K if c["arch"] == "topk" else None,
            "max_abs": max_abs,
            "max_feature": float(ref.abs().max()),
            "active_fraction": float((ref != 0).float().mean()),
            "point_max_abs": c["point_max_abs"],
            "verdict": verdict,
            "expected": c["expect"],
        }
        rows.append(row)
        log(
            f"{c['family']:7s} {c['hook_name']:26s} -> {c['resolved']:15s} {c['arch']:9s} max_abs={max_abs:.3g} "
            f"{verdict} (expected {c['expect']})"
        )
    doc = {
        "what": "ie_lab.load_sae + project() vs SAELens SAE.load_from_disk(...).encode on SAELens-written random SAEs",
        "text": TEXT,
        "tolerance_max_abs": TOL,
        "dtype": "float32",
        "versions": {**enc.get("versions", {}), "ie_lab_transformers": transformers.__version__},
        "files_written_by_saelens": [list(f) for f in sorted({tuple(v) for v in built["made"].values()})],
        "rows": rows,
        "all_as_expected": all(r["verdict"] == r["expected"] for r in rows),
    }
    CHECK.save(doc, out_dir)
    return doc


START = "<!-- validator-saelens:start (generated by `python -m validator sae` from results/saelens.json) -->"
END = "<!-- validator-saelens:end -->"


def table(doc: dict) -> str:
    """The README's SAELens table, from results/saelens.json alone."""
    v = doc["versions"]
    lines = [
        f"sae-lens {v.get('sae-lens')}, transformer-lens {v.get('transformer-lens')}, transformers "
        f"{v.get('transformers')}, torch {v.get('torch')}; fp32, tolerance max abs {doc['tolerance_max_abs']:g}; "
        f"text {doc['text']!r}. Files SAELens wrote per SAE: "
        + "; ".join(", ".join(f) for f in doc["files_written_by_saelens"])
        + ".",
        "",
        "| family | hook name | resolved to | architecture | tokens x d_sae | active | max abs | verdict | expected |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["rows"]:
        forced = " (forced)" if r["forced_address"] else ""
        lines.append(
            f"| {r['family']} | `{r['hook_name']}` | `{r['resolved']}`{forced} | {r['architecture']} | "
            f"{r['tokens']} x {r['d_sae']} | {r['active_fraction']:.3f} | {r['max_abs']:.3g} | {r['verdict']} | "
            f"{r['expected']} |"
        )
    return "\n".join(lines) + "\n"


CHECK = ExternalCheck(
    env="saelens",
    results_file="saelens.json",
    start=START,
    end=END,
    table=table,
    run=run,
    verdict_key="all_as_expected",
    label="saelens check",
    good="every row as expected",
    bad="NOT as expected",
)
readme_with = CHECK.readme_with
write_readme = CHECK.write_readme
main = CHECK.main
