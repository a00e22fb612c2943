"""What a harvest's manifest records of the model, and a resume or a read is checked against (docs/HARVEST.md): its
name and architecture, its weights, its tokenizer's vocabulary.

The weights are identified where they are: an in-process model (eager) by a SHA-256 over every parameter's name,
dtype, shape and bytes (exact for what runs, edits made in memory included; one tensor crosses to the CPU at a
time); a model whose weights live in another process (vLLM's engine) by its checkpoint files (their SHA-256, read
from the hub cache's blob names where the files are hub downloads, else computed over the bytes). Two models of
one architecture and name with other weights then never share a harvest folder.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from typing import Any

import torch

# the checkpoint files a served model's weights are read from, by preference
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """A parameter as the plain tensors that hold its bytes (a quantized tensor subclass: its inner tensors)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _plain(getattr(t, n))]


def _bytes(t: torch.Tensor) -> Any:
    """The tensor's bytes as a buffer hashlib reads without another copy."""
    flat = t.reshape(-1).contiguous()
    try:
        return flat.view(torch.uint8).cpu().numpy()
    except (RuntimeError, TypeError):  # a dtype with no byte view: its values
        return (flat.dequantize() if flat.is_quantized else flat).double().cpu().numpy()


def parameters_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}\n".encode())
        for t in _plain(p.detach()):
            if t.device.type == "meta":  # offloaded: its bytes are not here to hash (its name and shape are)
                continue
            h.update(_bytes(t))
    return h.hexdigest()[:16]


def _folder(name: str) -> str | None:
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    try:  # a hub id: the snapshot already downloaded (the engine loaded it from there)
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def _file_sha256(path: str) -> str:
    blob = os.path.basename(os.path.realpath(path))
    if os.path.islink(path) and _SHA256.fullmatch(blob):  # the hub cache names each blob by its SHA-256
        return blob
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_hash(name: str) -> str | None:
    """A SHA-256 over the checkpoint files' names and SHA-256s, or None where no file is found."""
    folder = _folder(name)
    if folder is None:
        return None
    for pattern in WEIGHT_FILES:
        files = sorted(glob.glob(os.path.join(folder, pattern)))
        if files:
            h = hashlib.sha256()
            for f in files:
                h.update(f"{os.path.basename(f)}|{_file_sha256(f)}\n".encode())
            return h.hexdigest()[:16]
    return None


def weights_identity(lm: Any) -> dict[str, Any]:
    """{"from": "parameters" | "files", "hash": ...}: how this model's weights are identified, and their hash."""
    hf = getattr(lm, "hf", None)
    if isinstance(hf, torch.nn.Module):
        return {"from": "parameters", "hash": parameters_hash(hf)}
    return {"from": "files", "hash": files_hash(str(lm.name))}


def model_identity(lm: Any) -> dict[str, Any]:
    """The manifest's model, weights and tokenizer entries: name and architecture, weights, the tokenizer's vocab."""
    facts = hashlib.sha256(f"{lm.name}\n{lm.facts!r}".encode()).hexdigest()[:16]
    tok = lm.tokenizer
    tok_hash = None
    if tok is not None:
        vocab = json.dumps(sorted(tok.get_vocab().items()), separators=(",", ":"))
        tok_hash = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return {
        "model": {"name": str(lm.name), "hash": facts},
        "weights": weights_identity(lm),
        "tokenizer": {"name": str(getattr(tok, "name_or_path", "") or ""), "hash": tok_hash},
    }


def check_weights(out: Any, have: dict[str, Any] | None, want: dict[str, Any]) -> str | None:
    """Why a harvest recorded with weights `have` cannot continue with `want` (None: it can)."""
    if have is None:  # a harvest started before the weights were recorded: its name and architecture were checked
        return None
    if have.get("from") != want["from"]:
        return (
            f"{out} holds a harvest whose weights were identified by their {have.get('from')} (another backend: "
            f"eager hashes its parameters, vLLM its checkpoint files), so this model's {want['from']} cannot be "
            "checked against them: continue it on the backend it was started on, or give a new out_dir."
        )
    if have.get("hash") != want["hash"]:
        return (
            f"{out} holds a harvest of other weights (weights hash {have.get('hash')}, this model's {want['hash']}; "
            "the same name and architecture, so its rows would mix with another model's): give a new out_dir, or "
            "load the weights the harvest there was started with."
        )
    return None
