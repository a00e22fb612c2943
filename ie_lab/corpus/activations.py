"""Activations: a harvest read back memory-mapped (docs/HARVEST.md), one directory or several as one.

`acts[address]` is a Rows: a [rows, width] view over every shard that reads only the rows it is indexed with
(`acts[address][acts.rows_of(i)]`, `acts[address][:, feature]`, `acts[address][idx]`); `.chunks()` walks it shard by
shard, each a tensor over the memory map (zero-copy). The per-row facts (`token_ids`, `prompt_ids`, `positions`)
are small and read whole on first use. Several directories read as one: their rows follow each other in the order
given, and a later directory's prompt ids are shifted past the earlier ones' (prompt i of the second of two runs of
100 prompts is prompt 100 + i), so prompt ids stay unique.
"""

from __future__ import annotations

import bisect
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from . import shards as S

_TORCH_OF = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "I64": torch.int64}


def _as_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: torch warns that writing would be undefined
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.asarray(a))
    return t.view(torch.bfloat16) if dtype == "BF16" else t


class _Shard:
    def __init__(self, path: Path, rows: int, first_prompt: int, shift: int):
        self.path, self.rows, self.first_prompt, self.shift = path, rows, first_prompt, shift
        self.start, self.header = S.read_header(path)

    def array(self, name: str) -> np.ndarray:
        return S.memmap(self.path, self.start, self.header[name])


def row_index(key: Any, n: int) -> np.ndarray:
    """The rows a key names (an int, a slice, a range, an index list or tensor, a bool mask), as an array."""
    if isinstance(key, (int, np.integer)):
        if not -n <= key < n:
            raise IndexError(f"row {key} is out of range for {n} rows.")
        return np.array([key % n])
    if isinstance(key, range):
        key = slice(key.start, key.stop, key.step)
    if isinstance(key, slice):
        return np.arange(n)[key]
    a = key.cpu().numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    if a.dtype == bool:
        if a.shape != (n,):
            raise IndexError(f"a boolean row mask must have {n} entries, got shape {a.shape}.")
        return np.flatnonzero(a)
    a = a.astype(np.int64).reshape(-1)
    if a.size and (a.min() < -n or a.max() >= n):
        raise IndexError(f"a row index is out of range for {n} rows.")
    return a % n if a.size else a


class Rows:
    """One address's rows across every shard: shape [rows, width], indexed like a tensor, read only where
    indexed. rows[i], rows[a:b], rows[index tensor or bool mask], rows[rows_sel, cols_sel] give torch tensors."""

    def __init__(self, acts: Activations, address: str):
        self._acts, self.address = acts, address
        self.width = acts.widths[address]
        self.shape = (len(acts), self.width)
        self._dtype = acts._st_dtype

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_OF[self._dtype]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Rows({self.address!r}, shape={list(self.shape)}, dtype={self.dtype}, memory-mapped)"

    def chunks(self):
        """(first row, tensor over that shard's rows), shard by shard: each tensor views the memory map."""
        for base, sh in zip(self._acts._bases, self._acts._shards):
            yield base, _as_torch(sh.array(f"act:{self.address}"), self._dtype)

    def __getitem__(self, key: Any) -> torch.Tensor:
        cols: Any = slice(None)
        if isinstance(key, tuple):
            if len(key) != 2:
                raise IndexError(f"{self.address} has two axes (rows, width); got {len(key)} indices.")
            key, cols = key
        idx = row_index(key, self.shape[0])
        out = np.empty((len(idx), self.width), dtype=S.NUMPY_OF[self._dtype])
        bases = self._acts._bases
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        for k, sh in enumerate(self._acts._shards):
            lo = np.searchsorted(sorted_idx, bases[k], "left")
            hi = np.searchsorted(sorted_idx, bases[k] + sh.rows, "left")
            if hi > lo:
                local = sorted_idx[lo:hi] - bases[k]
                mm = sh.array(f"act:{self.address}")
                if local[-1] - local[0] + 1 == len(local):  # a run of rows: one contiguous read
                    out[order[lo:hi]] = mm[local[0] : local[-1] + 1]
                else:
                    out[order[lo:hi]] = mm[local]
        t = _as_torch(out, self._dtype)
        t = t[:, cols]
        return t[0] if isinstance(key, (int, np.integer)) else t

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self[:].float().numpy() if self._dtype == "BF16" else self[:].numpy()
        return a.astype(dtype) if dtype is not None else a


class Activations:
    """A harvest on disk (ie_lab.harvest / s.harvest), read memory-mapped. Activations(out_dir) or
    Activations([dir1, dir2]) (several runs read as one, rows in that order)."""

    def __init__(self, out_dirs: Any):
        dirs = [out_dirs] if isinstance(out_dirs, (str, Path)) else list(out_dirs)
        if not dirs:
            raise InputError("Activations() needs a harvest directory (or a list of them).")
        self.dirs = [Path(d) for d in dirs]
        self.manifests = []
        for d in self.dirs:
            m = S.read_manifest(d)
            if m is None or m.get("format") != S.FORMAT:
                raise InputError(
                    f"{d} holds no harvest (no {S.MANIFEST} of ie_lab's format): give the out_dir a harvest wrote to."
                )
            self.manifests.append(m)
        first = self.manifests[0]
        for d, m in zip(self.dirs[1:], self.manifests[1:]):
            for key in ("addresses", "widths", "dtype", "sae"):  # sae: the features' and top-k's meaning
                if m.get(key) != first.get(key):
                    raise InputError(
                        f"{d} differs from {self.dirs[0]} in {key} ({m.get(key)} vs {first.get(key)}): only "
                        "harvests of the same points, dtype and SAE read as one; open them as separate Activations."
                    )
        self.addresses: list[str] = list(first["addresses"])
        self.widths: dict[str, int] = dict(first.get("widths") or {})
        self._st_dtype = S.SAFETENSORS_OF.get(first["dtype"], "F32")
        self._shards: list[_Shard] = []
        self._bases: list[int] = []
        rows = shift = 0
        for d, m in zip(self.dirs, self.manifests):
            for s in m["shards"]:
                self._bases.append(rows)
                self._shards.append(_Shard(d / s["file"], s["rows"], s["prompts"][0], shift))
                rows += s["rows"]
            shift += m["prompts_done"]
        self._rows = rows
        self.n_prompts = shift

    @property
    def manifest(self) -> dict[str, Any]:
        """The first directory's manifest (model, tokenizer, addresses, widths, dtype, shards)."""
        return self.manifests[0]

    def __len__(self) -> int:
        return self._rows

    def __repr__(self) -> str:
        where = str(self.dirs[0]) if len(self.dirs) == 1 else f"{len(self.dirs)} directories"
        return (
            f"Activations({where}: {self.n_prompts} prompts, {len(self)} rows, "
            f"{', '.join(f'{a} [{self.widths.get(a)}]' for a in self.addresses)}, {self.manifest['dtype']})"
        )

    def __contains__(self, address: Any) -> bool:
        return str(address) in self.addresses

    def __getitem__(self, address: Any) -> Rows:
        a = str(address)
        if a not in self.addresses:
            raise InputError(f"{a} was not harvested here; this harvest holds {', '.join(self.addresses)}.")
        return Rows(self, a)

    def _column(self, name: str) -> torch.Tensor:
        parts = []
        for sh in self._shards:
            t = torch.from_numpy(np.array(sh.array(name), dtype=np.int64))
            parts.append(t + sh.shift if name == "prompt_ids" else t)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    # ---- SAE features (a harvest with sae=) ---------------------------------------------------------------
    @property
    def sae(self) -> dict[str, Any] | None:
        """What the features were encoded with (address, d_sae, activation, top_k, hash), or None."""
        return self.manifest.get("sae")

    def _need_sae(self) -> dict[str, Any]:
        if self.sae is None:
            raise InputError("this harvest kept no SAE features: harvest again with sae=ie_lab.load_sae(...).")
        return self.sae

    def features(self, rows: Any) -> torch.Tensor:
        """The SAE's feature activations of `rows` (an index, a slice, a range such as rows_of(i), or an index
        list), dense float32 [len(rows), d_sae], rebuilt from the sparse shards."""
        d_sae = self._need_sae()["d_sae"]
        idx = row_index(rows, len(self))
        out = torch.zeros((len(idx), d_sae))
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        for base, sh in zip(self._bases, self._shards):
            lo = np.searchsorted(sorted_idx, base, "left")
            hi = np.searchsorted(sorted_idx, base + sh.rows, "left")
            if hi <= lo:
                continue
            local = sorted_idx[lo:hi] - base
            ptr = np.asarray(sh.array("sae:indptr"))
            starts, counts = ptr[local], ptr[local + 1] - ptr[local]
            total = int(counts.sum())
            if total == 0:
                continue
            # each selected row's run of non-zeros in the CSR arrays, read in one fancy index per array
            pos = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(total)
            cols = torch.from_numpy(np.asarray(sh.array("sae:indices")[pos], dtype=np.int64))
            vals = torch.from_numpy(np.array(sh.array("sae:values")[pos]))
            out[torch.from_numpy(np.repeat(order[lo:hi], counts)), cols] = vals
        return out[0] if isinstance(rows, (int, np.integer)) else out

    def top_rows(self, feature: int, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, rows) of the rows where `feature` is largest, largest first: at most top_k (the harvest's),
        only rows where it is active. The rows index acts[address], token_ids, prompt_ids and positions."""
        info = self._need_sae()
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < info["d_sae"]:
            raise InputError(f"feature must be an index in 0..{info['d_sae'] - 1}, got {feature!r}.")
        vals, rows = [], []
        for base, sh in zip(self._bases, self._shards):
            v = torch.from_numpy(np.array(sh.array("sae:top_values")[:, feature]))
            r = torch.from_numpy(np.array(sh.array("sae:top_rows")[:, feature]))
            keep = r >= 0
            vals.append(v[keep])
            rows.append(r[keep] + base)
        v, r = torch.cat(vals), torch.cat(rows)
        n = min(k if k is not None else info["top_k"], info["top_k"], len(v))
        # ties: the earlier row first, as one top-k over the whole corpus in row order would keep it
        order = sorted(range(len(v)), key=lambda i: (-float(v[i]), int(r[i])))[:n]
        return v[order], r[order]

    @cached_property
    def token_ids(self) -> torch.Tensor:
        """Each row's token id (int64)."""
        return self._column("token_ids")

    @cached_property
    def prompt_ids(self) -> torch.Tensor:
        """Each row's prompt: its index in the inputs (shifted past earlier directories' prompts)."""
        return self._column("prompt_ids")

    @cached_property
    def positions(self) -> torch.Tensor:
        """Each row's position in its prompt (0 is the prompt's first token)."""
        return self._column("positions")

    @cached_property
    def _prompt_starts(self) -> np.ndarray:
        """Row where each prompt starts, and the total at the end (prompts are whole and in order)."""
        counts = np.bincount(self.prompt_ids.numpy(), minlength=self.n_prompts)
        return np.concatenate([[0], np.cumsum(counts)])

    def rows_of(self, prompt: int) -> range:
        """Prompt `prompt`'s rows: acts[address][acts.rows_of(i)] is its [tokens, width] activations."""
        if isinstance(prompt, bool) or not isinstance(prompt, (int, np.integer)) or not 0 <= prompt < self.n_prompts:
            raise InputError(f"prompt must be an index in 0..{self.n_prompts - 1}, got {prompt!r}.")
        s = self._prompt_starts
        return range(int(s[prompt]), int(s[prompt + 1]))

    def shard_of(self, row: int) -> int:
        """Which shard (in reading order) holds `row`."""
        return bisect.bisect_right(self._bases, row) - 1
