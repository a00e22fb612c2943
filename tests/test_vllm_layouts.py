"""quirks.VLLM_LAYOUTS_REFUSED, read by vllm.checks.refuse_unserved_layout: the served families' layouts ie_lab's
vLLM worker does not bind or vLLM cannot load are refused from the table, in the words the backend refuses them."""

import os

import pytest

from ie_lab.arch.config_facts import ArchFacts
from ie_lab.errors import CapabilityUnsupported
from ie_lab.vllm.checks import refuse_unserved_layout
from tests.families import make_config, make_model, make_tokenizer

# family of tests/families.py, config keys set on it, the start of the refusal (None: served)
CASES = [
    ("opt", {"do_layer_norm_before": False}, "OPT-350m's layout on backend='vllm'"),
    ("opt", {"word_embed_proj_dim": 64}, "OPT-350m's layout on backend='vllm'"),
    ("falcon_4h", {"alibi": True}, "Falcon with ALiBi or sequential blocks (Falcon-RW) on backend='vllm'"),
    ("falcon", {}, "Falcon with ffn_hidden_size=256 on backend='vllm'"),
    ("opt", {}, None),
    ("falcon_4h", {}, None),
    ("falcon_mqa_4h", {}, None),
]


def _config(family, keys):
    cfg = make_config(family)
    for k, v in keys.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("family, keys, refusal", CASES)
def test_the_table_refuses_exactly_the_unserved_layouts(family, keys, refusal):
    cfg = _config(family, keys)
    if refusal is None:
        refuse_unserved_layout(cfg, ArchFacts.from_config(cfg))
        return
    with pytest.raises(CapabilityUnsupported) as e:
        refuse_unserved_layout(cfg, ArchFacts.from_config(cfg))
    assert str(e.value).startswith(refusal) and "Instead: use backend='eager'." in str(e.value)
    assert "{" not in str(e.value)  # every field of the table's texts filled


@pytest.mark.parametrize("family, keys", [("opt", {"do_layer_norm_before": False}), ("falcon", {})])
def test_the_backend_refuses_in_the_tables_words(family, keys, tmp_path):
    pytest.importorskip("vllm")
    import ie_lab

    cfg = _config(family, keys)
    with pytest.raises(CapabilityUnsupported) as want:
        refuse_unserved_layout(cfg, ArchFacts.from_config(cfg))
    model = make_model(family)
    for k, v in keys.items():
        setattr(model.config, k, v)
    path = os.fspath(tmp_path / family)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    with pytest.raises(CapabilityUnsupported) as got:
        ie_lab.Session(path, backend="vllm", progress=False)
    assert str(got.value) == str(want.value)
