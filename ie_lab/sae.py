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
that does not match the point. And a hostile or damaged folder (issue 28): every config field it reads is checked
for its type and range and against the tensors, and every tensor for its name, dtype, shape and values, before the
SAE is built; each refusal is an InputError (AddressError for the point) naming the file, the field, what was found
against what was expected, and the fix, never a plain Python or torch error (tests/test_sae_hostile.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from .address import Address
from .core.files import read_json
from .core.projection_args import make_encoder, point_width
from .errors import AddressError, InputError, did_you_mean, shown
from .ops.projection import scores as encode_rows
from .sae_files import SAEConfig, checked_weights, found_text, load_weights, read_config, refusal, weights_file


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
    # what its feature activations are captured as in a spliced run ('sae.<name>.acts'): load_sae's name=, by
    # default the folder's (or file's) name in letters, digits, '_' and '-'
    name: str = "sae"

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

    def splice(self, session: Any, *, error: bool = False) -> Any:
        """This SAE spliced in at its point (s.splice(self, error=...)): docs/SAE.md, "Splicing"."""
        return session.splice(self, error=error)

    def __repr__(self) -> str:
        where = self.address if self.address is not None else "unattached"
        return (
            f"SAE({self.name!r}: {self.activation}, d_in={self.d_in}, d_sae={self.d_sae}, at {where}, hook "
            f"{self.hook_name!r})"
        )


def _default_name(path: str) -> str:
    """The folder's or file's name as an SAE name: letters, digits, '_' and '-' (anything else becomes '_')."""
    base = os.path.basename(os.path.normpath(path))
    if base.endswith(".safetensors"):
        base = base[: -len(".safetensors")]
    return re.sub(r"[^A-Za-z0-9_\-]", "_", base)[:64] or "sae"


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", name):
        raise InputError(
            f"name={name!r}: an SAE's name is 1 to 64 letters, digits, '_' or '-' (its features are captured as "
            "'sae.<name>.acts'), e.g. name='res1'."
        )
    return name


def load_sae(
    path: Any = None,
    model: Any = None,
    *,
    address: Any = None,
    engine: str = "transformerlens",
    release: Any = None,
    sae_id: Any = None,
    repo_id: Any = None,
    revision: Any = None,
    cache_dir: Any = None,
    name: Any = None,
) -> SAE:
    """Load an SAE: a SAELens folder (cfg.json + sae_weights.safetensors), or a plain .safetensors dict with SAELens'
    names (W_enc [d, n], b_enc [n], W_dec [n, d], b_dec [d], threshold [n] for JumpReLU; ReLU without threshold).

    model (a Session, or a model ie_lab has loaded): resolves the config's hook name (another engine's name,
    TransformerLens by default) to the ie_lab point on this model, and checks the width. address= names the point
    instead (a plain dict has no hook name).

    Everything is checked before the SAE is built (docs/SAE.md, "Refused, with the reason"): the config's fields,
    the tensors' names, dtypes, shapes and values, the two against each other, and the point; each refusal is an
    InputError (or an AddressError for the point) naming the file, the field and the fix.

    release= and sae_id= (SAELens' registry names), or repo_id= and sae_id= (the folder in that repo), name a
    published SAE instead of path: its folder comes from the Hugging Face cache (ie_lab/sae_release.py).

    name= names it where its feature activations are captured in a spliced run ('sae.<name>.acts'; default: the
    folder's or file's name, e.g. 'demo_sae' for ie_lab.DEMO_SAE)."""
    if name is not None:
        name = _checked_name(name)
    if any(v is not None for v in (release, sae_id, repo_id, revision, cache_dir)):
        from .sae_release import resolve

        path = resolve(path, release, sae_id, repo_id, revision, cache_dir)
    try:
        path = os.fsdecode(os.fspath(path))
    except TypeError:
        raise InputError(
            f"path={found_text(path)}: pass the path of a SAELens folder or of a .safetensors file (a str or a "
            "pathlib.Path)."
        ) from None
    cfg: Any = {}
    cfg_path: str | None = None
    conf = SAEConfig()  # a plain dict's: ReLU (JumpReLU if it holds a threshold), b_dec applied where it has one
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "cfg.json")
        if not os.path.lexists(cfg_path):
            raise InputError(f"{path}: no cfg.json; a SAELens folder holds cfg.json and sae_weights.safetensors.")
        cfg = read_json(cfg_path, "the SAE's config")
        conf = read_config(cfg, cfg_path, False)  # checked before the weights are read: a bad config costs no read
        weights_path = weights_file(path)
    elif path.endswith(".safetensors"):
        weights_path = path
    else:
        raise InputError(f"{path!r}: pass a SAELens folder or a .safetensors file (never a pickle).")
    weights = load_weights(weights_path)
    if "threshold" in weights:  # a config that names no architecture: a saved threshold means JumpReLU
        conf = read_config(cfg, cfg_path, True) if cfg_path is not None else SAEConfig("jumprelu", "jumprelu")
    w = checked_weights(weights, weights_path, conf, cfg_path)
    source = cfg_path or weights_path
    addr: Address | None = None
    width: int | None = None  # the point's, where the model tells it
    if model is not None:
        lm = getattr(model, "_lm", model)
        facts = getattr(lm, "facts", None)
        if address is not None:
            addr = Address.parse(address)
            if facts is not None:
                addr = addr.check(facts)
                width = point_width(addr, facts)
        elif conf.hook_name is not None:
            from .mappers import ENGINES, from_engine

            if engine not in ENGINES:
                raise InputError(f"engine={engine!r}: one of {list(ENGINES)}.{did_you_mean(str(engine), ENGINES)}")
            if conf.head_index is not None:
                raise refusal(
                    source,
                    "'hook_head_index'",
                    str(conf.head_index),
                    "null: ie_lab attaches an SAE to a whole point by its hook name",
                    f"This SAE reads one head's slice of {shown(conf.hook_name)}: pass address= naming that head (such "
                    f"as address='z.L.head-{conf.head_index}') to load_sae.",
                )
            live = getattr(lm, "binding", None) is not None  # an eager model: the mapper reads its bound layers
            try:
                addr = from_engine(conf.hook_name, model if live else facts, engine)
                if facts is not None:
                    addr = addr.check(facts)
                    width = point_width(addr, facts)
            except (AddressError, InputError) as e:
                cls = AddressError if isinstance(e, AddressError) else InputError
                raise cls(
                    f"{source}: 'hook_name' {shown(conf.hook_name)} ({engine}) names no point this SAE can attach to on "
                    f"this model: {e} Correct hook_name, or pass address= naming the point the SAE was trained on."
                ) from None
        else:
            raise AddressError(
                f"{source} names no hook: pass address='resid_post.L', the point the SAE was trained on (or add "
                "hook_name to its cfg.json)."
            )
        if width is not None and width != int(w["W_enc"].shape[0]):
            raise InputError(
                f"{source}: the SAE reads {int(w['W_enc'].shape[0])}-wide rows (d_in) but {addr} is {width} wide on "
                "this model: it was trained on another point or model. Check hook_name, or pass address= naming the "
                "point it was trained on."
            )
    elif address is not None:
        addr = Address.parse(address)
    activation = conf.activation
    sae = SAE(
        w["W_enc"],
        w["b_enc"],
        w.get("W_dec"),
        w.get("b_dec"),
        activation,
        w.get("threshold") if activation == "jumprelu" else None,
        conf.k if activation == "topk" else None,
        conf.apply_b_dec_to_input,
        conf.hook_name,
        cfg=cfg,
    )
    sae.address = addr
    sae.name = name if name is not None else _default_name(path)
    return sae
