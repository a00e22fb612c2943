"""The gate hands test modules to its workers longest first (tests/conftest.py, tests/module_seconds.json): a long
module collected late became the run's tail, one worker busy while the others idled."""

from __future__ import annotations

import json
import os
import types

from tests import conftest

ROOT = conftest.ROOT


def _item(path: str):
    return types.SimpleNamespace(fspath=os.path.join(ROOT, path), name=path)


def test_modules_are_collected_longest_first_and_keep_their_own_order():
    seconds = conftest._module_seconds()
    longest = max(seconds, key=seconds.get)
    short = min(seconds, key=seconds.get)
    items = [_item(short), _item("tests/not_measured_yet.py"), _item(longest), _item(short)]
    items[0].name, items[3].name = "first", "second"
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.fspath for i in items] == [
        os.path.join(ROOT, p) for p in (longest, "tests/not_measured_yet.py", short, short)
    ]
    assert [items[2].name, items[3].name] == ["first", "second"]  # a module's tests keep their order


def test_every_measured_module_exists_and_the_gate_keeps_the_order():
    with open(conftest.MODULE_SECONDS_PATH, encoding="utf-8") as f:
        seconds = json.load(f)
    gone = [m for m in seconds if not os.path.isfile(os.path.join(ROOT, m))]
    assert not gone, f"modules gone since they were measured (python scripts/test_durations.py): {gone}"
    assert seconds["tests/test_vllm_tp.py"] > conftest.UNMEASURED_S
    with open(os.path.join(ROOT, "dev"), encoding="utf-8") as f:
        dev = f.read()
    # xdist reorders loadfile's modules by their number of tests unless told not to
    assert "--dist loadfile --no-loadscope-reorder" in dev


def test_recorded_durations_are_summed_per_module(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_durations", os.path.join(ROOT, "scripts", "test_durations.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "durations-gw0-1.tsv").write_text("tests/a.py\t1.5\ntests/b.py\t4.0\n")
    (tmp_path / "durations-gw1-2.tsv").write_text("tests/a.py\t3.0\n")
    out = tmp_path / "module_seconds.json"
    monkeypatch.setattr(mod, "OUT", str(out))
    mod.main(str(tmp_path))
    got = json.loads(out.read_text())
    assert got == {"tests/a.py": 4.5, "tests/b.py": 4.0} and list(got) == ["tests/a.py", "tests/b.py"]
