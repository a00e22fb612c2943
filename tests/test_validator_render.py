"""The committed results re-render to exactly the table in validator/README.md (no model run)."""

import os

from validator import render


def test_readme_table_matches_committed_json():
    docs = render.load()
    assert docs, "validator/results/ holds no JSON: run `python -m validator run --all`"
    with open(render.README) as f:
        text = f.read()
    assert render.readme_with(text, docs) == text, (
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
    assert os.path.exists(os.path.join(render.RESULTS, "heatmap.html"))
