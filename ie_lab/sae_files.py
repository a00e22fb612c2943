"""Reading an SAE's files, each thing checked before it is used: the config (cfg.json) field by field, the weights
(safetensors only) by name, dtype, shape and value, and the two against each other. Every refusal is an InputError
naming the file, the field, what was found against what was expected, and the fix (docs/SAE.md, "Refused, with the
reason"; tests/test_sae_hostile.py). ie_lab/sae.py builds the SAE from what this returns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .core.files import checked_file
from .errors import InputError, did_you_mean, shown

WEIGHT_KEYS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
ARCHITECTURES = {"standard": "relu", "relu": "relu", "jumprelu": "jumprelu", "topk": "topk"}


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


def found_text(v: Any) -> str:
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


def refusal(where: str, field: str, found: str, expected: str, fix: str, verb: str = "is") -> InputError:
    """The one shape of a refusal: the file, the field, what was found against what was expected, and the fix."""
    return InputError(f"{where}: {field} {verb} {found}, expected {expected}. {fix}")


@dataclass
class SAEConfig:
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


def read_config(cfg: Any, where: str, has_threshold: bool) -> SAEConfig:
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
        raise refusal(
            where,
            "'metadata'",
            found_text(meta),
            "a JSON object (SAELens' newer layout keeps hook_name there) or no such field",
            "Make it an object, or remove it.",
        )
    # the architecture, with the older layout's activation_fn_str ("topk" on a standard SAE meant TopK)
    arch_raw = cfg.get("architecture")
    if arch_raw is not None and not isinstance(arch_raw, str):
        raise refusal(
            where,
            "'architecture'",
            found_text(arch_raw),
            f"one of {sorted(ARCHITECTURES)} (a string)",
            "Write the architecture the SAE was trained with.",
        )
    act_raw, act_field = "", ""
    for name in ("activation_fn_str", "activation_fn"):
        v = cfg.get(name)
        if v is None or v == "":
            continue
        if not isinstance(v, str):
            raise refusal(
                where,
                f"'{name}'",
                found_text(v),
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
            f"{where}: 'architecture' is {found_text(arch_raw)}, which ie_lab does not load: it encodes standard (ReLU), "
            f"JumpReLU and TopK SAEs, written {sorted(ARCHITECTURES)}{why}.{did_you_mean(arch, ARCHITECTURES)}"
        )
    if arch in (None, "standard", "relu"):
        if act == "topk":
            arch = "topk"
        elif act not in ("", "relu"):
            raise refusal(
                where,
                f"'{act_field}'",
                found_text(act_raw),
                "'relu' (or 'topk') for a standard SAE",
                "ie_lab encodes a standard SAE with ReLU only: an SAE trained with another activation (tanh-relu, "
                "...) cannot be loaded faithfully.",
            )
        elif arch is None:  # a config from before the field: a saved threshold means JumpReLU
            arch = "jumprelu" if has_threshold else "standard"
    norm = cfg.get("normalize_activations")
    if not (norm is None or norm is False or (isinstance(norm, str) and norm.strip().lower() == "none")):
        raise InputError(
            f"{where}: normalize_activations is {found_text(norm)}: this SAE was trained on rescaled activations and the "
            "scale is not in its weights; fold it into W_enc / W_dec (or retrain without it), set "
            "normalize_activations to 'none', and load it again."
        )
    # TopK's k: 'k', or activation_fn_kwargs.k in the older layout
    kwargs = cfg.get("activation_fn_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise refusal(
            where,
            "'activation_fn_kwargs'",
            found_text(kwargs),
            'a JSON object (such as {"k": 32}) or no such field',
            "Make it an object, or remove it.",
        )
    k_top, k_kw = cfg.get("k"), kwargs.get("k")
    if k_top is not None and k_kw is not None and (_count(k_top) is None or _count(k_top) != _count(k_kw)):
        raise InputError(
            f"{where}: 'k' is {found_text(k_top)} but 'activation_fn_kwargs.k' is {found_text(k_kw)}: the config names two "
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
            raise refusal(
                where, k_field, found_text(k), "an integer from 1 to d_sae", "Write the k the SAE was trained with."
            )
    elif k is not None:
        raise refusal(
            where,
            k_field,
            found_text(k),
            f"no k: k is TopK's, and the architecture is {arch!r}",
            "Set 'architecture' to 'topk' if this is a TopK SAE, or remove k.",
        )
    apply, apply_given = True, "apply_b_dec_to_input" in cfg
    if apply_given:
        apply = cfg["apply_b_dec_to_input"]
        if not isinstance(apply, bool):
            raise refusal(
                where,
                "'apply_b_dec_to_input'",
                found_text(apply),
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
            raise refusal(
                where, f"'{name}'", found_text(v), f"a positive integer ({what})", f"Correct {name}, or remove it."
            )
        dims[name] = _count(v) if v is not None else None
    hooks = []
    for name, src in (("'hook_name'", cfg), ("'metadata.hook_name'", meta)):
        v = src.get("hook_name")
        if v is None:
            continue
        if not isinstance(v, str) or not v.strip():
            raise refusal(
                where,
                name,
                found_text(v),
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
        raise refusal(
            where,
            "'hook_head_index'",
            found_text(head),
            "a head index (an integer >= 0) or null",
            "Correct it, or remove it.",
        )
    return SAEConfig(
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


def checked_weights(
    weights: dict[str, torch.Tensor], where: str, conf: SAEConfig, cfg_where: str | None
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
            raise refusal(
                where,
                f"'{name}'",
                f"of dtype {str(t.dtype).removeprefix('torch.')}",
                "a floating-point tensor (float32, float16, bfloat16 or float64)",
                f"Save it as floats ({name}.float()).",
            )
    W = weights["W_enc"]
    if W.dim() != 2:
        raise refusal(
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
            raise refusal(
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
            raise refusal(
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
        raise refusal(
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
            raise refusal(
                cw,
                f"'{name}'",
                str(have),
                f"{real}, as W_enc {list(W.shape)} in {where} says",
                f"Correct {name}, or check that the weights are this config's.",
            )
    if conf.activation == "topk" and conf.k is not None and conf.k > n:
        raise refusal(
            cw,
            conf.k_field,
            str(conf.k),
            f"an integer from 1 to d_sae = {n} (TopK keeps the k largest of the d_sae features)",
            "Write the k the SAE was trained with.",
        )
    return out


def load_weights(path: str) -> dict[str, torch.Tensor]:
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


def weights_file(folder: str) -> str:
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
