"""Sum a recorded gate run's test seconds per module into tests/module_seconds.json, the longest-first order
tests/conftest.py hands modules to the test workers in.

    IE_LAB_RECORD_DURATIONS=/tmp/durations ./dev test     # each test process appends its tests' seconds there
    python scripts/test_durations.py /tmp/durations         # rewrites tests/module_seconds.json

Seconds are setup + call + teardown of every test in the module, as the gate ran them (three workers on two cores):
what matters is their order and rough size, not their exact value.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "module_seconds.json")


def main(folder: str) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    files = glob.glob(os.path.join(folder, "durations-*.tsv"))
    if not files:
        sys.exit(f"test_durations: no durations-*.tsv in {folder}: run the gate with IE_LAB_RECORD_DURATIONS={folder}")
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                module, _, sec = line.rstrip("\n").partition("\t")
                seconds[module] += float(sec)
    ordered = {m: round(s, 1) for m, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    print(
        f"test_durations: {len(ordered)} modules, {sum(ordered.values()):.0f} s in all -> {os.path.relpath(OUT, ROOT)}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ie_lab_durations")
