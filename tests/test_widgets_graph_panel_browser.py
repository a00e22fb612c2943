"""The attribution-graph panel in a real browser (Playwright + Debian Chromium, headless) against a real JupyterLab,
on the demo model and its demo transcoders, in the light and dark themes: the graph renders the kernel's number of
nodes of each kind, hovering the logit node shows the kernel's edge weights into it, clicking a feature node makes
the kernel send that feature's dashboard (drawn below the graph), and grouping two shift-clicked features shows a
supernode box while ``panel.supernodes`` holds it in the kernel. One JupyterLab server for the module. Screenshots
go to artifacts/widgets/."""

import re

import pytest

from benchmarks.widgets_harness import ROOT, Server, available
from tests.browser_helpers import kernel as _kernel
from tests.browser_helpers import switch_theme
from tests.browser_helpers import until as _until
from tests.test_widgets_graph_panel import PROMPT, TEXTS

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

SETUP = (
    f"import sys; sys.path.insert(0, {ROOT!r})\n"
    "import torch; torch.set_num_threads(1)\n"
    "import ie_lab\n"
    "s = ie_lab.Session(ie_lab.DEMO_MODEL, device='cpu', progress=False)\n"
    "tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)\n"
    f"g = ie_lab.attribution_graph(s, {PROMPT!r}, tcs, batch_size=128)\n"
    "from ie_lab.widgets.graph_panel_data import node_id\n"
    # a supernode's incoming edges as the kernel sums them: per outside source, its edges into the members
    "def summed_into(name):\n"
    "    out = {}\n"
    "    for t in [n for n in gp.shown.nodes if node_id(n) in gp.supernodes[name]]:\n"
    "        for n, w in gp.shown.edges_into(t).items():\n"
    "            if n.kind != 'bias' and node_id(n) not in gp.supernodes[name]:\n"
    "                out[node_id(n)] = out.get(node_id(n), 0.0) + w\n"
    "    return sorted(out.values(), key=lambda w: -abs(w))"
)
CELLS = [SETUP, f"gp = s.graph_panel(g, transcoders=tcs, corpus={TEXTS!r}, top=4); gp"]
KINDS = ("embedding", "feature", "error", "logit")


@pytest.fixture(scope="module")
def lab():
    srv = Server()
    try:
        srv.write("graph.ipynb", CELLS)
        page = srv.open("graph.ipynb")
        page.wait_for_selector(".iel-graph .iel-g-node", timeout=90000)
        yield srv, page
        srv.close_page(page)
    finally:
        srv.close()


def _counts(panel):
    return {k: panel.locator(f".iel-g-node.iel-g-{k}").count() for k in KINDS}


def _kernel_counts(srv, page):
    return _kernel(srv, page, f"{{k: sum(n.kind == k for n in gp.shown.nodes) for k in {list(KINDS)!r}}}")


def _check_hover(srv, page, panel):
    """Hover the top logit: the incoming weights listed are the kernel's largest edges into it (bias nodes aside)."""
    want = _kernel(
        srv,
        page,
        "sorted((w for n, w in gp.shown.edges_into(gp.shown.of_kind('logit')[0]).items() if n.kind != 'bias'),"
        " key=lambda w: -abs(w))",
    )
    panel.locator(".iel-g-node.iel-g-logit").first.hover()
    shown = [float(x) for x in panel.locator(".iel-g-in tr .iel-g-w").all_inner_texts()]
    assert len(shown) == min(6, len(want)) > 0
    assert shown == pytest.approx(want[: len(shown)], rel=1e-3, abs=1e-5)
    assert "logit" in panel.locator(".iel-g-label").inner_text()


def test_the_graph_renders_hovers_opens_dashboards_and_groups_supernodes_in_both_themes(lab):
    srv, page = lab
    panel = page.locator(".iel-graph")
    want = _kernel_counts(srv, page)
    assert want["feature"] > 3 and _counts(panel) == want
    _check_hover(srv, page, panel)
    srv.shot(panel, "graph-lab-light.png")

    # a click on a feature node: the kernel sends that feature's dashboard, drawn below the graph
    feats = panel.locator(".iel-g-node.iel-g-feature").evaluate_all("es => es.map(e => e.dataset.id)")
    fid = feats[0]
    panel.locator(f'.iel-g-node[data-id="{fid}"]').click()
    assert _until(lambda: _kernel(srv, page, "gp.selected") == fid)
    index = int(fid.split(":")[3])
    page.wait_for_function(
        "f => { const t = document.querySelector('.iel-graph .iel-g-dash .iel-title'); "
        "return t && t.textContent.startsWith('feature ' + f + ' '); }",
        arg=index,
    )
    shown = panel.locator(".iel-g-dash .iel-dash-ctx").evaluate_all(
        "es => es.map(e => Array.from(e.querySelectorAll('.iel-tok'), t => t.textContent))"
    )
    assert shown == _kernel(srv, page, "[c.tokens for c in gp.data.contexts]")
    assert panel.locator(".iel-g-dash .iel-dash-pos .iel-dash-logtok").all_inner_texts() == _kernel(
        srv, page, "gp.data.promoted_tokens"
    )

    # shift-click two features, name them, group: one box drawn, the kernel holds the supernode
    panel.locator(f'.iel-g-node[data-id="{feats[1]}"]').click(modifiers=["Shift"])
    panel.locator(f'.iel-g-node[data-id="{feats[2]}"]').click(modifiers=["Shift"])
    panel.locator(".iel-g-name").fill("pair")
    panel.get_by_role("button", name="group").click()
    assert _until(lambda: _kernel(srv, page, "gp.supernodes") == {"pair": feats[1:3]})
    page.wait_for_selector('.iel-graph .iel-g-super[data-name="pair"]')
    assert panel.locator(f'.iel-g-node[data-id="{feats[1]}"]').count() == 0
    assert _counts(panel)["feature"] == want["feature"] - 2
    panel.locator('.iel-g-super[data-name="pair"]').hover()
    assert "supernode" in panel.locator(".iel-g-label").inner_text()
    # its incoming edges: the members' edges from each outside node, summed in the kernel here
    summed = _kernel(srv, page, "summed_into('pair')")
    shown_in = [float(x) for x in panel.locator(".iel-g-in tr .iel-g-w").all_inner_texts()]
    assert len(shown_in) == min(6, len(summed)) > 0
    assert shown_in == pytest.approx(summed[: len(shown_in)], rel=1e-3, abs=1e-5)

    # dark theme: the same graph, its edges coloured by the theme's variables
    switch_theme(page, "JupyterLab Dark", False, ".iel-graph")
    try:
        srv.shot(panel, "graph-lab-dark.png")
        assert _counts(panel) == {**want, "feature": want["feature"] - 2}
        _check_hover(srv, page, panel)
        bg = panel.evaluate("e => getComputedStyle(e).backgroundColor")
        assert sum(map(int, re.findall(r"\d+", bg)[:3])) / 3 < 100
        pos = panel.locator(".iel-g-edge.iel-g-pos").first.evaluate("e => getComputedStyle(e).stroke")
        neg = panel.locator(".iel-g-edge.iel-g-neg")
        if neg.count():
            assert neg.first.evaluate("e => getComputedStyle(e).stroke") != pos
        # ungroup from the panel; re-prune from the panel's thresholds
        panel.locator('.iel-g-ungroup[data-name="pair"]').click()
        assert _until(lambda: _kernel(srv, page, "gp.supernodes") == {})
        page.wait_for_function("() => !document.querySelector('.iel-graph .iel-g-super')")
        panel.locator('input[aria-label="node threshold"]').fill("0.5")
        panel.locator('input[aria-label="edge threshold"]').fill("0.9")
        panel.get_by_role("button", name="prune").click()
        assert _until(lambda: _kernel(srv, page, "gp.node_threshold") == 0.5)
        want2 = _kernel_counts(srv, page)
        assert want2 == _kernel(
            srv, page, f"{{k: sum(n.kind == k for n in g.prune(0.5, 0.9).nodes) for k in {list(KINDS)!r}}}"
        )
        page.wait_for_function(
            "n => document.querySelectorAll('.iel-graph .iel-g-node.iel-g-feature').length === n", arg=want2["feature"]
        )
        assert _counts(panel) == want2
    finally:
        switch_theme(page, "JupyterLab Light", True, ".iel-graph")
