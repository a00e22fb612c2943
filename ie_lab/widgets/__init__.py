"""Notebook panels that talk back to the kernel (anywidget): address picker, attention viewer, steering panel,
feature panel, feature dashboard (and its static export), attribution-graph panel.

JS/CSS sources: the repository's ``widgets/`` folder, bundled into ``ie_lab/static/`` by ``widgets/build.py``.
"""

from .attention import AttentionViewer
from .dashboard import FeatureDashboard
from .dashboard_data import FeatureData, encode_corpus, feature_data
from .features import FeaturePanel
from .graph_panel import GraphPanel
from .picker import Picker, cheatsheet
from .steering import SteeringPanel

__all__ = [
    "AttentionViewer",
    "FeatureDashboard",
    "FeatureData",
    "FeaturePanel",
    "GraphPanel",
    "Picker",
    "SteeringPanel",
    "cheatsheet",
    "encode_corpus",
    "feature_data",
]
