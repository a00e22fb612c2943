"""DEMO_MODEL and DEMO_SAE: where the small tutorial model and its SAE ship inside the package.

Neutral: a path, read by both sessions (to print a portable name) and by the docs generator, so none of them
imports the package's __init__ for it.
"""

from __future__ import annotations

import os

#: The small model trained for the tutorials, shipped inside the package (works offline and in Colab).
DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")

#: A TopK SAE on DEMO_MODEL's resid_post.1, shipped beside it (SAELens' folder layout: `ie_lab.load_sae(DEMO_SAE, s)`);
#: trained by scripts/train_demo_sae.py, its numbers in the folder's training_report.json.
DEMO_SAE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_sae")

#: Per-layer transcoders on DEMO_MODEL (mlp_in.L -> mlp_out.L, one SAELens jumprelu_transcoder folder per layer):
#: `ie_lab.load_transcoders(DEMO_TRANSCODERS, s)`; trained by scripts/train_demo_transcoders.py, its numbers in the
#: folder's training_report.json.
DEMO_TRANSCODERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_transcoders")
