"""The validator's own test: a deliberately wrong mapping must come out FAIL.

The classic mistake: reading TransformerLens' ``blocks.L.hook_mlp_out`` as the raw MLP output (``mlp_out.L``).
On Gemma 2 that hook is taken after the post-feedforward norm, i.e. it is ``mlp_out_post.L``. On random weights the
two can still point roughly the same way (cosine ~0.95 was measured), so a cosine-only check is weak; the
magnitude checks (max abs, relative error) are what must catch it. The tiny Gemma 2 fixture re-draws its norm gains
far from 1 (tests/families.py), so the norm changes the magnitude per channel.

With ``--engine hf`` the same mistake is made with plain hooks (the post-feedforward norm's output read as mlp_out),
which needs no external environment.
"""

from __future__ import annotations

import json
import os
import tempfile

from . import spec as S
from .plan import Ask

FAMILY = "gemma2"


def wrong_mapping(engine: str):
    def override(model, eng, asks):
        if eng != engine:
            return asks
        out = []
        for a in asks:
            if not a.address.startswith("mlp_out."):
                continue
            L = int(a.address.split(".")[1])
            if engine == "tl":
                name = f"blocks.{L}.hook_mlp_out"
                out.append(Ask(a.address, name, {"name": name}))
            else:
                path = f"model.layers.{L}.post_feedforward_layernorm"
                out.append(Ask(a.address, f"{path}.output", {"kind": "module", "path": path, "side": "output"}))
        # dedupe (TL gets one ask per spelling)
        seen, uniq = set(), []
        for a in out:
            if (a.address, a.name) not in seen:
                seen.add((a.address, a.name))
                uniq.append(a)
        return uniq

    return override


def run_selftest(out_dir: str | None = None, engine: str = "tl", log=print) -> dict:
    from .run import run

    out_dir = out_dir or tempfile.mkdtemp(prefix="ie_lab_validator_selftest_")
    (doc,) = run([FAMILY], [engine], out_dir=out_dir, override=wrong_mapping(engine), log=log)
    return doc


def main(out_dir: str | None, engine: str) -> int:
    doc = run_selftest(out_dir, engine)
    rows = doc["rows"]
    for r in rows:
        print(
            f"{r['address']:10s} <- {r['name']:45s} {r['verdict']:12s} cosine={r.get('cosine')} "
            f"max_abs={r.get('max_abs')} rel_err={r.get('rel_err')}  {r.get('why', '')}"
        )
    ok = bool(rows) and all(r["verdict"] == S.FAIL for r in rows)
    print("self-test:", "the wrong mapping FAILs, as it must" if ok else "NOT caught: the validator is too lenient")
    if out_dir:
        with open(os.path.join(out_dir, "selftest.json"), "w") as f:
            json.dump({"caught": ok, "rows": rows}, f, indent=1)
    return 0 if ok else 1
