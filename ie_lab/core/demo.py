"""DEMO_MODEL: where the small tutorial model ships inside the package.

Neutral: a path, read by both sessions (to print a portable name) and by the docs generator, so none of them
imports the package's __init__ for it.
"""

from __future__ import annotations

import os

#: The small model trained for the tutorials, shipped inside the package (works offline and in Colab).
DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
