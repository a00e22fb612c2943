"""Files read from a user's path (issue 28): a FIFO, a device or an oversize file is refused, never waited on.

A reader blocked on a FIFO may hold the GIL (safetensors opens files in Rust), so no Python thread could time it
out: each call that meets a FIFO runs beside a shell started first, which after a generous 60 s opens each FIFO's
write end and closes it again, letting a stuck reader go (it then reads an empty file). A call that needed that
fails the test instead of hanging the run; the assertion is that it raised an IELabError naming the file, not how
fast. Oversize files are sparse: no disk is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import save_file

import ie_lab
from ie_lab.address import Address
from ie_lab.core.projection_args import make_encoder
from ie_lab.sae import load_sae

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")

D, N = 8, 16


def _guarded(fn, fifos=()):
    """(fn's value, its exception), failing the test if it blocked on one of the FIFOs until the waker let it go."""
    waker = None
    if fifos:
        script = 'sleep 60; for f; do exec 3<>"$f"; exec 3>&-; done'  # read-write: opening never blocks
        waker = subprocess.Popen(["sh", "-c", script, "sh", *map(str, fifos)], start_new_session=True)
    value = error = None
    try:
        value = fn()
    except BaseException as e:  # noqa: BLE001 - examined by the caller
        error = e
    finally:
        if waker is not None:
            woke = waker.poll() is not None
            if not woke:
                os.killpg(waker.pid, signal.SIGKILL)  # its own group: the shell and its sleep
            waker.wait()
            if woke:
                pytest.fail(f"the call blocked on a FIFO instead of refusing it (then raised {error!r})")
    return value, error


def _refused(fn, fifos=(), fragment=""):
    """fn()'s IELabError, asserting one was raised and that it names `fragment`."""
    value, err = _guarded(fn, fifos)
    assert isinstance(err, ie_lab.IELabError), f"expected an IELabError, got {err!r} / {value!r}"
    assert fragment in str(err), str(err)
    return err


def _sae_folder(folder) -> str:
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    w = {"W_enc": torch.randn(D, N, generator=g), "b_enc": torch.zeros(N), "W_dec": torch.randn(N, D, generator=g)}
    save_file(w, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"architecture": "standard", "hook_name": "blocks.0.hook_resid_post"}))
    return str(folder)


def _fifo_at(path) -> str:
    os.remove(path)
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("name", ["sae_weights.safetensors", "cfg.json"])
def test_a_fifo_in_place_of_an_sae_file_is_refused(tmp_path, name):
    folder = _sae_folder(tmp_path / "sae")
    assert load_sae(folder).d_sae == N  # the folder as written loads
    fifo = _fifo_at(tmp_path / "sae" / name)
    err = _refused(lambda: load_sae(folder), [fifo], name)
    assert "FIFO" in str(err) and "regular file" in str(err)


def test_a_fifo_or_a_device_passed_as_the_sae_file_is_refused(tmp_path):
    fifo = str(tmp_path / "sae.safetensors")
    os.mkfifo(fifo)
    _refused(lambda: load_sae(fifo), [fifo], "FIFO")
    if os.path.exists("/dev/zero"):
        link = tmp_path / "zero.safetensors"
        link.symlink_to("/dev/zero")  # a link is followed: what it names must be a regular file
        _refused(lambda: load_sae(str(link)), (), "character device")


def test_oversize_sae_files_are_refused_before_they_are_read(tmp_path):
    from ie_lab.core.files import LIMITS

    folder = _sae_folder(tmp_path / "sae")
    cfg = tmp_path / "sae" / "cfg.json"
    with open(cfg, "r+b") as f:
        f.truncate(LIMITS["json"] + 1)  # sparse
    _refused(lambda: load_sae(folder), (), "cfg.json")
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(LIMITS["tensors"] + 1)
    err = _refused(lambda: load_sae(str(big)), (), "big.safetensors")
    assert "GiB" in str(err)


def test_directions_and_steering_vectors_from_a_fifo_are_refused(tmp_path):
    fifo = str(tmp_path / "directions.safetensors")
    os.mkfifo(fifo)
    _refused(lambda: make_encoder(D, fifo), [fifo], "directions.safetensors")
    from ie_lab.widgets.steering_vector import load_vector as _load_vector

    for name in ("vector.pt", "vector.npy"):
        f = str(tmp_path / name)
        os.mkfifo(f)
        _refused(lambda f=f: _load_vector(f, Address("resid_post", 0)), [f], name)


def test_a_model_folder_with_a_fifo_for_a_file_is_refused(tmp_path):
    from ie_lab.toy import tiny_model

    m, t = tiny_model("llama")
    folder = tmp_path / "model"
    m.save_pretrained(folder)
    t.save_pretrained(folder)
    for name in ("tokenizer_config.json", "config.json"):
        fifo = _fifo_at(folder / name)
        _refused(lambda: ie_lab.load(str(folder), quiet=True), [fifo], name)
        _refused(lambda: ie_lab.load(m, tokenizer=str(folder), quiet=True), [fifo], name)
        os.remove(fifo)
        (folder / name).write_text("{}")


def test_a_fifo_as_the_servers_tokens_file_is_refused_at_start_and_revokes_when_running(tmp_path, capsys):
    from ie_lab.remote.server_tokens import Tokens

    fifo = str(tmp_path / "tokens")
    os.mkfifo(fifo)
    _refused(lambda: Tokens(fifo), [fifo], "FIFO")  # at start: `ie-lab serve` refuses, naming the file
    os.remove(fifo)
    good = "alice " + "a" * 32 + "\n"
    (tmp_path / "tokens").write_text(good)
    tokens, err = _guarded(lambda: Tokens(fifo))
    assert err is None and tokens.user("Bearer " + "a" * 32) == "alice"
    os.remove(fifo)
    os.mkfifo(fifo)  # a running server's file replaced by a FIFO: every file token revoked, nothing blocks
    user, err = _guarded(lambda: tokens.user("Bearer " + "a" * 32), [fifo])
    assert err is None and user is None
    assert "FIFO" in capsys.readouterr().err
