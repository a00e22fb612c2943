"""The panels on the demo model as a teacher shows them (notebook 05's recipe), in a real JupyterLab in both themes.

This run's screenshots are the ones docs/WIDGETS.md shows: they go to artifacts/widgets/ (not committed), and with
IE_LAB_DOCS_IMAGES=1 also to docs/img/ (commit those). One server and one notebook (the machine is small).
"""

import os
import re
import shutil

import pytest

from benchmarks.widgets_harness import ROOT, Server, available
from tests.browser_helpers import settle, switch_theme
from tests.browser_helpers import until as _until

browser = pytest.mark.skipif(available() is not None, reason=str(available()))

# screenshot -> the docs/img file it becomes; docs/WIDGETS.md shows these and no other panel image
DOCS_IMAGES = {
    "docs-picker-light.png": "widgets-picker-lab-light.png",
    "docs-picker-dark.png": "widgets-picker-lab-dark.png",
    "docs-attention-light.png": "widgets-attention-lab-light.png",
    "docs-attention-dark.png": "widgets-attention-lab-dark.png",
    "docs-steering-light.png": "widgets-steering-lab-light.png",
    "docs-steering-dark.png": "widgets-steering-lab-dark.png",
    "docs-features-light.png": "widgets-features-lab-light.png",
    "docs-features-dark.png": "widgets-features-lab-dark.png",
}
IMG = os.path.join(ROOT, "docs", "img")

# notebook 05's stories: the same words on both sides except the mood ones
HAPPY = [
    "One Monday , Anna went to the park . Anna felt happy and joyful . Anna smiled and laughed .",
    "One Sunday , Tom went to the beach . It was a sunny day at the beach . Tom was full of joy .",
    "One Friday , Lucy went to the garden . Lucy sang and danced . Lucy felt glad and proud .",
    "One Tuesday , Ben went to the market . Everyone at the market cheered . Ben felt cheerful .",
    "One Saturday , Emma went to the zoo . The bright morning made Emma feel excited . Emma giggled .",
    "One Thursday , Jack went to the lake . Jack felt thrilled and merry . Jack was full of delight .",
]
SAD = [
    "One Monday , Anna went to the park . Anna felt sad and lonely . Anna cried and sighed .",
    "One Sunday , Tom went to the beach . It was a rainy day at the beach . Tom was full of sorrow .",
    "One Friday , Lucy went to the garden . Lucy wept and sobbed . Lucy felt gloomy and upset .",
    "One Tuesday , Ben went to the market . Everyone at the market mourned . Ben felt miserable .",
    "One Saturday , Emma went to the zoo . The dreary morning made Emma feel hopeless . Emma frowned .",
    "One Thursday , Jack went to the lake . Jack felt heartbroken and weary . Jack was full of grief .",
]
SAD_STORY = "One Monday , Fiona went to the farm . Fiona cried and sobbed ."
MIXED = "Anna felt happy and joyful . Tom felt sad and lonely ."
# twelve random words told twice: the second copy attends one copy back (layer 2, head 0: the card's induction head)
REPEAT = "owl Paris bread seven kite drum violet Tuesday lamp river tiger honey"
CELLS = [
    f"import sys; sys.path.insert(0, {ROOT!r})\n"
    "import torch; torch.set_num_threads(1)\n"
    "import ie_lab\n"
    "s = ie_lab.Session(ie_lab.DEMO_MODEL, device='cpu', progress=False)",
    "p = s.picker(); p.select('resid_post.0'); p",
    f"a = s.show_attention({REPEAT + ' ' + REPEAT!r}, layer=2, head=0); a",
    f"sp = s.steering_panel({SAD_STORY!r}, address='resid_post.0', positive={HAPPY!r}, negative={SAD!r}, "
    "scale=8.0, max_new_tokens=24); sp",
    # the mood direction as a one-row probe: the tokens of a happy and a sad sentence coloured by it
    f"mood = s.mean_difference({HAPPY!r}, {SAD!r}, 'resid_post.0'); mood = mood / mood.norm()\n"
    f"fp = s.feature_panel({MIXED!r}, 'resid_post.0', mood[None], top=1); fp",
]


def _lexicon():
    import json

    with open(os.path.join(ROOT, "ie_lab", "demo_model", "training_report.json")) as f:
        lex = json.load(f)["lexicon"]
    return set(lex["happy_words"]), set(lex["sad_words"])


def _moods(text):
    happy, sad = _lexicon()
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w in happy for w in words), sum(w in sad for w in words)


def _shot(srv, locator, name):
    path = srv.shot(locator, name)
    if os.environ.get("IE_LAB_DOCS_IMAGES") == "1" and name in DOCS_IMAGES:
        shutil.copyfile(path, os.path.join(IMG, DOCS_IMAGES[name]))
    return path


@pytest.fixture(scope="module")
def lab():
    srv = Server()
    try:
        srv.write("demo.ipynb", CELLS)
        page = srv.open("demo.ipynb", width=1300)
        for sel in (".iel-picker svg", ".iel-attn canvas.iel-pattern", ".iel-steer .iel-text", ".iel-feat .iel-tok"):
            page.wait_for_selector(sel, timeout=60000)
        page.wait_for_function(
            "() => { const e = document.querySelector('.iel-steer'); return e && !e.classList.contains('iel-busy')"
            " && e.querySelector('[data-which=steered]').textContent.trim().length > 0; }",
            timeout=60000,
        )
        yield srv, page
        srv.close_page(page)
    finally:
        srv.close()


def _theme(page, theme, light):
    switch_theme(page, theme, light, ".iel-steer")
    # the screenshots are taken once the panel's colours hold still (the theme's transitions over, fonts loaded)
    settle(
        page,
        "() => [...document.querySelectorAll('.iel-steer, .iel-steer *')].slice(0, 200)"
        ".map((e) => { const c = getComputedStyle(e); return [c.color, c.backgroundColor]; })",
    )


@browser
def test_the_steering_panel_turns_the_sad_story_happy_on_screen(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    # the tokens as drawn (one box each: the demo model's word-level tokens carry no spaces)
    base = " ".join(panel.locator("[data-which=baseline] .iel-tok").all_inner_texts())
    steered = " ".join(panel.locator("[data-which=steered] .iel-tok").all_inner_texts())
    (bh, bs), (sh, ss) = _moods(base), _moods(steered)
    assert bs > 0 and bh == 0, base  # the story as the model tells it: sad
    assert sh > 0 and ss == 0, steered  # the direction added at resid_post.0, coefficient 8: happy
    assert panel.locator("[data-which=steered] .iel-tok").count() >= 8  # a sentence, not a word or two
    _shot(srv, panel, "docs-steering-light.png")
    # the slider at 0 gives the baseline back, on screen
    drawn = panel.locator("[data-which=steered] .iel-tok")
    srv.execute(page, "sp.update(scale=0.0)")
    assert _until(lambda: " ".join(drawn.all_inner_texts()) == base)
    srv.execute(page, "sp.update(scale=8.0)")
    assert _until(lambda: " ".join(drawn.all_inner_texts()) == steered)


@browser
def test_the_attention_viewer_shows_the_induction_heads_stripe(lab):
    srv, page = lab
    view = page.locator(".iel-attn")
    # the head on screen attends from the second copy one copy back (the token after the earlier occurrence)
    m = len(REPEAT.split())  # [BOS, copy, copy]: position q of the second copy attends to q - m + 1
    score = srv.execute(
        page,
        f"pat = a.head_pattern(); q = torch.arange({m} + 1, pat.shape[0]); print(float(pat[q, q - {m} + 1].mean()))",
    )
    assert float(score) > 0.9, score
    canvas = view.locator("canvas.iel-pattern")
    box = canvas.bounding_box()
    canvas.hover(position={"x": box["width"] * 0.3, "y": box["height"] * 0.8})
    assert "query" in view.locator(".iel-readout").inner_text()
    _shot(srv, view, "docs-attention-light.png")


@browser
def test_the_picker_card_shows_the_demo_models_numbers(lab):
    srv, page = lab
    picker = page.locator(".iel-picker")
    picker.locator('.iel-pt[data-name="mlp_out"]').hover()
    assert _until(lambda: "mlp_out" in picker.locator(".iel-card").inner_text())
    assert "128" in picker.locator(".iel-card").inner_text()  # d_model of the demo model
    _shot(srv, picker, "docs-picker-light.png")


@browser
def test_the_feature_panel_lights_the_happy_words_by_the_mood_direction(lab):
    srv, page = lab
    panel = page.locator(".iel-feat")
    happy, sad = _lexicon()
    proj = f"s.project({MIXED!r}, 'resid_post.0', mood[None])"
    toks = srv.execute(page, f"print('\\n'.join({proj}.str_tokens))").rstrip("\n").split("\n")
    scores = [
        float(x) for x in srv.execute(page, f"print(' '.join(str(v) for v in {proj}.scores[:, 0].tolist()))").split()
    ]
    assert panel.locator(".iel-tok").count() == len(toks) == len(scores)  # one box per token the model read
    assert " · 1 feature · " in panel.locator(".iel-title").inner_text()  # not "1 features" (issue 33)
    # the panel shows the mood probe's score per token: happy words score above sad ones
    h = [v for t, v in zip(toks, scores) if t.strip() in happy]
    sd = [v for t, v in zip(toks, scores) if t.strip() in sad]
    assert h and sd and min(h) > max(sd), (toks, scores)
    _shot(srv, panel, "docs-features-light.png")


def _settled(page, srv, scale):
    """The kernel has the slider's value and the panel has drawn the text generated for it."""
    return _until(
        lambda: (
            srv.execute(page, "print(sp.scale, sp.status)").split() == [str(float(scale)), "ready"]
            and not page.locator(".iel-steer").evaluate("e => e.classList.contains('iel-busy')")
        )
    )


@browser
def test_dragging_the_coefficient_slider_turns_the_mood_both_ways(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    drawn = panel.locator("[data-which=steered] .iel-tok")
    slider = panel.locator('input[data-knob="scale"]')
    slider.scroll_into_view_if_needed()
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    thumb = box["x"] + box["width"] * (8.0 + 10.0) / 20.0  # the range is -10..10, the thumb at 8

    def drag(to_x):
        page.mouse.move(thumb, y)
        page.mouse.down()
        page.mouse.move(to_x, y, steps=12)  # each step is an input event; the panel keeps the last
        page.mouse.up()

    try:
        drag(box["x"] - 40)  # past the left end: the slider's minimum, -10
        assert _settled(page, srv, -10.0), srv.execute(page, "print(sp.scale, sp.status)")
        h, sd = _moods(" ".join(drawn.all_inner_texts()))
        assert h == 0 and sd > 0, drawn.all_inner_texts()  # pushed the other way: still sad, nothing happy
        thumb = box["x"]
        drag(box["x"] + box["width"] + 40)  # past the right end: 10
        assert _settled(page, srv, 10.0)
        h, sd = _moods(" ".join(drawn.all_inner_texts()))
        assert h > 0 and sd == 0, drawn.all_inner_texts()
    finally:
        srv.execute(page, "sp.update(scale=8.0)")  # back where notebook 05 leaves it, for the screenshots


@browser
def test_dark_theme_screenshots(lab):
    srv, page = lab
    # the slider shows the kernel's coefficient (8, set from Python after the drag), not where the drag left it
    assert _until(lambda: page.locator('.iel-steer input[data-knob="scale"]').input_value() == "8")
    try:
        _theme(page, "JupyterLab Dark", False)
        for sel, name in (
            (".iel-picker", "picker"),
            (".iel-attn", "attention"),
            (".iel-steer", "steering"),
            (".iel-feat", "features"),
        ):
            _shot(srv, page.locator(sel).first, f"docs-{name}-dark.png")
    finally:
        _theme(page, "JupyterLab Light", True)


def test_widgets_md_shows_each_panel_from_this_test_run():
    with open(os.path.join(ROOT, "docs", "WIDGETS.md")) as f:
        shown = re.findall(r"!\[[^\]]*\]\(img/([^)]+)\)", f.read())
    assert sorted(shown) == sorted(DOCS_IMAGES.values()), "docs/WIDGETS.md shows other images than this test makes"
    missing = [n for n in shown if not os.path.exists(os.path.join(IMG, n))]
    assert not missing, f"run IE_LAB_DOCS_IMAGES=1 pytest {__file__} and commit docs/img/: {missing}"
