"""Transcoders in circuit-tracer's own on-disk layout (safetensors only), read into ie_lab's Transcoder records.

A folder holds either
  * per-layer transcoders: ``layer_<L>.safetensors`` for L = 0..N-1, each with W_enc [d_sae, d], W_dec [d_sae, d],
    b_enc [d_sae], b_dec [d], and optionally ``activation_function.threshold`` [d_sae] (JumpReLU; ReLU without it)
    and ``W_skip`` [d, d] (a skip transcoder: its output adds x @ W_skip^T, a linear path beside the features); or
  * a cross-layer transcoder (CLT): ``W_enc_<L>.safetensors`` (W_enc_<L> [d_sae, d], b_enc_<L> [d_sae], b_dec_<L>
    [d], optionally threshold_<L> [d_sae]) and ``W_dec_<L>.safetensors`` (W_dec_<L> [d_sae, N - L, d]: layer L's
    features' writes into the outputs of layers L..N-1) for L = 0..N-1;
and optionally ``config.yaml`` (what circuit-tracer's hub configs hold): ``model_kind`` (``transcoder_set`` or
``cross_layer_transcoder``), ``feature_input_hook`` and ``feature_output_hook`` (TransformerLens hook names without
the ``blocks.L.`` prefix, such as ``mlp.hook_in`` / ``hook_resid_mid`` and ``hook_mlp_out``), ``transcoders`` (a
list of per-layer files: local paths, relative to the folder, or hf://org/name/file?revision=... entries found in the
Hugging Face cache by transcoder_release.py). Without a config a CLT reads ``hook_resid_mid`` and writes
``hook_mlp_out`` (circuit-tracer's load_clt defaults); per-layer files need the config's hooks.

Every tensor is checked (present, floating, finite, its shape against the others and the model's width) before a
Transcoder is built; W_enc and W_skip are stored transposed to ie_lab's orientation (x @ W_enc, x @ W_skip).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from .core.files import read_bytes
from .core.projection_args import point_width
from .errors import InputError
from .sae_files import found_text, load_weights

PER_LAYER = re.compile(r"^layer_(\d+)\.safetensors$")
CLT_ENC = re.compile(r"^W_enc_(\d+)\.safetensors$")
CLT_DEC = re.compile(r"^W_dec_(\d+)\.safetensors$")
CLT_DEFAULT_HOOKS = ("hook_resid_mid", "hook_mlp_out")  # circuit-tracer's load_clt defaults


def is_circuit_tracer_folder(path: str) -> bool:
    names = os.listdir(path)
    return "config.yaml" in names or any(PER_LAYER.match(n) or CLT_ENC.match(n) for n in names)


def config_of(path: str) -> dict:
    f = os.path.join(path, "config.yaml")
    if not os.path.exists(f):
        return {}
    import yaml

    try:
        cfg = yaml.safe_load(read_bytes(f, "circuit-tracer's config", "text").decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{f}: not readable YAML ({type(e).__name__}: {e}); fix or remove it.") from None
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise InputError(f"{f}: circuit-tracer's config.yaml holds one mapping, not {found_text(cfg)}.")
    return cfg


def _numbered(path: str, pattern: re.Pattern, what: str) -> list[str]:
    """The files matching pattern, in layer order; refused unless they are layers 0..N-1."""
    found = {int(m.group(1)): n for n in os.listdir(path) if (m := pattern.match(n))}
    if sorted(found) != list(range(len(found))):
        raise InputError(
            f"{path}: {what} files for layers {sorted(found)}: circuit-tracer's layout has one per layer from 0 "
            f"without gaps (missing {sorted(set(range(max(found) + 1)) - set(found))})."
        )
    return [os.path.join(path, found[L]) for L in range(len(found))]


def _tensor(w: dict, name: str, shape: tuple, where: str, optional: bool = False) -> torch.Tensor | None:
    t = w.get(name)
    if t is None:
        if optional:
            return None
        raise InputError(f"{where}: no tensor {name!r} (it holds {sorted(w)}); circuit-tracer's layout needs it.")
    if not t.is_floating_point():
        raise InputError(f"{where}: {name} is {t.dtype}, expected a floating-point tensor.")
    if tuple(t.shape) != tuple(shape):
        hint = " (transposed?)" if tuple(t.shape) == tuple(reversed(shape)) and len(shape) == 2 else ""
        raise InputError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)}{hint}.")
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{where}: {name} holds NaN or infinite values; replace the file with finite weights.")
    return t.float()


def _hooks(cfg: dict, where: str, kind: str) -> tuple[str, str]:
    got = cfg.get("feature_input_hook"), cfg.get("feature_output_hook")
    if got == (None, None):
        if kind == "cross_layer_transcoder":
            return CLT_DEFAULT_HOOKS
        raise InputError(
            f"{where}: per-layer transcoders in circuit-tracer's layout need a config.yaml naming the points they "
            "read and write (feature_input_hook: mlp.hook_in, feature_output_hook: hook_mlp_out, for instance)."
        )
    for k, v in zip(("feature_input_hook", "feature_output_hook"), got):
        if not isinstance(v, str) or not v.strip() or v.startswith("blocks."):
            raise InputError(
                f"{where}: {k} is {found_text(v)}, expected a TransformerLens hook name without its 'blocks.L.' "
                "prefix, such as 'mlp.hook_in' or 'hook_mlp_out'."
            )
    return got  # type: ignore[return-value]


def _points(hooks: tuple[str, str], layer: int, model: Any, resolve: Any, where: str) -> tuple[Any, Any]:
    a_in = resolve(f"blocks.{layer}.{hooks[0]}", model, where, "'feature_input_hook'")
    a_out = resolve(f"blocks.{layer}.{hooks[1]}", model, where, "'feature_output_hook'")
    if a_in.name not in ("mlp_in", "resid_mid") or a_out.name not in ("mlp_out", "mlp_out_post"):
        raise InputError(
            f"{where}: the transcoders read {a_in} and write {a_out}; a transcoder that replaces an MLP reads its "
            "input (mlp_in, or the residual before the MLP's norm, resid_mid) and writes its output (mlp_out)."
        )
    return a_in, a_out


def _check_width(a: Any, d: int, model: Any, where: str) -> Any:
    facts = getattr(getattr(model, "_lm", model), "facts", None)
    if facts is None:
        return a
    a = a.check(facts)
    if point_width(a, facts) != d:
        raise InputError(
            f"{where}: the transcoder reads and writes {d}-wide rows but {a} is {point_width(a, facts)} wide on this "
            "model: it was trained on another model."
        )
    return a


def load_circuit_tracer(path: str, model: Any, make: Any, resolve: Any, fetch: Any) -> list:
    """The transcoders of a folder in circuit-tracer's layout (per-layer or cross-layer), each built by make
    (transcoders.py's Transcoder) on the points resolve(hook name, model, where, field) names; the hf:// files its
    config.yaml lists are fetch(uris, where)'s local paths ({uri: path}; transcoder_release.hub_files)."""
    cfg = config_of(path)
    names = os.listdir(path)
    clt = any(CLT_ENC.match(n) for n in names)
    per_layer = any(PER_LAYER.match(n) for n in names) or "transcoders" in cfg
    kind = cfg.get("model_kind", "cross_layer_transcoder" if clt else "transcoder_set")
    if kind not in ("transcoder_set", "cross_layer_transcoder"):
        raise InputError(
            f"{path}/config.yaml: model_kind is {found_text(kind)}, expected 'transcoder_set' or "
            "'cross_layer_transcoder' (circuit-tracer's two kinds)."
        )
    if clt and per_layer or (kind == "cross_layer_transcoder") != clt:
        raise InputError(
            f"{path}: config.yaml says {kind!r} but the folder holds "
            f"{'W_enc_<L>.safetensors (a CLT)' if clt else 'per-layer files'}"
            f"{' and layer_<L>.safetensors' if clt and per_layer else ''}: keep one kind per folder."
        )
    hooks = _hooks(cfg, f"{path}/config.yaml", kind)
    return (
        _load_clt(path, model, make, resolve, hooks)
        if clt
        else _load_per_layer(path, cfg, model, make, resolve, hooks, fetch)
    )


def _activation(th: torch.Tensor | None) -> str:
    return "relu" if th is None else "jumprelu"


def refuse_conversions(cfg: dict, repo_id: str, where: str) -> None:
    """What circuit-tracer converts on load (by the repo's name and the listed files' kind), refused with the fix."""
    listed = cfg.get("transcoders")
    if "gemma-scope-2" in repo_id and listed is not None:
        raise InputError(
            f"{where}: a Gemma Scope 2 set, which circuit-tracer converts from its own checkpoint format on load; "
            "ie_lab reads circuit-tracer's safetensors layout as saved. Save the converted transcoders as "
            "layer_<L>.safetensors (W_enc [d_sae, d], W_dec [d_sae, d], b_enc, b_dec, activation_function.threshold) "
            "with a config.yaml, and load that folder."
        )
    if isinstance(listed, list) and any(isinstance(p, str) and p.endswith(".npz") for p in listed):
        raise InputError(
            f"{where}: lists .npz files (Gemma Scope's params.npz, which circuit-tracer converts on load: it "
            "transposes W_enc); ie_lab reads safetensors as saved and never guesses a conversion. Save them as "
            "layer_<L>.safetensors in circuit-tracer's layout (W_enc [d_sae, d]) and load that folder."
        )


def _load_per_layer(
    path: str, cfg: dict, model: Any, make: Any, resolve: Any, hooks: tuple[str, str], fetch: Any
) -> list:
    listed = cfg.get("transcoders")
    if listed is None:
        files = _numbered(path, PER_LAYER, "layer_<L>.safetensors")
    else:
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise InputError(f"{path}/config.yaml: 'transcoders' is {found_text(listed)}, expected a list of paths.")
        refuse_conversions(cfg, "", f"{path}/config.yaml")
        uris = [p for p in listed if p.startswith("hf://")]
        hub: dict[str, str] = fetch(uris, f"{path}/config.yaml") if uris else {}
        files = [hub[p] if p in hub else p if os.path.isabs(p) else os.path.join(path, p) for p in listed]
    out = []
    for L, f in enumerate(files):
        w = load_weights(f)
        if "log_thresholds" in w:
            raise InputError(f"{f}: log_thresholds: circuit-tracer refuses them too; store the thresholds.")
        known = {"W_enc", "W_dec", "b_enc", "b_dec", "activation_function.threshold", "W_skip"}
        if set(w) - known:
            raise InputError(f"{f}: tensors {sorted(set(w) - known)} are not circuit-tracer's ({sorted(known)}).")
        if "b_enc" not in w or "b_dec" not in w:
            raise InputError(f"{f}: no b_enc or b_dec (circuit-tracer's layout holds both).")
        n, d = int(w["b_enc"].shape[0]), int(w["b_dec"].shape[0])
        W_enc = _tensor(w, "W_enc", (n, d), f)
        W_dec = _tensor(w, "W_dec", (n, d), f)
        b_enc, b_dec = _tensor(w, "b_enc", (n,), f), _tensor(w, "b_dec", (d,), f)
        th = _tensor(w, "activation_function.threshold", (n,), f, optional=True)
        skip = _tensor(w, "W_skip", (d, d), f, optional=True)
        a_in, a_out = _points(hooks, L, model, resolve, f)
        a_in, a_out = _check_width(a_in, d, model, f), _check_width(a_out, d, model, f)
        assert W_enc is not None and W_dec is not None and b_enc is not None and b_dec is not None
        out.append(
            make(
                W_enc.T.contiguous(),
                b_enc,
                W_dec,
                b_dec,
                _activation(th),
                a_in,
                a_out,
                th,
                None,
                f,
                dict(cfg),
                W_skip=None if skip is None else skip.T.contiguous(),  # circuit-tracer adds x @ W_skip^T
            )
        )
    return out


def _load_clt(path: str, model: Any, make: Any, resolve: Any, hooks: tuple[str, str]) -> list:
    encs = _numbered(path, CLT_ENC, "W_enc_<L>.safetensors")
    decs = _numbered(path, CLT_DEC, "W_dec_<L>.safetensors") if any(CLT_DEC.match(n) for n in os.listdir(path)) else []
    N = len(encs)
    if len(decs) != N:
        raise InputError(
            f"{path}: {N} W_enc_<L>.safetensors files but {len(decs)} W_dec_<L>.safetensors: a CLT has one decoder "
            "file per layer (layer L's writes into layers L..N-1)."
        )
    n_layers = getattr(getattr(getattr(model, "_lm", model), "facts", None), "n_layers", None)
    if n_layers is not None and N > n_layers:
        raise InputError(
            f"{path}: a CLT over {N} layers, but the model has {n_layers}: it was trained on another model."
        )
    out, thresholds = [], []
    for L in range(N):
        w = load_weights(encs[L])
        for k in (f"W_enc_{L}", f"b_enc_{L}", f"b_dec_{L}"):
            if k not in w:
                raise InputError(f"{encs[L]}: no tensor {k!r} (it holds {sorted(w)}).")
        n, d = int(w[f"b_enc_{L}"].shape[0]), int(w[f"b_dec_{L}"].shape[0])
        W_enc = _tensor(w, f"W_enc_{L}", (n, d), encs[L])
        b_enc, b_dec = _tensor(w, f"b_enc_{L}", (n,), encs[L]), _tensor(w, f"b_dec_{L}", (d,), encs[L])
        th = _tensor(w, f"threshold_{L}", (n,), encs[L], optional=True)
        thresholds.append(th is not None)
        wd = load_weights(decs[L])
        if set(wd) != {f"W_dec_{L}"}:
            raise InputError(f"{decs[L]}: holds {sorted(wd)}, expected the one tensor 'W_dec_{L}'.")
        W_dec = _tensor(wd, f"W_dec_{L}", (n, N - L, d), decs[L])
        assert W_enc is not None and b_enc is not None and b_dec is not None and W_dec is not None
        a_in, a_out = _points(hooks, L, model, resolve, encs[L])
        a_in, a_out = _check_width(a_in, d, model, encs[L]), _check_width(a_out, d, model, encs[L])
        out.append(
            make(
                W_enc.T.contiguous(),
                b_enc,
                W_dec[:, 0].contiguous(),
                b_dec,
                _activation(th),
                a_in,
                a_out,
                th,
                None,
                path,
                {
                    "model_kind": "cross_layer_transcoder",
                    "feature_input_hook": hooks[0],
                    "feature_output_hook": hooks[1],
                },
                decoders={L + k: W_dec[:, k].contiguous() for k in range(1, N - L)},
                clt_layers=tuple(range(N)),
            )
        )
    if len(set(thresholds)) > 1:
        raise InputError(f"{path}: threshold_<L> in some layers' files and not others: a CLT has one activation.")
    widths = {(t.d_in, t.d_sae) for t in out}
    if len(widths) > 1:
        raise InputError(f"{path}: the layers' (d_model, d_sae) differ ({sorted(widths)}): one CLT has one of each.")
    return out
