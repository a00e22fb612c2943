"""The committed results re-render to exactly the table in validator/README.md (no model run)."""

import glob
import os
import shutil

from validator import render


def test_readme_table_matches_committed_json():
    docs = render.load()
    assert docs, "validator/results/ holds no JSON: run `python -m validator run --all`"
    with open(render.README) as f:
        text = f.read()
    assert render.readme_with(text, docs, render.load_snapshots()) == text, (
        "validator/README.md's results table drifted from validator/results/*.json: run `python -m validator render`"
    )


def test_every_result_names_its_tolerance_and_verdicts():
    from validator import spec as S

    for d in render.load():
        assert set(d["tolerance"]) >= {"max_abs", "cosine", "worst_cosine", "rel", "why"}, d["model"]
        for r in d["rows"]:
            assert r["verdict"] in S.VERDICTS, (d["model"], d["engine"], r)
            if r["verdict"] in (S.PASS, S.WARN):
                assert {"cosine", "worst_token_cosine", "max_abs", "rel_err"} <= set(r), (d["model"], r)


def test_heatmap_renders_from_json(tmp_path):
    fig = render.heatmap(render.load())
    assert len(fig.data[0].y) == len({d["model"] for d in render.load()})
    assert os.path.exists(os.path.join(render.RESULTS, "heatmap.json"))
    # the HTML is written locally (not committed) and must open offline: plotly.js inside, no script from a CDN
    for p in glob.glob(os.path.join(render.RESULTS, "*__*.json")):
        shutil.copy(p, tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"{render.START}\n{render.END}\n")
    render.write_all(str(tmp_path), str(readme))
    html = (tmp_path / "heatmap.html").read_text()
    assert "<script src=" not in html and "validator-heatmap" in html and len(html) > 1_000_000


def test_every_family_the_swept_survey_binds_has_a_row():
    """The coverage snapshot written with the surveyed sweep: each bound model type is a fixture row or a
    surveyed-<type> row (re-run `python -m validator run --surveyed` when the survey binds more)."""
    snapshot = render.load_snapshot()
    assert snapshot is not None, (
        "validator/results/survey_bound.json is missing: run `python -m validator run --surveyed`"
    )
    section = render.coverage_section(render.load(), snapshot)
    assert f"{len(snapshot['bound'])} have a row; none is missing." in section


def test_every_family_bound_on_either_transformers_line_has_a_row():
    """Issue 20's "a validator row for every bound family", against the live committed surveys of both lines (not
    only the snapshots): binding a family without sweeping it fails here. Each line has its snapshot too."""
    from ie_lab import coverage

    docs = render.load()
    lines = {coverage.line(s["transformers"]) for s in render.load_snapshots()}
    for survey in coverage.load_surveys():
        line = coverage.line(survey["transformers"])
        assert line in lines, (
            f"no validator snapshot for transformers {line}: run `python -m validator run --surveyed` from that "
            "line's environment (validator/README.md, 'the newest transformers line')"
        )
        live = {
            "transformers": survey["transformers"],
            "bound": [r["model_type"] for r in survey["rows"] if r["status"] == "bound"],
        }
        section = render.coverage_section(docs, live)
        assert f"{len(live['bound'])} have a row; none is missing." in section, section.split("\n")[2][:600]


def _doc(model, family, tf, model_type=None):
    return {"model": model, "family": family, "model_type": model_type or family, "versions": {"transformers": tf}}


def test_coverage_section_names_the_line_a_row_ran_on_and_what_is_missing():
    docs = [_doc("surveyed-llama", "llama", "5.19.0"), _doc("surveyed-tf5.24-lfm3", "lfm3", "5.24.0")]
    newest = render.coverage_section(docs, {"transformers": "5.24.0", "bound": ["llama", "lfm3", "flint"]})
    assert "| `llama` | `surveyed-llama` (transformers 5.19) |" in newest
    assert "| `lfm3` | `surveyed-tf5.24-lfm3` |" in newest
    assert "2 have a row; no row yet: `flint`." in newest
    pinned = render.coverage_section(docs, {"transformers": "5.19.0", "bound": ["llama"]})
    assert "| `llama` | `surveyed-llama` |" in pinned and "none is missing." in pinned
