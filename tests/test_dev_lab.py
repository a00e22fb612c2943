"""`./dev lab` starts JupyterLab with a token that no other local user can read from the process list, prints a URL
that opens the quickstart notebook, and leaves a clean terminal (no node stack traces)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
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


QUICKSTART = "notebooks/01_quickstart.ipynb"
# A node stack frame ("    at fn (file:///...:4:393)") or node's closing banner ("Node.js v20.20.2"): JupyterLab
# runs node scripts from its venv at start (jupyter_builder's yarn.js), and a failing one prints both to the terminal.
NODE_TRACE = re.compile(r"^\s+at .*:\d+:\d+\)?$|^Node\.js v\d+|Fail to get yarn configuration", re.M)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None  # the 302 itself is the answer looked at


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
            m = re.search(r"^JupyterLab: (http://\S+)$", text, re.M)
            if m and token is None:
                url = urllib.parse.urlsplit(m.group(1))  # the URL for the user is still printed
                token = urllib.parse.parse_qs(url.query)["token"][0]
            if token and _status(port, token) == 200:
                break
            assert proc.poll() is None, f"./dev lab exited ({proc.returncode}):\n{text[-3000:]}"
            assert time.monotonic() < end, f"./dev lab did not answer (hung?):\n{text[-3000:]}"
            time.sleep(0.5)
        assert len(token) >= 32
        assert (url.netloc, url.path) == (f"127.0.0.1:{port}", f"/lab/tree/{QUICKSTART}"), url  # not the Launcher

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

        # The printed URL opens the quickstart: JupyterLab's page for it names the notebook as the path to open
        # (its page config's treePath; a bare /lab has none and shows the Launcher).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab/tree/{QUICKSTART}?token={token}", timeout=30) as r:
            page = r.read().decode()
        config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
        assert config is not None, page[:2000]
        assert json.loads(config.group(1))["treePath"] == QUICKSTART
        # ...and so does the bare address (what the server's own log line and a bookmark of the port lead to).
        opener = urllib.request.build_opener(_NoRedirect())
        with pytest.raises(urllib.error.HTTPError) as redirect:
            opener.open(f"http://127.0.0.1:{port}/?token={token}", timeout=30)
        assert (
            redirect.value.code == 302
            and urllib.parse.urlsplit(redirect.value.headers["Location"]).path == f"/lab/tree/{QUICKSTART}"
        )

        # JupyterLab has run its node scripts by now (the yarn configuration is read while the server starts).
        trace = NODE_TRACE.search(log.read_text(errors="replace"))
        assert trace is None, f"node failed in the ./dev lab terminal:\n{log.read_text(errors='replace')[-4000:]}"
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
