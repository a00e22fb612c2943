"""Published transcoders by name (issue 32 item 1): load_transcoders(release=..., model=lm) from the Hugging Face
cache, for circuit-tracer's hub sets (config.yaml with the files beside it, or hf:// references into other repos;
presets; subfolders and revisions) and SAELens transcoder releases (registry lookup, as load_sae's).

No network here: each test builds the hub cache the way huggingface_hub writes one (models--org--name/{blobs,
refs/main, snapshots/<commit>/<file> -> ../../blobs/<sha>}), with HF_HUB_OFFLINE=1, from files written by
tests/transcoder_files.py. Each published load is compared to the direct load of the same files by path: every
tensor equal and every address the same; a shape-correct neighbour (another seed) would differ.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import textwrap

import pytest
import torch

import ie_lab
from ie_lab.errors import InputError
from tests.conftest import lm_for
from tests.transcoder_files import write_circuit_tracer, write_transcoders

C1, C2 = "1" * 40, "2" * 40


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


@pytest.fixture(scope="module")
def lm():
    return lm_for("llama")


def hub_repo(cache, repo_id: str, files: dict[str, bytes], commit: str = C1, ref: str | None = "main") -> None:
    """files ({path in the repo: bytes}) as one snapshot of repo_id in the hub cache at cache; refs/<ref> -> commit."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    if ref is not None:
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    for name, data in files.items():
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(repo, "snapshots", commit, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)


def files_of(folder: str, under: str = "") -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            out[os.path.join(under, rel) if under else rel] = open(os.path.join(root, n), "rb").read()
    return out


def assert_same(got, want) -> None:
    assert len(got) == len(want) and got.layers == want.layers
    for a, b in zip(got, want, strict=True):
        assert (str(a.address_in), str(a.address_out), a.activation) == (
            str(b.address_in),
            str(b.address_out),
            b.activation,
        )
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            assert x is None or torch.equal(x, y), name
        assert sorted(a.decoders) == sorted(b.decoders)
        assert all(torch.equal(a.decoders[k], b.decoders[k]) for k in a.decoders)


def test_a_config_with_hf_references_loads_as_the_files_do(lm, tmp_path, monkeypatch):
    d, N = lm.facts.d_model, lm.facts.n_layers
    src = write_circuit_tracer(str(tmp_path / "src"), d, N, clt=False, skip=True)
    want = ie_lab.load_transcoders(src, lm)
    other = write_circuit_tracer(str(tmp_path / "other"), d, N, clt=False, skip=True, seed=1)
    assert not torch.equal(ie_lab.load_transcoders(other, lm)[0].W_enc, want[0].W_enc)  # the check can fail
    cache = str(tmp_path / "hub")
    # the weights live in one repo (at a pinned commit that is not main), the set's config.yaml in another
    hub_repo(cache, "ie-lab/tc-weights", files_of(src, "weights"), commit=C2, ref=None)
    listed = "".join(f"  - hf://ie-lab/tc-weights/weights/layer_{L}.safetensors?revision={C2}\n" for L in range(N))
    config = "model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\nfeature_output_hook: hook_mlp_out\n"
    hub_repo(cache, "ie-lab/tc-set", {"config.yaml": (config + "transcoders:\n" + listed).encode()})
    got = ie_lab.load_transcoders(release="ie-lab/tc-set", model=lm, cache_dir=cache)
    assert_same(got, want)
    assert got[0].source.startswith(os.path.join(cache, "models--ie-lab--tc-weights", "snapshots", C2))
    # the same through HF_HUB_CACHE, an hf:// name, a pinned revision, and circuit-tracer's preset names
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    assert_same(ie_lab.load_transcoders(release="hf://ie-lab/tc-set", model=lm), want)
    assert_same(ie_lab.load_transcoders(release=f"ie-lab/tc-set@{C1}", model=lm), want)
    assert_same(ie_lab.load_transcoders(release="ie-lab/tc-set", model=lm, revision=C1), want)
    hub_repo(cache, "mntss/transcoder-Llama-3.2-1B", {"config.yaml": (config + "transcoders:\n" + listed).encode()})
    assert_same(ie_lab.load_transcoders(release="llama", model=lm), want)
    # a local folder whose config.yaml lists hf:// files reads them from the cache too
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.yaml").write_text(config + "transcoders:\n" + listed)
    assert_same(ie_lab.load_transcoders(str(local), lm), want)
    monkeypatch.delenv("HF_HUB_CACHE")
    assert_same(ie_lab.load_transcoders(str(local), lm, cache_dir=cache), want)


def test_a_clt_in_a_subfolder_loads_as_the_files_do(lm, tmp_path):
    d, N = lm.facts.d_model, lm.facts.n_layers
    src = write_circuit_tracer(str(tmp_path / "clt"), d, N, clt=True)
    cache = str(tmp_path / "hub")
    hub_repo(cache, "ie-lab/clts", files_of(src, "small"))
    got = ie_lab.load_transcoders(release="ie-lab/clts/small", model=lm, cache_dir=cache)
    assert got.cross_layer
    assert_same(got, ie_lab.load_transcoders(src, lm))


def test_what_is_not_cached_names_the_path_and_the_command(lm, tmp_path):
    d, N = lm.facts.d_model, lm.facts.n_layers
    cache = str(tmp_path / "hub")
    with pytest.raises(InputError) as e:
        ie_lab.load_transcoders(release="ie-lab/clts/small", model=lm, cache_dir=cache)
    msg = str(e.value)
    assert os.path.join(cache, "models--ie-lab--clts", "snapshots", "<revision>", "small") in msg
    assert f'`hf download ie-lab/clts --include "small/*" --cache-dir {cache}`' in msg
    # config.yaml cached, the layers it names not: the command fetches those files from their repo, at their revision
    listed = "".join(f"  - hf://ie-lab/w/layer_{L}.safetensors?revision={C2}\n" for L in range(N))
    config = "model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\nfeature_output_hook: hook_mlp_out\n"
    hub_repo(cache, "ie-lab/set", {"config.yaml": (config + "transcoders:\n" + listed).encode()})
    every = " ".join(f"layer_{L}.safetensors" for L in range(N))
    with pytest.raises(InputError, match=rf"`hf download ie-lab/w {every} --revision {C2} --cache-dir"):
        ie_lab.load_transcoders(release="ie-lab/set", model=lm, cache_dir=cache)
    # a CLT's config.yaml cached without its weights
    src = write_circuit_tracer(str(tmp_path / "clt"), d, N, clt=True)
    hub_repo(cache, "ie-lab/clt-config-only", {"config.yaml": open(os.path.join(src, "config.yaml"), "rb").read()})
    with pytest.raises(InputError, match=r"\*\.safetensors not in the Hugging Face cache.*`hf download ie-lab/clt-c"):
        ie_lab.load_transcoders(release="ie-lab/clt-config-only", model=lm, cache_dir=cache)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"path": "x", "release": "llama"}, "not both"),
        ({"release": "llama", "sae_id": "a"}, "circuit-tracer set"),
        ({"release": "llama", "repo_id": "a/b"}, "one of them"),
        ({"revision": "main"}, "one of them"),
        ({"release": "ie-lab/set@abc", "revision": "main"}, "pass one"),
        ({"release": "lama"}, "sae-lens is not installed.*a circuit-tracer set is named"),
        ({"release": "hf://ie-lab"}, "hf://org/name"),
        ({"release": 3}, "non-empty string"),
        ({"release": "ie-lab/set/../../x"}, "without '.' or '..'"),
        ({"path": "llama"}, "not a folder.*release='llama'"),
    ],
)
def test_bad_names_are_refused(lm, kwargs, match):
    with pytest.raises(InputError, match=match):
        ie_lab.load_transcoders(model=lm, **kwargs)


def test_what_circuit_tracer_converts_is_refused(lm, tmp_path):
    cache = str(tmp_path / "hub")
    config = "model_kind: transcoder_set\nfeature_input_hook: mlp.hook_in\nfeature_output_hook: hook_mlp_out\n"
    npz = config + "transcoders:\n  - hf://google/gemma-scope-2b-pt-transcoders/layer_0/params.npz\n"
    hub_repo(cache, "mwhanna/gemma-scope-transcoders", {"config.yaml": npz.encode()})
    with pytest.raises(InputError, match="params.npz, which circuit-tracer converts"):
        ie_lab.load_transcoders(release="gemma", model=lm, cache_dir=cache)


REGISTRY = textwrap.dedent(
    """\
    ie-lab-tc:
      conversion_func: null
      model: tiny-llama
      repo_id: ie-lab/saelens-tc
      saes:
      - id: blocks.0.mlp.hook_in
        path: layer_0
      - id: blocks.1.mlp.hook_in
        path: layer_1
    ie-lab-tc-converted:
      conversion_func: mwhanna_transcoder
      model: tiny-llama
      repo_id: ie-lab/saelens-tc
      saes:
      - id: blocks.0.mlp.hook_in
        path: layer_0
    """
)


def test_a_saelens_release_loads_as_its_folders_do(lm, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "sae_lens").mkdir(parents=True)
    (site / "sae_lens" / "__init__.py").write_text("raise ImportError('read, never imported')\n")
    (site / "sae_lens" / "pretrained_saes.yaml").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    src = write_transcoders(str(tmp_path / "src"), lm.facts.d_model, [0, 1])
    want = ie_lab.load_transcoders(src, lm)
    cache = str(tmp_path / "hub")
    hub_repo(cache, "ie-lab/saelens-tc", files_of(src))
    assert_same(ie_lab.load_transcoders(release="ie-lab-tc", model=lm, cache_dir=cache), want)  # every id
    one = ie_lab.load_transcoders(release="ie-lab-tc", sae_id="blocks.1.mlp.hook_in", model=lm, cache_dir=cache)
    assert one.layers == [1] and torch.equal(one[1].W_enc, want[1].W_enc)
    by_repo = ie_lab.load_transcoders(
        repo_id="ie-lab/saelens-tc", sae_id=["layer_0", "layer_1"], model=lm, cache_dir=cache
    )
    assert_same(by_repo, want)
    with pytest.raises(InputError, match=r"converts on load.*load_transcoders\('folder', s\)"):
        ie_lab.load_transcoders(release="ie-lab-tc-converted", model=lm, cache_dir=cache)
    with pytest.raises(InputError, match="not in SAELens' registry.*'ie-lab-tc'"):
        ie_lab.load_transcoders(release="ie-lab-t", model=lm, cache_dir=cache)
    with pytest.raises(InputError, match="hf download ie-lab/saelens-tc layer_0/cfg.json layer_0/sae_weights"):
        ie_lab.load_transcoders(release="ie-lab-tc", model=lm, cache_dir=str(tmp_path / "empty"))
