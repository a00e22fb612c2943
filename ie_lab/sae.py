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
from dataclasses import dataclass, field
from typing import Any

import torch

from .address import Address
from .core.files import checked_file, read_json
from .core.projection_args import make_encoder, point_width
from .errors import AddressError, InputError, did_you_mean, shown
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


def _json_type(v: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _found(v: Any) -> str:
    """A config value as a message shows it: its repr (cut) and its JSON type."""
    text = repr(v)
    if len(text) > 60:
        text = text[:60] + f"... ({len(text)} characters)"
    return f"{text} ({_json_type(v)})"


def _count(v: Any) -> int | None:
    """A config's count (d_in, d_sae, k) as an int: an integer, or a float that is one (32.0, as some writers save
    k); None for anything else (a bool, a string, 16.5, NaN)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _refuse(where: str, field: str, found: str, expected: str, fix: str, verb: str = "is") -> InputError:
    """The one shape of a refusal: the file, the field, what was found against what was expected, and the fix."""
    return InputError(f"{where}: {field} {verb} {found}, expected {expected}. {fix}")


@dataclass
class _Config:
    """What load_sae reads from a cfg.json, each field checked (a plain safetensors dict has the defaults)."""

    activation: str = "relu"  # ops/projection.py's name
    architecture: str = "standard"  # as the config says it (or as it was inferred)
    k: int | None = None
    k_field: str = "'k'"
    apply_b_dec_to_input: bool = True
    apply_given: bool = False
    hook_name: str | None = None
    head_index: int | None = None
    d_in: int | None = None
    d_sae: int | None = None


def _read_config(cfg: Any, where: str, has_threshold: bool) -> _Config:
    """Check a SAELens cfg.json (older flat layout or newer one with a metadata block) field by field. Fields
    ie_lab does not use (dtype, device, model_name, training settings, ...) are left alone; a field it uses that
    has the wrong type, an impossible value or contradicts another is refused."""
    if not isinstance(cfg, dict):
        raise InputError(
            f'{where}: a SAELens cfg.json holds one JSON object ({{"architecture": ..., "hook_name": ...}}), '
            f"not {_json_type(cfg)}. Replace it with the cfg.json saved with the SAE."
        )
    meta = cfg.get("metadata")
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict):
        raise _refuse(
            where,
            "'metadata'",
            _found(meta),
            "a JSON object (SAELens' newer layout keeps hook_name there) or no such field",
            "Make it an object, or remove it.",
        )
    # the architecture, with the older layout's activation_fn_str ("topk" on a standard SAE meant TopK)
    arch_raw = cfg.get("architecture")
    if arch_raw is not None and not isinstance(arch_raw, str):
        raise _refuse(
            where,
            "'architecture'",
            _found(arch_raw),
            f"one of {sorted(ARCHITECTURES)} (a string)",
            "Write the architecture the SAE was trained with.",
        )
    act_raw, act_field = "", ""
    for name in ("activation_fn_str", "activation_fn"):
        v = cfg.get(name)
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise _refuse(
                where,
                f"'{name}'",
                _found(v),
                "a string ('relu' or 'topk')",
                "Write the activation's name, or remove it.",
            )
        act_raw, act_field = act_raw or v, act_field or name
    act = act_raw.strip().lower()
    arch = arch_raw.strip().lower() if arch_raw is not None else None
    if arch is not None and arch not in ARCHITECTURES:
        why = (
            " (a gated SAE needs its separate magnitude path, which project() does not run)" if arch == "gated" else ""
        )
        raise InputError(
            f"{where}: 'architecture' is {_found(arch_raw)}, which ie_lab does not load: it encodes standard (ReLU), "
            f"JumpReLU and TopK SAEs, written {sorted(ARCHITECTURES)}{why}.{did_you_mean(arch, ARCHITECTURES)}"
        )
    if arch in (None, "standard", "relu"):
        if act == "topk":
            arch = "topk"
        elif act not in ("", "relu"):
            raise _refuse(
                where,
                f"'{act_field}'",
                _found(act_raw),
                "'relu' (or 'topk') for a standard SAE",
                "ie_lab encodes a standard SAE with ReLU only: an SAE trained with another activation (tanh-relu, "
                "...) cannot be loaded faithfully.",
            )
        elif arch is None:  # a config from before the field: a saved threshold means JumpReLU
            arch = "jumprelu" if has_threshold else "standard"
    norm = cfg.get("normalize_activations")
    if not (norm is None or norm is False or (isinstance(norm, str) and norm.strip().lower() == "none")):
        raise InputError(
            f"{where}: normalize_activations is {_found(norm)}: this SAE was trained on rescaled activations and the "
            "scale is not in its weights; fold it into W_enc / W_dec (or retrain without it), set "
            "normalize_activations to 'none', and load it again."
        )
    # TopK's k: 'k', or activation_fn_kwargs.k in the older layout
    kwargs = cfg.get("activation_fn_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise _refuse(
            where,
            "'activation_fn_kwargs'",
            _found(kwargs),
            'a JSON object (such as {"k": 32}) or no such field',
            "Make it an object, or remove it.",
        )
    k_top, k_kw = cfg.get("k"), kwargs.get("k")
    if k_top is not None and k_kw is not None and (_count(k_top) is None or _count(k_top) != _count(k_kw)):
        raise InputError(
            f"{where}: 'k' is {_found(k_top)} but 'activation_fn_kwargs.k' is {_found(k_kw)}: the config names two "
            "k's. Keep the one the SAE was trained with (in either place) and remove the other."
        )
    k = k_top if k_top is not None else k_kw
    k = _count(k) if _count(k) is not None else k
    k_field = "'k'" if k_top is not None else "'activation_fn_kwargs.k'"
    if arch == "topk":
        if k is None:
            raise InputError(
                f"{where}: a TopK SAE needs its k in cfg.json ('k' or activation_fn_kwargs.k): add the k it was "
                "trained with."
            )
        if _count(k) is None or k < 1:
            raise _refuse(
                where, k_field, _found(k), "an integer from 1 to d_sae", "Write the k the SAE was trained with."
            )
    elif k is not None:
        raise _refuse(
            where,
            k_field,
            _found(k),
            f"no k: k is TopK's, and the architecture is {arch!r}",
            "Set 'architecture' to 'topk' if this is a TopK SAE, or remove k.",
        )
    apply, apply_given = True, "apply_b_dec_to_input" in cfg
    if apply_given:
        apply = cfg["apply_b_dec_to_input"]
        if not isinstance(apply, bool):
            raise _refuse(
                where,
                "'apply_b_dec_to_input'",
                _found(apply),
                "true or false",
                "Write true (SAELens' default: b_dec is subtracted from the input before encoding) or false.",
            )
    dims: dict[str, int | None] = {}
    for name, what in (
        ("d_in", "the width of the rows it reads, W_enc's first dimension"),
        ("d_sae", "its number of features, W_enc's second dimension"),
    ):
        v = cfg.get(name)
        if v is not None and (_count(v) is None or v < 1):
            raise _refuse(
                where, f"'{name}'", _found(v), f"a positive integer ({what})", f"Correct {name}, or remove it."
            )
        dims[name] = _count(v) if v is not None else None
    hooks = []
    for name, src in (("'hook_name'", cfg), ("'metadata.hook_name'", meta)):
        v = src.get("hook_name")
        if v is None:
            continue
        if not isinstance(v, str) or not v.strip():
            raise _refuse(
                where,
                name,
                _found(v),
                "the name of the point the SAE was trained on, e.g. 'blocks.3.hook_resid_post'",
                "Write that name, or remove it and pass address= to load_sae.",
            )
        hooks.append((name, v))
    if len(hooks) == 2 and hooks[0][1].strip() != hooks[1][1].strip():
        raise InputError(
            f"{where}: 'hook_name' is {shown(hooks[0][1])} but 'metadata.hook_name' is {shown(hooks[1][1])}: the "
            "config names "
            "two points. Keep the one the SAE was trained on, or pass address= to load_sae."
        )
    head = cfg.get("hook_head_index")
    if head is None:
        head = meta.get("hook_head_index")
    if head is not None and (isinstance(head, bool) or not isinstance(head, int) or head < 0):
        raise _refuse(
            where,
            "'hook_head_index'",
            _found(head),
            "a head index (an integer >= 0) or null",
            "Correct it, or remove it.",
        )
    return _Config(
        activation=ARCHITECTURES[arch],
        architecture=arch,
        k=k,
        k_field=k_field,
        apply_b_dec_to_input=apply,
        apply_given=apply_given,
        hook_name=hooks[0][1] if hooks else None,
        head_index=head,
        d_in=dims["d_in"],
        d_sae=dims["d_sae"],
    )


_SHAPES = {
    "b_enc": "one bias per feature: d_sae, W_enc's second dimension",
    "W_dec": "[d_sae, d_in]: W_enc's shape reversed",
    "b_dec": "d_in, W_enc's first dimension",
    "threshold": "one threshold per feature: d_sae, W_enc's second dimension",
}


def _checked_weights(
    weights: dict[str, torch.Tensor], where: str, conf: _Config, cfg_where: str | None
) -> dict[str, torch.Tensor]:
    """The SAE's tensors as finite float32, once names, dtypes, shapes and values are checked against each other
    and the config; else an InputError naming the file (the weights file, or cfg.json where the config is wrong)."""
    unknown = sorted(set(weights) - set(WEIGHT_KEYS))
    if unknown:
        raise InputError(
            f"{where}: unknown weight(s) {unknown}; an SAE holds {list(WEIGHT_KEYS)} (SAELens' names), and ie_lab "
            "does not guess what another tensor does to the encoding (a gated SAE's r_mag, a scaling factor). Remove "
            "them (folding any scale into W_enc / W_dec first) and save the file again."
        )
    missing = [n for n in ("W_enc", "b_enc") if n not in weights]
    if missing:
        raise InputError(
            f"{where}: no {' and no '.join(missing)} in the weights (tensors found: {sorted(weights)}); an SAE needs "
            "W_enc [d_in, d_sae] and b_enc [d_sae] under SAELens' names. Save them under these names."
        )
    for name, t in weights.items():
        if not t.is_floating_point():
            raise _refuse(
                where,
                f"'{name}'",
                f"of dtype {str(t.dtype).removeprefix('torch.')}",
                "a floating-point tensor (float32, float16, bfloat16 or float64)",
                f"Save it as floats ({name}.float()).",
            )
    W = weights["W_enc"]
    if W.dim() != 2:
        raise _refuse(
            where, "'W_enc'", f"{list(W.shape)} ({W.dim()}-D)", "a 2-D tensor [d_in, d_sae]", "Save W_enc as a matrix."
        )
    d_in, n = (int(x) for x in W.shape)
    if d_in == 0 or n == 0:
        raise InputError(
            f"{where}: 'W_enc' is {list(W.shape)}: an SAE with no features (d_sae = 0) or no input (d_in = 0) encodes "
            "nothing. Save the trained weights."
        )
    b_enc = weights["b_enc"]
    by_bias = b_enc.dim() == 1 and b_enc.numel() == d_in != n
    if by_bias or (conf.d_in, conf.d_sae) == (n, d_in) != (d_in, n):
        why = f"b_enc has {b_enc.numel()} entries" if by_bias else f"cfg.json says d_in={conf.d_in}, d_sae={conf.d_sae}"
        raise InputError(
            f"{where}: 'W_enc' is {list(W.shape)} but {why}: W_enc looks transposed (saved [d_sae, d_in]), expected "
            "[d_in, d_sae] as SAELens saves it. Save W_enc.T instead."
        )
    want = {"b_enc": (n,), "W_dec": (n, d_in), "b_dec": (d_in,), "threshold": (n,)}
    for name, shape in want.items():
        got = weights.get(name)
        if got is not None and tuple(got.shape) != shape:
            flipped = got.dim() == 2 and tuple(got.shape)[::-1] == shape
            hint = f" (it looks transposed: save {name}.T)" if flipped else ""
            raise _refuse(
                where,
                f"'{name}'",
                str(list(got.shape)),
                f"{list(shape)} ({_SHAPES[name]})",
                f"Save {name} with that shape{hint}, or check that the tensors are one SAE's.",
            )
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        x = t.detach().to("cpu", torch.float32).contiguous()  # float64, float16, bfloat16: converted here, explicitly
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
            over = int(
                (torch.isinf(x) & torch.isfinite(t.to(torch.float64))).sum()
            )  # finite in its own dtype, too large for float32
            said = [f"{n_nan} NaN"] if n_nan else []
            said += [f"{n_inf - over} inf"] if n_inf > over else []
            said += [f"{over} value(s) too large for float32 (|x| > 3.4e38), which ie_lab computes in"] if over else []
            first = [int(i) for i in bad.nonzero()[0]]
            raise _refuse(
                where,
                f"'{name}'",
                f"{', '.join(said)} (the first at index {first})",
                "finite numbers",
                "A non-finite weight makes every feature it touches NaN: export the SAE again from a healthy checkpoint.",
                verb="holds",
            )
        out[name] = x
    if conf.activation == "jumprelu" and "threshold" not in out:
        raise InputError(
            f"{where}: a JumpReLU SAE needs its threshold [d_sae] in the weights (architecture "
            f"{conf.architecture!r}); save it under the name 'threshold'."
        )
    if conf.activation != "jumprelu" and "threshold" in out:
        raise InputError(
            f"{where}: 'threshold' is in the weights, but the SAE's architecture is {conf.architecture!r}; a threshold "
            "is JumpReLU's. Set 'architecture' to 'jumprelu' in cfg.json if this is a JumpReLU SAE, or remove the "
            "threshold."
        )
    if "threshold" in out and bool((out["threshold"] < 0).any()):
        thr = out["threshold"]
        raise _refuse(
            where,
            "'threshold'",
            f"{int((thr < 0).sum())} negative value(s) (the smallest {float(thr.min()):.3g})",
            "thresholds >= 0",
            "A JumpReLU passes z only above its threshold, so a negative one lets negative activations through, "
            "which no trained JumpReLU SAE does. If the file holds log-thresholds, save threshold = exp(them).",
            verb="holds",
        )
    if "b_dec" not in out and conf.apply_given and conf.apply_b_dec_to_input:
        raise InputError(
            f"{where}: no 'b_dec' in the weights, but cfg.json sets apply_b_dec_to_input to true (b_dec is "
            "subtracted from the input before encoding). Save b_dec [d_in] with the weights, or set "
            "apply_b_dec_to_input to false if the SAE has none."
        )
    cw = cfg_where or where
    for name, have, real in (("d_in", conf.d_in, d_in), ("d_sae", conf.d_sae, n)):
        if have is not None and have != real:
            raise _refuse(
                cw,
                f"'{name}'",
                str(have),
                f"{real}, as W_enc {list(W.shape)} in {where} says",
                f"Correct {name}, or check that the weights are this config's.",
            )
    if conf.activation == "topk" and conf.k is not None and conf.k > n:
        raise _refuse(
            cw,
            conf.k_field,
            str(conf.k),
            f"an integer from 1 to d_sae = {n} (TopK keeps the k largest of the d_sae features)",
            "Write the k the SAE was trained with.",
        )
    return out


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    checked = checked_file(path, "the SAE's weights file", "tensors")
    try:
        return load_file(checked, device="cpu")
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError, OverflowError) as e:
        raise InputError(
            f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); replace it with the SAE's weights "
            "as saved (safetensors.torch.save_file, or SAELens' save)."
        ) from None


def _weights_file(folder: str) -> str:
    try:
        entries = os.listdir(folder)
    except OSError as e:
        raise InputError(f"{folder}: the folder cannot be listed ({e}); check its permissions.") from None
    names = sorted(n for n in entries if n.endswith(".safetensors") and "sparsity" not in n)
    preferred = [n for n in names if n == "sae_weights.safetensors"]
    if not names:
        raise InputError(f"{folder}: no .safetensors weights file (SAELens saves sae_weights.safetensors).")
    if not preferred and len(names) > 1:
        raise InputError(f"{folder}: several .safetensors files ({names}); pass the weights file's path.")
    return os.path.join(folder, (preferred or names)[0])


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
    published SAE instead of path: its folder comes from the Hugging Face cache (ie_lab/sae_release.py)."""
    if any(v is not None for v in (release, sae_id, repo_id, revision, cache_dir)):
        from .sae_release import resolve

        path = resolve(path, release, sae_id, repo_id, revision, cache_dir)
    try:
        path = os.fsdecode(os.fspath(path))
    except TypeError:
        raise InputError(
            f"path={_found(path)}: pass the path of a SAELens folder or of a .safetensors file (a str or a "
            "pathlib.Path)."
        ) from None
    cfg: Any = {}
    cfg_path: str | None = None
    conf = _Config()  # a plain dict's: ReLU (JumpReLU if it holds a threshold), b_dec applied where it has one
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "cfg.json")
        if not os.path.lexists(cfg_path):
            raise InputError(f"{path}: no cfg.json; a SAELens folder holds cfg.json and sae_weights.safetensors.")
        cfg = read_json(cfg_path, "the SAE's config")
        conf = _read_config(cfg, cfg_path, False)  # checked before the weights are read: a bad config costs no read
        weights_path = _weights_file(path)
    elif path.endswith(".safetensors"):
        weights_path = path
    else:
        raise InputError(f"{path!r}: pass a SAELens folder or a .safetensors file (never a pickle).")
    weights = _load_weights(weights_path)
    if "threshold" in weights:  # a config that names no architecture: a saved threshold means JumpReLU
        conf = _read_config(cfg, cfg_path, True) if cfg_path is not None else _Config("jumprelu", "jumprelu")
    w = _checked_weights(weights, weights_path, conf, cfg_path)
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
                raise _refuse(
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
    return sae
