"""Sparse autoencoders as users have them on disk: a SAELens folder (cfg.json and safetensors weights) or a plain
safetensors dict, attached to the ie_lab point it was trained on.

``load_sae(path, model)`` reads the weights (safetensors only, never a pickle) and the config, and resolves the
config's hook name (a TransformerLens name such as ``blocks.8.hook_resid_post``) through the model-aware mappers
(ie_lab/mappers.py): on a family where a name means another tensor than its plain reading (Gemma 2's
``hook_mlp_out`` is the MLP output after its post-norm, ie_lab's ``mlp_out_post``) the mapper resolves it or refuses
it, never crossing silently. The SAE then encodes through ``project()`` (ie_lab/ops/projection.py: the scores are
computed where the activation is, in the eager hook or the vLLM worker), decodes, checks itself by its reconstruction
error (a known-good SAE with a high error is most likely attached to the wrong point), and steers along its decoder
directions.

What the loader refuses, naming why: architectures other than standard (ReLU), JumpReLU and TopK (gated SAEs need
their magnitude path); activation normalisation other than none (the scale lives outside the weights); a width
that does not match the point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .address import Address
from .core.files import checked_file, read_json
from .core.projection_args import make_encoder, point_width
from .errors import AddressError, InputError
from .ops.projection import scores as encode_rows

WEIGHT_KEYS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
ARCHITECTURES = {"standard": "relu", "relu": "relu", "jumprelu": "jumprelu", "topk": "topk"}


@dataclass
class SAE:
    """One sparse autoencoder: W_enc [d, n], b_enc [n], W_dec [n, d], b_dec [d], threshold [n] (JumpReLU)."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor | None
    b_dec: torch.Tensor | None
    activation: str  # "relu" | "jumprelu" | "topk" (ops/projection.py's names)
    threshold: torch.Tensor | None = None
    k: int | None = None  # TopK's k
    apply_b_dec_to_input: bool = True
    hook_name: str | None = None  # as the config names the point (another engine's name)
    address: Address | None = None  # the ie_lab point it attaches to
    cfg: dict = field(default_factory=dict)

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def encoder(self) -> dict[str, torch.Tensor]:
        """The directions= dict project() takes (SAELens' names)."""
        enc = {"W_enc": self.W_enc, "b_enc": self.b_enc}
        if self.apply_b_dec_to_input and self.b_dec is not None:
            enc["b_dec"] = self.b_dec
        if self.threshold is not None:
            enc["threshold"] = self.threshold
        return enc

    def _addr(self) -> Address:
        if self.address is None:
            raise AddressError(
                "this SAE is attached to no point: load it with a model (load_sae(path, s)) so its hook name is "
                "resolved, or pass address='resid_post.L'."
            )
        return self.address

    def project(self, session: Any, prompt: Any, **kwargs: Any) -> Any:
        """Feature activations per token, [tokens, d_sae], computed where the activation is (s.project)."""
        return session.project(
            prompt,
            self._addr(),
            self.encoder(),
            activation=self.activation,
            k=self.k if self.activation == "topk" else None,
            **kwargs,
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations of rows x [..., d_in], here (the arithmetic project() runs in the hook)."""
        enc = make_encoder(
            self.d_in, self.encoder(), activation=self.activation, k=self.k if self.activation == "topk" else None
        )
        return encode_rows(x.float(), enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        if self.W_dec is None:
            raise InputError("this SAE has no W_dec (an encoder-only dict): it cannot decode or steer along features.")
        out = f.float() @ self.W_dec.float()
        return out + self.b_dec.float() if self.b_dec is not None else out

    def reconstruction_error(self, session: Any, prompts: Any) -> float:
        """Fraction of variance unexplained over every token of the prompts: |x - decode(encode(x))|^2 summed, over
        |x - mean(x)|^2 summed. A trained SAE on its own point is well below 1; about 1 or more means it reconstructs
        nothing there."""
        addr = self._addr()
        xs = [session.capture(p, [addr])[addr][0].float() for p in ([prompts] if isinstance(prompts, str) else prompts)]
        x = torch.cat(xs)
        err = (x - self.decode(self.encode(x))).pow(2).sum()
        var = (x - x.mean(0)).pow(2).sum()
        return float(err / var)

    def check(self, session: Any, prompts: Any, max_error: float = 0.5) -> str:
        """The reconstruction error in words: a high one on a known-good SAE reports the point as likely wrong."""
        fvu = self.reconstruction_error(session, prompts)
        if fvu <= max_error:
            return f"{self._addr()}: fraction of variance unexplained {fvu:.3f} (<= {max_error}): the point fits."
        return (
            f"{self._addr()}: fraction of variance unexplained {fvu:.3f} (> {max_error}). If this SAE is known to be "
            f"good, it is most likely attached to the wrong point (its hook name {self.hook_name!r} resolved to "
            f"{self._addr()}): compare with the neighbouring points (e.g. {self._addr().name}_post, resid_pre vs "
            "resid_post) and pass address= to load_sae."
        )

    def steer(self, session: Any, feature: int, scale: float = 1.0, **kwargs: Any) -> Any:
        """A steering spec adding scale x the feature's decoder direction at the SAE's point (s.steer)."""
        if self.W_dec is None:
            raise InputError("this SAE has no W_dec (an encoder-only dict): it cannot steer along features.")
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < self.d_sae:
            raise InputError(f"feature={feature!r}: an int from 0 to {self.d_sae - 1}.")
        return session.steer(self._addr(), self.W_dec[feature].float(), scale=scale, **kwargs)

    def __repr__(self) -> str:
        where = self.address if self.address is not None else "unattached"
        return f"SAE({self.activation}, d_in={self.d_in}, d_sae={self.d_sae}, at {where}, hook {self.hook_name!r})"


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checked_file(path, "the SAE's weights file", "tensors"))


def _weights_file(folder: str) -> str:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") and "sparsity" not in n)
    preferred = [n for n in names if n == "sae_weights.safetensors"]
    if not names:
        raise InputError(f"{folder}: no .safetensors weights file (SAELens saves sae_weights.safetensors).")
    if not preferred and len(names) > 1:
        raise InputError(f"{folder}: several .safetensors files ({names}); pass the weights file's path.")
    return os.path.join(folder, (preferred or names)[0])


def _config(cfg: dict) -> tuple[str, int | None, bool, str | None]:
    """(activation, k, apply_b_dec_to_input, hook name) from a SAELens cfg.json (older flat layout or newer one
    with a metadata block)."""
    meta = cfg.get("metadata") or {}
    arch = str(cfg.get("architecture") or "standard").lower()
    act_fn = str(cfg.get("activation_fn_str") or cfg.get("activation_fn") or "").lower()
    if arch == "standard" and act_fn == "topk":
        arch = "topk"
    if arch not in ARCHITECTURES:
        raise InputError(
            f"SAE architecture {arch!r} is not loaded: ie_lab encodes standard (ReLU), JumpReLU and TopK SAEs "
            "(a gated SAE needs its separate magnitude path)."
        )
    norm = cfg.get("normalize_activations")
    if norm not in (None, "none", False):
        raise InputError(
            f"normalize_activations={norm!r}: this SAE was trained on rescaled activations and the scale is not in "
            "its weights; fold it into W_enc / W_dec (or retrain without it) before loading."
        )
    k = cfg.get("k") or (cfg.get("activation_fn_kwargs") or {}).get("k")
    apply = bool(cfg.get("apply_b_dec_to_input", True))
    hook = cfg.get("hook_name") or meta.get("hook_name")
    return ARCHITECTURES[arch], (int(k) if k is not None else None), apply, hook


def load_sae(path: Any, model: Any = None, *, address: Any = None, engine: str = "transformerlens") -> SAE:
    """Load an SAE: a SAELens folder (cfg.json + sae_weights.safetensors), or a plain .safetensors dict with SAELens'
    names (W_enc [d, n], b_enc [n], W_dec [n, d], b_dec [d], threshold [n] for JumpReLU; ReLU without threshold).

    model (a Session, or a model ie_lab has loaded): resolves the config's hook name (another engine's name,
    TransformerLens by default) to the ie_lab point on this model, and checks the width. address= names the point
    instead (a plain dict has no hook name)."""
    path = os.fspath(path)
    cfg: dict = {}
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "cfg.json")
        if not os.path.lexists(cfg_path):
            raise InputError(f"{path}: no cfg.json; a SAELens folder holds cfg.json and sae_weights.safetensors.")
        cfg = read_json(cfg_path, "the SAE's config")
        if not isinstance(cfg, dict):
            raise InputError(f"{cfg_path}: a SAELens cfg.json holds one JSON object, not a {type(cfg).__name__}.")
        weights = _load_weights(_weights_file(path))
    elif path.endswith(".safetensors"):
        weights = _load_weights(path)
    else:
        raise InputError(f"{path!r}: pass a SAELens folder or a .safetensors file (never a pickle).")
    unknown = sorted(set(weights) - set(WEIGHT_KEYS))
    if unknown:
        raise InputError(f"{path}: unknown weight(s) {unknown}; an SAE holds {list(WEIGHT_KEYS)} (SAELens' names).")
    if "W_enc" not in weights or "b_enc" not in weights:
        raise InputError(f"{path}: an SAE needs W_enc [d, n] and b_enc [n].")
    if cfg:
        activation, k, apply, hook = _config(cfg)
    else:
        activation, k, apply, hook = ("jumprelu" if "threshold" in weights else "relu"), None, True, None
    if activation == "jumprelu" and "threshold" not in weights:
        raise InputError(f"{path}: a JumpReLU SAE needs its threshold [n] in the weights.")
    if activation == "topk" and k is None:
        raise InputError(f"{path}: a TopK SAE needs its k in cfg.json ('k' or activation_fn_kwargs.k).")
    w = {n: t.float() for n, t in weights.items()}
    sae = SAE(
        w["W_enc"],
        w["b_enc"],
        w.get("W_dec"),
        w.get("b_dec"),
        activation,
        w.get("threshold") if activation == "jumprelu" else None,
        k,
        apply,
        hook,
        cfg=cfg,
    )
    if sae.W_dec is not None and tuple(sae.W_dec.shape) != (sae.d_sae, sae.d_in):
        raise InputError(f"{path}: W_dec is {list(sae.W_dec.shape)}, expected [{sae.d_sae}, {sae.d_in}] (W_enc's).")
    if model is not None:
        lm = getattr(model, "_lm", model)
        facts = getattr(lm, "facts", None)
        if address is not None:
            addr = Address.parse(address)
        elif hook is not None:
            from .mappers import from_engine

            live = getattr(lm, "binding", None) is not None  # an eager model: the mapper reads its bound layers
            addr = from_engine(hook, model if live else facts, engine)
        else:
            raise AddressError(f"{path} names no hook: pass address='resid_post.L', the point it was trained on.")
        if facts is not None:
            addr = addr.check(facts)
            width = point_width(addr, facts)
            if width != sae.d_in:
                raise InputError(
                    f"{path}: the SAE reads {sae.d_in}-wide rows but {addr} is {width} wide on this model; it was "
                    "trained on another point or model."
                )
        sae.address = addr
    elif address is not None:
        sae.address = Address.parse(address)
    return sae
