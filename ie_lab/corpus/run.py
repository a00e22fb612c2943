"""The harvest's driver, shared by the backends: inputs read, resumed where the manifest stops, batched, buffered
into shards and committed (docs/HARVEST.md).

A backend drives it: `Harvester(...)` checks everything and opens (or resumes) the out_dir before any forward;
`batches()` yields the prompts still to do, `batch_size` at a time, as (prompt index, [1, T] ids); the backend runs
each batch through its own batched capture and hands the rows back to `add()`; `finish()` commits the last shard
and returns the Activations. Prompts are committed whole, in order, only with their shard: after an interrupt or a
killed process the same call skips exactly the committed prompts (checked to be the same inputs) and redoes the rest.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.inputs import check_prepend_bos, prepare, with_bos
from ..errors import AddressError, InputError, check_flag
from ..points import Width
from . import shards as S
from .activations import Activations
from .features import FeatureBuffer
from .identity import check_weights, model_identity

DEFAULT_SHARD_ROWS = 16384
DEFAULT_MAX_TOKENS = 1024
# The test hook of a killed harvest: "shard_written:N" (shard N is on disk, the manifest not yet) or "committed:N"
# (shard N and its manifest are written) makes the process SIGKILL itself there, so a test resumes from a known point.
KILL_ENV = "IE_LAB_HARVEST_KILL"


def _positive(name: str, x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise InputError(f"{name} must be a positive integer ({what}), got {x!r}.")
    return x


def check_points(addrs: list) -> None:
    """Only per-token vectors are harvested: a row is one token's activation at each address."""
    if not addrs:
        raise AddressError("no addresses given: name at least one point, e.g. ['resid_post.0'], or an sae=.")
    for a in addrs:
        w = a.point.width
        if w is Width.ATTN or w is Width.STATE or w is Width.STREAMS or a.stream is not None:
            raise AddressError(
                f"address {a}: {a.name} is not one vector per token, so it has no row per token to harvest; "
                "harvest a per-token point such as 'resid_post.L' or 'z.L'."
            )
        if w is Width.HEADS_D_MODEL and a.head is None:
            raise AddressError(
                f"address {a}: {a.name} is one d_model vector per head; harvest one head's, e.g. '{a}.head-0', "
                f"or the heads' sum, attn_out.{a.layer}."
            )


def _texts(source: Any, text_column: str) -> tuple[Iterator[Any], int | None]:
    """(the prompts in order, how many if known) of a list, a datasets.Dataset or any object with a text column."""
    if isinstance(source, (str, bytes)) or (isinstance(source, torch.Tensor)):
        raise InputError(
            "harvest takes many prompts: a list of texts (or of token-id lists), or a dataset with a text column; "
            f"got one {type(source).__name__}: wrap it in a list."
        )
    if not isinstance(text_column, str):
        raise InputError(f"text_column must be a column name (str), got {text_column!r}.")
    if isinstance(source, (list, tuple)):
        return iter(source), len(source)
    names = getattr(source, "column_names", None)
    if names is not None:  # a datasets.Dataset (or anything that offers its columns the same way): rows in chunks
        if text_column not in list(names):
            raise InputError(
                f"the dataset has no column {text_column!r}; its columns are {list(names)}: pass text_column=..."
            )
        if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
            n = len(source)

            def rows() -> Iterator[Any]:
                for i in range(0, n, 1024):
                    yield from source[i : min(n, i + 1024)][text_column]

            return rows(), n
        return (r[text_column] for r in source), None  # an IterableDataset: rows are dicts
    if isinstance(source, Mapping) or hasattr(source, "columns"):  # a dict of columns, a pandas DataFrame
        try:
            col = source[text_column]
        except (KeyError, TypeError):
            cols = list(source.keys()) if isinstance(source, Mapping) else list(source.columns)
            raise InputError(f"no column {text_column!r} here; the columns are {cols}: pass text_column=...") from None
        return iter(col), len(col)
    if hasattr(source, "__iter__"):
        return (r[text_column] if isinstance(r, Mapping) else r for r in source), None
    raise InputError(
        f"harvest reads a list of texts or a dataset with a {text_column!r} column, got {type(source).__name__}."
    )


def _fingerprint(h: Any, prompt: Any) -> None:
    if isinstance(prompt, str):
        h.update(b"s" + len(prompt.encode()).to_bytes(8, "little") + prompt.encode())
    else:
        ids = torch.as_tensor(prompt).reshape(-1).long().numpy() if not isinstance(prompt, list) else prompt
        h.update(b"i" + np.asarray(ids, dtype=np.int64).tobytes() + b";")


def ie_lab_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("ie_lab")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "unknown"


def _kill_at(stage: str, index: int) -> None:
    if os.environ.get(KILL_ENV) == f"{stage}:{index}":
        os.kill(os.getpid(), signal.SIGKILL)


class Harvester:
    def __init__(
        self,
        lm: Any,
        source: Any,
        addrs: list,
        out_dir: Any,
        *,
        batch_size: int,
        max_tokens_per_prompt: int | None,
        text_column: str,
        shard_rows: int,
        progress: bool,
        sae: Any = None,
        top_k: int = 32,
        prepend_bos: bool | None = None,
    ):
        check_prepend_bos(prepend_bos)
        self.prepend_bos = prepend_bos
        self.features = FeatureBuffer(sae, top_k) if sae is not None else None
        extra = [] if self.features is None or self.features.address in addrs else [self.features.address]
        self.capture_addrs = [*addrs, *extra]  # what each batch captures: the points kept, and the SAE's
        check_points(self.capture_addrs)
        _positive("batch_size", batch_size, "prompts per forward")
        if max_tokens_per_prompt is not None:
            _positive("max_tokens_per_prompt", max_tokens_per_prompt, "a longer prompt keeps its first tokens")
        _positive("shard_rows", shard_rows, "rows a shard holds before it is written")
        check_flag("progress", progress)
        if not isinstance(out_dir, (str, os.PathLike)):
            raise InputError(f"out_dir must be a directory path, got {type(out_dir).__name__}.")
        self.lm, self.addrs, self.names = lm, addrs, [str(a) for a in addrs]
        self.batch_size, self.max_tokens, self.shard_rows = batch_size, max_tokens_per_prompt, shard_rows
        self.items, self.total = _texts(source, text_column)
        self.out = Path(out_dir)
        if self.out.exists() and not self.out.is_dir():
            raise InputError(f"out_dir {self.out} is a file; give a directory (it is created if missing).")
        self.dtype = str(lm.dtype).replace("torch.", "")
        if self.dtype not in S.SAFETENSORS_OF:
            raise InputError(f"harvest writes float32, float16 or bfloat16 rows; this model runs {self.dtype}.")
        ident = model_identity(lm)
        want = {
            "addresses": self.names,
            "dtype": self.dtype,
            "max_tokens_per_prompt": max_tokens_per_prompt,
            "prepend_bos": prepend_bos,  # other ids, other rows (a harvest from before this key read None)
            "sae": None if self.features is None else self.features.identity,
            **ident,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        m = S.read_manifest(self.out)
        if m is not None:
            self._check_same(m, want)
        else:
            m = {
                "format": S.FORMAT,
                "version": S.VERSION,
                "ie_lab_version": ie_lab_version(),
                **want,
                "text_column": text_column,
                "widths": {},
                "shard_rows": shard_rows,
                "prompts_done": 0,
                "rows": 0,
                "complete": False,
                "shards": [],
            }
        S.discard_strays(self.out, m if self.out.joinpath(S.MANIFEST).exists() else None)
        self.manifest = m
        self._buffer: list[tuple[int, torch.Tensor, dict[str, np.ndarray]]] = []
        self._buffered_rows = 0
        self._hash = hashlib.sha256()
        self._bar = tqdm(
            desc=f"harvest {', '.join(self.names)}"[:60],
            unit="tok",
            unit_scale=True,
            initial=m["rows"],
            disable=not progress,
            leave=False,
        )
        self._bar.set_postfix_str(self._prompts_text())

    def _check_same(self, m: dict, want: dict) -> None:
        if m.get("format") != S.FORMAT:
            raise InputError(f"{self.out} holds a {S.MANIFEST} that is not a harvest's: give an empty or new out_dir.")
        for key, value in want.items():
            if key == "weights":
                why = check_weights(self.out, m.get(key), value)
                if why:
                    raise InputError(why)
            elif m.get(key) != value:
                raise InputError(
                    f"{self.out} holds another harvest ({key}: {m.get(key)!r}, this call: {value!r}); a harvest "
                    "continues only with the same model, addresses, dtype, max_tokens_per_prompt and prepend_bos: give "
                    "a new "
                    "out_dir, or call again exactly as the harvest there was started."
                )

    def _prompts_text(self) -> str:
        done = self.manifest["prompts_done"] + len(self._buffer)
        return f"{done}/{self.total} prompts" if self.total is not None else f"{done} prompts"

    # ---- reading the inputs -----------------------------------------------------------------------------
    def _ids(self, i: int, prompt: Any) -> torch.Tensor:
        if isinstance(prompt, Mapping):
            raise InputError(f"prompt {i} is a {type(prompt).__name__}: pass text_column= to name its text.")
        if isinstance(prompt, str) and self.prepend_bos is not None:  # the door's rule (core/inputs.py with_bos)
            prompt = with_bos(self.lm.tokenizer, prompt, self.prepend_bos)
        try:
            ids = prepare(self.lm, prompt)[0]
        except InputError as e:
            raise InputError(f"prompt {i}: {e}") from None
        if ids.shape[0] != 1:
            raise InputError(f"prompt {i} is {ids.shape[0]} prompts; harvest takes one text or id list per item.")
        return ids[:, : self.max_tokens] if self.max_tokens is not None else ids

    def batches(self) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """The prompts not yet committed, in batches; the committed ones are checked to be the same inputs."""
        shards = list(self.manifest["shards"])  # the committed ones (add() appends to the manifest as we go)
        k, h = 0, hashlib.sha256()
        batch: list[tuple[int, torch.Tensor]] = []
        i = -1
        for i, prompt in enumerate(self.items):
            if k < len(shards):  # a committed prompt: it must be the one the harvest there read
                _fingerprint(h, prompt)
                if i + 1 == shards[k]["prompts"][1]:
                    if h.hexdigest() != shards[k]["sha256"]:
                        raise InputError(
                            f"{self.out} holds a harvest of other inputs (prompts {shards[k]['prompts'][0]}.."
                            f"{i} differ from this call's): give a new out_dir, or the same inputs to continue it."
                        )
                    k, h = k + 1, hashlib.sha256()
                continue
            batch.append((i, self._ids(i, prompt)))
            _fingerprint(self._hash, prompt)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if k < len(shards):
            raise InputError(
                f"{self.out} holds a harvest of {self.manifest['prompts_done']} prompts, more than the {i + 1} given: "
                "give the same inputs to continue it, or a new out_dir."
            )
        if batch:
            yield batch

    # ---- writing ----------------------------------------------------------------------------------------
    def add(self, batch: list[tuple[int, torch.Tensor]], rows: list[dict[str, torch.Tensor]]) -> None:
        """One batch's rows: rows[j][address] is prompt j's [tokens, width] activations (no padding)."""
        widths = self.manifest["widths"]
        tokens = 0
        if self.features is not None:
            sae_rows = torch.cat([got[str(self.features.address)] for got in rows])
            if sae_rows.shape[1] != self.features.enc.d:
                raise InputError(
                    f"the SAE reads {self.features.enc.d}-wide rows, but {self.features.address} is "
                    f"{sae_rows.shape[1]} wide on this model: give the SAE made for this model's point."
                )
            self.features.add(sae_rows)
        for (i, ids), got in zip(batch, rows):
            n = ids.shape[1]
            per: dict[str, np.ndarray] = {}
            for name in self.names:
                t = got[name]
                if t.dim() != 2 or t.shape[0] != n:
                    raise AssertionError(f"{name}: prompt {i} gave rows of shape {list(t.shape)}, expected [{n}, w]")
                widths.setdefault(name, int(t.shape[1]))
                if t.shape[1] != widths[name]:
                    raise InputError(
                        f"{name} is {t.shape[1]} wide here but {widths[name]} in {self.out}'s harvest: give a new out_dir."
                    )
                t = t.detach().to("cpu", self.lm.dtype).contiguous()
                per[name] = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
            self._buffer.append((i, ids[0].cpu(), per))
            self._buffered_rows += n
            tokens += n
        self._bar.update(tokens)
        if self._buffered_rows >= self.shard_rows:
            self._flush()
        self._bar.set_postfix_str(self._prompts_text(), refresh=False)

    def _flush(self) -> None:
        if not self._buffer:
            return
        m = self.manifest
        index = len(m["shards"])
        rows = self._buffered_rows
        st = S.SAFETENSORS_OF[self.dtype]
        tensors: dict[str, tuple[str, tuple[int, ...], list[np.ndarray]]] = {
            "token_ids": ("I64", (rows,), [ids.numpy().astype(np.int64) for _, ids, _ in self._buffer]),
            "prompt_ids": ("I64", (rows,), [np.full(len(ids), i, np.int64) for i, ids, _ in self._buffer]),
            "positions": ("I32", (rows,), [np.arange(len(ids), dtype=np.int32) for _, ids, _ in self._buffer]),
        }
        for name in self.names:
            tensors[f"act:{name}"] = (st, (rows, m["widths"][name]), [per[name] for _, _, per in self._buffer])
        if self.features is not None:
            tensors.update(self.features.tensors())
        name = S.shard_name(index)
        S.write_shard(self.out / name, tensors)
        _kill_at("shard_written", index)
        first, last = self._buffer[0][0], self._buffer[-1][0] + 1
        m["shards"].append({"file": name, "rows": rows, "prompts": [first, last], "sha256": self._hash.hexdigest()})
        m["prompts_done"], m["rows"], m["complete"] = last, m["rows"] + rows, False
        S.write_manifest(self.out, m)
        _kill_at("committed", index)
        self._buffer, self._buffered_rows, self._hash = [], 0, hashlib.sha256()
        if self.features is not None:
            self.features.reset()

    def finish(self) -> Activations:
        self._flush()
        m = self.manifest
        if not m["complete"]:
            m["complete"] = True
            S.write_manifest(self.out, m)
        self.close()
        return Activations(self.out)

    def close(self) -> None:
        self._bar.close()
