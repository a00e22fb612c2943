"""Shared pieces of the real-browser tests (tests/test_*browser*.py): reading a value back from the notebook's
kernel, and polling until a condition holds. The JupyterLab server and Chromium are benchmarks/widgets_harness.py's
Server."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def kernel(srv: Any, page: Any, expr: str) -> Any:
    """The value of a JSON-able Python expression in the page's notebook kernel (run outside any cell)."""
    out = srv.execute(page, f"import json as _j; print(_j.dumps({expr}))")
    assert not out.startswith("ERROR"), out
    return json.loads(out)


def until(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """fn()'s first truthy value, or its last value once `timeout` seconds have passed (the caller asserts it).
    A wait, not a measurement: nothing is timed, only how long to keep asking."""
    end = time.time() + timeout
    while True:
        v = fn()
        if v or time.time() > end:
            return v
        time.sleep(0.1)


# The page has settled for a measurement once its fonts are loaded, no finite animation or CSS transition is running
# (a theme switch fades colours; an infinite spinner never ends and moves nothing measured), and what the test is
# about to measure (`probe(arg)`, any JSON-able value: boxes, computed colours) read the same at `frames`
# consecutive animation frames. A predicate polled once per frame runs before that frame's style, layout and
# ResizeObserver callbacks, so an unchanged reading across frames means no pending resize-observer or animation-frame
# work still moves it. A wait for a condition (Playwright's wait_for_function), never for a moment.
_SETTLED = """([key, arg, frames]) => {
  const probe = %s;
  const st = window[key] || (window[key] = { last: undefined, same: 0 });
  const moving = document.getAnimations().some((a) => {
    const end = a.effect && a.effect.getComputedTiming().endTime;
    return (a.playState === 'running' || a.pending) && end !== Infinity;
  });
  if (document.fonts.status !== 'loaded' || moving) { st.last = undefined; st.same = 0; return false; }
  const now = JSON.stringify(probe(arg));
  st.same = now === st.last ? st.same + 1 : 0;
  st.last = now;
  return st.same >= frames;
}"""
_settle_calls = [0]


def settle(page: Any, probe: str = "() => null", arg: Any = None, frames: int = 3, timeout: float = 30000) -> None:
    """Wait until the page has settled for a measurement (see _SETTLED): fonts loaded, no transition running, and
    `probe` (a JS function of `arg`: what is about to be measured) unchanged over `frames` animation frames."""
    _settle_calls[0] += 1
    key = f"__ielSettled{_settle_calls[0]}"
    page.evaluate("() => document.fonts.ready.then(() => true)")  # resolves once every font in use has loaded
    page.wait_for_function(_SETTLED % probe, arg=[key, arg, frames], polling="raf", timeout=timeout)
    page.evaluate("(key) => { delete window[key]; }", key)


def box_probe(selectors: list[str]) -> tuple[str, list[str]]:
    """A probe for settle(): the client rectangles of the first element each selector finds (null if none)."""
    js = """(sels) => sels.map((s) => { const e = document.querySelector(s); if (!e) return null;
      const r = e.getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })"""
    return js, selectors


def switch_theme(page: Any, theme: str, light: bool, panel: str) -> None:
    """Switch JupyterLab's theme and wait until it has applied: the body names the theme, and the theme's stylesheet
    (its CSS variables) has reached the panel, whose own background is then dark (or light) as the theme is."""
    page.evaluate("t => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})", theme)
    page.wait_for_function(
        "t => document.body.dataset.jpThemeName === t[0] && document.body.dataset.jpThemeLight === t[1]",
        arg=[theme, str(light).lower()],
        timeout=20000,
    )
    page.wait_for_function(
        "a => { const c = getComputedStyle(document.querySelector(a[0])).backgroundColor"
        ".match(/\\d+/g).map(Number); const l = (c[0] + c[1] + c[2]) / 3; return a[1] ? l < 100 : l > 155; }",
        arg=[panel, not light],
        timeout=20000,
    )
