"""What a newer transformers changes for ie_lab: the families survey and each model type's measured structure.

`./dev upstream` runs this in two environments, the newest verified line (.venvs/latest, pinned by
.ci/constraints-newest.txt) and a throwaway one on the newest release on PyPI (.venvs/upstream), then compares:

    python scripts/upstream.py fingerprint OUT.json [model_type ...]   # in one environment
    python scripts/upstream.py compare VERIFIED.json UPSTREAM.json     # anywhere; prints the report

A fingerprint is, per model type in transformers' causal-LM mapping, the survey's verdict (ie_lab.coverage.classify:
bound / refused / defect / untested, and the reason) and, where it binds, what the binder measured on each layer (the
LayerBinding's fields: which module class holds each role, whether attention goes through transformers' attention
interface, the value source, ...). Two versions' fingerprints differ exactly where transformers changed something
ie_lab reads, which is what a pin raise has to look at: new survey file, quirks, bound (docs/DEVELOPING.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from typing import Any


def _describe(value: Any) -> Any:
    """A LayerBinding field as plain data: a module by its class, a parameter by its shape, numbers rounded (a
    measured multiplier differs in the last bits between runs; a structural change does not)."""
    import torch

    if isinstance(value, torch.nn.Parameter | torch.Tensor):
        return f"tensor{list(value.shape)}"
    if isinstance(value, torch.nn.Module):
        return type(value).__name__
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_describe(v) for v in value]
    return value


def structure(lm: Any) -> list[dict[str, Any]]:
    """What the binder measured, layer by layer (the model itself, `layer`, is left out: its class is in `attn`'s
    parent chain anyway and the index says which one)."""
    out = []
    for lb in lm.binding.layers:
        fields = {f.name: _describe(getattr(lb, f.name)) for f in dataclasses.fields(lb) if f.name not in ("index",)}
        out.append(fields)
    return out


def fingerprint(model_type: str) -> dict[str, Any]:
    from ie_lab import coverage

    entry: dict[str, Any] = {}
    row = coverage.classify(model_type, on_bound=lambda lm: entry.update(layers=structure(lm)))
    row["category"] = coverage.category(row)
    entry["survey"] = row
    return entry


def write_fingerprints(path: str, types: list[str]) -> None:
    import transformers

    from ie_lab import coverage

    warnings.filterwarnings("ignore")
    types = types or sorted(coverage.causal_lm_types())
    out: dict[str, Any] = {"transformers": transformers.__version__, "types": {}}
    t0 = time.time()
    for i, mt in enumerate(types):
        out["types"][mt] = fingerprint(mt)
        print(f"\r{i + 1}/{len(types)} {mt:40s}", end="", file=sys.stderr, flush=True)
    print(f"\n{len(types)} model types in {time.time() - t0:.0f} s", file=sys.stderr)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, sort_keys=True)


def _layer_changes(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} layers bound -> {len(b)}"]
    changes: dict[str, list[int]] = {}
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                changes.setdefault(f"{k}: {x.get(k)!r} -> {y.get(k)!r}", []).append(i)
    return [f"{what} (layers {', '.join(map(str, idx))})" for what, idx in changes.items()]


def compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], int]:
    """The report's lines and how many model types need attention before a pin raise."""
    va, vb = old["transformers"], new["transformers"]
    lines = [f"# transformers {va} (verified) -> {vb} (newest on PyPI)", ""]
    a, b = old["types"], new["types"]
    added, removed = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    verdicts, structural = [], []
    for mt in sorted(set(a) & set(b)):
        sa, sb = a[mt]["survey"], b[mt]["survey"]
        if (sa["status"], sa["category"]) != (sb["status"], sb["category"]):
            why = sb.get("reason", "")
            verdicts.append(f"- `{mt}`: {sa['category']} -> {sb['category']}" + (f" ({why})" if why else ""))
        elif "layers" in a[mt] and "layers" in b[mt]:
            changes = _layer_changes(a[mt]["layers"], b[mt]["layers"])
            if changes:
                structural.append(f"- `{mt}`: " + "; ".join(changes))
    lines.append(f"## Verdicts that changed ({len(verdicts)})")
    lines += verdicts or ["none"]
    lines += ["", f"## Same verdict, measured structure changed ({len(structural)})"]
    lines += structural or ["none"]
    lines += ["", f"## New model types in the causal-LM mapping ({len(added)})"]
    lines += [f"- `{mt}`: {b[mt]['survey']['category']}" for mt in added] or ["none"]
    lines += ["", f"## Model types no longer in the mapping ({len(removed)})"]
    lines += [f"- `{mt}`" for mt in removed] or ["none"]
    defects = [mt for mt in b if b[mt]["survey"]["status"] == "defect"]
    lines += ["", f"## Defects on {vb} ({len(defects)}: a crash or a failing invariant, to fix before raising the pin)"]
    lines += [f"- `{mt}`: {b[mt]['survey'].get('reason', '')}" for mt in sorted(defects)] or ["none"]
    return lines, len(verdicts) + len(structural) + len(added) + len(removed) + len(defects)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "fingerprint":
        write_fingerprints(argv[1], argv[2:])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        with open(argv[1], encoding="utf-8") as f:
            old = json.load(f)
        with open(argv[2], encoding="utf-8") as f:
            new = json.load(f)
        lines, _ = compare(old, new)
        print("\n".join(lines))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
