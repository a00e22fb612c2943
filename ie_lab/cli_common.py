"""What every `ie-lab` command shares: its exit codes and the version line. The commands live in cli.py (the table
of commands, `ie-lab lab`), cli_points.py, cli_doctor.py and remote/command.py (`ie-lab serve`)."""

from __future__ import annotations

import importlib.metadata

# Exit codes: 2 for a command line that cannot work as written (argparse's own convention), 1 for a refusal or an
# environment that lacks something, 0 otherwise.
USAGE, FAILED = 2, 1


def version() -> str:
    # From the installed distribution's metadata: no module imports the package __init__ (tests/test_import_contract.py).
    try:
        return importlib.metadata.version("ie_lab")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (ie_lab is not installed here: pip install -e . in the checkout)"
