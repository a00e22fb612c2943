"""`python -m ie_lab` is the `ie-lab` command (ie_lab/cli.py), for environments whose scripts folder is not on PATH."""

import sys

from .cli import main

sys.exit(main())
