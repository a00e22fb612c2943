"""Notebook panels that talk back to the kernel (anywidget): address picker, attention viewer, steering panel,
feature panel.

JS/CSS sources: the repository's ``widgets/`` folder, bundled into ``ie_lab/static/`` by ``widgets/build.py``.
"""

from .attention import AttentionViewer
from .features import FeaturePanel
from .picker import Picker, cheatsheet
from .steering import SteeringPanel

__all__ = ["AttentionViewer", "FeaturePanel", "Picker", "SteeringPanel", "cheatsheet"]
