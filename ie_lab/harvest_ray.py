"""A corpus harvest past one machine (docs/HARVEST.md, "Past one machine"): the prompts split into N contiguous
ranges, one harvest task per range on a Ray cluster, each writing `out_dir/part-0000k/` with the ordinary resumable
harvest (ie_lab/corpus/run.py), read back as one `ie_lab.Activations` whose prompt ids are the inputs' own order. With sae=, each shard keeps its own
per-feature top-k (corpus/features.py) and the reader merges every shard's, across the parts as within one harvest,
so features and top_rows equal a one-process harvest's.

Each task opens its own Session on the node Ray places it on (the model path must be readable there, and out_dir
shared by every node: a network filesystem, or one machine). Ray is optional (`pip install ie_lab[ray]`) and imported
only when this runs. On one machine, vLLM's own data parallelism serves one Session from several engines
(Session(..., backend="vllm", data_parallel_size=N), docs/VLLM.md); parts reach past one machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .corpus import Activations
from .corpus import shards as S
from .corpus.features import FeatureBuffer
from .corpus.run import _fingerprint, _texts
from .errors import InputError

PLAN = "parts.json"  # out_dir's record of the split: a rerun must split the same inputs the same way


def part_ranges(n: int, shards: int) -> list[tuple[int, int]]:
    """n prompts split into at most `shards` contiguous, non-empty ranges [first, last + 1), as even as can be (the
    first n % shards ranges hold one more)."""
    k = min(shards, n)
    size, extra = divmod(n, k) if k else (0, 0)
    out, first = [], 0
    for j in range(k):
        last = first + size + (j < extra)
        out.append((first, last))
        first = last
    return out


def part_dir(out_dir: Path, j: int) -> Path:
    return out_dir / f"part-{j:05d}"


def _slice(texts: Any, first: int, last: int) -> Any:
    if isinstance(texts, (list, tuple)):
        return list(texts[first:last])
    return texts.select(range(first, last))  # a datasets.Dataset: a view, no copy of the rows


def _check_texts(texts: Any) -> int:
    if isinstance(texts, (list, tuple)) or (hasattr(texts, "select") and hasattr(texts, "__len__")):
        return len(texts)
    raise InputError(
        "harvest_on_ray splits the inputs by prompt range, so it takes a list of texts (or of token-id lists) or a "
        f"datasets.Dataset (len() and .select()), got {type(texts).__name__}: make a list, or a Dataset."
    )


def inputs_hash(texts: Any, text_column: str) -> str:
    """A SHA-256 of every prompt, the way each shard's manifest entry hashes its own (corpus/run.py): a rerun that
    would skip a finished part is first checked to be over the same inputs."""
    items, _ = _texts(texts, text_column)
    h = hashlib.sha256()
    for prompt in items:
        _fingerprint(h, prompt)
    return h.hexdigest()


def _plan(out_dir: Path, n: int, ranges: list[tuple[int, int]], digest: str) -> None:
    """Write the split, or check a rerun splits the same inputs the same way."""
    want = {"format": "ie_lab.harvest_parts", "prompts": n, "parts": [list(r) for r in ranges], "sha256": digest}
    path = out_dir / PLAN
    if path.exists():
        have = json.loads(path.read_text())
        if have.get("sha256") != digest:
            raise InputError(
                f"{out_dir} holds a harvest of other inputs: give a new out_dir, or the same inputs to continue it."
            )
        if have != want:
            raise InputError(
                f"{out_dir} holds a harvest split as {have.get('parts')} over {have.get('prompts')} prompts; this call "
                f"splits {n} prompts as {want['parts']}: call again with the same inputs and shards= to continue it, "
                "or give a new out_dir."
            )
        return
    if (out_dir / S.MANIFEST).exists():
        raise InputError(f"{out_dir} holds a one-process harvest; give harvest_on_ray a new out_dir.")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (PLAN + ".tmp")
    tmp.write_text(json.dumps(want))
    os.replace(tmp, path)


def _done(d: Path) -> bool:
    m = S.read_manifest(d) if d.is_dir() else None
    return bool(m and m.get("complete"))


def harvest_part(
    model: str, texts: Any, addresses: Any, out: str, backend: str, session_kwargs: dict, kw: dict, sae: Any = None
) -> str:
    """One part, in whichever process runs it: its own Session, the ordinary (resumable) harvest, closed after."""
    from .session import Session

    with Session(model, backend=backend, progress=False, **session_kwargs) as s:
        s.harvest(texts, addresses, out, progress=False, sae=sae, **kw)
    return out


def harvest_on_ray(
    model: str | os.PathLike,
    texts: Any,
    addresses: Any,
    out_dir: str | os.PathLike,
    *,
    shards: int,
    backend: str = "eager",
    num_cpus: float = 1,
    num_gpus: float = 0,
    session_kwargs: dict | None = None,
    **harvest_kwargs: Any,
) -> Activations:
    """Harvest `texts` at `addresses` as `shards` Ray tasks over contiguous prompt ranges, each writing
    out_dir/part-0000k/ through its own Session(model, backend=...); returns Activations of the parts in order
    (prompt ids equal the inputs' order). Resumable: a rerun skips finished parts and resumes partial ones through
    harvest's own resume. Ray must be installed; an unconnected process is connected by ray.init() (RAY_ADDRESS, or a
    local cluster). num_cpus / num_gpus: each task's Ray resources. session_kwargs: each task's Session's (dtype,
    prepend_bos, vLLM's engine keywords, ...). harvest_kwargs: s.harvest's (batch_size, max_tokens_per_prompt,
    shard_rows, prepend_bos, sae, top_k, ...): with sae=, each part keeps its rows' features and its shards' own
    top-k, and Activations reads the parts' top-k merged (top_rows equals a one-process harvest's)."""
    if not isinstance(model, (str, os.PathLike)):
        raise InputError(
            f"harvest_on_ray opens a Session on each node from the model's path or hub name, got a "
            f"{type(model).__name__}: save the model (model.save_pretrained(path)) and pass the path."
        )
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InputError(f"shards must be a positive integer (how many prompt ranges), got {shards!r}.")
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InputError(f"out_dir must be a directory path, got {type(out_dir).__name__}.")
    if "progress" in harvest_kwargs:
        raise InputError(
            "harvest_on_ray does not take progress=: the tasks run on other processes, which show no bar here."
        )
    sae = harvest_kwargs.pop("sae", None)
    if sae is not None:  # refused here, before any task loads a model, if harvest would refuse it
        FeatureBuffer(sae, harvest_kwargs.get("top_k", 32))
    if isinstance(addresses, str):
        addresses = [addresses]
    n = _check_texts(texts)
    if n == 0:
        raise InputError("no prompts given: pass at least one text.")
    try:
        import ray
    except ImportError:
        raise InputError(
            "harvest_on_ray needs Ray: pip install 'ie_lab[ray]' (or ray itself) on every node of the cluster."
        ) from None
    out = Path(out_dir).expanduser().absolute()
    ranges = part_ranges(n, shards)
    _plan(out, n, ranges, inputs_hash(texts, harvest_kwargs.get("text_column", "text")))
    if not ray.is_initialized():
        ray.init()  # RAY_ADDRESS names a cluster; without it, a local one with this machine's cores
    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(harvest_part)
    model_s = os.fspath(model)
    sae_ref = ray.put(sae) if sae is not None else None  # one copy in the object store, not one per task
    pending = [
        task.remote(
            model_s,
            _slice(texts, a, b),
            list(addresses),
            str(part_dir(out, j)),
            backend,
            session_kwargs or {},
            harvest_kwargs,
            sae_ref,
        )
        for j, (a, b) in enumerate(ranges)
        if not _done(part_dir(out, j))
    ]
    ray.get(pending)  # a failed task raises here, naming its part; the finished parts stay for the rerun
    return Activations([part_dir(out, j) for j in range(len(ranges))])
