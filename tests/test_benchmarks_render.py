import os
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_results_latest_is_rendered_from_the_cells():
    render = runpy.run_path(os.path.join(ROOT, "benchmarks", "render.py"))["render"]
    with open(os.path.join(ROOT, "benchmarks", "results-latest.md")) as f:
        assert f.read() == render(), "run `python benchmarks/render.py`"
