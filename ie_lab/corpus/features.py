"""A harvest's SAE features (`sae=`): each row's feature activations kept sparse, and each feature's top-k rows.

The SAE (ie_lab.sae.SAE, read by what it offers: encoder(), activation, k, address, d_in) encodes the rows of its
point through the projection path every backend shares (core/projection_args.make_encoder, ops/projection.scores:
the arithmetic s.project and SAE.encode run). A shard holds its rows' features as CSR (`sae:indptr` [rows + 1],
`sae:indices` int32, `sae:values` float32) and its own per-feature top-k (`sae:top_values`, `sae:top_rows`
[top_k, d_sae], rows local to the shard, -1 where the shard has fewer active rows): the corpus's top-k is the merge
of the shards', so a resumed harvest's top-k is exactly an uninterrupted one's.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..core.projection_args import make_encoder
from ..errors import InputError
from ..ops.projection import Encoder, scores


def _positive(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise InputError(f"top_k must be a positive integer (rows kept per feature), got {x!r}.")
    return x


def encoder_of(sae: Any) -> Encoder:
    """The checked encoder of an ie_lab SAE attached to a point (what a harvest with sae= applies to each row)."""
    for attr in ("encoder", "activation", "address", "d_in"):
        if not hasattr(sae, attr):
            raise InputError(
                f"sae= takes an ie_lab SAE (ie_lab.load_sae(...), docs/SAE.md); got {type(sae).__name__}, "
                f"which has no {attr!r}."
            )
    if sae.address is None:
        raise InputError("this SAE is attached to no point: load it with a model (ie_lab.load_sae(path, s)).")
    return make_encoder(
        int(sae.d_in),
        sae.encoder(),
        activation=sae.activation,
        k=getattr(sae, "k", None) if sae.activation == "topk" else None,
    )


def sae_identity(sae: Any, enc: Encoder | None = None) -> dict[str, Any]:
    """What the manifest records of the SAE a harvest encoded with: its point, width, activation and a hash of
    every number the encoding reads (weights, biases, threshold, a top-k's k), so a reader can tell whether the
    stored features are the ones this SAE gives (the feature dashboards read them instead of encoding again)."""
    enc = encoder_of(sae) if enc is None else enc
    h = hashlib.sha256(enc.W.numpy().tobytes())
    for t in (enc.b, enc.b_dec, enc.threshold):
        if t is not None:
            h.update(t.numpy().tobytes())
    if enc.topk is not None:  # same weights, another k: other features
        h.update(f"topk={enc.topk}".encode())
    return {"address": str(sae.address), "d_sae": enc.k, "activation": enc.activation, "hash": h.hexdigest()[:16]}


class FeatureBuffer:
    """One shard's sparse features and running top-k, filled batch by batch."""

    def __init__(self, sae: Any, top_k: int):
        self.enc = encoder_of(sae)
        self.top_k = _positive(top_k)
        self.address = sae.address
        self.d_sae = self.enc.k
        self.identity = {**sae_identity(sae, self.enc), "top_k": self.top_k}
        self.reset()

    def reset(self) -> None:
        self.rows = 0
        self.nnz: list[np.ndarray] = []  # per row count, per batch
        self.indices: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.top_values = torch.full((0, self.d_sae), float("-inf"))
        self.top_rows = torch.zeros((0, self.d_sae), dtype=torch.long)

    def add(self, x: torch.Tensor) -> None:
        """x: [rows, d_in], the SAE's point's rows of one batch (prompts in order)."""
        f = scores(x, self.enc).cpu()  # [rows, d_sae] float32
        nz = f != 0
        self.nnz.append(nz.sum(1).numpy().astype(np.int64))
        r, c = nz.nonzero(as_tuple=True)
        self.indices.append(c.numpy().astype(np.int32))
        self.values.append(f[r, c].numpy())
        local = torch.arange(self.rows, self.rows + f.shape[0]).unsqueeze(1).expand_as(f)
        # a row where the feature is 0 never enters its top-k
        vals = torch.cat([self.top_values, torch.where(nz, f, torch.tensor(float("-inf")))])
        rows = torch.cat([self.top_rows, local])
        keep = min(self.top_k, vals.shape[0])
        self.top_values, at = vals.topk(keep, dim=0)
        self.top_rows = rows.gather(0, at)
        self.rows += f.shape[0]

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...], list[np.ndarray]]]:
        """The shard's sae:* tensors (write_shard's form)."""
        counts = np.concatenate(self.nnz) if self.nnz else np.zeros(0, np.int64)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        nnz = int(indptr[-1])
        k = self.top_k
        tv = torch.full((k, self.d_sae), float("-inf"))
        tr = torch.full((k, self.d_sae), -1, dtype=torch.long)
        n = self.top_values.shape[0]
        tv[:n], tr[:n] = self.top_values, self.top_rows
        tr[tv == float("-inf")] = -1
        return {
            "sae:indptr": ("I64", (self.rows + 1,), [indptr]),
            "sae:indices": ("I32", (nnz,), self.indices),
            "sae:values": ("F32", (nnz,), self.values),
            "sae:top_values": ("F32", (k, self.d_sae), [tv.numpy()]),
            "sae:top_rows": ("I64", (k, self.d_sae), [tr.numpy()]),
        }
