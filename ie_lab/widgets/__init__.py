"""Notebook panels that talk back to the kernel (anywidget): address picker, attention viewer, steering panel.

JS/CSS sources: the repository's ``widgets/`` folder (shipped in the wheel as ``ie_lab/static/widgets``).
"""

from .attention import AttentionViewer
from .picker import Picker, cheatsheet
from .steering import SteeringPanel

__all__ = ["AttentionViewer", "Picker", "SteeringPanel", "cheatsheet"]
