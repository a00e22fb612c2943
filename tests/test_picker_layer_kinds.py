"""Issue 20, item 3: the picker and the text cheat sheet say, per layer, what mixes tokens there (attention or the
mixer kind the model's facts name), and the picker draws a mixer layer's mixer block in place of attention."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

import ie_lab
from ie_lab.coverage import build_tiny
from ie_lab.errors import AddressError
from ie_lab.toy import tokenizer
from ie_lab.widgets.picker import cheatsheet

# The tiny instances' layer 0 is the mixer, layer 1 attention (tests below check this against the binding).
HYBRIDS = {
    "qwen3_next": "linear_attention",
    "jamba": "mamba",
    "lfm2": "conv",
}  # lfm2: measured, its config says nothing


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request):
    lm = ie_lab.load(build_tiny(request.param), tokenizer=tokenizer())
    return request.param, lm


def test_the_picker_names_each_layers_kind(hybrid):
    family, lm = hybrid
    p = cheatsheet(lm, layer=0)
    truth = [lb.mixer_kind or "attention" for lb in lm.binding.layers]
    assert truth == [HYBRIDS[family], "attention"]
    assert p.spec["layer_mixers"] == truth
    # the neighbour layer's kind (what a picker labelling by position instead of by layer would show) is wrong
    assert p.spec["layer_mixers"] != truth[::-1]
    assert p.spec["layer_kinds_text"] == f"layer 0: {HYBRIDS[family]} (mixer); 1: attention"
    assert p.layer_kind == HYBRIDS[family]
    p.layer = 1
    assert p.layer_kind == "attention"
    assert f"{HYBRIDS[family]} (mixer)" in repr(p)


def test_a_point_of_the_other_kind_is_refused_naming_the_kinds(hybrid):
    family, lm = hybrid
    p = cheatsheet(lm)
    assert p.select("mixer_out.0").layer == 0
    assert p.layer_kind == HYBRIDS[family]
    with pytest.raises(AddressError, match=HYBRIDS[family]):
        p.select("attn_out.0")
    with pytest.raises(AddressError):
        p.select("mixer_out.1")
    assert p.select("attn_out.1").layer == 1 and p.layer_kind == "attention"


def test_the_config_only_cheat_sheet_reads_the_kinds_from_the_config():
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["qwen3_next"]()
    p = cheatsheet(config)
    want = ["attention" if t == "full_attention" else t for t in config.layer_types]
    assert p.spec["layer_mixers"] == want
    assert p.spec["layer_kinds_text"].startswith("layers 0-2, 4-6, 8-10")
    assert p.spec["layer_kinds_text"].endswith(
        "linear_attention (mixer); 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47: attention"
    )


def test_a_dense_picker_is_unchanged():
    p = cheatsheet("llama")
    assert set(p.spec["layer_mixers"]) == {"attention"} and p.spec["layer_kinds_text"] == ""
    assert repr(p) == "Picker(llama, 32 layers, backend=eager; layer 16; selected: none)"


def _drawn(spec: dict, layers: list[int]) -> dict:
    """widgets/util.js under node: per layer, (labels of the modules and point names) and the selector's label."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    util = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "widgets", "util.js")
    script = (
        f"import {{ layoutBlock, layerKindLabel }} from {json.dumps('file://' + util)};\n"
        "let d = ''; process.stdin.on('data', (c) => d += c); process.stdin.on('end', () => {\n"
        "  const [spec, layers] = JSON.parse(d); const st = spec.structure; const out = {};\n"
        "  for (const L of layers) { const lay = layoutBlock(st, st.moe_layers.includes(L), null, L);\n"
        "    out[L] = { modules: lay.items.filter((i) => i.kind === 'module').map((i) => i.label),\n"
        "      points: lay.items.filter((i) => i.kind === 'point').map((i) => i.name),\n"
        "      label: layerKindLabel(spec, L) }; }\n"
        "  process.stdout.write(JSON.stringify(out)); });\n"
    )
    r = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        input=json.dumps([spec, layers]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {int(k): v for k, v in json.loads(r.stdout).items()}


def test_the_diagram_draws_the_mixer_block_on_a_mixer_layer(hybrid):
    family, lm = hybrid
    kind = HYBRIDS[family]
    drawn = _drawn(cheatsheet(lm).spec, [0, 1])
    mixer, attn = drawn[0], drawn[1]
    assert f"{kind} mixer" in mixer["modules"] and not any(m.startswith("attention") for m in mixer["modules"])
    assert {"mixer_in", "mixer_out", "mixer_out_post"} <= set(mixer["points"])
    assert not {"attn_in", "z", "attn_out"} & set(mixer["points"])
    assert mixer["label"] == f"{kind} (mixer)"
    assert f"{kind} mixer" not in attn["modules"] and any(m.startswith("attention") for m in attn["modules"])
    assert not {"mixer_in", "mixer_out"} & set(attn["points"]) and "attn_out" in attn["points"]
    assert attn["label"] == "attention"


def test_a_dense_diagram_has_no_mixer_and_no_kind_label():
    drawn = _drawn(cheatsheet("llama").spec, [0])[0]
    assert drawn["label"] == "" and not any("mixer" in m for m in drawn["modules"])
    assert not any(n.startswith("mixer") for n in drawn["points"])


def test_the_text_cheat_sheet_lists_the_layer_kinds(capsys):
    from ie_lab import cli

    assert cli.main(["points", "qwen3_next"]) == 0
    out = capsys.readouterr().out
    assert "Layer kinds: layer 0: linear_attention (mixer); 1: attention;" in out
    assert cli.main(["points", "llama"]) == 0
    assert "Layer kinds" not in capsys.readouterr().out


def test_in_jupyterlab_the_strip_labels_the_mixer_layer_and_draws_its_mixer():
    """One real browser check (JupyterLab + Chromium): the layer strip names each layer's kind, a click on the
    mixer layer draws its mixer block and its points, and a click on mixer_out selects it in the kernel."""
    from benchmarks.widgets_harness import ROOT, Server, available

    if available() is not None:
        pytest.skip(str(available()))
    srv = Server()
    try:
        srv.write(
            "kinds.ipynb",
            [
                f"import sys; sys.path.insert(0, {ROOT!r})\n"
                "import torch; torch.set_num_threads(1)\n"
                "import ie_lab\nfrom ie_lab.coverage import build_tiny\nfrom ie_lab.toy import tokenizer\n"
                "s = ie_lab.Session(build_tiny('qwen3_next'), tokenizer=tokenizer(), progress=False)",
                "p = s.picker(layer=1); p",
            ],
        )
        page = srv.open("kinds.ipynb")
        picker = page.locator(".iel-picker")
        page.wait_for_selector(".iel-picker svg", timeout=30000)
        cells = picker.locator(".iel-kinds .iel-kind")
        assert [cells.nth(i).get_attribute("aria-label") for i in range(cells.count())] == [
            "layer 0: linear_attention (mixer)",
            "layer 1: attention",
        ]
        svg = picker.locator("svg")
        assert "layer 1 of 2 · MoE · attention" in svg.text_content()
        assert picker.locator('.iel-pt[data-name="mixer_out"]').count() == 0
        cells.nth(0).click()
        assert "layer 0 of 2 · MoE · linear_attention" in svg.text_content()
        assert "linear_attention mixer" in svg.text_content()
        assert picker.locator('.iel-pt[data-name="attn_out"]').count() == 0
        assert "0 · linear_attention (mixer) MoE" in picker.locator('select[aria-label="layer"]').inner_text()
        srv.shot(picker, "picker-hybrid-mixer-layer.png")
        picker.locator('.iel-pt[data-name="mixer_out"]').click()
        deadline = 100
        out = ""
        while deadline and "mixer_out.0 linear_attention" not in out:
            out = srv.execute(page, "print(p.address, p.layer_kind)")
            deadline -= 1
        assert "mixer_out.0 linear_attention" in out, out
        srv.close_page(page)
    finally:
        srv.close()


def test_the_diagram_draws_a_mixers_states_on_the_layers_that_leave_them(hybrid):
    family, lm = hybrid
    spec = cheatsheet(lm).spec
    from ie_lab.points import Structure

    st = Structure.from_binding(lm.binding)
    states, convs = set(st.state_layers), set(st.conv_state_layers)
    drawn = _drawn(spec, [0, 1])
    for layer in (0, 1):
        assert ("mixer_state" in drawn[layer]["points"]) == (layer in states), (family, layer)
        assert ("mixer_conv_state" in drawn[layer]["points"]) == (layer in convs), (family, layer)
    assert states or convs, family
    # a state has no position axis: its card must not claim [batch, seq, ...]
    card = next(p for p in spec["points"] if p["name"] == ("mixer_state" if states else "mixer_conv_state"))
    assert "seq" not in card["shape"].split("(")[0], card["shape"]


@pytest.mark.parametrize("family", ["deepseek_v2", "minicpm3"])
def test_the_diagram_draws_latent_attentions_latents(family):
    lm = ie_lab.load(build_tiny(family), tokenizer=tokenizer())
    drawn = _drawn(cheatsheet(lm).spec, [0])[0]["points"]
    assert {"kv_latent", "k_nope"} <= set(drawn)
    assert ("q_latent" in drawn) == any(getattr(lb, "q_latent", None) is not None for lb in lm.binding.layers)
    assert drawn.index("kv_latent") < drawn.index("k_nope") < drawn.index("attn_scores")
    plain = _drawn(cheatsheet("llama").spec, [0])[0]["points"]
    assert not {"q_latent", "kv_latent", "k_nope"} & set(plain)
