"""The feature panel in a real JupyterLab, driven by Playwright + Debian Chromium (headless): it renders, a click in
the picker and an index typed in the number box select a feature in the kernel and recolour the tokens with that
feature's project() scores, hovering a token lists its strongest features, and the panel follows a dark theme.
Screenshots go to artifacts/widgets/ (test artifacts, not committed)."""

import pytest

from benchmarks.widgets_harness import Server, available, setup_code
from tests.browser_helpers import kernel as _kernel
from tests.browser_helpers import until as _until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

PROMPT = "When Mary and John went to the store , John gave a drink to"
SAE = (
    "import tempfile, os, torch\nfrom safetensors.torch import save_file\n"
    "_g = torch.Generator().manual_seed(3); _d = s.facts.d_model\n"
    "_w = {'W_enc': torch.randn(_d, 64, generator=_g) / _d**0.5, 'b_enc': torch.randn(64, generator=_g) * 0.1,"
    " 'W_dec': torch.randn(64, _d, generator=_g), 'b_dec': torch.zeros(_d)}\n"
    "_f = os.path.join(tempfile.mkdtemp(), 'sae.safetensors'); save_file(_w, _f)\n"
    "sae = ie_lab.load_sae(_f, s, address='resid_post.1')"
)
CELLS = [setup_code("llama"), SAE, f"fp = s.feature_panel({PROMPT!r}, None, sae, top=8, hover=4); fp"]


@pytest.fixture(scope="module")
def lab():
    srv = Server()
    try:
        srv.write("features.ipynb", CELLS)
        page = srv.open("features.ipynb")
        page.wait_for_selector(".iel-feat .iel-featbtn", timeout=30000)
        yield srv, page
        srv.close_page(page)
    finally:
        srv.close()


def _colours(panel):
    return panel.locator(".iel-feat-tokens .iel-tok").evaluate_all(
        "es => es.map(e => getComputedStyle(e).backgroundColor)"
    )


def test_click_a_feature_hover_a_token_in_both_themes(lab):
    srv, page = lab
    panel = page.locator(".iel-feat")
    picks = panel.locator(".iel-feats .iel-featbtn")
    assert picks.count() == 8
    ids = [int(x) for x in picks.evaluate_all("es => es.map(e => e.dataset.f)")]
    assert ids == _kernel(srv, page, "sae.project(s, " + repr(PROMPT) + ").scores.amax(0).topk(8).indices.tolist()")
    assert panel.locator(".iel-featbtn.iel-sel").get_attribute("data-f") == str(ids[0])
    srv.shot(panel, "features-lab-light.png")
    before = _colours(panel)

    # a click in the picker selects the feature in the kernel; the tokens are recoloured by its scores
    panel.locator(f'.iel-feats .iel-featbtn[data-f="{ids[2]}"]').click()
    assert _until(lambda: _kernel(srv, page, "fp.feature") == ids[2])
    page.wait_for_selector(f'.iel-feat .iel-feats .iel-featbtn.iel-sel[data-f="{ids[2]}"]', timeout=15000)
    after = _colours(panel)
    assert after != before
    want = _kernel(srv, page, f"sae.project(s, {PROMPT!r}).scores[:, {ids[2]}].tolist()")
    # a token is coloured exactly where the feature is active, and the strongest token is the most coloured
    lit = [c not in ("rgba(0, 0, 0, 0)", "transparent") for c in after]
    assert lit == [abs(v) > 0 for v in want]
    shown = _kernel(srv, page, "fp.feature_values().tolist()")
    assert shown == want
    assert f"feature {ids[2]}" in panel.locator(".iel-title").inner_text()

    # hover a token: its strongest features, as Projection.top reads in the kernel
    panel.locator('.iel-feat-tokens .iel-tok[data-i="5"]').hover()
    readout = panel.locator(".iel-readout")
    assert "token 5" in readout.inner_text()
    top = _kernel(srv, page, f"[f for f, _ in sae.project(s, {PROMPT!r}).top(4)[5]]")
    assert [int(x) for x in readout.locator(".iel-featbtn").evaluate_all("es => es.map(e => e.dataset.f)")] == top
    srv.shot(panel, "features-lab-hover.png")

    # any index through the number box (not among the picker's), and an index out of range refused on screen
    other = next(f for f in range(64) if f not in ids)
    panel.locator('input[aria-label="feature index"]').fill(str(other))
    panel.locator('input[aria-label="feature index"]').press("Enter")
    assert _until(lambda: _kernel(srv, page, "fp.feature") == other)
    panel.locator('input[aria-label="feature index"]').fill("64")
    panel.get_by_role("button", name="show").click()
    page.wait_for_function("() => document.querySelector('.iel-feat .iel-error').textContent.includes('0 to 63')")
    assert _kernel(srv, page, "fp.feature") == other

    # dark theme: the panel follows it, and the tokens stay coloured
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    try:
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=20000)
        page.wait_for_function(
            "() => { const c = getComputedStyle(document.querySelector('.iel-feat')).backgroundColor"
            ".match(/\\d+/g).map(Number); return (c[0] + c[1] + c[2]) / 3 < 100; }",
            timeout=20000,
        )
        page.wait_for_timeout(200)
        panel.locator('.iel-feat-tokens .iel-tok[data-i="3"]').hover()
        srv.shot(panel, "features-lab-dark.png")
        fg = panel.locator(".iel-feat-tokens .iel-tok").first.evaluate("e => getComputedStyle(e).color")
        assert sum(map(int, fg[fg.index("(") + 1 : fg.index(")")].split(",")[:3])) / 3 > 150  # light text on dark
    finally:
        page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")
