"""Published transcoders by name: `load_transcoders(release=..., model=s)`, from the Hugging Face cache.

Two kinds of name, told apart by their shape:
  * circuit-tracer's: a preset ('gemma', 'llama': the repos circuit-tracer 0.5 maps them to), a repo
    ('org/name', 'org/name/subfolder', either with '@revision'), or an hf:// URI ('hf://org/name/subfolder?revision=
    ...'). The folder holds config.yaml (model_kind, feature_input_hook, feature_output_hook) and either the
    safetensors themselves (layer_<L>.safetensors, or a CLT's W_enc_<L> / W_dec_<L>.safetensors) or, for a
    transcoder set, a `transcoders:` list whose hf://org/name/file?revision=... entries name files of other repos;
    those are found in the cache too (circuit_tracer_files.py asks `hub_file`).
  * SAELens': a release name of its registry (no '/' in it), read as load_sae reads it (sae_release.py), each
    sae_id one SAELens transcoder folder; or repo_id= with sae_id= the folders in that repo.

Files come from the hub cache (`HF_HUB_CACHE`; cache_dir=) when they are there, are downloaded when they are not and
the hub answers, and are otherwise refused naming the cache path and the `hf download` command
(sae_release.cached_files). What circuit-tracer converts on load (Gemma Scope's params.npz, Gemma Scope 2's
checkpoints) is refused with the reason: ie_lab reads circuit-tracer's safetensors layout as saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

from .errors import InputError, shown

#: circuit-tracer 0.5's short names (utils/hf_utils.py, load_transcoder_from_hub) and the repos they stand for.
PRESETS = {"gemma": "mwhanna/gemma-scope-transcoders", "llama": "mntss/transcoder-Llama-3.2-1B"}


@dataclass(frozen=True)
class HubRef:
    """A folder (or, from an hf:// file URI, a file) of a hub repo at a revision (None: main)."""

    repo_id: str
    path: str
    revision: str | None


def is_circuit_tracer_ref(release: str) -> bool:
    """A circuit-tracer name (preset, repo path or hf:// URI) rather than a SAELens release (which has no '/')."""
    return release in PRESETS or "/" in release


def parse_hf_uri(uri: str, where: str = "") -> HubRef:
    """hf://org/name/path?revision=rev -> HubRef('org/name', 'path', 'rev'), as circuit-tracer reads the URIs."""
    u = urlparse(uri)
    parts = u.path.strip("/").split("/", 1)
    if u.scheme != "hf" or not u.netloc or not parts[0]:
        raise InputError(f"{where}{shown(uri)}: an hf:// URI is hf://org/name[/path][?revision=...].")
    revs = parse_qs(u.query).get("revision")
    rev = revs[0] if revs else None
    return _checked(HubRef(f"{u.netloc}/{parts[0]}", parts[1] if len(parts) > 1 else "", rev), uri, where)


def _checked(ref: HubRef, text: str, where: str) -> HubRef:
    """A path inside the repo: '..' would leave the snapshot folder the cache resolves it in."""
    if any(p in ("..", ".") for p in ref.repo_id.split("/") + ref.path.split("/")):
        raise InputError(f"{where}{shown(text)}: a path inside the repo, without '.' or '..' components.")
    return ref


def parse_ref(release: str) -> HubRef:
    """A circuit-tracer name -> its repo, folder and revision ('org/name/sub@rev' as circuit-tracer splits it)."""
    release = PRESETS.get(release, release)
    if release.startswith("hf://"):
        return parse_hf_uri(release, "release=")
    name, _, rev = release.partition("@")
    parts = [p for p in name.split("/") if p]
    if len(parts) < 2:
        raise InputError(
            f"release={release!r}: a circuit-tracer transcoder set is named 'org/name' (optionally '/subfolder' and "
            f"'@revision'), 'hf://org/name/subfolder', or a preset ({', '.join(map(repr, PRESETS))})."
        )
    return _checked(HubRef("/".join(parts[:2]), "/".join(parts[2:]), rev or None), release, "release=")


def _joined(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def circuit_tracer_folder(release: str, revision: str | None, cache_dir: Any) -> str:
    """The cached snapshot folder of a circuit-tracer transcoder set: its config.yaml, and (unless config.yaml lists
    the files) its safetensors beside it."""
    from .circuit_tracer_files import CLT_ENC, PER_LAYER, config_of, refuse_conversions
    from .sae_release import _offline, cached_files, not_cached

    ref = parse_ref(release)
    if revision is not None and ref.revision is not None and revision != ref.revision:
        raise InputError(f"release={release!r} names revision {ref.revision!r} and revision={revision!r}: pass one.")
    rev = revision or ref.revision
    pattern = f'--include "{_joined(ref.path, "*")}"' if ref.path else ""  # the whole set: config and weights
    config = cached_files(ref.repo_id, [_joined(ref.path, "config.yaml")], rev, cache_dir, command=pattern)[0]
    folder = os.path.dirname(config)
    cfg = config_of(folder)
    refuse_conversions(cfg, ref.repo_id, config)
    if "transcoders" in cfg or any(PER_LAYER.match(n) or CLT_ENC.match(n) for n in os.listdir(folder)):
        return folder
    cause = "HF_HUB_OFFLINE is set"
    if not _offline():
        from huggingface_hub import snapshot_download

        from .sae_release import cache_dir_of

        try:
            got = snapshot_download(
                ref.repo_id,
                revision=rev,
                cache_dir=cache_dir_of(cache_dir),
                allow_patterns=[_joined(ref.path, "*.safetensors"), _joined(ref.path, "config.yaml")],
            )
            return os.path.join(got, ref.path) if ref.path else got
        except Exception as e:  # noqa: BLE001 - as cached_files: any failure ends in the same advice
            cause = f"the hub did not answer: {type(e).__name__}: {shown(str(e), 200)}"
    raise not_cached(ref.repo_id, [_joined(ref.path, "*.safetensors")], rev, cache_dir, cause, pattern)


def hub_files(uris: list[str], cache_dir: Any, where: str) -> dict[str, str]:
    """The cached local paths of a config.yaml's hf://org/name/file?revision=... entries, fetched per repo and
    revision (so a refusal names every missing file of that repo in one command)."""
    from .sae_release import cached_files

    refs = {u: parse_hf_uri(u, f"{where}: ") for u in uris}
    groups: dict[tuple[str, str | None], list[str]] = {}
    for u, r in refs.items():
        if not r.path:
            raise InputError(f"{where}: {shown(u)} names a repo, not a file (hf://org/name/path/file.safetensors).")
        groups.setdefault((r.repo_id, r.revision), []).append(u)
    out: dict[str, str] = {}
    for (repo, rev), group in groups.items():
        paths = cached_files(repo, [refs[u].path for u in group], rev, cache_dir)
        out.update(zip(group, paths, strict=True))
    return out


def saelens_folders(
    release: str | None, sae_id: Any, repo_id: str | None, revision: str | None, cache_dir: Any
) -> list[str]:
    """The cached SAELens folders of release= (SAELens' registry; sae_id None: all its ids) or repo_id= with sae_id=
    (folders in the repo), one per transcoder."""
    from .sae_release import cached_folder, lookup, releases

    if sae_id is None and release is None:
        raise InputError(f"repo_id={repo_id!r} needs sae_id=, the transcoder's folder in the repo (or a list).")
    if release is not None:
        try:
            table = releases()
        except InputError as e:
            raise InputError(
                f"{e} (release={release!r} has no '/', so it was read as a SAELens release name; a circuit-tracer set "
                f"is named 'org/name[/subfolder]' or a preset: {', '.join(map(repr, PRESETS))}.)"
            ) from None
    if sae_id is None:
        assert release is not None  # (refused above when both are None)
        if release not in table:
            lookup(release, "", loader="load_transcoders")  # raises: the name is not in the registry, and the nearest
        ids = sorted(table[release].saes)
    elif isinstance(sae_id, str):
        ids = [sae_id]
    elif isinstance(sae_id, (list, tuple)) and sae_id and all(isinstance(i, str) for i in sae_id):
        ids = list(sae_id)
    else:
        raise InputError(f"sae_id={shown(repr(sae_id))}: a string or a non-empty list of strings (one per layer).")
    out = []
    for i in ids:
        repo, folder = lookup(release, i, loader="load_transcoders") if release is not None else (repo_id, i)
        assert repo is not None
        out.append(cached_folder(repo, folder, revision, cache_dir))
    return out
