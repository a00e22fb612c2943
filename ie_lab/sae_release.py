"""Published SAEs by name: `load_sae(release=..., sae_id=..., model=s)`, as SAELens users write
`SAE.from_pretrained(release, sae_id)`.

Two steps, each replaceable:
  * the name -> (hub repo, folder in it): SAELens' own registry, its `pretrained_saes.yaml`. sae-lens is an optional
    extra: the file is found with `importlib.util.find_spec`, which locates the installed package without running
    it (importing sae_lens imports TransformerLens and its own torch stack; ie_lab needs only the table). Without
    sae-lens, `repo_id=` names the repo and `sae_id=` the folder in it, and no registry is read.
  * the folder -> files on disk: the Hugging Face hub cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub:
    models--org--name/snapshots/<revision>/<folder>/), read offline when the files are there, downloaded with
    huggingface_hub (a dependency of transformers) when they are not and the hub answers, and otherwise refused with
    the cache path it looked in and the command that fills it.

The folder then loads as any SAELens folder (ie_lab/sae.py, `load_sae(path)`), with every check that implies.
What SAELens converts on load (a release with a `conversion_func`: Gemma Scope's params.npz, Llama Scope, ...)
and what it rescales (a `norm_scaling_factor`, or a `config_overrides` entry in a field that changes the encoder)
is refused, naming what to do instead: ie_lab loads files as saved and never guesses a conversion.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError, did_you_mean, nearest, shown

#: The files a SAELens folder holds on the hub (SAELens' SAE_CFG_FILENAME and SAE_WEIGHTS_FILENAME).
FILES = ("cfg.json", "sae_weights.safetensors")

# cfg.json fields that change what load_sae builds (ie_lab/sae.py reads them): a registry override of one of these
# would make SAELens and ie_lab load different SAEs from the same files, so it is refused rather than ignored.
# Overrides of other fields (dataset_path, model_from_pretrained_kwargs, ...) describe training or TransformerLens'
# loading and leave the encoder as saved.
ENCODER_FIELDS = frozenset(
    {
        "architecture",
        "activation_fn",
        "activation_fn_str",
        "activation_fn_kwargs",
        "k",
        "apply_b_dec_to_input",
        "normalize_activations",
        "hook_name",
        "hook_point",
        "hook_head_index",
        "hook_point_head_index",
        "d_in",
        "d_sae",
        "metadata",
        "rescale_acts_by_decoder_norm",
        "finetuning_scaling_factor",
    }
)

INSTALL = "pip install sae-lens"


@dataclass(frozen=True)
class Release:
    """One entry of SAELens' registry, as its get_pretrained_saes_directory reads it."""

    name: str
    repo_id: str
    model: str
    conversion_func: str | None
    saes: dict[str, str]  # sae_id -> folder in the repo
    config_overrides: dict[str, Any] = field(default_factory=dict)
    norm_scaling_factor: dict[str, float] = field(default_factory=dict)


def registry_file() -> str:
    """The path of the installed sae-lens' pretrained_saes.yaml (the package is located, not imported)."""
    spec = importlib.util.find_spec("sae_lens")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            "release=: the names of published SAEs come from SAELens' registry, and sae-lens is not installed: "
            f"`{INSTALL}` (ie_lab reads its table, pretrained_saes.yaml, and imports nothing of it), or pass "
            "repo_id='org/name' and sae_id='<folder in the repo>' to load without the registry."
        )
    for where in spec.submodule_search_locations:
        path = os.path.join(where, "pretrained_saes.yaml")
        if os.path.isfile(path):
            return path
    raise InputError(
        f"sae-lens is installed at {list(spec.submodule_search_locations)} but holds no pretrained_saes.yaml (its "
        f"registry): reinstall it (`{INSTALL} --force-reinstall`), or pass repo_id= and sae_id= to load without it."
    )


_PARSED: dict[tuple[str, int, int], dict[str, Release]] = {}


def releases(path: str | None = None) -> dict[str, Release]:
    """SAELens' registry as {release name: Release}; parsed once per file version (it is 1.5 MB of YAML)."""
    path = path or registry_file()
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _PARSED:
        import yaml  # a dependency of transformers and huggingface_hub

        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if isinstance(data, dict) and isinstance(data.get("SAE_LOOKUP"), dict):  # sae-lens before 3.x nested it
            data = data["SAE_LOOKUP"]
        if not isinstance(data, dict):
            raise InputError(f"{path}: not SAELens' registry (a mapping of release names); reinstall sae-lens.")
        out = {}
        for name, entry in data.items():
            if not isinstance(entry, dict) or "repo_id" not in entry or not isinstance(entry.get("saes"), list):
                continue  # not a release SAELens can load either (its reader raises on a missing 'saes')
            saes: dict[str, str] = {}
            scale: dict[str, float] = {}
            for sae in entry["saes"]:
                if isinstance(sae, dict) and "id" in sae and "path" in sae:
                    saes[str(sae["id"])] = str(sae["path"])  # SAELens: an int path (a layer number) is its str
                    if "norm_scaling_factor" in sae:
                        scale[str(sae["id"])] = sae["norm_scaling_factor"]
            out[str(name)] = Release(
                str(name),
                str(entry["repo_id"]),
                str(entry.get("model", "")),
                entry.get("conversion_func"),
                saes,
                dict(entry.get("config_overrides") or {}),
                scale,
            )
        _PARSED.clear()  # one registry per process in practice: keep only the newest parse
        _PARSED[key] = out
    return _PARSED[key]


def _listed(names: list[str], n: int = 8) -> str:
    return ", ".join(map(repr, names[:n])) + (f" ... ({len(names)} in all)" if len(names) > n else "")


def lookup(release: str, sae_id: str, path: str | None = None, loader: str = "load_sae") -> tuple[str, str]:
    """(repo_id, folder) of one SAE of a release, or an InputError saying why ie_lab will not load it (loader: the
    ie_lab function its advice names, load_sae or load_transcoders)."""
    table = releases(path)
    where = path or registry_file()
    if release not in table:
        near = nearest(release, table, n=5)
        raise InputError(
            f"release={release!r} is not in SAELens' registry ({where}, {len(table)} releases)"
            + (f"; the nearest: {_listed(near)}" if near else "")
            + ". Check the name (SAELens' docs list them), upgrade sae-lens for a newer release, or pass repo_id= "
            "and sae_id= (the folder in the repo) for one the registry does not hold."
        )
    r = table[release]
    if sae_id not in r.saes:
        ids = sorted(r.saes)
        raise InputError(
            f"sae_id={sae_id!r} is not in release {release!r}.{did_you_mean(sae_id, ids)} Its ids: {_listed(ids)}."
        )
    if r.conversion_func:
        raise InputError(
            f"release {release!r} is stored as {r.conversion_func!r} files that SAELens converts on load "
            f"(conversion_func: {r.conversion_func}), not as a SAELens folder (cfg.json + sae_weights.safetensors); "
            "ie_lab loads files as saved and does not guess a conversion. Convert it once with SAELens: "
            f"`SAE.from_pretrained({release!r}, {sae_id!r}).save_model('folder')`, then `{loader}('folder', s)`."
        )
    touched = sorted(set(r.config_overrides) & ENCODER_FIELDS)
    if touched:
        raise InputError(
            f"release {release!r}: SAELens' registry overrides {touched} of its cfg.json on load, which changes the "
            "SAE ie_lab would build from the files as saved. Save it with SAELens "
            f"(`SAE.from_pretrained({release!r}, {sae_id!r}).save_model('folder')`), then `{loader}('folder', s)`."
        )
    if sae_id in r.norm_scaling_factor:
        raise InputError(
            f"release {release!r}, sae_id {sae_id!r}: SAELens scales its input by norm_scaling_factor "
            f"{r.norm_scaling_factor[sae_id]} (kept in the registry, not in the weights); ie_lab refuses an SAE whose "
            "scale lives outside its weights (docs/SAE.md). Fold the factor into W_enc and b_dec and load the folder."
        )
    return r.repo_id, r.saes[sae_id]


def cache_dir_of(cache_dir: Any = None) -> str:
    """Where the hub cache is: cache_dir=, else $HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default.
    Read at call time (huggingface_hub reads the variables once, when it is first imported)."""
    if cache_dir is not None:
        return os.fsdecode(os.fspath(cache_dir))
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _repo_folder(cache: str, repo_id: str) -> str:
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"))


def cached_files(
    repo_id: str,
    names: list[str],
    revision: str | None = None,
    cache_dir: Any = None,
    *,
    command: str | None = None,
) -> list[str]:
    """The local paths of files `names` of repo_id: from the hub cache offline when all are there, else downloaded;
    when neither works, an InputError naming the cache path and the download command (`hf download repo_id names`,
    or `hf download repo_id` + command where the caller knows a pattern that fetches the whole set)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cache = cache_dir_of(cache_dir)
    found = [try_to_load_from_cache(repo_id, n, cache_dir=cache, revision=revision) for n in names]
    if all(isinstance(p, str) for p in found):
        return [str(p) for p in found]
    cause = "HF_HUB_OFFLINE is set"
    if not _offline():
        try:
            return [hf_hub_download(repo_id, n, cache_dir=cache, revision=revision) for n in names]
        except Exception as e:  # noqa: BLE001 - any failure to fetch (no network, no repo, no file) ends in the same advice
            cause = f"the hub did not answer: {type(e).__name__}: {shown(str(e), 200)}"
    missing = [n for n, p in zip(names, found, strict=True) if not isinstance(p, str)]
    raise not_cached(repo_id, missing, revision, cache_dir, cause, command)


def not_cached(
    repo_id: str, missing: list[str], revision: str | None, cache_dir: Any, cause: str, command: str | None = None
) -> InputError:
    """The refusal for files of repo_id that are neither in the cache nor downloadable: where it looked, and the
    `hf download` command that fills the cache."""
    cache = cache_dir_of(cache_dir)
    rev = revision or "main"
    folder = os.path.commonpath([os.path.dirname(n) or "." for n in missing])
    folder = "" if folder == "." else folder
    where = os.path.join(_repo_folder(cache, repo_id), "snapshots", "<revision>", folder)
    cmd = f"hf download {repo_id} " + (command if command is not None else " ".join(missing))
    cmd = cmd.rstrip() + (f" --revision {revision}" if revision else "")
    if cache_dir is not None or os.environ.get("HF_HUB_CACHE"):
        cmd += f" --cache-dir {cache}"
    return InputError(
        f"{repo_id} ({rev}): {', '.join(missing)} not in the Hugging Face cache (looked in {where}) and not "
        f"downloaded ({cause}). Download it where the hub is reachable: `{cmd}` (huggingface_hub before 1.0: "
        f"`huggingface-cli download` with the same arguments), then copy {_repo_folder(cache, repo_id)} into this "
        "machine's cache (HF_HUB_CACHE) and load again."
    )


def cached_folder(repo_id: str, folder: str, revision: str | None = None, cache_dir: Any = None) -> str:
    """The snapshot folder holding `folder`'s cfg.json and weights (cached_files' rules)."""
    names = [f"{folder.strip('/')}/{f}" if folder.strip("/") else f for f in FILES]
    return os.path.dirname(cached_files(repo_id, names, revision, cache_dir)[0])


def resolve(
    path: Any,
    release: Any = None,
    sae_id: Any = None,
    repo_id: Any = None,
    revision: Any = None,
    cache_dir: Any = None,
) -> str:
    """The local folder load_sae reads for load_sae(release=, sae_id=) or load_sae(repo_id=, sae_id=)."""
    if path is not None:
        raise InputError(
            "load_sae: pass a path, or release= (or repo_id=) with sae_id=, not both: the path is already the SAE "
            "(revision= and cache_dir= belong to a published SAE's lookup)."
        )
    for name, v in (("release", release), ("repo_id", repo_id), ("revision", revision)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise InputError(f"{name}={v!r}: a non-empty string.")
    if sae_id is not None and not isinstance(sae_id, str):
        raise InputError(f"sae_id={sae_id!r}: a string, the SAE's id in the release (with repo_id=: its folder).")
    if release is not None and repo_id is not None:
        raise InputError(
            f"release={release!r} and repo_id={repo_id!r}: pass one (a release names its repo in SAELens' registry)."
        )
    if sae_id is None:
        raise InputError(
            "load_sae(release=...) needs sae_id=, the SAE in the release (SAELens' `id`, such as "
            "'blocks.8.hook_resid_pre'); with repo_id=, sae_id= is the folder in the repo ('' for its root)."
        )
    if release is None and repo_id is None:
        raise InputError(f"sae_id={sae_id!r}: name where it is, with release= (SAELens' registry) or repo_id=.")
    if release is not None:
        repo_id, folder = lookup(release, sae_id)
    else:
        folder = sae_id
    return cached_folder(repo_id, folder, revision, cache_dir)
