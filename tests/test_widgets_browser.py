"""The panels in a real JupyterLab 4 and Notebook 7, driven by Playwright + Debian Chromium (headless).

One server and one notebook per module (the machine is small). Screenshots go to artifacts/widgets/.
"""

import json
import time

import pytest

from benchmarks.widgets_harness import ROOT, Server, available, setup_code

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
def lab():
    srv = Server()
    try:
        srv.write("panels.ipynb", CELLS)
        page = srv.open("panels.ipynb")
        for sel in (".iel-picker svg", ".iel-attn canvas.iel-pattern", ".iel-steer .iel-text"):
            page.wait_for_selector(sel, timeout=30000)
        yield srv, page
        srv.close_page(page)
    finally:
        srv.close()


def _kernel(srv, page, expr):
    out = srv.execute(page, f"import json as _j; print(_j.dumps({expr}))")
    assert not out.startswith("ERROR"), out
    return json.loads(out)


def _until(fn, timeout=20.0):
    end = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > end:
            return v
        time.sleep(0.1)


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
    js = page.evaluate("""() => { const v = document.querySelector('.iel-attn'); return v.querySelector('.iel-title').textContent; }""")
    assert "head 2" in js
    ok = _kernel(srv, page, "bool(__import__('torch').allclose(a.head_pattern(), s.capture(%r, ['attn_probs.0'])['attn_probs.0'][0, 2]))" % PROMPT)
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
    page.wait_for_function("b => { const e = document.querySelector('.iel-steer [data-which=\"steered\"]');"
                           " return e.innerText !== b && !document.querySelector('.iel-steer').classList.contains('iel-busy'); }",
                           arg=before, timeout=20000)
    dom = steered.locator(".iel-tok").all_text_contents()
    assert panel.locator('[data-which="steered"] .iel-added').count() > 0  # token-level differences marked
    k = _until(lambda: (lambda r: r if r["scale"] == 10.0 else None)(_kernel(srv, page, "dict(scale=sp.scale, toks=sp.steered)")))
    assert k and k["scale"] == 10.0
    assert dom == k["toks"]  # the toy vocabulary has no spaces or newlines, so tokens show verbatim
    srv.shot(panel, "steering-lab-light.png")


def test_a_long_contrast_shows_progress_leaves_the_kernel_free_and_stops(lab):
    srv, page = lab
    panel = page.locator(".iel-steer")
    # hold the vector job after its first prompt (on the session's loop), to look at the panel meanwhile
    srv.execute(page, "import threading as _t, torch as _torch\n_reached, _release = _t.Event(), _t.Event()\n"
                      "def _gate(ch):\n    if ch['new'][0] == 1:\n        _reached.set(); _release.wait(60)\n"
                      "sp.observe(_gate, 'progress'); _v0, _src0 = sp.vector.clone(), sp.vector_source")
    try:
        panel.locator(".iel-contrast summary").click()
        panel.locator('textarea[aria-label^="positive"]').fill("\n".join(f"happy good day {i}" for i in range(64)))
        panel.locator('textarea[aria-label^="negative"]').fill("\n".join(f"sad bad night {i}" for i in range(64)))
        panel.get_by_role("button", name="use difference of means").click()
        page.wait_for_function("() => document.querySelector('.iel-steer .iel-status').textContent.includes('1/128')",
                               timeout=30000)
        assert panel.locator("progress.iel-progress").is_visible()
        # the kernel answers while the vector is being computed
        assert _kernel(srv, page, "[_reached.is_set(), sp.status, sp.progress]") == [True, "vector", [1, 128]]
        srv.shot(panel, "steering-vector-progress.png")
        panel.get_by_role("button", name="stop").click()
        assert _until(lambda: _kernel(srv, page, "sp.status") == "ready")
    finally:
        srv.execute(page, "_release.set(); sp.wait(); sp.unobserve(_gate, 'progress')")
    page.wait_for_function("() => !document.querySelector('.iel-steer').classList.contains('iel-busy')", timeout=30000)
    assert not panel.locator("progress.iel-progress").is_visible()
    assert _kernel(srv, page, "[bool(_torch.equal(sp.vector, _v0)), sp.vector_source == _src0]") == [True, True]


def test_dark_theme(lab):
    srv, page = lab
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20000)
    page.wait_for_timeout(300)
    bg = page.locator(".iel-picker").evaluate("e => getComputedStyle(e).backgroundColor")
    assert bg not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)")
    srv.shot(page.locator(".iel-picker"), "picker-lab-dark.png")
    srv.shot(page.locator(".iel-attn"), "attention-lab-dark.png")
    srv.shot(page.locator(".iel-steer"), "steering-lab-dark.png")
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")


def test_notebook7_renders_the_panels(lab):
    srv, _ = lab
    srv.write("nb7.ipynb", ["import sys; sys.path.insert(0, %r)\nimport ie_lab" % ROOT,
                            "p = ie_lab.cheatsheet('gemma2', backend='vllm'); p"])
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
