"""Feature dashboards in a real browser (Playwright + Debian Chromium, headless), on the demo model and demo SAE: the
panel in a real JupyterLab renders the top contexts with tokens tinted where the feature fires, hovering a token
shows its value, switching feature (the list, the number box) updates the view from the kernel, in the light and
dark themes; the static HTML export opens from file:// and shows every feature with no network request, in a light
and a dark colour scheme. One JupyterLab server for the module. Screenshots go to artifacts/widgets/."""

import os
import re
import shutil

import pytest

from benchmarks.widgets_harness import ROOT, Server, available
from tests.browser_helpers import kernel as _kernel
from tests.browser_helpers import switch_theme
from tests.browser_helpers import until as _until
from tests.test_widgets_dashboard import PROMPT, TEXTS

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

SETUP = (
    f"import sys; sys.path.insert(0, {ROOT!r})\n"
    "import torch; torch.set_num_threads(1)\n"
    "import ie_lab\nfrom ie_lab.widgets import encode_corpus\n"
    "s = ie_lab.Session(ie_lab.DEMO_MODEL, device='cpu', progress=False)\n"
    "sae = ie_lab.load_sae(ie_lab.DEMO_SAE, s)\n"
    f"enc = encode_corpus(s, sae, {TEXTS!r})\n"
    "F0 = int(enc.counts().argmax())"
)
CELLS = [SETUP, f"db = s.feature_dashboard(sae, F0, enc, prompt={PROMPT!r}, top=5, max_new_tokens=4, listed=8); db"]


@pytest.fixture(scope="module")
def lab():
    srv = Server()
    try:
        srv.write("dashboard.ipynb", CELLS)
        page = srv.open("dashboard.ipynb")
        page.wait_for_selector(".iel-dash .iel-dash-ctx .iel-tok", timeout=60000)
        yield srv, page
        srv.close_page(page)
    finally:
        srv.close()


def _shown_contexts(panel):
    """Per context on screen: its tokens' text and whether each is tinted."""
    return panel.locator(".iel-dash-ctx").evaluate_all(
        "es => es.map(e => Array.from(e.querySelectorAll('.iel-tok'), t => [t.textContent, t.classList.contains('iel-on')]))"
    )


def _check_contexts(srv, page, panel):
    want = _kernel(srv, page, "[[c.tokens, [float(v) for v in c.values], c.at] for c in db.data.contexts]")
    shown = _shown_contexts(panel)
    assert [[t for t, _ in c] for c in shown] == [toks for toks, _, _ in want]
    assert [[on for _, on in c] for c in shown] == [[v > 0 for v in vals] for _, vals, _ in want]
    peaks = panel.locator(".iel-dash-ctx").evaluate_all(
        "es => es.map(e => Number(e.querySelector('.iel-peak').dataset.i))"
    )
    assert peaks == [at for _, _, at in want]
    return want


def _value_in(text: str) -> float:
    return float(re.search(r"= (-?[\d.]+)$", text.strip()).group(1))


def test_the_panel_shows_contexts_hovers_values_and_switches_feature_in_both_themes(lab):
    srv, page = lab
    panel = page.locator(".iel-dash")
    f0 = _kernel(srv, page, "F0")
    assert f"feature {f0}" in panel.locator(".iel-title").inner_text()
    want = _check_contexts(srv, page, panel)
    assert panel.locator(".iel-dash-bar").count() == 24
    assert panel.locator(".iel-dash-pos .iel-dash-logtok").all_inner_texts() == _kernel(
        srv, page, "db.data.promoted_tokens"
    )
    assert panel.locator('[data-which="steered"]').inner_text() == _kernel(srv, page, "db.data.steering.steered")
    assert panel.locator('[data-which="baseline"]').inner_text() == _kernel(srv, page, "db.data.steering.baseline")

    # hover the first context's peak: the read-out gives its value, as the kernel has it
    toks, vals, at = want[0]
    panel.locator(".iel-dash-ctx").first.locator(f'.iel-tok[data-i="{at}"]').hover()
    readout = panel.locator(".iel-dash-readout").inner_text()
    assert f"feature {f0} = " in readout and toks[at] in readout
    assert _value_in(readout) == pytest.approx(vals[at], rel=5e-3)
    srv.shot(panel, "dashboard-lab-light.png")

    # a click in the list of strongest features: the kernel switches, the view follows with the new data
    ids = [int(x) for x in panel.locator(".iel-feats .iel-featbtn").evaluate_all("es => es.map(e => e.dataset.f)")]
    assert ids == _kernel(srv, page, "enc.maxima().topk(8).indices.tolist()")
    f1 = next(f for f in ids if f != f0)
    panel.locator(f'.iel-feats .iel-featbtn[data-f="{f1}"]').click()
    assert _until(lambda: _kernel(srv, page, "db.feature") == f1)
    page.wait_for_function(
        "f => document.querySelector('.iel-dash .iel-title').textContent.startsWith('feature ' + f + ' ')", arg=f1
    )
    _check_contexts(srv, page, panel)

    # the number box: any index, and one out of range refused on screen with the feature kept
    box = panel.locator('input[aria-label="feature index"]')
    box.fill(str(f0))
    box.press("Enter")
    assert _until(lambda: _kernel(srv, page, "db.feature") == f0)
    page.wait_for_function(
        "f => document.querySelector('.iel-dash .iel-title').textContent.startsWith('feature ' + f + ' ')", arg=f0
    )
    _check_contexts(srv, page, panel)
    box.fill("512")
    panel.get_by_role("button", name="show").click()
    page.wait_for_function("() => document.querySelector('.iel-dash .iel-error').textContent.includes('0 to 511')")
    assert _kernel(srv, page, "db.feature") == f0

    # dark theme: the panel follows it; the tokens stay tinted and readable
    switch_theme(page, "JupyterLab Dark", False, ".iel-dash")
    try:
        panel.locator(".iel-dash-ctx").first.locator(f'.iel-tok[data-i="{at}"]').hover()
        srv.shot(panel, "dashboard-lab-dark.png")
        fg = panel.locator(".iel-dash-ctx .iel-tok").first.evaluate("e => getComputedStyle(e).color")
        assert sum(map(int, re.findall(r"\d+", fg)[:3])) / 3 > 150  # light text on dark
        assert [[on for _, on in c] for c in _shown_contexts(panel)] == [[v > 0 for v in vals] for _, vals, _ in want]
    finally:
        switch_theme(page, "JupyterLab Light", True, ".iel-dash")


def test_the_static_export_opens_from_file_with_no_network_in_light_and_dark(lab):
    srv, page = lab
    path = os.path.join(srv.tmp, "dashboards.html")
    feats = _kernel(srv, page, "enc.maxima().topk(4).indices.tolist()")
    srv.execute(page, f"ie_lab.export_dashboards(s, sae, {feats!r}, enc, {path!r}, top=4)")
    want = _kernel(
        srv,
        page,
        f"[[c.tokens for c in ie_lab.widgets.feature_data(s, sae, f, enc, top=4).contexts] for f in {feats!r}]",
    )
    asked: list[str] = []

    def only_files(route):  # every request the page makes is recorded; only file:// ones are served
        asked.append(route.request.url)
        route.continue_() if route.request.url.startswith("file:") else route.abort()

    for scheme, dark in (("light", False), ("dark", True)):
        p = srv.browser.new_page(viewport={"width": 1200, "height": 900}, color_scheme=scheme)
        asked.clear()
        p.route("**/*", only_files)
        try:
            p.goto("file://" + path)
            p.wait_for_selector("body[data-iel-ready=true]", timeout=15000)
            assert asked == ["file://" + path]  # the page itself, nothing else
            secs = p.locator(".iel-dash-feature")
            assert [int(x) for x in secs.evaluate_all("es => es.map(e => e.dataset.f)")] == feats
            assert p.locator(".iel-dash-nav a").count() == len(feats)
            for i, ctxs in enumerate(want):
                shown = (
                    secs.nth(i)
                    .locator(".iel-dash-ctx")
                    .evaluate_all("es => es.map(e => Array.from(e.querySelectorAll('.iel-tok'), t => t.textContent))")
                )
                assert shown == ctxs
                assert secs.nth(i).locator(".iel-dash-bar").count() == 24
                assert secs.nth(i).locator(".iel-dash-pos .iel-dash-logtok").count() == 10
            # hover: the value of the token under the pointer
            first = secs.nth(1).locator(".iel-dash-ctx").first.locator(".iel-tok.iel-peak")
            first.hover()
            readout = secs.nth(1).locator(".iel-dash-readout").inner_text()
            assert f"feature {feats[1]} = " in readout
            assert _value_in(readout) == pytest.approx(float(first.get_attribute("data-v")), rel=5e-3)
            bg = p.locator(".iel-export").evaluate("e => getComputedStyle(e).backgroundColor")
            lum = sum(map(int, re.findall(r"\d+", bg)[:3])) / 3
            assert lum < 100 if dark else lum > 155
            srv.shot(p.locator(".iel-export"), f"dashboard-export-{scheme}.png")
        finally:
            p.close()


TUTORIAL = "07_features_from_a_corpus.ipynb"


def test_the_features_tutorial_runs_in_jupyterlab_and_shows_its_dashboard(lab):
    """Tutorial 7 as a reader runs it (issue 31): every cell in a real JupyterLab kernel, its dashboard drawn in
    Chromium with the contexts of the feature the tutorial found, and its last check true in that kernel."""
    srv, _ = lab
    shutil.copy(os.path.join(ROOT, "tutorials", TUTORIAL), os.path.join(srv.root, TUTORIAL))
    page = srv.open(TUTORIAL)
    try:
        panel = page.locator(".iel-dash")
        panel.locator(".iel-dash-ctx .iel-tok").first.wait_for(timeout=60000)
        f = _kernel(srv, page, "sad_feature")
        assert panel.locator(".iel-title").inner_text().startswith(f"feature {f} ")
        want = _kernel(srv, page, "[c.tokens for c in panel.data.contexts]")
        shown = panel.locator(".iel-dash-ctx").evaluate_all(
            "es => es.map(e => Array.from(e.querySelectorAll('.iel-tok'), t => t.textContent))"
        )
        assert shown == want and len(want) > 0
        errors = page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        ).all_inner_texts()
        assert not [e for e in errors if "Error" in e or "Traceback" in e], errors
        assert _kernel(srv, page, "happy_after < happy_before and sad_after > sad_before") is True
    finally:
        srv.close_page(page)
