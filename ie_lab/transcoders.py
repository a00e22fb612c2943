"""Transcoders as users have them on disk: SAELens' transcoder folders (cfg.json and safetensors weights), one per
layer, each reading the MLP's input after its norm (mlp_in.L) and predicting the MLP's output (mlp_out.L); and
circuit-tracer's layout (circuit_tracer_files.py): per-layer files, with a skip path (W_skip) or not, and
cross-layer transcoders (CLT), whose layer-L features write into the output of layer L and of every later layer.

``load_transcoders(path, session)`` reads one folder, or a parent folder of them (one per layer), and attaches each
transcoder to the points its hook names mean on the model (ie_lab/mappers.py). The file checks are the SAE's
(ie_lab/sae_files.py: every config field and tensor checked before use); what is a transcoder's own is read here:
the architecture (SAELens' ``transcoder`` = ReLU, ``jumprelu_transcoder``, and ``topk_transcoder`` with its k), the
output's hook name (``hook_name_out``) and width (``d_out``), and b_dec belonging to the output (never subtracted from
the input). Skip and cross-layer transcoders in SAELens' layout are refused with the reason. The transcoders feed
ie_lab.attribution_graph (docs/CIRCUITS.md); ``check`` reports each layer's reconstruction error of the MLP output.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .address import Address
from .core.files import read_json
from .core.projection_args import point_width
from .errors import AddressError, InputError, did_you_mean, shown
from .sae_files import checked_weights, found_text, load_weights, read_config, refusal, weights_file

# SAELens' transcoder architectures, as the SAE architecture whose encoding each one runs.
ARCHITECTURES = {"transcoder": "standard", "jumprelu_transcoder": "jumprelu", "topk_transcoder": "topk"}
ENGINES = ("transformerlens", "transformerlens_bridge")  # tried in order by engine="auto"


@dataclass
class Transcoder:
    """One transcoder: W_enc [d, n], b_enc [n], W_dec [n, d], b_dec [d], threshold [n] (JumpReLU), k (TopK); it
    reads `address_in` (mlp_in.L) and predicts `address_out` (mlp_out.L)."""

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    activation: str  # "relu" | "jumprelu" | "topk"
    address_in: Address
    address_out: Address
    threshold: torch.Tensor | None = None
    k: int | None = None
    source: str = ""
    cfg: dict = field(default_factory=dict)
    # A cross-layer transcoder's layer: W_dec is its write into its own layer's output; decoders[l] [d_sae, d] its
    # write into a later layer l's output (address_out's kind at layer l); clt_layers every layer of its CLT.
    decoders: dict[int, torch.Tensor] = field(default_factory=dict)
    clt_layers: tuple[int, ...] = ()
    # A skip transcoder's linear path beside the features: x @ W_skip [d_in, d_out] added to its output.
    W_skip: torch.Tensor | None = None

    @property
    def layer(self) -> int:
        return int(self.address_in.layer)  # type: ignore[arg-type]

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_in] -> [..., d_sae]: x @ W_enc + b_enc (nothing subtracted from the input)."""
        return x.float() @ self.W_enc.to(x.device) + self.b_enc.to(x.device)

    def activate(self, pre: torch.Tensor) -> torch.Tensor:
        """The activation on pre-activations: ReLU, JumpReLU (pre where pre > threshold) or TopK (the k largest,
        ReLU'd)."""
        if self.activation == "jumprelu":
            assert self.threshold is not None
            return pre * (pre > self.threshold.to(pre.device))
        if self.activation == "topk":
            assert self.k is not None
            top = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
        return torch.relu(pre)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate(self.pre_activations(x))

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """Its own layer's output from its own features (a CLT layer's output also holds the earlier layers' writes:
        Transcoders.reconstruct)."""
        return f.float() @ self.W_dec.to(f.device) + self.b_dec.to(f.device)

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The skip path's write for inputs x (zeros without W_skip)."""
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], int(self.W_dec.shape[1]), device=x.device)
        return x.float() @ self.W_skip.to(x.device).float()

    @property
    def cross_layer(self) -> bool:
        return bool(self.clt_layers)

    @property
    def writes_to(self) -> list[int]:
        """The layers whose output its features write: its own, then a CLT's later ones."""
        return [self.layer, *sorted(self.decoders)]

    def decoder(self, layer: int) -> torch.Tensor | None:
        """[d_sae, d]: its features' write into layer's output (None where they write nothing)."""
        return self.W_dec if layer == self.layer else self.decoders.get(layer)

    def output_at(self, layer: int) -> Address:
        return self.address_out if layer == self.layer else Address(self.address_out.name, layer)

    # What a feature dashboard reads of a dictionary (ie_lab.widgets.feature_data): the point its encoder reads,
    # and steering along a feature's decoder direction, which a transcoder writes at its output point.
    @property
    def address(self) -> Address:
        return self.address_in

    def steer(self, session: Any, feature: int, scale: float = 1.0, **kwargs: Any) -> Any:
        """A steering spec adding scale x the feature's decoder direction at the transcoder's output point; for a
        cross-layer transcoder a list of them, one per layer it writes (steer= takes the list)."""
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < self.d_sae:
            raise InputError(f"feature={feature!r}: an int from 0 to {self.d_sae - 1}.")
        specs = [
            session.steer(self.output_at(L), self.decoder(L)[feature].float(), scale=scale, **kwargs)  # type: ignore[index]
            for L in self.writes_to
        ]
        return specs if self.cross_layer else specs[0]

    def splice(self, session: Any, *, error: bool = False) -> Any:
        """This transcoder spliced in place of its MLP's output (s.splice(self, error=...)): docs/CIRCUITS.md."""
        return session.splice(self, error=error)

    def __repr__(self) -> str:
        outs = f"{self.address_out}" + (f" .. layer {self.writes_to[-1]}" if self.decoders else "")
        extra = (", cross-layer" if self.cross_layer else "") + (", skip" if self.W_skip is not None else "")
        return (
            f"Transcoder({self.activation}, d_in={self.d_in}, d_sae={self.d_sae}, {self.address_in} -> {outs}{extra})"
        )


class Transcoders:
    """The transcoders of one model, one per layer at most, in layer order (index by layer: ``tcs[2]``): per-layer
    ones, or the layers of one cross-layer transcoder (``cross_layer``)."""

    def __init__(self, items: list[Transcoder]):
        self._by_layer = {t.layer: t for t in sorted(items, key=lambda t: t.layer)}

    def __getitem__(self, layer: int) -> Transcoder:
        if layer not in self._by_layer:
            raise InputError(f"no transcoder at layer {layer!r}; these cover layers {self.layers}.")
        return self._by_layer[layer]

    def __iter__(self) -> Iterator[Transcoder]:
        return iter(self._by_layer.values())

    def __len__(self) -> int:
        return len(self._by_layer)

    @property
    def layers(self) -> list[int]:
        return list(self._by_layer)

    @property
    def cross_layer(self) -> bool:
        """A cross-layer transcoder (CLT): each layer's features write into its own and every later layer's output."""
        return any(t.cross_layer for t in self)

    def reconstruct(self, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per layer written, its output predicted from the inputs {layer: [..., d_in]}: every feature's write into
        that layer (a CLT's earlier layers' too), its b_dec and its skip path."""
        out: dict[int, torch.Tensor] = {}
        for t in self:
            x = inputs[t.layer]
            f = t.encode(x)
            for L in t.writes_to:
                W = t.decoder(L)
                assert W is not None
                out[L] = out.get(L, 0) + f @ W.to(x.device).float()  # type: ignore[operator]
        for t in self:
            out[t.layer] = out[t.layer] + t.b_dec.to(inputs[t.layer].device).float() + t.skip(inputs[t.layer])
        return out

    def reconstruction_errors(self, session: Any, prompts: Any) -> dict[int, float]:
        """Per layer, the fraction of the MLP output's variance the transcoders leave unexplained over every token of
        the prompts: |y - prediction|^2 summed over |y - mean(y)|^2 summed (y = mlp_out.L; the prediction from
        mlp_in.L, and for a CLT from every earlier layer's input too; one capture)."""
        rows = [prompts] if isinstance(prompts, str) else list(prompts)
        addrs = list(dict.fromkeys(a for t in self for a in (t.address_in, t.address_out)))
        caches = [session.capture(p, addrs) for p in rows]
        xs = {t.layer: torch.cat([c[t.address_in][0].float() for c in caches]) for t in self}
        pred = self.reconstruct(xs)
        out = {}
        for t in self:
            y = torch.cat([c[t.address_out][0].float() for c in caches])
            err = (y - pred[t.layer]).pow(2).sum()
            out[t.layer] = float(err / (y - y.mean(0)).pow(2).sum())
        return out

    def check(self, session: Any, prompts: Any, max_error: float = 0.5) -> str:
        """Each layer's reconstruction error in words, one line per layer; a high one on known-good transcoders
        names the likely cause (another point, another model)."""
        lines = []
        for layer, fvu in self.reconstruction_errors(session, prompts).items():
            t = self[layer]
            verdict = (
                "fits"
                if fvu <= max_error
                else "does not fit: if these transcoders are known to be good, they were trained on another model or "
                "point (check hook_name / hook_name_out)"
            )
            lines.append(
                f"layer {layer}: {t.address_in} -> {t.address_out}: fraction of variance unexplained {fvu:.3f} "
                f"({'<=' if fvu <= max_error else '>'} {max_error}): {verdict}."
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        acts = sorted({t.activation for t in self})
        kind = "cross-layer transcoder: " if self.cross_layer else ""
        return f"Transcoders({kind}{len(self)} layers {self.layers}, {'/'.join(acts)}, d_sae {[t.d_sae for t in self]})"


def _hook_name_out(cfg: dict, where: str) -> str:
    meta: dict = cfg["metadata"] if isinstance(cfg.get("metadata"), dict) else {}
    out = [v for v in (cfg.get("hook_name_out"), meta.get("hook_name_out")) if v is not None]
    if len(set(map(str, out))) > 1:
        raise InputError(
            f"{where}: 'hook_name_out' is {shown(out[0])} but 'metadata.hook_name_out' is {shown(out[1])}: the config "
            "names two output points. Keep the one the transcoder was trained to predict."
        )
    if not out:
        raise InputError(
            f"{where}: no 'hook_name_out': a transcoder's cfg.json names the point it predicts (SAELens' "
            "hook_name_out, such as 'blocks.3.hook_mlp_out'). Add it; a folder without it is an SAE (ie_lab.load_sae)."
        )
    if not isinstance(out[0], str) or not out[0].strip():
        raise refusal(
            where, "'hook_name_out'", found_text(out[0]), "a hook name such as 'blocks.3.hook_mlp_out'", "Write it."
        )
    return out[0]


def _resolve(name: str, model: Any, engine: str, where: str, field_name: str) -> Address:
    from .mappers import ENGINES as ALL_ENGINES
    from .mappers import from_engine

    engines = ENGINES if engine == "auto" else (engine,)
    if engine != "auto" and engine not in ALL_ENGINES:
        raise InputError(
            f"engine={engine!r}: 'auto' or one of {list(ALL_ENGINES)}.{did_you_mean(str(engine), ALL_ENGINES)}"
        )
    found: dict[str, Address] = {}
    errors = []
    for e in engines:
        try:
            found[e] = from_engine(name, model, e)
        except (AddressError, InputError) as err:
            errors.append(f"{e}: {err}")
    if len({str(a) for a in found.values()}) > 1:
        raise InputError(
            f"{where}: {field_name} {shown(name)} means {', '.join(f'{a} in {e}' for e, a in found.items())}: pass "
            "engine= naming the library the transcoder was trained with."
        )
    if not found:
        raise AddressError(
            f"{where}: {field_name} {shown(name)} names no ie_lab point on this model ({' / '.join(errors)}). Correct "
            "it to the point the transcoder reads or predicts (mlp_in.L: TransformerLens bridge's blocks.L.mlp.hook_in; "
            "mlp_out.L: blocks.L.hook_mlp_out)."
        )
    return next(iter(found.values()))


def _refuse_other_kinds(cfg: dict, where: str) -> None:
    arch = cfg.get("architecture")
    text = arch.strip().lower() if isinstance(arch, str) else None
    if text is not None and (text == "clt" or text.endswith("_clt") or "cross" in text) or "n_layers" in cfg:
        raise InputError(
            f"{where}: a cross-layer transcoder in SAELens' layout (architecture {found_text(arch)}): ie_lab reads "
            "CLTs in circuit-tracer's layout (W_enc_<L>.safetensors and W_dec_<L>.safetensors per layer; "
            "docs/CIRCUITS.md). Save it in that layout (circuit-tracer's CrossLayerTranscoder.to_safetensors)."
        )
    if text == "skip_transcoder":
        raise InputError(
            f"{where}: a skip transcoder (W_skip: a linear path from the MLP's input to its output beside the "
            "features) in SAELens' layout: ie_lab reads skip transcoders in circuit-tracer's layout "
            "(layer_<L>.safetensors with W_skip; docs/CIRCUITS.md)."
        )
    if text not in ARCHITECTURES:
        raise InputError(
            f"{where}: 'architecture' is {found_text(arch)}, expected one of {sorted(ARCHITECTURES)} (SAELens' "
            f"transcoder architectures).{did_you_mean(str(text), ARCHITECTURES)} A folder of an SAE (one point in "
            "and out) loads with ie_lab.load_sae."
        )


def _load_one(folder: str, model: Any, engine: str) -> Transcoder:
    cfg_path = os.path.join(folder, "cfg.json")
    cfg = read_json(cfg_path, "the transcoder's config")
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path}: a SAELens cfg.json holds one JSON object, not {found_text(cfg)}.")
    _refuse_other_kinds(cfg, cfg_path)
    as_sae = {k: v for k, v in cfg.items() if k != "apply_b_dec_to_input"}  # a transcoder's b_dec is its output's
    as_sae["architecture"] = ARCHITECTURES[cfg["architecture"].strip().lower()]
    conf = read_config(as_sae, cfg_path, False)
    if conf.hook_name is None:
        raise InputError(f"{cfg_path}: no 'hook_name' (the point the transcoder reads, e.g. 'blocks.3.mlp.hook_in').")
    name_out = _hook_name_out(cfg, cfg_path)
    d_out = cfg.get("d_out")
    if d_out is not None and (isinstance(d_out, bool) or not isinstance(d_out, int) or d_out < 1):
        raise refusal(
            cfg_path, "'d_out'", found_text(d_out), "a positive integer (W_dec's second dimension)", "Fix it."
        )
    if d_out is not None and conf.d_in is not None and d_out != conf.d_in:
        raise InputError(
            f"{cfg_path}: d_in is {conf.d_in} but d_out is {d_out}: a transcoder that replaces an MLP reads and writes "
            "d_model-wide rows; this one maps between two widths, which ie_lab does not attach."
        )
    weights_path = weights_file(folder)
    weights = load_weights(weights_path)
    if "W_skip" in weights:
        raise InputError(
            f"{weights_path}: a W_skip tensor (a skip transcoder) in SAELens' layout: ie_lab reads skip transcoders "
            "in circuit-tracer's layout (layer_<L>.safetensors with W_skip; docs/CIRCUITS.md)."
        )
    for need in ("W_dec",):
        if need not in weights:
            raise InputError(f"{weights_path}: no {need}: a transcoder needs its decoder W_dec [d_sae, d_out].")
    w = checked_weights(weights, weights_path, conf, cfg_path)
    lm = getattr(model, "_lm", model)
    facts = getattr(lm, "facts", None)
    a_in = _resolve(conf.hook_name, model, engine, cfg_path, "'hook_name'")
    a_out = _resolve(name_out, model, engine, cfg_path, "'hook_name_out'")
    if facts is not None:
        a_in, a_out = a_in.check(facts), a_out.check(facts)
        for a, label in ((a_in, "reads"), (a_out, "writes")):
            if point_width(a, facts) != int(w["W_enc"].shape[0]):
                raise InputError(
                    f"{cfg_path}: the transcoder {label} {int(w['W_enc'].shape[0])}-wide rows but {a} is "
                    f"{point_width(a, facts)} wide on this model: it was trained on another model."
                )
    if a_in.layer != a_out.layer:
        raise InputError(
            f"{cfg_path}: it reads {a_in} and predicts {a_out}, two layers: a per-layer transcoder replaces one "
            "layer's MLP."
        )
    return Transcoder(
        w["W_enc"],
        w["b_enc"],
        w["W_dec"],
        w.get("b_dec", torch.zeros(w["W_dec"].shape[1])),
        conf.activation,
        a_in,
        a_out,
        w.get("threshold"),
        conf.k if conf.activation == "topk" else None,
        folder,
        cfg,
    )


def load_transcoders(
    path: Any = None,
    model: Any = None,
    *,
    engine: str = "auto",
    release: Any = None,
    sae_id: Any = None,
    repo_id: Any = None,
    revision: Any = None,
    cache_dir: Any = None,
) -> Transcoders:
    """Transcoders from a SAELens transcoder folder (cfg.json + sae_weights.safetensors), a folder of such folders
    (one per layer), or a folder in circuit-tracer's layout (per-layer layer_<L>.safetensors, or a cross-layer
    transcoder's W_enc_<L> / W_dec_<L>.safetensors; config.yaml), attached to the points their hook names mean on
    model (a Session or a loaded model). engine: the library whose hook names the configs use ('transformerlens', 'transformerlens_bridge'), or
    'auto' (each name read in both, refused if the two disagree). Every field and tensor is checked first (the
    SAE's checks, ie_lab/sae_files.py; circuit_tracer_files.py's).

    Published transcoders by name instead of path, from the Hugging Face cache (ie_lab/transcoder_release.py):
    release= a circuit-tracer set ('gemma', 'llama', 'org/name[/subfolder][@revision]', 'hf://org/name/...'), or a
    SAELens release (its registry's name; sae_id= one id, a list, or None for all of them); repo_id= with sae_id=
    the SAELens folders in that repo. revision= and cache_dir= as for load_sae (cache_dir= with a path: where the
    hf:// files its config.yaml lists are cached)."""
    if model is None:
        raise InputError("load_transcoders needs the model (a Session) to attach the transcoders to its points.")
    if any(v is not None for v in (release, sae_id, repo_id, revision)) or (cache_dir is not None and path is None):
        return _load_published(path, model, engine, release, sae_id, repo_id, revision, cache_dir)
    try:
        path = os.fsdecode(os.fspath(path))
    except TypeError:
        raise InputError(
            f"path={found_text(path)}: pass the path of a transcoder folder (str or pathlib.Path), or release= "
            "for a published set."
        ) from None
    if not os.path.isdir(path):
        raise InputError(
            f"{path!r}: not a folder; pass a SAELens transcoder folder or a folder of them (one per layer)"
            + (
                f", or release={path!r} for the published set of that name."
                if "/" in path or path in _presets()
                else "."
            )
        )
    if os.path.lexists(os.path.join(path, "cfg.json")):
        return _from_folders([path], model, engine)
    folders = sorted(
        os.path.join(path, n)
        for n in os.listdir(path)
        if os.path.isdir(os.path.join(path, n)) and os.path.lexists(os.path.join(path, n, "cfg.json"))
    )
    from .circuit_tracer_files import is_circuit_tracer_folder

    if not folders and is_circuit_tracer_folder(path):
        return _from_circuit_tracer(path, model, engine, cache_dir)
    if not folders:
        raise InputError(
            f"{path}: no cfg.json here nor in any subfolder; a transcoder folder holds cfg.json and "
            "sae_weights.safetensors (a parent folder: one such folder per layer)."
        )
    return _from_folders(folders, model, engine)


def _presets() -> dict:
    from .transcoder_release import PRESETS

    return PRESETS


def _from_circuit_tracer(path: str, model: Any, engine: str, cache_dir: Any = None) -> Transcoders:
    from .circuit_tracer_files import load_circuit_tracer
    from .transcoder_release import hub_files

    def resolve(name: str, m: Any, where: str, field_name: str) -> Address:
        return _resolve(name, m, engine, where, field_name)

    def fetch(uris: list[str], where: str) -> dict[str, str]:  # config.yaml's hf:// files, from the hub cache
        return hub_files(uris, cache_dir, where)

    return Transcoders(load_circuit_tracer(path, model, Transcoder, resolve, fetch))


def _from_folders(folders: list[str], model: Any, engine: str) -> Transcoders:
    items = [_load_one(f, model, engine) for f in folders]
    seen: dict[int, str] = {}
    for t in items:
        if t.layer in seen:
            raise InputError(
                f"{seen[t.layer]} and {t.source} both replace layer {t.layer}'s MLP: keep one transcoder per layer"
                " (a release's sae_id= picks which)."
            )
        seen[t.layer] = t.source
    return Transcoders(items)


def _load_published(
    path: Any, model: Any, engine: str, release: Any, sae_id: Any, repo_id: Any, revision: Any, cache_dir: Any
) -> Transcoders:
    from . import transcoder_release as tr

    if path is not None:
        raise InputError(
            "load_transcoders: pass a path, or release= (or repo_id=), not both: the path is already the transcoders "
            "(revision= and cache_dir= belong to a published set's lookup)."
        )
    for name, v in (("release", release), ("repo_id", repo_id), ("revision", revision)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise InputError(f"{name}={v!r}: a non-empty string.")
    if (release is None) == (repo_id is None):
        raise InputError(
            "load_transcoders: name the published transcoders with release= (a circuit-tracer set such as 'llama' or "
            "'org/name', or a SAELens release) or with repo_id= and sae_id= (SAELens folders in that repo): one of them."
        )
    if release is not None and tr.is_circuit_tracer_ref(release):
        if sae_id is not None:
            raise InputError(
                f"release={release!r} is a circuit-tracer set, which names all its layers; sae_id= belongs to SAELens "
                "releases (a subfolder of the repo goes in the name: 'org/name/subfolder')."
            )
        return _from_circuit_tracer(tr.circuit_tracer_folder(release, revision, cache_dir), model, engine, cache_dir)
    return _from_folders(tr.saelens_folders(release, sae_id, repo_id, revision, cache_dir), model, engine)
