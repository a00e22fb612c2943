"""The option audit: every option that changes how the model computes on the eager backend gives the answer of the
raw transformers model run with the same option, or the call refuses. docs/CAPABILITIES.md ("Options that change
the answer") says what each option does; vLLM engine arguments are audited in the vLLM tests (docs/VLLM.md)."""

import copy
import warnings

import pytest
import torch

import ie_lab
from ie_lab.eager.model import attention_drops
from tests.conftest import ids
from tests.families import FAMILIES, make_config, make_model, make_tokenizer, saved_model_dir

# llama: sdpa drops nothing, so the default kernel stays; gemma2: sdpa drops the attention soft-cap, so the answer the
# model defines is the eager kernel's.
REFERENCE_ATTENTION = {"llama": None, "gemma2": "eager"}
DTYPES = {None: torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    return {f: saved_model_dir(f, root) for f in REFERENCE_ATTENTION}


def _raw(path, dtype=torch.float32, attn=None):
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


def _answer(model, x):
    """The logits, and the lm_head output read by a plain torch hook (what ie_lab's `lm_head` point must equal)."""
    seen = {}
    h = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.setdefault("lm_head", out))
    try:
        with torch.no_grad():
            logits = model(x).logits
    finally:
        h.remove()
    return logits, seen["lm_head"]


def _assert_same_answer(lm, ref, x=None):
    x = ids() if x is None else x
    logits, head = _answer(ref, x)
    got_logits, _ = _answer(lm.hf, x)
    assert got_logits.dtype == logits.dtype
    assert torch.equal(got_logits, logits), (got_logits - logits).abs().max()
    assert torch.equal(ie_lab.capture(lm, x, ["lm_head"])["lm_head"], head)


# ---- which kernel drops what: measured on every family -------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_differs_from_eager_exactly_where_the_quirks_table_says(family):
    """Anything sdpa leaves out must be in quirks.ATTENTION_KERNEL_DROPS (keyed by the config fact), and nothing
    else: a family that differs with no entry, or an entry that changes nothing, fails here."""
    from ie_lab.arch.config_facts import ArchFacts

    predicted = attention_drops(ArchFacts.from_config(make_config(family)).raw, "sdpa")
    try:
        sdpa = make_model(family, attn_implementation="sdpa")
    except ValueError as e:  # transformers refuses sdpa for the family: it runs eager whatever is asked
        assert "does not support" in str(e)
        return
    eager = make_model(family, attn_implementation="eager")
    x = ids(seq=12)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding on one row: masks are part of what a kernel must honour
    with torch.no_grad():
        a = sdpa(x, attention_mask=mask).logits[mask.bool()]
        b = eager(x, attention_mask=mask).logits[mask.bool()]
    differs = (a - b).abs().max().item() > 1e-4
    assert differs == bool(predicted), (family, (a - b).abs().max().item(), predicted)


# ---- dtype -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(REFERENCE_ATTENTION))
def test_dtype_from_a_folder(folders, family, dtype):
    lm = ie_lab.load(folders[family], dtype=dtype, quiet=True)
    _assert_same_answer(lm, _raw(folders[family], DTYPES[dtype], REFERENCE_ATTENTION[family]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dtype_on_a_model_object(dtype):
    obj = make_model("gemma2", attn_implementation="eager")
    ref = copy.deepcopy(obj).to(DTYPES[dtype])
    lm = ie_lab.load(obj, dtype=dtype, quiet=True)
    _assert_same_answer(lm, ref)
    assert next(obj.parameters()).dtype == torch.float32  # the caller's object is not cast


def test_dtype_through_a_session(folders):
    with ie_lab.Session(folders["gemma2"], backend="eager", dtype="bfloat16", progress=False) as s:
        got = s.run(lambda lm: _answer(lm.hf, ids())[0])
    assert torch.equal(got, _answer(_raw(folders["gemma2"], torch.bfloat16, "eager"), ids())[0])


def test_unknown_dtype_refuses(folders):
    with pytest.raises(ie_lab.InputError, match="unknown dtype"):
        ie_lab.load(folders["llama"], dtype="int8", quiet=True)


# ---- device (cpu here; the GPU tests cover cuda) -----------------------------------------------------------------


def test_device_cpu(folders):
    _assert_same_answer(ie_lab.load(folders["llama"], device="cpu", quiet=True), _raw(folders["llama"]))
    obj = make_model("llama")
    lm = ie_lab.load(obj, device="cpu", quiet=True)
    assert lm.hf is obj  # already there: nothing to copy
    _assert_same_answer(lm, make_model("llama"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal of a missing CUDA device")
def test_device_that_is_not_there_refuses(folders):
    with pytest.raises(ie_lab.InputError, match="no CUDA device"):
        ie_lab.load(folders["llama"], device="cuda", quiet=True)
    with pytest.raises(ie_lab.InputError, match="no CUDA device"):
        ie_lab.load(make_model("llama"), device="cuda", quiet=True)


# ---- attention implementation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", [None, "eager", "sdpa"])
@pytest.mark.parametrize("family", list(REFERENCE_ATTENTION))
def test_attention_implementation_from_a_folder(folders, family, attn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = ie_lab.load(folders[family], attn_implementation=attn, quiet=True)
    warned = [w for w in caught if issubclass(w.category, ie_lab.ComputeDiffersWarning)]
    # the answer is the raw model's with the same option; unasked, the kernel that computes what the model defines
    _assert_same_answer(lm, _raw(folders[family], attn=attn or REFERENCE_ATTENTION[family]))
    # a warning exactly when what runs drops something (forcing sdpa on Gemma 2)
    assert bool(warned) == (family == "gemma2" and attn == "sdpa"), [str(w.message) for w in warned]


@pytest.mark.parametrize("attn", ["flash_attention_2", "no_such_kernel"])
def test_attention_implementation_that_cannot_run_refuses(folders, attn):
    pytest.importorskip("torch")
    try:
        import flash_attn  # noqa: F401

        if attn == "flash_attention_2":
            pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    with pytest.raises(ie_lab.InputError, match="attn_implementation"):
        ie_lab.load(folders["llama"], attn_implementation=attn, quiet=True)


def test_attention_implementation_on_an_object_refuses():
    with pytest.raises(ie_lab.CapabilityUnsupported, match="set_attn_implementation"):
        ie_lab.load(make_model("llama"), attn_implementation="sdpa", quiet=True)


# ---- tokenizer ---------------------------------------------------------------------------------------------------

TEXT = "When Mary and John went to the store , John gave a drink to"


@pytest.mark.parametrize("how", ["from the folder", "tokenizer=path", "tokenizer=object"])
def test_tokenizer_options_tokenize_like_the_raw_tokenizer(folders, how):
    from transformers import AutoTokenizer

    path = folders["llama"]
    kw = {
        "from the folder": {},
        "tokenizer=path": {"tokenizer": path},
        "tokenizer=object": {"tokenizer": make_tokenizer()},
    }[how]
    lm = ie_lab.load(path, quiet=True, **kw)
    want = AutoTokenizer.from_pretrained(path)(TEXT, return_tensors="pt").input_ids
    assert torch.equal(lm.to_tokens(TEXT).reshape(1, -1), want)
    by_text = ie_lab.capture(lm, TEXT, ["lm_head"])["lm_head"]
    assert torch.equal(by_text, _answer(_raw(path), want)[1])
