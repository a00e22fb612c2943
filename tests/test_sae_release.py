"""Published SAEs by name (issue 31 item 1): load_sae(release=, sae_id=, model=s) and load_sae(repo_id=, sae_id=).

No network here, so the hub is a Hugging Face cache folder built in each test the way huggingface_hub writes one
(models--org--name/{blobs,refs/main,snapshots/<commit>/<folder>/<file> -> ../../blobs/<sha>}), holding the demo
SAE's files as a published repo would. SAELens' registry is its pretrained_saes.yaml: the tests install a stand-in
`sae_lens` package holding only an excerpt of the real file (copied from sae-lens 6.54.12, entries unchanged) and an
__init__.py that raises, which proves ie_lab reads the table without importing SAELens. Where the real sae-lens is
importable (findable on sys.path), test_the_real_registry reads its whole file too.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import textwrap

import pytest
import torch

import ie_lab
from ie_lab import sae_release
from ie_lab.errors import InputError

REPO_ID = "ie-lab/demo-saes"
FOLDER = "blocks.1.hook_resid_post"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# An excerpt of sae-lens 6.54.12's sae_lens/pretrained_saes.yaml (the first SAEs of three real releases, fields as
# written there) and one release for the demo SAE in the same shape.
REGISTRY = textwrap.dedent(
    f"""\
    gemma-scope-2b-pt-res:
      conversion_func: gemma_2
      model: gemma-2-2b
      repo_id: google/gemma-scope-2b-pt-res
      saes:
      - id: embedding/width_4k/average_l0_6
        path: embedding/width_4k/average_l0_6
      - id: layer_0/width_16k/average_l0_105
        l0: 105
        path: layer_0/width_16k/average_l0_105
    gpt2-small-mlp-tm:
      config_overrides:
        dataset_path: Skylion007/openwebtext
        model_from_pretrained_kwargs:
          center_writing_weights: true
      conversion_func: null
      links:
        model: https://huggingface.co/gpt2
      model: gpt2-small
      repo_id: tommmcgrath/gpt2-small-mlp-out-saes
      saes:
      - id: blocks.0.hook_mlp_out
        l0: 15.0
        norm_scaling_factor: 1.049317316132615
        path: sae_group_gpt2_blocks.0.hook_mlp_out_24576:v1
        variance_explained: 0.999
    gpt2-small-res-jb:
      config_overrides:
        model_from_pretrained_kwargs:
          center_writing_weights: true
      conversion_func: null
      links:
        dashboards: https://www.neuronpedia.org/gpt2sm-res-jb
        model: https://huggingface.co/gpt2
      model: gpt2-small
      repo_id: jbloom/GPT2-Small-SAEs-Reformatted
      saes:
      - id: blocks.0.hook_resid_pre
        l0: 10.0
        neuronpedia: gpt2-small/0-res-jb
        path: blocks.0.hook_resid_pre
        variance_explained: 0.999
      - id: blocks.8.hook_resid_pre
        l0: 65.0
        neuronpedia: gpt2-small/8-res-jb
        path: blocks.8.hook_resid_pre
        variance_explained: 0.97
    ie-lab-demo-res:
      conversion_func: null
      model: ie_lab-demo
      repo_id: {REPO_ID}
      saes:
      - id: {FOLDER}
        l0: 16.0
        path: {FOLDER}
    ie-lab-demo-overridden:
      config_overrides:
        hook_name: blocks.2.hook_resid_post
      conversion_func: null
      model: ie_lab-demo
      repo_id: {REPO_ID}
      saes:
      - id: {FOLDER}
        path: {FOLDER}
    """
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network, even where there is one
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    yield sess
    sess.close()


def hub_cache(root, repo_id: str = REPO_ID, folder: str = FOLDER, commit: str = COMMIT, files=None) -> str:
    """A Hugging Face hub cache holding `files` ({name: bytes}, default the demo SAE's) under `folder` of repo_id."""
    if files is None:
        files = {n: open(os.path.join(ie_lab.DEMO_SAE, n), "rb").read() for n in sae_release.FILES}
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit / folder
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        os.symlink(os.path.relpath(repo / "blobs" / sha, snap), snap / name)  # relative, as huggingface_hub links
    return str(root)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A findable `sae_lens` holding the registry excerpt; importing it fails."""
    site = tmp_path / "site"
    (site / "sae_lens").mkdir(parents=True)
    (site / "sae_lens" / "__init__.py").write_text(
        "raise ImportError('ie_lab must read the registry, not import it')\n"
    )
    (site / "sae_lens" / "pretrained_saes.yaml").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return str(site / "sae_lens" / "pretrained_saes.yaml")


def test_a_release_loads_from_the_hub_cache_offline(s, tmp_path, registry):
    cache = hub_cache(tmp_path / "hub")
    sae = ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s, cache_dir=cache)
    shipped = ie_lab.load_sae(ie_lab.DEMO_SAE, s)
    assert str(sae.address) == "resid_post.1" and (sae.activation, sae.k) == ("topk", 16)
    assert torch.equal(sae.W_enc, shipped.W_enc) and torch.equal(sae.W_dec, shipped.W_dec)
    assert "sae_lens" not in sys.modules  # the table was read, SAELens never ran
    x = s.capture("Mary felt happy .", ["resid_post.1"])["resid_post.1"][0]
    assert torch.equal(sae.encode(x), shipped.encode(x))
    # the folder is the snapshot's, where the cache links the blobs
    folder = sae_release.resolve(None, "ie-lab-demo-res", FOLDER, cache_dir=cache)
    assert folder == os.path.join(cache, "models--ie-lab--demo-saes", "snapshots", COMMIT, FOLDER)


def test_hf_hub_cache_and_revision_are_read_when_called(s, tmp_path, registry, monkeypatch):
    cache = hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)  # after huggingface_hub read its own constants: read at call time
    sae = ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s, revision=COMMIT)
    assert str(sae.address) == "resid_post.1"
    with pytest.raises(InputError, match=f"--revision {'f' * 40}"):
        ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s, revision="f" * 40)


def test_a_repo_id_loads_without_the_registry(s, tmp_path):
    if importlib.util.find_spec("sae_lens") is None:  # no registry at all here: repo_id= must not need one
        with pytest.raises(InputError, match="pip install sae-lens"):
            ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s)
    cache = hub_cache(tmp_path / "hub", folder="saes/resid_post_1")
    sae = ie_lab.load_sae(repo_id=REPO_ID, sae_id="saes/resid_post_1", model=s, cache_dir=cache)
    assert str(sae.address) == "resid_post.1"
    root = hub_cache(tmp_path / "root", repo_id="ie-lab/one-sae", folder="")  # files at the repo's root
    assert str(ie_lab.load_sae(repo_id="ie-lab/one-sae", sae_id="", model=s, cache_dir=root).address) == "resid_post.1"


def test_missing_from_the_cache_names_the_path_and_the_command(s, tmp_path, registry):
    cache = str(tmp_path / "empty")
    with pytest.raises(InputError) as e:
        ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s, cache_dir=cache)
    msg = str(e.value)
    assert os.path.join(cache, "models--ie-lab--demo-saes", "snapshots", "<revision>", FOLDER) in msg
    assert f"hf download {REPO_ID} {FOLDER}/cfg.json {FOLDER}/sae_weights.safetensors --cache-dir {cache}" in msg
    assert "HF_HUB_OFFLINE" in msg and "huggingface-cli download" in msg
    # half a download (the config without the weights) is still missing, and says which file
    only_cfg = {"cfg.json": open(os.path.join(ie_lab.DEMO_SAE, "cfg.json"), "rb").read()}
    half = hub_cache(tmp_path / "half", files=only_cfg)
    with pytest.raises(InputError, match=f"{FOLDER}/sae_weights.safetensors not in the Hugging Face cache"):
        ie_lab.load_sae(release="ie-lab-demo-res", sae_id=FOLDER, model=s, cache_dir=half)


def test_the_registry_lookup_and_its_refusals(registry):
    assert sae_release.lookup("gpt2-small-res-jb", "blocks.8.hook_resid_pre") == (
        "jbloom/GPT2-Small-SAEs-Reformatted",
        "blocks.8.hook_resid_pre",
    )  # its config_overrides touch only TransformerLens' loading: looked up
    with pytest.raises(InputError, match=r"'gpt2-small-res-jb'"):
        sae_release.lookup("gpt2-small-res-j", "blocks.8.hook_resid_pre")
    with pytest.raises(InputError, match=r"Did you mean 'blocks\.8\.hook_resid_pre'"):
        sae_release.lookup("gpt2-small-res-jb", "blocks.8.hook_resid_post")
    with pytest.raises(InputError, match=r"conversion_func: gemma_2.*save_model"):
        sae_release.lookup("gemma-scope-2b-pt-res", "layer_0/width_16k/average_l0_105")
    with pytest.raises(InputError, match=r"overrides \['hook_name'\]"):
        sae_release.lookup("ie-lab-demo-overridden", FOLDER)
    with pytest.raises(InputError, match="norm_scaling_factor 1.049"):
        sae_release.lookup("gpt2-small-mlp-tm", "blocks.0.hook_mlp_out")
    assert "sae_lens" not in sys.modules


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"path": "x", "release": "ie-lab-demo-res", "sae_id": FOLDER}, "not both"),
        ({"release": "ie-lab-demo-res"}, "needs sae_id="),
        ({"sae_id": FOLDER}, "release= .*or repo_id="),
        ({"release": "ie-lab-demo-res", "repo_id": REPO_ID, "sae_id": FOLDER}, "pass one"),
        ({"release": 3, "sae_id": FOLDER}, "release=3: a non-empty string"),
        ({"repo_id": REPO_ID, "sae_id": 1}, "sae_id=1: a string"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match, registry):
    with pytest.raises(InputError, match=match):
        ie_lab.load_sae(**kwargs)


def test_the_real_registry():
    """Runs where the real sae-lens is installed (or unpacked on PYTHONPATH): its whole table is read."""
    spec = importlib.util.find_spec("sae_lens")
    if spec is None:
        pytest.skip("sae-lens is not installed here (an optional extra): the stand-in registry tests cover the code")
    table = sae_release.releases()
    assert len(table) > 100 and "sae_lens" not in sys.modules
    assert sae_release.lookup("gpt2-small-res-jb", "blocks.8.hook_resid_pre") == (
        "jbloom/GPT2-Small-SAEs-Reformatted",
        "blocks.8.hook_resid_pre",
    )
    with pytest.raises(InputError, match="conversion_func: gemma_2"):
        sae_release.lookup("gemma-scope-2b-pt-res", "layer_0/width_16k/average_l0_105")
