"""The `ie-lab` command. Run as a user runs it (a subprocess of `python -m ie_lab.cli`, `python -m ie_lab` or the
console script in this venv's bin/) where the process is what is tested: --version, --help, doctor, `lab`'s server,
one `points` table, and what --help and a usage error import. The other runs (refusals, model types, folders, vLLM)
call ie_lab.cli.main in this process (`cli` below): the same exit code and the same stdout and stderr, without a
new interpreter importing torch and transformers for each. Each answer is checked against the code it reports on
(the registry, a Session's own points, the installed versions), so a table that drifts from the binding fails here.

docs/CLI.md's ```console blocks run here too: each `$ ie-lab ...` line is executed and the output lines shown under
it must appear in order ("..." stands for lines left out).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

import ie_lab
from ie_lab import points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(os.path.dirname(sys.executable), "ie-lab")
HANG_S = 300  # only turns a hang into a failure
# A row of the cheat sheet: address, shape, eager, vLLM.
ROW = re.compile(r"^(\S+)\s+(\[[^\]]*\])\s+(yes|no)\s+(yes|no)\s*$")


def _env() -> dict[str, str]:
    # Offline, as the command promises: a download attempt fails the run instead of passing slowly.
    env = {k: v for k, v in os.environ.items() if k not in ("IE_LAB_TOKEN", "JUPYTER_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def run(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    cmd = [SCRIPT, *args] if script else [sys.executable, "-m", "ie_lab.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_S)


@pytest.fixture()
def cli(capfd, monkeypatch):
    """`ie-lab ARGS` in this process (ie_lab.cli.main) as run() gives it: offline, the exit code `sys.exit(main())`
    would give (argparse's SystemExit included), and what reached stdout and stderr (file descriptors included)."""
    import huggingface_hub.constants

    from ie_lab.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at its import

    def call(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # what the interpreter does with sys.exit("text")
                print(e.code, file=sys.stderr)
                code = 1
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["ie-lab", *args], code, out, err)

    return call


def sheet(out: str) -> tuple[dict[str, tuple[str, bool, bool]], str]:
    """({address: (shape, eager, vLLM)}, the "Not served here" section) of a cheat sheet."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = (m.group(2), m.group(3) == "yes", m.group(4) == "yes")
    rest = out.split("Not served here:", 1)[1] if "Not served here:" in out else ""
    return rows, rest


def named(section: str) -> set[str]:
    """Points the "Not served here" section names as absent from the model: entries without " on eager" or
    " on vLLM" (those name points one backend refuses while the table lists them)."""
    found = set()
    for entry in re.split(r"\n  (?! )", "\n" + section):
        head = " ".join(entry.split()).split(":", 1)[0]
        if head.endswith((" on eager", " on vLLM")):
            continue
        found |= {part.strip() for part in head.split(",")} & set(points.NAMES)
    return found


def check_sheet(out: str, session) -> dict[str, tuple[str, bool, bool]]:
    """The table lists exactly the addresses the session serves; every other registry point is named as absent."""
    table = session.points()
    served = {r.example for r in table.rows if r.served}
    rows, rest = sheet(out)
    assert set(rows) == served, (sorted(set(rows) - served), sorted(served - set(rows)))
    assert all(eager for _, eager, _ in rows.values())
    by_example = {r.example: r.name for r in table.rows}
    listed, absent = {by_example[a] for a in rows}, named(rest)
    assert not listed & absent, sorted(listed & absent)
    assert listed | absent == set(points.NAMES), sorted(set(points.NAMES) - listed - absent)
    return rows


@pytest.fixture(scope="module")
def demo_session():
    s = ie_lab.Session(ie_lab.DEMO_MODEL, backend="eager", device="cpu", progress=False, replace=False)
    yield s
    s.close()


def test_points_demo_lists_what_the_demo_session_serves(demo_session):
    r = run("points", "demo")
    assert r.returncode == 0, r.stderr
    rows = check_sheet(r.stdout, demo_session)
    f = demo_session.facts
    L = f.n_layers // 2
    # the shapes are the real tensors'
    cache = demo_session.capture("When Mary and John went to the store", [f"resid_post.{L}", f"z.{L}", f"mlp_act.{L}"])
    assert rows[f"resid_post.{L}"][0] == f"[batch, seq, {cache[f'resid_post.{L}'].shape[-1]}]"
    assert rows[f"z.{L}"][0] == f"[batch, seq, {cache[f'z.{L}'].shape[-1]} = {f.n_heads} x {f.head_dim}]"
    assert rows[f"mlp_act.{L}"][0] == f"[batch, seq, {cache[f'mlp_act.{L}'].shape[-1]}]"
    assert rows[f"attn_probs.{L}"][0] == f"[batch, {f.n_heads}, seq, seq]"
    # vLLM column: the demo family is verified on vLLM, so it is the registry's vLLM verdict on the served points
    on_vllm = {a for a, (_, _, v) in rows.items() if v}
    names = {r.example: r.name for r in demo_session.points().rows}
    assert on_vllm == {a for a in rows if names[a] in points.served("vllm")}
    assert "lm_head" in rows and not rows["lm_head"][2]  # eager only
    assert "demo_model" in r.stdout.splitlines()[0] and "llama" in r.stdout
    assert "no QK-norm" in r.stdout  # the binding's reason for the q/k-norm points
    assert "ie_lab:" not in r.stdout  # the load line goes to stderr, the table alone to stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("model", ["demo", "qwen3"])
def test_points_backend_vllm_asks_a_vllm_session_and_matches_the_expected_column(model, cli, monkeypatch):
    """--backend vllm starts a real vLLM session (a saved tiny instance for a model type); its verdicts equal the
    column the default run expects from the registry and the binding. In this process, with its in-process engine
    (tests/conftest.py), as the other vLLM tests: a subprocess per run imported torch, transformers and vLLM again."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))  # the command sets it
    r = cli("points", model)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "expected from the registry" in r.stdout
    expected, _ = sheet(r.stdout)
    r = cli("points", model, "--backend", "vllm")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a vLLM session's verdict" in r.stdout
    rows, _ = sheet(r.stdout)
    assert rows == expected
    assert any(v for _, _, v in rows.values()) and not all(v for _, _, v in rows.values())  # lm_head: eager only


def test_points_on_a_model_type_builds_a_tiny_instance(cli):
    from ie_lab.coverage import build_tiny
    from ie_lab.toy import tokenizer

    r = cli("points", "llama")
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[0]
    assert "tiny random-weight LlamaForCausalLM" in head and "no download" in head
    s = ie_lab.Session(
        build_tiny("llama"), tokenizer=tokenizer(), backend="eager", device="cpu", progress=False, replace=False
    )
    try:
        rows = check_sheet(r.stdout, s)
        assert rows[f"resid_post.{s.facts.n_layers // 2}"][0] == f"[batch, seq, {s.facts.d_model}]"
    finally:
        s.close()


def test_points_on_an_moe_family_and_an_unverified_one(cli):
    r = cli("points", "mixtral")
    assert r.returncode == 0, r.stderr
    rows, rest = sheet(r.stdout)
    assert rows["router_logits.1"] == ("[batch, seq, 4]", True, True)
    assert rows["expert_weights.1"][1:] == (True, False)  # eager reads it; vLLM's fused kernel never builds it
    assert "mlp_act.1" not in rows and "mlp_act" in named(rest)
    r = cli("points", "gpt_neox")  # bound on eager, not verified on vLLM
    assert r.returncode == 0, r.stderr
    rows, rest = sheet(r.stdout)
    assert rows and all(e and not v for _, e, v in rows.values())
    assert "every point on vLLM: gpt_neox is not among the families verified on vLLM" in " ".join(rest.split())
    assert "resid_mid" in named(rest)  # a parallel block


def test_a_local_folder(tmp_path, cli):
    from ie_lab.toy import tiny_model

    model, tok = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    r = cli("points", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows, _ = sheet(r.stdout)
    assert rows["q_norm_in.1"][1:] == (True, True)  # Qwen 3 has QK-norm
    assert str(tmp_path) in r.stdout.splitlines()[0]


@pytest.mark.parametrize(
    "name, hint",
    [
        ("lama", "'llama'"),
        ("Llama", "'llama'"),
        ("dem", "'demo'"),
        ("org/model", "hf download"),
        ("./no/such/folder", "hf download"),
        ("t5", "no causal-LM class"),
    ],
)
def test_an_unknown_name_exits_2_with_the_fix(name, hint, cli):
    r = cli("points", name)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert hint in r.stderr and r.stdout == ""
    assert "Traceback" not in r.stderr


def _unbuildable() -> str:
    """A model type whose config will not build small in this transformers (the survey records it as untested)."""
    import json

    from ie_lab import coverage

    path = coverage.data_path(coverage.installed_version())
    if not os.path.exists(path):
        pytest.skip(f"no family survey for this transformers ({path})")
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    found = [r["model_type"] for r in rows if r["status"] == "untested" and "ValueError" in r["reason"]]
    if not found:
        pytest.skip("every family builds a tiny instance in this transformers")
    return found[0]


def test_a_refused_family_exits_1_with_the_reason(cli):
    r = cli("points", "openai-gpt")  # (mamba and rwkv bind since issue 20: their mixer layers have points)
    assert r.returncode == 1 and "post-norm" in r.stderr and "Traceback" not in r.stderr
    r = cli("points", _unbuildable())
    assert r.returncode == 1 and "no tiny instance" in r.stderr and "Instead:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_doctor_reports_this_environment():
    import torch
    import transformers

    r = run("doctor", script=True)
    assert r.returncode == 0, r.stderr
    # "  key   value": keys may hold spaces ("vllm graph mode"), two or more spaces end them
    lines = dict(
        re.match(r"^  (\S+(?: \S+)*) {2,}(.*)$", ln).groups() for ln in r.stdout.splitlines() if ln.startswith("  ")
    )
    assert lines["torch"] == torch.__version__
    assert lines["transformers"] == transformers.__version__
    assert lines["ie_lab"].split()[0] == ie_lab.__version__
    assert lines["python"].split()[0] == ".".join(map(str, sys.version_info[:3]))
    assert lines["eager"].startswith("yes")
    if importlib.util.find_spec("vllm") is None:
        assert lines["vllm"].startswith("not installed") and "Fix:" in r.stdout
    else:
        assert not lines["vllm"].startswith("not installed")
    for key in ("anywidget", "jupyterlab", "cpu", "mps", "ie_lab.Session()", "vllm graph mode", "vllm tensor parallel"):
        assert key in lines, key
    if torch.cuda.is_available():
        assert lines["cuda:0"].startswith(torch.cuda.get_device_name(0))
    else:
        assert "not available" in lines["cuda"] and "Fix:" in lines["cuda"]


def test_version_and_help():
    r = run("--version", script=True)
    assert r.returncode == 0 and r.stdout.strip() == f"ie_lab {ie_lab.__version__}"
    r = run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("lab", "points", "doctor"))
    r = run("lab", "--help")
    assert r.returncode == 0 and "--port" in r.stdout and "JUPYTER_TOKEN" in r.stdout
    r = run("points", "--help")
    assert r.returncode == 0 and "MODEL_OR_FAMILY" in r.stdout and "--backend" in r.stdout
    r = run("doctor", "--help")
    assert r.returncode == 0 and "exits 0" in r.stdout
    r = run("doctor", "--bogus")
    assert r.returncode == 2 and "--bogus" in r.stderr
    r = run("lab", "--port", "0")
    assert r.returncode == 2 and "port" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "ie_lab", "--version"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 0 and r.stdout.strip() == f"ie_lab {ie_lab.__version__}"


HEAVY = {"torch", "transformers", "vllm", "fastapi", "uvicorn"}
# What needs no model, with the exit code it must give (2: a command line that cannot work as written).
NO_MODEL = [
    (["--help"], 0),
    (["--version"], 0),
    (["lab", "--help"], 0),
    (["points", "--help"], 0),
    (["doctor", "--help"], 0),
    (["serve", "--help"], 0),
    ([], 2),
    (["bogus"], 2),
    (["doctor", "--bogus"], 2),
    (["lab", "--port", "0"], 2),
    (["points"], 2),
    (["points", "demo", "--backend", "tpu"], 2),
    (["serve"], 2),
    (["serve", "demo", "--port", "x"], 2),
]


def test_help_version_and_usage_errors_import_no_torch():
    """The command line is built and checked before torch, transformers or vLLM load (issue 29: `ie-lab --help`
    took 1.6x the time of importing torch): ie_lab.cli.main on each line of NO_MODEL in one fresh interpreter, and
    `python -m ie_lab --help` as a user runs it, its imports listed by -X importtime."""
    code = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from ie_lab.cli import main
        codes = []
        for argv in json.loads(sys.argv[1]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    codes.append(main(argv))
                except SystemExit as e:
                    codes.append(e.code or 0)
        print(json.dumps({"codes": codes, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
        """
    )
    import json

    lines = json.dumps([argv for argv, _ in NO_MODEL])
    r = subprocess.run(
        [sys.executable, "-c", code, lines], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_S
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert dict(zip(map(" ".join, (a for a, _ in NO_MODEL)), got["codes"])) == {" ".join(a): c for a, c in NO_MODEL}
    assert "ie_lab" in got["modules"] and not HEAVY & set(got["modules"]), sorted(HEAVY & set(got["modules"]))

    # `ie-lab points` with no model answers with the usage line (exit 2) from the command's own module, which the
    # command line imports: no more than --help.
    for argv, code, shown in ((["--help"], 0, "points"), (["points"], 2, "ie-lab points --list")):
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "ie_lab", *argv],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert r.returncode == code and shown in r.stdout + r.stderr, r.stderr[-3000:]
        imported = {ln.rsplit("|", 1)[1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        assert {"ie_lab.cli", "ie_lab.cli_points"} <= imported  # -X importtime listed the imports
        heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
        assert not heavy, (argv, heavy)


# ---- lab: a real server ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, token: str | None) -> int:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@pytest.mark.skipif(
    not os.path.isdir("/proc/self") or importlib.util.find_spec("jupyterlab") is None,
    reason="needs Linux /proc and JupyterLab in this environment",
)
def test_lab_passes_jupyter_arguments_and_keeps_the_token_off_the_command_line(tmp_path):
    port, token = _free_port(), "ab" * 16
    env = _env()
    env.update(
        IE_LAB_TOKEN=token,
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
    )
    log = tmp_path / "lab.log"
    with open(log, "wb") as f:
        # --ServerApp.base_url is JupyterLab's, passed through untouched
        proc = subprocess.Popen(
            [SCRIPT, "lab", "--port", str(port), "--ServerApp.base_url=/ie/"],
            cwd=str(tmp_path),
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/ie/api/status"
    try:
        end = time.monotonic() + HANG_S
        while _status(url, token) != 200:
            assert proc.poll() is None, f"ie-lab lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < end, f"ie-lab lab did not answer:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        # The printed URL opens the quickstart under the base URL given (a bare /lab would open the Launcher).
        printed = f"http://127.0.0.1:{port}/ie/lab/tree/notebooks/01_quickstart.ipynb?token={token}"
        assert f"JupyterLab: {printed}\n" in log.read_text()
        with urllib.request.urlopen(printed, timeout=30) as r:
            page = r.read().decode()
        config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
        assert config is not None and json.loads(config.group(1))["treePath"] == "notebooks/01_quickstart.ipynb"
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        assert b"jupyterlab" in cmdline and token.encode() not in cmdline  # exec'd, token in the environment only
        assert f"--ServerApp.root_dir={ROOT}".encode() in cmdline  # a checkout serves the repository
        assert b"01_quickstart.ipynb" in cmdline
        assert _status(url, None) == 403 and _status(url, "0" * len(token)) == 403
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


def test_lab_serves_the_current_folder_outside_a_checkout(tmp_path, monkeypatch):
    from ie_lab import cli

    # What an installed wheel sees: no repository around the package.
    monkeypatch.setattr(cli, "_checkout", lambda: None)
    monkeypatch.chdir(tmp_path)
    argv, env, url = cli.lab_command(8899, ["--foo=1"], {"IE_LAB_TOKEN": "t0k", "PATH": "/bin"})
    assert f"--ServerApp.root_dir={tmp_path}" in argv and not any(a.endswith(".ipynb") for a in argv)
    assert argv[-1] == "--foo=1" and "--port=8899" in argv and not any("t0k" in a for a in argv)
    assert env == {"JUPYTER_TOKEN": "t0k", "PATH": "/bin"} and url.endswith("token=t0k")
    argv, _, _ = cli.lab_command(8899, ["--ServerApp.root_dir=/srv"], {})
    assert [a for a in argv if "root_dir" in a] == ["--ServerApp.root_dir=/srv"]


# ---- docs/CLI.md ----------------------------------------------------------------------------------------------

CONSOLE = re.compile(r"```console\n(.*?)```", re.S)


def _doc_commands() -> list[tuple[list[str], list[str]]]:
    with open(os.path.join(ROOT, "docs", "CLI.md"), encoding="utf-8") as f:
        text = f.read()
    out: list[tuple[list[str], list[str]]] = []
    for block in CONSOLE.findall(text):
        for line in block.splitlines():
            if line.startswith("$ ie-lab"):
                out.append((line[len("$ ie-lab") :].split(), []))
            elif out:
                out[-1][1].append(line.rstrip())
    return out


@pytest.mark.parametrize("args, shown", _doc_commands(), ids=[" ".join(a) for a, _ in _doc_commands()])
def test_docs_console_examples_are_what_the_command_prints(args, shown, cli):
    r = cli(*args)
    actual = [ln.rstrip() for ln in (r.stdout + r.stderr).splitlines()]
    i = 0
    for want in (w for w in shown if w and w != "..."):
        while i < len(actual) and actual[i] != want:
            i += 1
        assert i < len(actual), f"`ie-lab {' '.join(args)}` no longer prints (in this order):\n{want}\n\n" + "\n".join(
            actual
        )
        i += 1
