"""python -m validator: cross-engine parity for ie_lab's hook points.

python -m validator run --all                       # the full sweep: every family ie_lab binds x every engine
python -m validator run --surveyed                  # every other model type the coverage survey binds, every engine
python -m validator run --ci                        # CI's subset (4 families x hf, tl), into a temp dir
python -m validator run --family llama --engine hf --engine tl
python -m validator run --model gpt2 --model google/gemma-2-2b --device cuda --dtype bfloat16   # real weights
python -m validator selftest                        # the classic mistake must come out FAIL
python -m validator render                          # README table + heatmap from the committed JSON only
python -m validator setup tl                        # create .venvs/tl (also: nnsight, nnterp, interp, saelens, circuit_tracer)
python -m validator sae                             # load_sae's encode vs SAELens' own encode (needs .venvs/saelens)
python -m validator circuits                        # attribution_graph vs circuit-tracer (needs .venvs/circuit_tracer)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from . import spec as S


def _families_all() -> list[str]:
    """Every fixture family the sweep runs (validator.run.families_all: run.py reads it too, and imports nothing
    of this module)."""
    from .run import families_all

    return families_all()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m validator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="capture, compare, write JSON (and re-render unless --out elsewhere)")
    r.add_argument("--family", action="append", default=[], help="a tiny fixture family (tests/families.py)")
    r.add_argument("--model", action="append", default=[], help="a real HF id or folder (needs the weights)")
    r.add_argument("--engine", action="append", default=[], choices=list(S.ENGINES))
    r.add_argument("--all", action="store_true", help="every family ie_lab binds, every engine")
    r.add_argument(
        "--surveyed",
        action="store_true",
        help="the survey's tiny instance of every model type ie_lab/coverage_data records as bound that no fixture "
        "family covers (surveyed-<type>)",
    )
    r.add_argument(
        "--surveyed-type",
        action="append",
        default=[],
        help="one surveyed model type (its survey instance, whether or not a fixture covers it)",
    )
    r.add_argument(
        "--chunk", type=int, default=None, help="at most this many models per engine process (default: all at once)"
    )
    r.add_argument(
        "--ci", action="store_true", help=f"CI's subset: {', '.join(S.CI_FAMILIES)} x {', '.join(S.CI_ENGINES)}"
    )
    r.add_argument("--out", default=None, help="results folder (default validator/results; --ci: a temp dir)")
    r.add_argument("--models-dir", default=None, help="where the tiny fixtures are saved (reused across runs)")
    r.add_argument(
        "--attn",
        default="eager",
        help="attn_implementation every engine loads with (default eager, which TransformerBridge forces anyway)",
    )
    r.add_argument("--device", default="cpu")
    r.add_argument("--dtype", default="float32")
    r.add_argument("--setup", action="store_true", help="create missing engine environments first")
    s = sub.add_parser("selftest", help="inject TL hook_mlp_out -> raw mlp_out on Gemma2; it must FAIL")
    s.add_argument("--out", default=None)
    s.add_argument("--engine", default="tl", choices=["tl", "hf"])
    sub.add_parser("render", help="re-render validator/README.md's table and the heatmap from validator/results")
    e = sub.add_parser("setup", help="create an engine environment")
    e.add_argument("env", choices=["tl", "nnsight", "nnterp", "interp", "saelens", "circuit_tracer"])
    sa = sub.add_parser("sae", help="ie_lab.load_sae's encode vs SAELens' encode on SAELens-written random SAEs")
    sa.add_argument("--out", default=None, help="results folder (default validator/results, and README re-rendered)")
    ci = sub.add_parser("circuits", help="ie_lab.attribution_graph vs circuit-tracer's attribute() on the same model")
    ci.add_argument("--out", default=None, help="results folder (default validator/results, and README re-rendered)")
    args = ap.parse_args(argv)

    if args.cmd == "setup":
        import subprocess

        from .run import HERE

        return subprocess.call(["bash", os.path.join(HERE, "envs", "setup.sh"), args.env])
    if args.cmd == "render":
        from . import circuits, render, sae

        render.write_all()
        circuits.write_readme()
        sae.write_readme()
        print("rendered validator/README.md and validator/results/heatmap.{json,html}")
        return 0
    if args.cmd == "sae":
        from . import sae

        return sae.main(args.out)
    if args.cmd == "circuits":
        from . import circuits

        return circuits.main(args.out)
    if args.cmd == "selftest":
        from . import selftest

        return selftest.main(args.out, args.engine)

    from . import render
    from .run import RESULTS, run

    families = list(args.family)
    engines = list(args.engine)
    surveyed = list(args.surveyed_type)
    if args.surveyed:
        from .run import surveyed_types

        surveyed = surveyed or surveyed_types()
    if args.all:
        families = families or _families_all()
        engines = engines or list(S.DEFAULT_ENGINES)
    if args.ci:
        families = families or list(S.CI_FAMILIES)
        engines = engines or list(S.CI_ENGINES)
    engines = engines or list(S.DEFAULT_ENGINES)
    if not families and not args.model and not surveyed:
        ap.error("name --family, --model, --surveyed, --all or --ci")
    out = args.out or (tempfile.mkdtemp(prefix="ie_lab_validator_ci_") if args.ci else RESULTS)
    docs = run(
        families,
        engines,
        models=args.model,
        surveyed=surveyed,
        chunk=args.chunk,
        out_dir=out,
        models_dir=args.models_dir,
        attn=args.attn,
        device=args.device,
        dtype=args.dtype,
        setup=args.setup,
    )
    if args.surveyed:
        from .run import write_survey_snapshot

        write_survey_snapshot(out)
    if os.path.abspath(out) == os.path.abspath(RESULTS):
        render.write_all()
    print(render.summary_text(docs))
    print(f"JSON in {out}")
    return 1 if any(row["verdict"] == S.FAIL for d in docs for row in d["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
