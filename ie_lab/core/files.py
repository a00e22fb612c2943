"""Files opened from a path a user gave: only a regular file of a bounded size is opened.

A FIFO, a socket or a device where a weights or config file should be would block the process in open() or read
(a FIFO nobody writes to), or never end (/dev/zero); a file far larger than its kind ever is would fill memory. So
every reader of a user's path (load_sae, load()'s folder and its JSON files, directions and steering vectors read
from files) asks `checked_file` first, and JSON is read through `read_json`, which opens without blocking and checks
the very file it opened. Each refusal is an InputError naming the file and what to pass instead.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from ..errors import InputError

MiB = 2**20
GiB = 2**30

# The largest file of each kind ie_lab opens: far above any real one (the largest tokenizer.json files on the hub are
# tens of MiB; the largest SAEs tens of GiB), far below what would exhaust a machine's memory or disk in one read.
LIMITS = {
    "json": 256 * MiB,  # config.json, cfg.json, tokenizer_config.json, tokenizer.json, ...
    "tensors": 256 * GiB,  # an SAE's weights, a file of projection directions
    "vector": 1 * GiB,  # a steering vector saved with torch.save or numpy.save
    "text": 16 * MiB,  # ie-lab serve's tokens file
}

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


def _size(n: int) -> str:
    return f"{n / GiB:.3g} GiB" if n >= GiB else f"{n / MiB:.3g} MiB" if n >= MiB else f"{n} bytes"


def _check(st: os.stat_result, path: str, what: str, kind: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        it = next((name for test, name in _KINDS if test(st.st_mode)), "something other than a file")
        raise InputError(
            f"{what} {path!r} is {it}, not a regular file: ie_lab opens only regular files (a pipe or a device "
            "would block or never end). Put the file itself at that path (copy it there) and pass it again."
        )
    limit = LIMITS[kind]
    if st.st_size > limit:
        raise InputError(
            f"{what} {path!r} is {_size(st.st_size)} ({st.st_size:,} bytes), more than the {_size(limit)} any such "
            f"file is: it is not the file meant (check the path), or raise ie_lab.core.files.LIMITS[{kind!r}] if it "
            "really is."
        )


def checked_file(path: str | os.PathLike, what: str, kind: str = "tensors") -> str:
    """The path, once it is known to name a regular file (symbolic links followed) of at most LIMITS[kind] bytes;
    else an InputError naming it: missing, unreadable, a FIFO, socket, device or folder, or too large."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError(f"{what} {p!r}: no such file; check the path.") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, a NUL in it
        raise InputError(f"{what} {p!r} cannot be read ({e}); check the path and its permissions.") from None
    _check(st, p, what, kind)
    return p


def special_file(path: str | os.PathLike) -> bool:
    """Whether the path names something that is neither a regular file nor a folder (a FIFO, socket or device), a
    link to one included; a path that is missing or cannot be read is not (its reader reports it)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def read_bytes(path: str | os.PathLike, what: str, kind: str = "json") -> bytes:
    """A file's bytes. Opened without blocking (a FIFO is refused, never waited on) and checked on the open file
    itself, so what is read is the file that was checked."""
    p = os.fspath(path)
    checked_file(p, what, kind)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InputError(f"{what} {p!r} cannot be read ({e}); check the path and its permissions.") from None
    with os.fdopen(fd, "rb") as f:
        _check(os.fstat(f.fileno()), p, what, kind)  # the file opened, should the path have changed meanwhile
        return f.read(LIMITS[kind] + 1)


def read_json(path: str | os.PathLike, what: str) -> Any:
    """A JSON file's content, read as `read_bytes` does; invalid JSON (or JSON nested too deeply for the parser) is
    an InputError naming the file."""
    data = read_bytes(path, what, "json")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(
            f"{what} {os.fspath(path)!r} is not valid JSON ({e}); replace it with the file as it was saved."
        ) from None
    except RecursionError:  # '[[[[...' thousands deep: valid JSON no config is, and json's parser recurses on it
        raise InputError(
            f"{what} {os.fspath(path)!r} nests its lists or objects too deeply to read; no config does: replace it "
            "with the file as it was saved."
        ) from None


def check_folder(folder: str | os.PathLike, what: str) -> None:
    """Refuse a folder whose entries include a FIFO, socket or device (a link to one too): a library reading the
    folder's files (transformers' from_pretrained) would block on it or never finish."""
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if special_file(path):
            checked_file(path, f"{what} file", "json")  # raises, naming the file and what it is
