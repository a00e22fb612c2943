"""to_saelens: a harvest (ie_lab.Activations) written as the cached activations SAELens trains from (docs/HARVEST.md).

SAELens 6.x reads cached activations with `datasets.load_from_disk(cached_activations_path)`: a Hugging Face
`Dataset` saved to disk (`data-XXXXX-of-XXXXX.arrow`, `dataset_info.json`, `state.json`) with one column per hook
name (TransformerLens spelling, e.g. `blocks.1.hook_resid_post`), each row an `Array2D` of [context_size, d_in],
and a `token_ids` column of `context_size` int32 (what its `exclude_special_tokens` filters on). Its
ActivationsStore checks the column's shape against (context_size, d_in) and reads rows in order, flattening each
to context_size tokens. That is the layout its CacheActivationsRunner writes; this module writes the same layout
from a harvest already on disk, without a model.

Rows are packed in harvest order into windows of context_size tokens: a window may end in one prompt and go on in
the next. SAELens' own runner does the same (its store concatenates documents into context_size windows by
default); for an SAE, which sees one token's activation at a time, the window is only a container. Unlike
SAELens' runner, each prompt's activations here were computed on that prompt alone, so no token attended to
another document. The last rows that fill no whole window are left out (SAELens drops its partial window too);
the returned record and the sidecar file say how many.

`datasets` (and pyarrow) is needed only here, imported when the export runs: ie_lab does not depend on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .corpus.activations import Activations
from .errors import InputError

SIDECAR = "ie_lab_export.json"
_MAX_FILE_BYTES = 500 * 1024**2  # per Arrow file, as datasets' save_to_disk shards (SAELens keeps shards < 2 GB)
_BLOCK_BYTES = 64 * 1024**2  # rows read from the harvest per write
# Arrow has no bfloat16: such a harvest is written as float32 (exact, every bfloat16 is a float32)
_ARROW_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}


@dataclass(frozen=True)
class SAELensExport:
    """What to_saelens wrote: give SAELens `cached_activations_path=path`, `hook_name=hook_names[address]`,
    `context_size`, `d_in=d_in[address]` (and its `dtype`)."""

    path: str
    hook_names: dict[str, str]  # address -> the dataset's column (TransformerLens hook name)
    d_in: dict[str, int]
    context_size: int
    windows: int  # dataset rows, each context_size tokens
    rows_written: int  # windows * context_size: the harvest's first rows_written rows, in order
    rows_dropped: int  # the harvest's last rows, fewer than context_size, that fill no window
    dtype: str
    source: list[str] = field(default_factory=list)


def _hook_names(acts: Activations, addresses: list[str], model: Any, hook_names: Any) -> dict[str, str]:
    given = dict(hook_names or {})
    unknown = [a for a in given if a not in addresses]
    if unknown:
        raise InputError(f"hook_names names {', '.join(unknown)}, not exported here ({', '.join(addresses)}).")
    out = {}
    for a in addresses:
        if a in given:
            out[a] = str(given[a])
        elif model is not None:
            from .mappers import to_engine

            out[a] = to_engine(a, model, "transformerlens")
        else:
            raise InputError(
                f"SAELens names each column by its TransformerLens hook name, which depends on the model: pass "
                f"model= (the Session or loaded model the harvest ran, its config, or a family name such as 'llama') "
                f"or hook_names={{'{a}': 'blocks.L.hook_...'}}."
            )
    if len(set(out.values())) != len(out) or "token_ids" in out.values():
        raise InputError(f"the hook names must differ from each other and from 'token_ids'; got {out}.")
    return out


def _fingerprint(acts: Activations, cols: dict[str, str], context_size: int) -> str:
    """A fingerprint for datasets' state.json: the same harvest exported the same way gets the same one."""
    h = hashlib.sha256()
    for m in acts.manifests:
        h.update(json.dumps([m.get("model"), [s.get("sha256") for s in m["shards"]]], sort_keys=True).encode())
    h.update(json.dumps([cols, context_size]).encode())
    return h.hexdigest()[:16]


def to_saelens(
    acts: Any,
    path: Any,
    *,
    context_size: int = 128,
    address: Any = None,
    model: Any = None,
    hook_names: dict[str, str] | None = None,
) -> SAELensExport:
    """Write a harvest as SAELens' cached activations at `path` (a new or empty directory): one column per
    address (all the harvest's by default; `address=` one or a list), named by its TransformerLens hook name
    (from `model=`, or given in `hook_names=`), rows of [context_size, d_in], and `token_ids`. Needs `datasets`."""
    if not isinstance(acts, Activations):
        acts = Activations(acts)
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise InputError(f"context_size must be a positive int (tokens per row of the dataset), got {context_size!r}.")
    addresses = list(acts.addresses) if address is None else [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise InputError("address= names no point to export; give one of " + ", ".join(acts.addresses) + ".")
    for a in addresses:
        acts[a]  # refuses an address the harvest does not hold, naming those it does
    cols = _hook_names(acts, addresses, model, hook_names)
    windows = len(acts) // context_size
    if windows == 0:
        raise InputError(
            f"the harvest holds {len(acts)} rows, fewer than one window of context_size={context_size}: "
            "give a smaller context_size or harvest more text."
        )
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"{out} exists and is not an empty directory: give a new path (nothing there is replaced).")
    try:
        import datasets
        from datasets.arrow_writer import ArrowWriter
    except ImportError:
        raise InputError(
            "to_saelens writes a Hugging Face `datasets` dataset, and `datasets` is not installed: "
            "pip install datasets (or pip install 'ie_lab[saelens-export]')."
        ) from None

    dtype = _ARROW_DTYPE[acts.manifest["dtype"]]
    np_dtype = np.dtype(dtype)
    tokens_type = getattr(datasets, "List", None) or datasets.Sequence  # List since datasets 4, Sequence before
    features = datasets.Features(
        {
            **{cols[a]: datasets.Array2D(shape=(context_size, acts.widths[a]), dtype=dtype) for a in addresses},
            "token_ids": tokens_type(datasets.Value("int32"), length=context_size),
        }
    )
    window_bytes = context_size * (sum(acts.widths[a] for a in addresses) * np_dtype.itemsize + 4)
    per_file = max(1, _MAX_FILE_BYTES // window_bytes)
    per_block = max(1, min(per_file, _BLOCK_BYTES // window_bytes))
    n_files = math.ceil(windows / per_file)
    token_ids = acts.token_ids
    if len(token_ids) and int(token_ids.max()) >= 2**31:
        raise InputError("a token id does not fit SAELens' int32 token_ids column.")

    out.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(n_files):
        name = f"data-{f:05d}-of-{n_files:05d}.arrow"
        writer = ArrowWriter(features=features, path=str(out / name))
        try:
            for w0 in range(f * per_file, min(windows, (f + 1) * per_file), per_block):
                w1 = min(w0 + per_block, (f + 1) * per_file, windows)
                r0, r1 = w0 * context_size, w1 * context_size
                batch: dict[str, Any] = {}
                for a in addresses:
                    rows = acts[a][r0:r1]  # contiguous: one read per shard it spans
                    batch[cols[a]] = (
                        rows.float().numpy().astype(np_dtype, copy=False).reshape(w1 - w0, context_size, -1)
                    )
                batch["token_ids"] = token_ids[r0:r1].numpy().astype(np.int32).reshape(w1 - w0, context_size)
                writer.write_batch(batch)
            writer.finalize()
        finally:
            writer.close()
        files.append({"filename": name})

    result = SAELensExport(
        path=str(out),
        hook_names=cols,
        d_in={a: acts.widths[a] for a in addresses},
        context_size=context_size,
        windows=windows,
        rows_written=windows * context_size,
        rows_dropped=len(acts) - windows * context_size,
        dtype=dtype,
        source=[str(d) for d in acts.dirs],
    )
    with open(out / SIDECAR, "w") as fh:
        json.dump(
            {"format": "ie_lab.saelens_export", **asdict(result), "model": acts.manifest.get("model")}, fh, indent=2
        )
    datasets.DatasetInfo(
        features=features, description="ie_lab harvest exported by ie_lab.to_saelens"
    ).write_to_directory(str(out))
    # state.json last: datasets.load_from_disk needs it, so an export killed before here leaves nothing loadable
    state: dict[str, Any] = {
        "_data_files": files,
        "_fingerprint": _fingerprint(acts, cols, context_size),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    tmp = out / "state.json.tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, indent=2)
    os.replace(tmp, out / "state.json")
    ds = datasets.load_from_disk(str(out))  # memory-mapped: a check that datasets reads back what was written
    if len(ds) != windows or any(ds.features[cols[a]].shape != (context_size, acts.widths[a]) for a in addresses):
        raise RuntimeError(f"datasets read back {len(ds)} rows of {ds.features} from {out}; expected {windows}.")
    return result
