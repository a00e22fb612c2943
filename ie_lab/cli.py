"""The `ie-lab` command: its table of commands, `main`, and `ie-lab lab` (JupyterLab with a private token). The other
commands have their own modules: `ie-lab points` (a model's points as a text cheat sheet) in cli_points.py,
`ie-lab doctor` (what this machine can run) in cli_doctor.py, `ie-lab serve` in remote/command.py.

`./dev lab` calls `ie-lab lab` after setting up the venv, so there is one implementation of the lab launch. Nothing
here evaluates its arguments: a model argument is a folder, `demo` or a transformers model type, loaded through
`ie_lab.Session` with trust_remote_code off and safetensors only, like any other load.

Building the command line imports neither torch nor transformers: `ie-lab --help`, `--version`, a command's
`--help` and a usage error answer at once. Each command imports what it needs when it runs (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from . import cli_doctor, cli_points
from .cli_common import FAILED, USAGE, version
from .remote.command import add_serve_command
from .sizing.command import add_size_command

__all__ = ["COMMANDS", "FAILED", "USAGE", "lab_command", "main", "parser"]

QUICKSTART = os.path.join("notebooks", "01_quickstart.ipynb")


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


def add_lab_command(sub: Any) -> None:
    """`ie-lab lab` on the subparsers of the command line."""
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


# The commands, in the order `ie-lab --help` lists them. Each entry adds its subparser to the command line and sets
# run= (the function the command runs, given the parsed arguments, and the leftover ones where takes_extra is set);
# a command's module imports what the command runs only when it runs, so that building the command line (--help, a
# usage error) imports neither torch nor transformers. A new command is a module with such a function and one line
# here (and its row in tests/test_import_contract.py's LAYERS).
COMMANDS: tuple[Callable[[Any], None], ...] = (
    add_lab_command,
    cli_points.add_command,
    cli_doctor.add_command,
    add_serve_command,  # `ie-lab serve`: its options in ie_lab/remote/command.py
    add_size_command,  # `ie-lab size`: its options in ie_lab/sizing/command.py
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="ie-lab",
        allow_abbrev=False,
        description="ie_lab: a Jupyter-first workbench for looking inside language models.",
        epilog="Docs: docs/CLI.md in the repository. Each command's --help lists its options.",
    )
    top.add_argument("--version", action="version", version=f"ie_lab {version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")

    for add in COMMANDS:
        add(sub)
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
