"""What the checks against another tool in its own environment share (validator/sae.py against SAELens,
validator/circuits.py against circuit-tracer): that environment's python, a worker run there as a child over a JSON
job, the README section each re-renders from its results file, and the command's ending (run, re-render, verdict).

Each check is one ``ExternalCheck``: its environment's name, its results file, its README section markers, its
table and the key of its results' verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from .run import HERE, RESULTS, env_python

README = os.path.join(HERE, "README.md")


def call_worker(py: str, worker: str, cmd: str, job: dict, path: str, timeout: int, env: dict | None = None) -> dict:
    """Write `job` to `path`, run `py worker cmd path`, and read what the worker wrote to `path`.out."""
    with open(path, "w") as f:
        json.dump(job, f)
    p = subprocess.run([py, worker, cmd, path], capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{os.path.basename(worker)} {cmd} failed:\n{p.stderr[-4000:]}")
    with open(path + ".out") as f:
        return json.load(f)


@dataclass(frozen=True)
class ExternalCheck:
    env: str  # .venvs/<env>
    results_file: str  # in the results folder
    start: str  # the README section's markers
    end: str
    table: Callable[[dict], str]  # the results as the section's markdown
    run: Callable[[str], dict]  # the check, its results written into the folder it is given
    verdict_key: str  # the results' bool: every row as it should be
    label: str  # what the command prints before the verdict
    good: str
    bad: str

    def python(self) -> tuple[str | None, str]:
        return env_python(self.env)

    def readme_with(self, text: str, doc: dict) -> str:
        if self.start not in text or self.end not in text:
            raise ValueError(f"{README} lacks the {self.label} section markers")
        head, rest = text.split(self.start, 1)
        _, tail = rest.split(self.end, 1)
        return head + self.start + "\n\n" + self.table(doc) + "\n" + self.end + tail

    def save(self, doc: dict, out_dir: str | None) -> None:
        """Write the results file into out_dir (None: keep them in memory only)."""
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, self.results_file), "w") as f:
                json.dump(doc, f, indent=1)

    def write_readme(self, results_dir: str = RESULTS, readme: str = README) -> None:
        """Re-render the README's section from the results file (nothing to do where there is none yet)."""
        path = os.path.join(results_dir, self.results_file)
        if not os.path.exists(path):
            return
        with open(path) as f:
            doc = json.load(f)
        with open(readme) as f:
            text = f.read()
        new = self.readme_with(text, doc)
        if new != text:
            with open(readme, "w") as f:
                f.write(new)

    def main(self, out_dir: str | None) -> int:
        """The command: 2 without the environment; else run into out_dir (default the committed results, and the
        README re-rendered), print the verdict, 0 where every row is as it should be."""
        py, why = self.python()
        if py is None:
            print(why)
            return 2
        doc = self.run(out_dir or RESULTS)
        if out_dir is None:
            self.write_readme()
        print(f"{self.label}:", self.good if doc[self.verdict_key] else self.bad)
        return 0 if doc[self.verdict_key] else 1
