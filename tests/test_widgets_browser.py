"""The panels in a real JupyterLab 4 and Notebook 7, driven by Playwright + Debian Chromium (headless).

One server and one notebook per module (the machine is small). Screenshots go to artifacts/widgets/.
"""

import os

import pytest

from benchmarks.widgets_harness import ROOT, Server, available, setup_code
from tests.browser_helpers import box_probe, settle, switch_theme
from tests.browser_helpers import kernel as _kernel
from tests.browser_helpers import until as _until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

PROMPT = "When Mary and John went to the store , John gave a drink to"
CELLS = [
    setup_code("llama"),
    "p = s.picker(); p",
    f"a = s.show_attention({PROMPT!r}); a",
    "sp = s.steering_panel('Mary went to the', positive=['happy good day', 'good morning'], "
    "negative=['sad bad night', 'bad evening'], scale=0.0, max_new_tokens=12); sp",
]


@pytest.fixture(scope="module")
def server():
    srv = Server()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def lab(server):
    srv = server
    srv.write("panels.ipynb", CELLS)
    page = srv.open("panels.ipynb")
    for sel in (".iel-picker svg", ".iel-attn canvas.iel-pattern", ".iel-steer .iel-text"):
        page.wait_for_selector(sel, timeout=30000)
    yield srv, page
    srv.close_page(page)


def test_picker_renders_and_a_click_sets_the_address_in_the_kernel(lab):
    srv, page = lab
    picker = page.locator(".iel-picker")
    assert picker.locator(".iel-pt").count() == 19  # Llama's block: no QK-norm points drawn, nothing greyed on eager
    assert picker.locator(".iel-pt.iel-off").count() == 0
    srv.shot(picker, "picker-lab-light.png")
    picker.locator('.iel-pt[data-name="mlp_out"]').click()
    assert _until(lambda: _kernel(srv, page, "str(p.address)") == "mlp_out.1")
    assert "blocks.1.hook_mlp_out" in picker.locator(".iel-card").inner_text()
    picker.locator('.iel-pt[data-name="attn_out"]').click(modifiers=["Shift"])
    assert _until(lambda: _kernel(srv, page, "[str(x) for x in p.addresses]") == ["mlp_out.1", "attn_out.1"])
    # keyboard: focus a point, move down with the arrow key, select with Enter; change layer with PageUp
    picker.locator('.iel-pt[data-name="resid_pre"]').focus()
    page.keyboard.press("PageUp")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    assert _until(lambda: _kernel(srv, page, "str(p.address)") == "attn_in.0")
    srv.shot(picker, "picker-lab-selected.png")


def test_clicking_a_head_shows_that_heads_pattern(lab):
    srv, page = lab
    view = page.locator(".iel-attn")
    assert view.locator(".iel-thumb").count() == 4
    before = view.locator("canvas.iel-pattern").screenshot()
    view.locator('.iel-thumb[data-head="2"]').click()
    page.wait_for_selector('.iel-attn .iel-thumb.iel-sel[data-head="2"]', timeout=15000)
    assert view.locator("canvas.iel-pattern").screenshot() != before
    assert _kernel(srv, page, "[a.layer, a.head]") == [0, 2]
    # the browser holds exactly the kernel's head pattern
    js = page.evaluate(
        """() => { const v = document.querySelector('.iel-attn'); return v.querySelector('.iel-title').textContent; }"""
    )
    assert "head 2" in js
    ok = _kernel(
        srv,
        page,
        f"bool(__import__('torch').allclose(a.head_pattern(), s.capture({PROMPT!r}, ['attn_probs.0'])['attn_probs.0'][0, 2]))",
    )
    assert ok
    # hovering a token highlights what it attends to
    view.locator('.iel-tok[data-i="5"]').hover()
    assert "token 5" in view.locator(".iel-readout").inner_text()
    assert view.locator('.iel-tok[data-i="0"]').evaluate("e => e.style.background") != ""
    view.locator('select[aria-label="layer"]').select_option("1")
    assert _until(lambda: _kernel(srv, page, "[a.layer, a.head]") == [1, 2])
    srv.shot(view, "attention-lab-light.png")


def test_moving_a_slider_changes_the_steered_text_in_the_dom_and_the_kernel(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    steered = panel.locator('[data-which="steered"]')
    before = steered.inner_text()
    assert before == panel.locator('[data-which="baseline"]').inner_text()  # scale 0: identical
    page.evaluate("""() => { const r = document.querySelector('.iel-steer input[data-knob="scale"]');
        r.value = String(r.max); r.dispatchEvent(new Event('input', {bubbles: true})); }""")
    page.wait_for_function(
        "b => { const e = document.querySelector('.iel-steer [data-which=\"steered\"]');"
        " return e.innerText !== b && !document.querySelector('.iel-steer').classList.contains('iel-busy'); }",
        arg=before,
        timeout=20000,
    )
    dom = steered.locator(".iel-tok").all_text_contents()
    assert panel.locator('[data-which="steered"] .iel-added').count() > 0  # token-level differences marked
    k = _until(
        lambda: (lambda r: r if r["scale"] == 10.0 else None)(
            _kernel(srv, page, "dict(scale=sp.scale, toks=sp.steered)")
        )
    )
    assert k and k["scale"] == 10.0
    assert dom == k["toks"]  # the toy vocabulary has no spaces or newlines, so tokens show verbatim
    srv.shot(panel, "steering-lab-light.png")


def test_a_long_contrast_shows_progress_leaves_the_kernel_free_and_stops(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    # hold the vector job after its first batch (on the session's loop), to look at the panel meanwhile
    srv.execute(
        page,
        "import threading as _t, torch as _torch\n_reached, _release = _t.Event(), _t.Event()\n"
        "def _gate(ch):\n    if ch['new'][0] == 64:\n        _reached.set(); _release.wait(60)\n"
        "sp.observe(_gate, 'progress'); _v0, _src0 = sp.vector.clone(), sp.vector_source",
    )
    try:
        panel.locator(".iel-contrast summary").click()
        panel.locator('textarea[aria-label^="positive"]').fill("\n".join(f"happy good day {i}" for i in range(64)))
        panel.locator('textarea[aria-label^="negative"]').fill("\n".join(f"sad bad night {i}" for i in range(64)))
        panel.get_by_role("button", name="use difference of means").click()
        page.wait_for_function(
            "() => document.querySelector('.iel-steer .iel-status').textContent.includes('64/128')", timeout=30000
        )
        assert panel.locator("progress.iel-progress").is_visible()
        # the kernel answers while the vector is being computed
        assert _kernel(srv, page, "[_reached.is_set(), sp.status, sp.progress]") == [True, "vector", [64, 128]]
        srv.shot(panel, "steering-vector-progress.png")
        panel.get_by_role("button", name="stop").click()
        assert _until(lambda: _kernel(srv, page, "sp.status") == "ready")
    finally:
        srv.execute(page, "_release.set(); sp.wait(); sp.unobserve(_gate, 'progress')")
    page.wait_for_function("() => !document.querySelector('.iel-steer').classList.contains('iel-busy')", timeout=30000)
    assert not panel.locator("progress.iel-progress").is_visible()
    assert _kernel(srv, page, "[bool(_torch.equal(sp.vector, _v0)), sp.vector_source == _src0]") == [True, True]


# Every value each text column's token count took, in order (MutationObserver records keep the value each set
# replaced, so no intermediate state is lost however the browser batches its callbacks).
WATCH_COUNTS = """() => { const root = document.querySelector('.iel-steer'); window._counts = [];
  const boxes = { baseline: root.querySelector('[data-which="baseline"]'), steered: root.querySelector('[data-which="steered"]') };
  window._countsObs = new MutationObserver((recs) => { for (const r of recs)
    window._counts.push([r.target.dataset.which, r.oldValue === null ? null : Number(r.oldValue)]); });
  for (const b of Object.values(boxes)) window._countsObs.observe(b, { attributes: true, attributeFilter: ['data-count'], attributeOldValue: true });
  return true; }"""
READ_COUNTS = """() => { window._countsObs.disconnect(); const root = document.querySelector('.iel-steer');
  return { recs: window._counts, final: { baseline: Number(root.querySelector('[data-which="baseline"]').dataset.count),
    steered: Number(root.querySelector('[data-which="steered"]').dataset.count) } }; }"""


def _states(recs, final):
    """(baseline, steered) token counts after each redraw: each record holds the value its set replaced, so the
    value a set wrote is the next record's old value on that column (or the final one)."""
    values = {w: [old for which, old in recs if which == w] + [final[w]] for w in ("baseline", "steered")}
    return list(zip(values["baseline"][1:], values["steered"][1:]))


def test_a_new_prompt_streams_the_baseline_beside_the_steered_text(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    n = _kernel(srv, page, "sp.max_new_tokens")
    page.evaluate(WATCH_COUNTS)
    box = panel.locator('textarea[aria-label="prompt"]')
    box.fill("John went to the")
    box.press("Control+Enter")
    assert _until(lambda: _kernel(srv, page, "[sp.prompt, sp.status]") == ["John went to the", "ready"], 60)
    page.wait_for_function("() => !document.querySelector('.iel-steer').classList.contains('iel-busy')", timeout=30000)
    got = page.evaluate(READ_COUNTS)
    states = _states(got["recs"], got["final"])
    assert states and states[-1] == (n, n), states
    # the baseline column grew token by token while the steered one was still growing: a burst at the end would
    # jump from 0 to n after the steered text was complete
    growing = [(b, st) for b, st in states if 0 < b < n and st < n]
    assert len({b for b, _ in growing}) >= 2, states
    assert panel.locator('[data-which="baseline"] .iel-tok').all_text_contents() == _kernel(srv, page, "sp.baseline")
    assert _kernel(srv, page, "sp.baseline_ids == s.generate('John went to the', sp.max_new_tokens).ids")


def test_dark_theme(lab):
    srv, page = lab
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20000)
    settle(page, "() => getComputedStyle(document.querySelector('.iel-picker')).backgroundColor")
    bg = page.locator(".iel-picker").evaluate("e => getComputedStyle(e).backgroundColor")
    assert bg not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)")
    srv.shot(page.locator(".iel-picker"), "picker-lab-dark.png")
    srv.shot(page.locator(".iel-attn"), "attention-lab-dark.png")
    srv.shot(page.locator(".iel-steer"), "steering-lab-dark.png")
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")


def test_notebook7_renders_the_panels(lab):
    srv, _ = lab
    srv.write(
        "nb7.ipynb",
        [
            f"import sys; sys.path.insert(0, {ROOT!r})\nimport ie_lab",
            "p = ie_lab.cheatsheet('gemma2', backend='vllm'); p",
        ],
    )
    page = srv.open("nb7.ipynb", ui="notebook")
    try:
        page.wait_for_selector(".iel-picker svg", timeout=30000)
        # greyed where vLLM cannot serve the point: the card says why, and nothing is selected
        page.locator('.iel-pt.iel-off[data-name="lm_head"]').click()
        assert "compute_logits" in page.locator(".iel-picker .iel-error").inner_text()
        page.locator('.iel-pt[data-name="mlp_out_post"]').click()
        assert _until(lambda: _kernel(srv, page, "str(p.address)") == "mlp_out_post.13")
        assert "post-MLP norm" in page.locator(".iel-picker svg").text_content()  # Gemma 2's sandwich norms drawn
        srv.shot(page.locator(".iel-picker"), "picker-notebook7-gemma2.png")
    finally:
        srv.close_page(page)


# ---- issue 19: what a teacher would see (a 1,100 px window with the file browser open; both themes) --------------
PROMPT41 = (
    "When Mary and John went to the store , John gave a drink to Mary . Then Alice and Bob went to the park , "
    "and Bob gave a book to Alice . Later Tom and Sarah went home and slept"
)
CELLS19 = [
    setup_code("llama"),
    "p = s.picker(); p",
    f"a = s.show_attention({PROMPT41!r}); a",
    "sp = s.steering_panel('Mary went to the', max_new_tokens=4); sp",
    "sq = s.steering_panel('Mary went to the', address='resid_post.1', positive=['happy good day', 'good morning'], "
    "negative=['sad bad night', 'bad evening'], scale=2.0, max_new_tokens=4); sq",
    f"fig = s.attention({PROMPT41!r}, layers=[0]).plot(0, 0); fig",
    "a10 = s.show_attention('Mary went to the store with John and Bob today'); a10",
    f"a200 = s.show_attention({' . '.join([PROMPT41] * 5)!r}); a200",
]

# Colours of text as the browser computed them, over the first opaque background behind each element.
MEASURE = """(sels) => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const v = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number); return [v[0], v[1], v[2], v.length > 3 ? v[3] : 1]; };
  const bgOf = (e) => { for (let x = e; x; x = x.parentElement) { if (x instanceof SVGElement && x.tagName !== 'svg') continue;
      const c = parse(getComputedStyle(x).backgroundColor); if (c && c[3] > 0.5) return c; } return [255, 255, 255, 1]; };
  const out = [];
  for (const [what, sel] of sels) {
    const els = [...document.querySelectorAll(sel)].filter((e) => e.getClientRects().length).slice(0, 12);
    for (const e of els) { const cs = getComputedStyle(e);
      out.push({ what, fg: parse(e instanceof SVGElement ? cs.fill : cs.color), opacity: Number(cs.opacity), bg: bgOf(e) }); }
  }
  return out; }"""
TEXTS = [
    ("picker point", ".iel-picker .iel-pt:not(.iel-off) text"),
    ("picker module", ".iel-picker .iel-mod text"),
    ("picker card", ".iel-picker .iel-def"),
    ("attention axis label", ".iel-attn .iel-axes text"),
    ("attention token", ".iel-attn .iel-tokens .iel-tok"),
    ("attention read-out", ".iel-attn .iel-readout"),
    ("steering text", ".iel-steer .iel-text .iel-tok"),
    ("steering note", ".iel-steer .iel-novector"),
    ("steering status", ".iel-steer .iel-status"),
]


def _contrast(fg, bg):
    """WCAG contrast ratio; a translucent foreground is blended over its background first."""
    a = fg[3] if fg[3] is not None else 1
    rgb = [fg[i] * a + bg[i] * (1 - a) for i in range(3)]

    def lum(c):
        c = [x / 255 for x in c]
        c = [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]

    hi, lo = sorted((lum(rgb), lum(bg[:3])), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


CARD_TITLE = "document.querySelector('.iel-picker .iel-card .iel-card-title code')?.textContent || ''"


def _card_title(page):
    return page.evaluate(f"() => {CARD_TITLE}")


@pytest.fixture(scope="module")
def lab19(server):
    srv = server
    srv.write("issue19.ipynb", CELLS19)
    page = srv.open("issue19.ipynb", width=1100)
    for sel in (".iel-picker svg", ".iel-attn canvas.iel-pattern", ".iel-steer .iel-text"):
        page.wait_for_selector(sel, timeout=30000)
    page.evaluate("() => window.jupyterapp.shell.activateById('filebrowser')")
    page.wait_for_function(
        "() => { const f = document.getElementById('filebrowser'); return f && f.offsetWidth > 150; }", timeout=15000
    )
    settle(page, *box_probe(["#filebrowser", ".iel-picker", ".iel-attn canvas.iel-pattern", ".iel-steer"]))
    yield srv, page
    srv.close_page(page)


def test_picker_select_from_python_updates_the_card(lab19):
    srv, page = lab19
    picker = page.locator(".iel-picker")
    card = picker.locator(".iel-card")
    assert _card_title(page) == "resid_post.1"
    srv.execute(page, "p.select('mlp_out.0')")
    page.wait_for_function(f"() => ({CARD_TITLE}) === 'mlp_out.0'", timeout=15000)
    assert "blocks.0.hook_mlp_out" in card.inner_text()
    assert picker.locator('select[aria-label="layer"]').input_value() == "0"
    srv.execute(page, "p.select('embeddings')")  # a trunk point keeps the layer
    page.wait_for_function(f"() => ({CARD_TITLE}) === 'embeddings'", timeout=15000)


def test_picker_card_stays_in_view_at_1100px_with_the_file_browser_open(lab19):
    srv, page = lab19
    picker = page.locator(".iel-picker")
    card = picker.locator(".iel-card")
    vh = page.viewport_size["height"]

    def hover_and_check(name):
        pt = picker.locator(f'.iel-pt[data-name="{name}"]')
        pt.hover()
        page.wait_for_function(f"n => ({CARD_TITLE}).startsWith(n)", arg=name, timeout=10000)
        # the card is placed after its text changes (and again as its new size is observed): measured once still
        settle(page, *box_probe([".iel-picker .iel-card", ".iel-picker .iel-card-title", ".iel-picker .iel-diagram"]))
        title = card.locator(".iel-card-title").bounding_box()
        assert title is not None and 0 <= title["y"] and title["y"] + title["height"] <= vh, (name, title)
        return pt.bounding_box(), card.bounding_box()

    for name in ("lm_head", "embeddings", "mlp_act", "lm_head"):
        hover_and_check(name)
    hover_and_check("resid_post")
    # engine names wrap after a "." or "_", never inside a word (issue 33's walk: "blocks.1.hook_r / esid_post")
    cut = page.evaluate("""() => [...document.querySelectorAll('.iel-picker .iel-kv td code')].flatMap((c) => {
        const r = document.createRange(), out = [];
        for (const t of [...c.childNodes].filter((n) => n.nodeType === 3)) {
          r.selectNodeContents(t); if (!/\\s/.test(t.textContent) && r.getClientRects().length > 1) out.push(t.textContent); }
        return out; })""")
    assert not cut, cut
    pt, box = hover_and_check("final_norm")
    diagram = picker.locator(".iel-diagram").bounding_box()
    assert box["x"] >= diagram["x"] + diagram["width"] - 1  # side by side: there is room at this width
    srv.shot(page.locator(".jp-LabShell"), "picker-1100px-filebrowser.png")
    # narrower still: the card sits above the diagram and stays in view while scrolling down it
    page.set_viewport_size({"width": 760, "height": 900})
    try:
        page.wait_for_function("() => window.innerWidth === 760", timeout=10000)
        settle(page, *box_probe([".jp-LabShell", ".iel-picker", ".iel-picker .iel-diagram", ".iel-picker .iel-card"]))
        vh = 900
        for name in ("lm_head", "resid_pre"):
            hover_and_check(name)
        srv.shot(page.locator(".jp-LabShell"), "picker-760px-filebrowser.png")
    finally:
        page.set_viewport_size({"width": 1100, "height": 1000})


def test_steering_panel_without_a_vector_says_what_is_missing(lab19):
    srv, page = lab19
    panel = page.locator(".iel-steer").nth(0)
    assert panel.locator('input[data-knob="scale"]').is_disabled()
    note = panel.locator(".iel-novector")
    assert note.is_visible()
    text = note.inner_text()
    for way in ("use difference of means", "positive=", "vector=", "set_contrast"):
        assert way in text, way
    assert "no vector" in panel.locator(".iel-status").inner_text()
    assert panel.locator("details.iel-contrast").get_attribute("open") is not None
    assert _kernel(srv, page, "[sp.status, sp.has_vector]") == ["no vector", False]
    srv.shot(panel, "steering-no-vector.png")
    # the offered way works: two lists and the button give a vector, and the knobs come alive
    panel.locator('textarea[aria-label^="positive"]').fill("happy good day\ngood morning")
    panel.locator('textarea[aria-label^="negative"]').fill("sad bad night\nbad evening")
    panel.get_by_role("button", name="use difference of means").click()
    assert _until(lambda: _kernel(srv, page, "[sp.status, sp.has_vector]") == ["ready", True], 60)
    page.wait_for_function(
        "() => !document.querySelectorAll('.iel-steer')[0].querySelector('input[data-knob=\"scale\"]').disabled",
        timeout=15000,
    )
    assert not note.is_visible()


def test_typed_contrast_lists_survive_a_slider_move_and_a_layer_change(lab19):
    srv, page = lab19
    panel = page.locator(".iel-steer").nth(1)
    pos, neg = panel.locator('textarea[aria-label^="positive"]'), panel.locator('textarea[aria-label^="negative"]')
    if panel.locator("details.iel-contrast").get_attribute("open") is None:
        panel.locator(".iel-contrast summary").click()
    typed_pos, typed_neg = "joy and sun\nwarm smile", "grey rain\ncold tears"
    pos.fill(typed_pos)
    neg.fill(typed_neg)
    # the slider, by keyboard (focus leaves the text boxes, as with a mouse)
    slider = panel.locator('input[data-knob="scale"]')
    slider.focus()
    page.keyboard.press("ArrowRight")
    assert _until(lambda: _kernel(srv, page, "[sq.scale != 2.0, sq.status]") == [True, "ready"], 60)
    page.wait_for_timeout(300)
    assert (pos.input_value(), neg.input_value()) == (typed_pos, typed_neg)
    # the layer: re-measures the kernel's (old) lists at the new point; the typed ones stay in the boxes
    layer = panel.locator('input[aria-label="layer"]')
    layer.fill("0")
    layer.press("Tab")
    assert _until(lambda: _kernel(srv, page, "[sq.address, sq.status]") == ["resid_post.0", "ready"], 60)
    page.wait_for_timeout(300)
    assert (pos.input_value(), neg.input_value()) == (typed_pos, typed_neg)
    assert _kernel(srv, page, "[sq.positive, sq.negative]") == [
        ["happy good day", "good morning"],
        ["sad bad night", "bad evening"],
    ]
    panel.get_by_role("button", name="use difference of means").click()
    assert _until(
        lambda: (
            _kernel(srv, page, "[sq.positive, sq.negative, sq.status]")
            == [typed_pos.split("\n"), typed_neg.split("\n"), "ready"]
        ),
        60,
    )


def test_attention_pattern_has_square_cells_and_every_label_readable(lab19):
    srv, page = lab19
    view = page.locator(".iel-attn").nth(0)
    n = _kernel(srv, page, "len(a.tokens)")
    assert n == 41
    canvas = view.locator("canvas.iel-pattern").bounding_box()
    assert abs(canvas["width"] - canvas["height"]) < 1
    labels = view.locator(".iel-axes text")
    assert labels.count() == 2 * n
    geo = page.evaluate("""() => { const t = [...document.querySelectorAll('.iel-attn .iel-axes text.iel-ylab')];
        const r = t.map((e) => e.getBoundingClientRect());
        return { font: Math.min(...t.map((e) => parseFloat(getComputedStyle(e).fontSize))),
                 overlap: r.slice(1).some((b, i) => b.top < r[i].bottom - 1),
                 step: (r[r.length - 1].top - r[0].top) / (r.length - 1),
                 panel: document.querySelector('.iel-attn').getBoundingClientRect().width }; }""")
    assert geo["font"] >= 10 and not geo["overlap"] and geo["step"] >= 12, geo
    # sized to the prompt and the width: the pattern uses a good part of the panel, not a 240 px corner
    assert canvas["width"] >= 0.5 * geo["panel"], (canvas, geo)
    srv.shot(view, "attention-41-tokens.png")


def test_attention_viewer_sizes_to_10_and_200_tokens(lab19):
    srv, page = lab19
    assert _kernel(srv, page, "[len(a10.tokens), len(a200.tokens) >= 200]") == [10, True]
    sizes = page.evaluate("""() => [...document.querySelectorAll('.iel-attn')].map((v) => {
        const c = v.querySelector('canvas.iel-pattern').getBoundingClientRect();
        return { n: v.querySelector('.iel-tokens').children.length, w: c.width, h: c.height,
                 labels: v.querySelectorAll('.iel-axes text').length, panel: v.getBoundingClientRect().width,
                 cell: parseFloat(v.style.getPropertyValue('--iel-cell')) }; })""")
    short, long = sizes[1], sizes[2]
    # 10 tokens: large labelled cells, not blown up to the whole width
    assert short["n"] == 10 and short["labels"] == 20 and 20 <= short["cell"] <= 28, short
    # 200 tokens: every cell on screen inside the panel, labels moved to the read-out
    assert long["cell"] >= 2 and long["w"] <= long["panel"] and long["w"] >= 0.6 * long["panel"], long
    assert abs(long["w"] - long["h"]) < 1
    view = page.locator(".iel-attn").nth(2)
    canvas = view.locator("canvas.iel-pattern")
    box = canvas.bounding_box()
    canvas.hover(position={"x": box["width"] * 0.9, "y": box["height"] * 0.95})
    assert "query" in view.locator(".iel-readout").inner_text() and "key" in view.locator(".iel-readout").inner_text()
    srv.shot(view, "attention-200-tokens.png")


def test_panels_read_well_in_both_themes_and_follow_a_switch(lab19):
    srv, page = lab19

    def check(theme):
        # measured once the readings themselves hold still: fonts loaded, the theme's colour transitions over, the
        # same colours at consecutive frames (a colour read mid-switch measured 4.48 against 4.5)
        settle(page, MEASURE, TEXTS)
        got = page.evaluate(MEASURE, TEXTS)
        seen = {g["what"] for g in got}
        assert {w for w, _ in TEXTS} - {"steering note"} <= seen, {w for w, _ in TEXTS} - seen
        bad = []
        for g in got:
            need = 3.0 if g["what"] in ("picker module", "steering status") else 4.5  # muted UI text: 3:1
            r = _contrast(g["fg"], g["bg"])
            if r < need or g["opacity"] < 0.9:
                bad.append(f"{g['what']}: {g['fg']} on {g['bg']}: {r:.2f} < {need}")
        assert not bad, f"{theme}:\n" + "\n".join(bad)
        return {g["what"]: g["fg"] for g in got}

    def switch(theme, light):
        switch_theme(page, theme, light, ".iel-attn")

    light = check("light")
    try:
        switch("JupyterLab Dark", False)
        dark = check("dark")
        assert dark["attention axis label"] != light["attention axis label"]
        for sel, name in ((".iel-picker", "picker"), (".iel-attn", "attention"), (".iel-steer", "steering")):
            srv.shot(page.locator(sel).first, f"{name}-lab-dark-1100.png")
    finally:
        switch("JupyterLab Light", True)
    assert check("light again")["attention axis label"] == light["attention axis label"]


def test_attention_plot_has_square_cells_and_every_label(lab19):
    srv, page = lab19
    page.wait_for_selector(".js-plotly-plot .nsewdrag", timeout=30000)
    geo = page.evaluate("""() => { const p = document.querySelector('.js-plotly-plot');
        const area = p.querySelector('.nsewdrag').getBoundingClientRect();
        const ticks = (ax) => [...p.querySelectorAll(`.${ax}tick text`)].filter((t) => t.textContent.trim());
        const ys = ticks('y').map((t) => t.getBoundingClientRect()).sort((a, b) => a.top - b.top);
        return { w: area.width, h: area.height, x: ticks('x').length, y: ys.length,
                 overlap: ys.slice(1).some((b, i) => b.top < ys[i].bottom - 1) }; }""")
    srv.shot(page.locator(".js-plotly-plot").first, "attention-plot-41.png")
    assert abs(geo["w"] - geo["h"]) <= 0.05 * geo["w"], geo  # square cells for a square pattern
    assert geo["x"] == 41 and geo["y"] == 41 and not geo["overlap"], geo


# ---- issue 33: the panels as a newcomer meets them (a 1,100 px window, a session not called `s`) ------------------
# Every family's diagram labels are measured on the fewest diagrams that between them draw every (label, box) pair.
_LAYOUT_JS = """import { layoutBlock } from %s;
let d = ''; process.stdin.on('data', (c) => d += c); process.stdin.on('end', () => {
  const out = {}; for (const [k, [st, layer]] of Object.entries(JSON.parse(d))) {
    const lay = layoutBlock(st, st.moe_layers.includes(layer), null, layer);
    out[k] = lay.items.filter((i) => i.kind === 'module' || i.kind === 'trunk')
      .map((i) => [i.label, i.span === 2 ? 2 : i.col === 0 ? 0 : 1]); }
  process.stdout.write(JSON.stringify(out)); });"""


def _diagrams_covering_every_label():
    """(family, layer) pairs whose diagrams draw, between them, every module label any family's diagram draws, at
    every box width it is drawn in (the picker's own layout code, widgets/util.js, run under node)."""
    import json
    import os
    import shutil
    import subprocess

    from ie_lab.arch.config_facts import ArchFacts
    from ie_lab.widgets.picker import _structure_from_facts
    from tests.families import FAMILIES, make_config

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    specs = {}
    for fam in FAMILIES:
        facts = ArchFacts.from_config(make_config(fam))
        st = _structure_from_facts(facts)
        for L in range(facts.n_layers):
            specs[f"{fam}/{L}"] = [st, L]
    util = "file://" + os.path.join(ROOT, "widgets", "util.js")
    r = subprocess.run(
        ["node", "--input-type=module", "-e", _LAYOUT_JS % json.dumps(util)],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    drawn = {k: {tuple(x) for x in v} for k, v in json.loads(r.stdout).items()}
    todo, chosen = set().union(*drawn.values()), []
    while todo:  # greedy cover: the diagram drawing the most pairs not yet covered
        key = max(sorted(drawn), key=lambda k: len(drawn[k] & todo))
        chosen.append(key)
        todo -= drawn[key]
    return [(k.split("/")[0], int(k.split("/")[1])) for k in chosen]


def _cells33(cover):
    return [
        setup_code("llama") + "g = s; del s  # a session not called s: what the panels' code must call it\n",
        "p = g.picker(); p",
        "sp = g.steering_panel('Mary went to the', positive=['happy good day', 'good morning'], "
        "negative=['sad bad night', 'bad evening'], scale=2.0, max_new_tokens=6); sp",
        "fp = g.feature_panel('Mary went to the store', 'resid_post.0', torch.randn(3, g.facts.d_model)); fp",
        "fig = g.attention('Mary went to the store', layers=[0]).plot(0, 0); fig",
        "from IPython.display import display\nfrom tests.families import make_config\n"
        f"for _f, _L in {cover!r}:\n    display(ie_lab.cheatsheet(make_config(_f), layer=_L))",
    ]


FIG_CELL = 4


@pytest.fixture(scope="module")
def lab33(server):
    srv = server
    cover = _diagrams_covering_every_label()
    srv.write("issue33.ipynb", _cells33(cover))
    page = srv.open("issue33.ipynb", width=1100)
    for sel in (".iel-picker svg", ".iel-steer .iel-text .iel-tok", ".iel-feat .iel-tok", ".js-plotly-plot .nsewdrag"):
        page.wait_for_selector(sel, timeout=60000)
    page.wait_for_function(f"() => document.querySelectorAll('.iel-picker svg').length === {1 + len(cover)}")
    yield srv, page
    srv.close_page(page)


def test_the_pickers_snippet_calls_the_session_the_notebook_has_and_runs(lab33):
    srv, page = lab33
    card = page.locator(".iel-picker").first.locator(".iel-card")
    code = card.locator("pre.iel-snippet").inner_text()
    assert code.startswith("cache = g.capture("), code
    out = srv.execute(page, code.splitlines()[0] + "\nprint(tuple(cache[next(iter(cache))].shape))")
    assert not out.startswith("ERROR") and out.startswith("(1, "), out  # run as copied: no undefined name
    # a family's cheatsheet (no model loaded): its snippet makes the session it then uses
    fam = page.locator(".iel-picker").nth(1).locator("pre.iel-snippet").inner_text()
    assert fam.startswith("s = ie_lab.Session(") and "cache = s.capture(" in fam and "lm" not in fam, fam


def test_every_familys_diagram_labels_fit_their_boxes(lab33):
    srv, page = lab33
    probe = """() => [...document.querySelectorAll('.iel-picker .iel-mod')].map((g) => {
        const r = g.querySelector('rect').getBoundingClientRect(), t = g.querySelector('text').getBoundingClientRect();
        return [g.querySelector('text').dataset.full, r.left, r.right, t.left, t.right,
                g.querySelector('title') ? g.querySelector('title').textContent : null]; })"""
    settle(page, probe)
    boxes = page.evaluate(probe)
    assert len(boxes) > 10 * (page.locator(".iel-picker").count() - 1)
    over = [f"{b[0]!r}: text {b[3]:.0f}..{b[4]:.0f} in box {b[1]:.0f}..{b[2]:.0f}" for b in boxes if b[4] > b[2] - 2]
    assert not over, "\n".join(over)
    assert all(b[5] == b[0] for b in boxes)  # the full label on hover
    gptj = [b for b in boxes if b[0].startswith("attention (RoPE on")]
    assert gptj, "GPT-J's partial-rotary attention label is drawn"
    srv.shot(page.locator(".iel-picker").nth(1), "picker-issue33-family.png")


def test_steering_text_copies_with_its_spaces(lab33):
    srv, page = lab33
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=srv.base)
    box = page.locator('.iel-steer [data-which="steered"]')
    box.evaluate(
        "(e) => { const r = document.createRange(); r.selectNodeContents(e); const s = getSelection();"
        " s.removeAllRanges(); s.addRange(r); }"
    )
    page.keyboard.press("Control+c")
    copied = page.evaluate("() => navigator.clipboard.readText()")
    k = _kernel(srv, page, "[''.join(sp.steered), sp.steered_text]")
    assert copied == k[0] and copied.strip() == k[1].strip(), (copied, k)
    assert copied.count(" ") >= len(k[1].split()) - 1 and "·" not in copied, copied  # the text, not marked tokens


def test_steering_points_are_the_models_own(lab33):
    srv, page = lab33
    offered = page.locator('.iel-steer select[aria-label="steering point"] option').all_text_contents()
    own = _kernel(
        srv,
        page,
        "[n for n in __import__('ie_lab.widgets.steering', fromlist=['x']).STEERABLE"
        " if n in {r.name for r in g.points().rows if r.served}]",
    )
    assert offered == own and "mixer_in" not in offered, (offered, own)


def test_a_refused_value_shows_an_error_and_the_value_in_effect(lab33):
    srv, page = lab33
    panel = page.locator(".iel-steer")
    layer = panel.locator('input[aria-label="layer"]')
    before = _kernel(srv, page, "sp.address")
    for typed in ("99", "", "1.5"):
        layer.fill(typed)
        layer.press("Tab")
        assert layer.get_attribute("aria-invalid") == "true", typed
        assert layer.input_value() == before.split(".")[1], typed  # the layer in effect is back in the box
        assert "0 to 1" in panel.locator(".iel-error").inner_text(), typed
    assert _kernel(srv, page, "sp.address") == before
    srv.shot(panel, "steering-refused-layer.png")
    # a prompt the kernel refuses: marked, kept in the box to be fixed; the last good prompt still runs
    prompt = panel.locator('textarea[aria-label="prompt"]')
    prompt.fill("   ")
    prompt.press("Control+Enter")
    page.wait_for_function(
        "() => document.querySelector('.iel-steer textarea[aria-label=\"prompt\"]').getAttribute('aria-invalid') === 'true'"
    )
    assert "non-empty" in panel.locator(".iel-error").inner_text()
    assert _kernel(srv, page, "sp.prompt") == "Mary went to the"
    prompt.fill("Mary went to the")  # an edit clears the mark
    assert prompt.get_attribute("aria-invalid") is None
    # an accepted command clears the marks its refusals left (the layer box is not red for good)
    layer.fill("99")
    layer.press("Tab")
    assert layer.get_attribute("aria-invalid") == "true"
    srv.execute(page, "sp.update(scale=1.0)")
    page.wait_for_function(
        "() => !document.querySelector('.iel-steer input[aria-label=\"layer\"]').hasAttribute('aria-invalid')"
    )
    assert panel.locator(".iel-error").inner_text() == ""
    # the feature panel's number box: out of range, refused the same way
    feat = page.locator(".iel-feat")
    num = feat.locator('input[aria-label="feature index"]')
    shown = _kernel(srv, page, "fp.feature")
    num.fill("7")
    num.press("Enter")
    assert num.get_attribute("aria-invalid") == "true" and num.input_value() == str(shown)
    assert "0 to 2" in feat.locator(".iel-error").inner_text()


def test_each_steering_method_is_explained_in_the_panel(lab33):
    srv, page = lab33
    panel = page.locator(".iel-steer")
    helps = _kernel(srv, page, "__import__('ie_lab.ops.steering', fromlist=['x']).METHOD_HELP")
    method = panel.locator('select[aria-label="method"]')
    described = page.locator("#" + method.get_attribute("aria-describedby"))
    try:
        # three choices in a row, faster than the kernel answers: the select ends on the last, never flips back
        page.evaluate(
            """() => { const s = document.querySelector('.iel-steer select[aria-label="method"]');
            for (const m of ['swap', 'orthogonal', 'norm_scaled_add']) {
              s.value = m; s.dispatchEvent(new Event('change', { bubbles: true })); }
            window._seen = new Set(); window._stop = false;  // what the select shows at every frame from now on
            const tick = () => { window._seen.add(s.value); if (!window._stop) requestAnimationFrame(tick); }; tick(); }"""
        )
        assert _until(lambda: _kernel(srv, page, "[sp.method, sp.status]") == ["norm_scaled_add", "ready"], 60)
        seen = page.evaluate(
            "() => new Promise((ok) => requestAnimationFrame(() => { window._stop = true; ok([...window._seen]); }))"
        )
        assert seen == ["norm_scaled_add"], seen  # the kernel's echoes of the first two never flipped it back
        for m in ("cap", "ablate", "add"):
            method.select_option(m)
            assert _until(lambda: _kernel(srv, page, "[sp.method, sp.status]") == [m, "ready"], 60), m  # noqa: B023
            page.wait_for_function(
                "([id, m]) => document.getElementById(id).textContent.startsWith(m + ':')",
                arg=[method.get_attribute("aria-describedby"), m],
            )
            assert described.inner_text() == helps[m] and method.get_attribute("title") == helps[m], m
            assert panel.locator(f'select[aria-label="method"] option[value="{m}"]').get_attribute("title") == helps[m]
    finally:
        _until(lambda: _kernel(srv, page, "sp.status") == "ready", 60)


def _overlaps(page, root):
    return page.evaluate(
        """(root) => { const p = document.querySelector(root);
        const els = [...p.querySelectorAll('input, select, textarea, button, output, progress, summary, .iel-status')]
          .filter((e) => e.getClientRects().length && getComputedStyle(e).visibility !== 'hidden');
        const r = els.map((e) => e.getBoundingClientRect()), bad = [];
        for (let i = 0; i < r.length; i++) for (let j = i + 1; j < r.length; j++) {
          const a = r[i], b = r[j];
          if (els[i].contains(els[j]) || els[j].contains(els[i])) continue;
          if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
            bad.push([els[i].outerHTML.slice(0, 60), els[j].outerHTML.slice(0, 60)]); }
        return { n: els.length, bad }; }""",
        root,
    )


def test_steering_controls_do_not_overlap_at_1100px(lab33):
    srv, page = lab33
    panel = page.locator(".iel-steer")
    method = panel.locator('select[aria-label="method"]')
    if panel.locator("details.iel-contrast").get_attribute("open") is None:
        panel.locator(".iel-contrast summary").click()  # its two lists and button in the card too
    try:
        for sidebar in (False, True):
            if sidebar:
                page.evaluate("() => window.jupyterapp.shell.activateById('filebrowser')")
                page.wait_for_function("() => document.getElementById('filebrowser')?.offsetWidth > 150")
            for m in ("cap", "add"):  # cap has two sliders; add one
                method.select_option(m)
                assert _until(lambda: _kernel(srv, page, "[sp.method, sp.status]") == [m, "ready"], 60)  # noqa: B023
                settle(page, *box_probe([".iel-steer", ".iel-steer .iel-controls", ".iel-steer .iel-sliders"]))
                got = _overlaps(page, ".iel-steer")
                assert got["n"] >= 10 and not got["bad"], (sidebar, m, got)
                srv.shot(panel, f"steering-1100px-{m}{'-filebrowser' if sidebar else ''}.png")
    finally:
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")


def _plot_colours(page):
    """The plot's tick labels' colour and what is behind them: the first opaque background up from the plot
    (plotly's paper rectangle, else the notebook's output area)."""
    return page.evaluate(
        """() => { const p = document.querySelector('.js-plotly-plot');
        const parse = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
        const paper = parse(getComputedStyle(p.querySelector('.main-svg')).backgroundColor);
        let bg = paper; for (let x = p; (!bg.length || (bg.length > 3 && bg[3] < 0.5)) && x; x = x.parentElement)
          bg = parse(getComputedStyle(x).backgroundColor);
        const tick = p.querySelector('.ytick text'); return { fg: parse(tick.style.fill || getComputedStyle(tick).fill), bg }; }"""
    )


def test_plotly_figures_follow_the_dark_theme(lab33):
    srv, page = lab33
    light = _plot_colours(page)
    try:
        switch_theme(page, "JupyterLab Dark", False, ".iel-steer")
        # JupyterLab has saved the theme (its settings file, which the kernel can read): a figure made now is in it
        saved = os.path.join(srv.tmp, "settings", "@jupyterlab", "apputils-extension", "themes.jupyterlab-settings")
        assert _until(lambda: os.path.exists(saved) and "JupyterLab Dark" in open(saved).read())
        page.evaluate(
            f"() => {{ const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = {FIG_CELL};"
            " return window.jupyterapp.commands.execute('notebook:run-cell'); }"
        )
        srv.wait_cells(page)
        page.wait_for_selector(".js-plotly-plot .ytick text", timeout=30000)
        settle(
            page, "() => { const t = document.querySelector('.js-plotly-plot .ytick text'); return t && t.style.fill; }"
        )
        dark = _plot_colours(page)
        lum = lambda c: sum(c[:3]) / 3  # noqa: E731
        assert lum(dark["bg"]) < 80, dark  # no white block in the dark notebook
        assert _contrast(dark["fg"] + [1], dark["bg"][:3] + [1]) >= 4.5, dark
        assert _contrast(light["fg"] + [1], light["bg"][:3] + [1]) >= 4.5, light
        srv.shot(page.locator(".js-plotly-plot").first, "attention-plot-dark.png")
    finally:
        switch_theme(page, "JupyterLab Light", True, ".iel-steer")
