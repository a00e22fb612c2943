import os

import pytest
import torch

import ie_lab
from tests.conftest import assert_clean, ids
from tests.families import make_model, make_tokenizer, saved_model_dir


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return saved_model_dir("qwen3", tmp_path_factory.mktemp("models"))


def test_load_from_a_local_folder_equals_the_object(saved):
    from_disk = ie_lab.load(saved, quiet=True)
    in_memory = ie_lab.load(make_model("qwen3"), make_tokenizer())
    assert from_disk.tokenizer is not None
    x = ids()
    a = ie_lab.capture(from_disk, x, ["resid_post.1", "q_norm_out.0"])
    b = ie_lab.capture(in_memory, x, ["resid_post.1", "q_norm_out.0"])
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    assert_clean(from_disk)


def test_text_input_uses_the_tokenizer(saved):
    lm = ie_lab.load(saved, quiet=True)
    c = ie_lab.capture(lm, "When Mary and John went to the store", ["resid_post.0"])
    assert c.str_tokens[0][:3] == lm.tokenizer.convert_ids_to_tokens(lm.tokenizer("When Mary and John")["input_ids"])[:3]
    assert c["resid_post.0"].shape[1] == len(c.str_tokens[0])


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(ie_lab.InputError, match="no folder at"):
        ie_lab.load(str(tmp_path / "nope"))


def test_pickle_only_folder_is_refused(tmp_path, saved):
    import shutil

    d = tmp_path / "pickled"
    shutil.copytree(saved, d)
    os.remove(d / "model.safetensors")
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(ie_lab.InputError, match="safetensors only"):
        ie_lab.load(str(d))


def test_unknown_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ie_lab.InputError, match="could not load"):
        ie_lab.load("nobody-here/not-a-model", quiet=True)


def test_missing_device_and_bad_dtype(saved):
    if not torch.cuda.is_available():
        with pytest.raises(ie_lab.InputError, match="no CUDA device"):
            ie_lab.load(saved, device="cuda", quiet=True)
    with pytest.raises(ie_lab.InputError, match="unknown dtype"):
        ie_lab.load(saved, dtype="float8", quiet=True)


def test_dtype_by_name(saved):
    lm = ie_lab.load(saved, dtype="bfloat16", quiet=True)
    assert lm.dtype == torch.bfloat16
    c = ie_lab.capture(lm, ids(), ["resid_post.0"])
    assert c["resid_post.0"].dtype == torch.bfloat16


def test_vllm_backend_refuses_a_model_object():
    # vLLM builds its own copy of the weights from a folder or id; an in-memory object cannot be handed over.
    with pytest.raises(ie_lab.CapabilityUnsupported, match="vLLM"):
        ie_lab.load(make_model("llama"), backend="vllm")


def test_raw_hf_model_is_accepted_directly():
    m = make_model("gpt2")
    c = ie_lab.capture(m, ids(), ["resid_post.0"])
    assert c["resid_post.0"].shape == (2, 11, 128)
