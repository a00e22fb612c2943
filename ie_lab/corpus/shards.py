"""The on-disk format of a harvest (docs/HARVEST.md): safetensors shards and the manifest that commits them.

A shard is a plain safetensors file (an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes), written here without the safetensors package so the rows of a batch
go to disk as they are, and read back through numpy.memmap at the header's offsets (nothing is loaded until a row
is indexed). Each shard holds whole prompts: `token_ids`, `prompt_ids`, `positions` (one per row) and one
[rows, width] tensor per address, named `act:<address>`.

A shard exists for a reader only once the manifest names it. The writer puts the shard in place first (a temporary
name, fsync, os.replace), then the manifest (likewise): a process killed anywhere leaves either the old manifest
(the new shard is a stray, deleted when the harvest resumes) or the new one (the shard is whole).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "ie_lab.harvest"
VERSION = 1
SHARD_GLOB = "shard-*.safetensors"

# safetensors dtype names <-> the numpy dtype the bytes are read as (bfloat16 has none: its 16 bits are read as
# uint16 and viewed as torch.bfloat16 by the reader)
NUMPY_OF = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32, "I64": np.int64}
SAFETENSORS_OF = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "int64": "I64"}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _fsync_replace(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    try:  # the rename itself durable on POSIX (a directory fsync); Windows has no such call, and needs none
        fd = os.open(final.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_shard(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], list[np.ndarray]]]) -> None:
    """Write one safetensors file at `path` (through a temporary name). tensors: name -> (safetensors dtype, shape,
    the arrays whose bytes, in order, make the tensor: the batches' rows, written without joining them first)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, parts) in tensors.items():
        n = sum(p.nbytes for p in parts)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for _, _, parts in tensors.values():
            for p in parts:
                f.write(np.ascontiguousarray(p).data)
        f.flush()
        os.fsync(f.fileno())
    _fsync_replace(tmp, path)


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(where the data starts, the header) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def memmap(path: Path, start: int, entry: dict[str, Any]) -> np.ndarray:
    """One tensor of a shard as a read-only numpy memmap at its byte range (no byte is read yet)."""
    lo, hi = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if hi == lo:
        return np.zeros(shape, dtype=NUMPY_OF[entry["dtype"]])
    return np.memmap(path, dtype=NUMPY_OF[entry["dtype"]], mode="r", offset=start + lo, shape=shape)


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / MANIFEST
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_replace(tmp, out_dir / MANIFEST)


def discard_strays(out_dir: Path, manifest: dict[str, Any] | None) -> list[str]:
    """Delete the shards no manifest entry names and every temporary file a killed writer left; their names."""
    kept = {s["file"] for s in (manifest or {}).get("shards", [])}
    gone = []
    for p in [*out_dir.glob(SHARD_GLOB), *out_dir.glob("shard-*.safetensors.tmp"), out_dir / (MANIFEST + ".tmp")]:
        if p.exists() and p.name not in kept:
            p.unlink()
            gone.append(p.name)
    return gone
