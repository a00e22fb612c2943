"""Tutorial solutions as a reader sees them in JupyterLab (issue 33, item 14): collapsed, input and output, until
clicked; then the code shows. A real JupyterLab and Chromium; the notebook is only opened, not run (nbval runs it)."""

import os
import shutil

import pytest

from benchmarks.widgets_harness import ROOT, Server, available

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TUTORIAL = "05_logit_lens.ipynb"  # one exercise, one solution


def test_a_tutorial_solution_is_collapsed_until_clicked():
    srv = Server()
    page = None
    try:
        shutil.copy(os.path.join(ROOT, "tutorials", TUTORIAL), os.path.join(srv.root, TUTORIAL))
        page = srv.browser.new_page(viewport={"width": 1100, "height": 1000})
        page.goto(f"{srv.base}/lab/tree/{TUTORIAL}?reset&token={srv.token}")
        page.wait_for_function(
            "() => { const w = window.jupyterapp?.shell?.currentWidget; return w && w.content"
            " && w.content.widgets.length > 5 && w.context.isReady; }",
            timeout=60000,
        )
        # Every cell as JupyterLab holds it: whether its input / output is collapsed, and its first line.
        cells = page.evaluate(
            "() => window.jupyterapp.shell.currentWidget.content.widgets.map((c) => ({"
            " type: c.model.type, source: c.model.sharedModel.getSource().split('\\n')[0],"
            " inputHidden: c.inputHidden, outputHidden: c.model.type === 'code' ? c.outputHidden : false }))"
        )
        i = next(k for k, c in enumerate(cells) if c["source"].startswith("**Solution"))
        solution = cells[i + 1]
        assert solution["type"] == "code" and solution["inputHidden"] and solution["outputHidden"], solution
        assert not any(c["inputHidden"] for k, c in enumerate(cells) if k != i + 1), "only the solution is hidden"
        # On screen: a placeholder bar instead of the code; clicking it shows the code.
        cell = page.locator(".jp-Notebook .jp-Cell").nth(i + 1)
        cell.scroll_into_view_if_needed()
        placeholder = cell.locator(".jp-InputPlaceholder")
        assert placeholder.is_visible() and not cell.locator(".jp-InputArea-editor").is_visible()
        placeholder.click()
        editor = cell.locator(".jp-InputArea-editor")
        editor.wait_for(state="visible", timeout=30000)
        assert solution["source"][:40] in editor.inner_text()
    finally:
        if page is not None:
            srv.close_page(page)
        srv.close()
