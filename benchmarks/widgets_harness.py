"""A real JupyterLab (and Notebook 7) server plus headless Debian Chromium, for the widget tests and benchmarks.

The server runs on 127.0.0.1 with a random token and private config/runtime/settings/workspace folders;
notebooks are written to a temporary root folder, opened with ``?reset`` and run through the front end's
own command (``notebook:run-all-cells``), so widgets render exactly as for a user. Nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("IE_LAB_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = os.path.join(ROOT, "artifacts", "widgets")
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


def available() -> str | None:
    """None when a browser test can run here, else why not."""
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[dev]')"
    if shutil.which("jupyter", path=os.path.dirname(sys.executable)) is None:
        return "jupyter is not installed in this environment"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_code(family: str = "llama", **tiny: Any) -> str:
    return (
        f"import sys; sys.path.insert(0, {ROOT!r})\n"
        "import torch; torch.set_num_threads(1)\n"
        "import ie_lab\nfrom ie_lab.toy import tiny_model\n"
        f"m, t = tiny_model({family!r})\n"
        "s = ie_lab.Session(m, tokenizer=t, progress=False)\n"
    )


class Server:
    """One Jupyter server (JupyterLab at /lab, Notebook 7 at /tree) and one Chromium, for a test module."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="ie_lab_lab_")
        self.root = os.path.join(self.tmp, "root")
        os.makedirs(self.root)
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        for var, sub in (
            ("JUPYTER_CONFIG_DIR", "config"),
            ("JUPYTER_RUNTIME_DIR", "runtime"),
            ("JUPYTERLAB_SETTINGS_DIR", "settings"),
            ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
            ("IPYTHONDIR", "ipython"),
        ):
            env[var] = os.path.join(self.tmp, sub)
            os.makedirs(env[var], exist_ok=True)
        notif = os.path.join(env["JUPYTERLAB_SETTINGS_DIR"], "@jupyterlab", "apputils-extension")
        os.makedirs(notif, exist_ok=True)
        with open(os.path.join(notif, "notification.jupyterlab-settings"), "w") as f:
            json.dump({"fetchNews": "false", "checkForUpdates": False}, f)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "jupyter"),
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
            "--JupyterNotebookApp.expose_app_in_browser=True",
            "--ServerApp.open_browser=False",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(os.path.join(self.tmp, "server.log"), "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError("the Jupyter server did not start; see its log")
            time.sleep(0.3)
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)

    # ---- notebooks ------------------------------------------------------------------------------
    def write(self, name: str, cells: list[str]) -> str:
        nb = {
            "cells": [
                {"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                for c in cells
            ],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        with open(os.path.join(self.root, name), "w") as f:
            json.dump(nb, f)
        return name

    def open(self, name: str, *, ui: str = "lab", theme: str | None = None, width: int = 1300) -> Any:
        """Open a notebook, wait for its kernel, run all cells, wait until they have all run."""
        page = self.browser.new_page(viewport={"width": width, "height": 1000})
        page.on("console", lambda m: m.type == "error" and print("[browser]", m.text))
        page.on("pageerror", lambda e: print("[browser error]", e))
        url = (
            f"{self.base}/lab/tree/{name}?reset&token={self.token}"
            if ui == "lab"
            else f"{self.base}/notebooks/{name}?token={self.token}"
        )
        page.goto(url)
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget"
            " && window.jupyterapp.shell.currentWidget.sessionContext",
            timeout=60000,
        )
        page.evaluate(
            "async () => { const w = window.jupyterapp.shell.currentWidget; await w.sessionContext.ready; "
            "await w.context.ready; }"
        )
        page.wait_for_function(
            "() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel;"
            " return k && k.connectionStatus === 'connected' && k.status === 'idle'; }",
            timeout=60000,
        )
        if theme:
            page.evaluate(f"() => window.jupyterapp.commands.execute('apputils:change-theme', {{theme: {theme!r}}})")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        self.wait_cells(page)
        return page

    def wait_cells(self, page: Any, timeout: float = 120) -> None:
        page.wait_for_function(
            "() => { const nb = window.jupyterapp.shell.currentWidget.content; const k = "
            "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
            " return k.status === 'idle' && nb.widgets.every(c => c.model.type !== 'code' || "
            "(c.model.executionCount !== null && !c.node.querySelector('.jp-InputArea-prompt')?.textContent.includes('*'))); }",
            timeout=timeout * 1000,
        )

    def execute(self, page: Any, code: str, timeout: float = 60) -> str:
        """Run code in the notebook's kernel (not in a cell) and return what it printed."""
        return page.evaluate(
            """async (code) => {
              const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
              const f = k.requestExecute({code, store_history: false});
              let out = '';
              f.onIOPub = (m) => {
                if (m.header.msg_type === 'stream') out += m.content.text;
                if (m.header.msg_type === 'error') out += 'ERROR ' + m.content.ename + ': ' + m.content.evalue;
              };
              await f.done;
              return out;
            }""",
            code,
        )

    def shot(self, locator: Any, name: str) -> str:
        os.makedirs(ARTIFACTS, exist_ok=True)
        path = os.path.join(ARTIFACTS, name)
        locator.screenshot(path=path)
        return path

    def close_page(self, page: Any) -> None:
        try:
            page.evaluate(
                "async () => { const w = window.jupyterapp.shell.currentWidget; await w.sessionContext.shutdown(); }"
            )
        except Exception:  # noqa: BLE001 - the page may be gone already
            pass
        page.close()

    def close(self) -> None:
        for step in (lambda: self.browser.close(), lambda: self._pw.stop()):
            try:
                step()
            except Exception:  # noqa: BLE001
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
