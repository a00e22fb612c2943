"""Each backend declares its own verdicts (ie_lab/<backend>/verdicts.py): one per point of the registry and one
cell per capability, read through the shared tables without those tables naming any backend's answer."""

import subprocess
import sys

import pytest

from ie_lab import capabilities, points


@pytest.mark.parametrize("backend", points.BACKENDS)
def test_each_backend_gives_a_verdict_on_every_point_and_capability_and_nothing_else(backend):
    mod = points.verdicts_of(backend)
    assert list(mod.POINTS) == list(points.NAMES)  # in the registry's order, so the tables read alike
    assert set(mod.CAPABILITIES) == {c.name for c in capabilities.CAPABILITIES}
    for c in capabilities.CAPABILITIES:
        cell = c.cell(backend)
        assert cell and getattr(c, backend) == cell
        if cell.startswith("no"):
            assert cell.startswith("no: "), (backend, c.name, cell)  # the refusal's reason follows "no: "
    for name in points.NAMES:
        assert points.get(name).verdict(backend) is mod.POINTS[name] is getattr(points.get(name), backend)


def test_an_unknown_backend_is_named_in_the_refusal():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        points.get("resid_post").verdict("tpu")
    with pytest.raises(AttributeError):
        points.get("resid_post").tpu  # noqa: B018


def test_the_registry_and_the_verdict_tables_import_no_torch():
    code = (
        "import sys; from ie_lab import capabilities, points; "
        "[p.verdict(b) for p in points.all_points() for b in points.BACKENDS]; capabilities.markdown_table(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
