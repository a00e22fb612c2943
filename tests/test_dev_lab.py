"""`./dev lab` starts JupyterLab with a token that no other local user can read from the process list."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP = 180  # seconds; only to turn a hang into a failure (JupyterLab starts in seconds)

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self") or not os.path.exists(os.path.join(sys.prefix, "bin", "jupyter-lab")),
    reason="needs Linux /proc and JupyterLab in this environment",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(port: int, token: str | None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/status")
    if token is not None:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0  # not listening yet


def _group(pgid: int) -> dict[int, bytes]:
    """cmdline of every process in the process group ./dev lab leads (the server, and anything it started)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            # fields after the command name (which may hold spaces): state ppid pgrp ...
            if int(stat.rsplit(b")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out[int(d)] = f.read()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def test_dev_lab_keeps_the_token_off_the_command_line(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_TOKEN", "JUPYTER_TOKEN_FILE", "IE_LAB_TOKEN")}
    env.update(
        IE_LAB_SKIP_INSTALL="1",
        IE_LAB_PORT=str(port),
        IE_LAB_VENV=sys.prefix,
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
    )
    log = tmp_path / "lab.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [os.path.join(ROOT, "dev"), "lab"],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        end = time.monotonic() + STARTUP
        token = None
        while True:
            text = log.read_text(errors="replace")
            m = re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=([0-9a-f]+)", text)
            if m and token is None:
                token = m.group(1)  # the URL for the user is still printed
            if token and _status(port, token) == 200:
                break
            assert proc.poll() is None, f"./dev lab exited ({proc.returncode}):\n{text[-3000:]}"
            assert time.monotonic() < end, f"./dev lab did not answer (hung?):\n{text[-3000:]}"
            time.sleep(0.5)
        assert len(token) >= 32

        procs = _group(proc.pid)
        assert proc.pid in procs and b"jupyter" in procs[proc.pid], procs  # ./dev exec'd the server
        leaked = {
            pid: cmd.replace(b"\0", b" ").decode(errors="replace")
            for pid, cmd in procs.items()
            if token.encode() in cmd
        }
        assert not leaked, f"the token is readable in the process list: {leaked}"

        assert _status(port, None) == 403
        assert _status(port, "0" * len(token)) == 403
        assert _status(port, token) == 200
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
