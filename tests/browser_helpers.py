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
