"""The attention viewer and the steering panel of a remote Session in a real JupyterLab (Playwright + Debian
Chromium, headless): the notebook's kernel connects to an `ie-lab serve demo` on loopback and draws the panels; a
click on a head and a slider move in the browser reach the server, and what the page and the kernel hold equals
what a local Session of the same model computes.
"""

from __future__ import annotations

import secrets

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from benchmarks.widgets_harness import Server as Lab  # noqa: E402
from benchmarks.widgets_harness import available  # noqa: E402
from tests.browser_helpers import kernel as _kernel  # noqa: E402
from tests.browser_helpers import until as _until
from tests.test_remote import ROOT, Server, _write_tokens, stats  # noqa: E402

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

PROMPT = "When Mary and John went to the store"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    token = f"alice-{secrets.token_urlsafe(24)}"
    path = tmp_path_factory.mktemp("remote-browser") / "tokens"
    _write_tokens(path, {"alice": token}, ["alice"])
    s = Server(path)
    try:
        yield s, token
    finally:
        s.stop()


@pytest.fixture(scope="module")
def lab(served):
    server, token = served
    cells = [
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import torch; torch.set_num_threads(1)\n"
        "import ie_lab\n"
        f"s = ie_lab.connect({server.url!r}, token={token!r}, progress=False)\n"
        "local = ie_lab.Session(ie_lab.DEMO_MODEL, backend='eager', progress=False, replace=False)\n"
        "v = torch.randn(s.facts.d_model, generator=torch.Generator().manual_seed(3))\n",
        f"a = s.show_attention({PROMPT!r}); a",
        "sp = s.steering_panel('Mary went to the', vector=v, scale=0.0, max_new_tokens=8); sp",
    ]
    srv = Lab()
    try:
        srv.write("remote.ipynb", cells)
        page = srv.open("remote.ipynb")
        for sel in (".iel-attn canvas.iel-pattern", ".iel-steer .iel-text"):
            page.wait_for_selector(sel, timeout=60000)
        yield srv, page, server, token
        srv.close_page(page)
    finally:
        srv.close()


def test_a_head_clicked_in_the_browser_is_fetched_from_the_server(lab):
    srv, page, server, token = lab
    assert _kernel(srv, page, "[s.backend, s.served_backend]") == ["remote", "eager"]
    before = stats(server, token)["operations"]
    view = page.locator(".iel-attn")
    assert view.locator(".iel-thumb").count() == 4
    shown = view.locator("canvas.iel-pattern").screenshot()
    view.locator('select[aria-label="layer"]').select_option("2")  # a layer not fetched yet: a capture on the server
    assert _until(lambda: _kernel(srv, page, "a.layer") == 2)
    view.locator('.iel-thumb[data-head="3"]').click()
    page.wait_for_selector('.iel-attn .iel-thumb.iel-sel[data-head="3"]', timeout=15000)
    assert view.locator("canvas.iel-pattern").screenshot() != shown
    assert _kernel(srv, page, "[a.layer, a.head]") == [2, 3]
    assert stats(server, token)["operations"] > before
    same = (
        f"torch.allclose(a.head_pattern(), local.capture({PROMPT!r}, 'attn_probs.2')['attn_probs.2'][0, 3], atol=1e-6)"
    )
    neighbour = (
        f"torch.allclose(a.head_pattern(), local.capture({PROMPT!r}, 'attn_probs.2')['attn_probs.2'][0, 2], atol=1e-3)"
    )
    assert _kernel(srv, page, f"[bool({same}), bool({neighbour})]") == [True, False]


def test_a_slider_moved_in_the_browser_steers_on_the_server(lab):
    srv, page, server, token = lab
    panel = page.locator(".iel-steer")
    steered = panel.locator('[data-which="steered"]')
    before = steered.inner_text()
    assert before == panel.locator('[data-which="baseline"]').inner_text()  # scale 0: identical
    ops = stats(server, token)["operations"]
    page.evaluate("""() => { const r = document.querySelector('.iel-steer input[data-knob="scale"]');
        r.value = String(r.max); r.dispatchEvent(new Event('input', {bubbles: true})); }""")
    page.wait_for_function(
        "b => { const e = document.querySelector('.iel-steer [data-which=\"steered\"]');"
        " return e.innerText !== b && !document.querySelector('.iel-steer').classList.contains('iel-busy'); }",
        arg=before,
        timeout=60000,
    )
    k = _until(lambda: (lambda r: r if r["scale"] == 10.0 else None)(_kernel(srv, page, "dict(scale=sp.scale)")))
    assert k
    assert stats(server, token)["operations"] > ops  # the stream ran on the server
    assert len(steered.locator(".iel-tok").all_text_contents()) == _kernel(srv, page, "len(sp.steered)")
    # the panel's tokens are a local session's steered generation of the same vector and scale
    same = "sp.steered_ids == local.generate('Mary went to the', 8, steer=local.steer(sp.address, v, scale=10.0)).ids"
    unsteered = "sp.steered_ids == local.generate('Mary went to the', 8).ids"
    assert _kernel(srv, page, f"[{same}, {unsteered}]") == [True, False]
