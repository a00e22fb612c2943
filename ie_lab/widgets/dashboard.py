"""The feature dashboard: ``s.feature_dashboard(sae, feature, acts, prompt=None, top=10)``, one SAE feature as SAE-Vis
and Neuronpedia show one.

Its top-activating contexts in the corpus (tokens tinted by the feature's value, hover a token for it), a histogram
of its non-zero activations with its density, the tokens its decoder direction promotes and suppresses, and, given
a prompt, the text generated without and with steering along it. The numbers are ``dashboard_data.feature_data``'s
(computed in the kernel, testable without a browser); the front end receives them as binary buffers (float32 /
int32) and strings, and switches feature by asking the kernel (a number box, or a click in the list of the corpus's
strongest features): the corpus is encoded once, so a switch reads one column.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import traitlets

from ..errors import InputError, plural
from . import _base, _static
from .dashboard_data import EncodedCorpus, FeatureData, check_feature, encode_corpus, feature_data

MAX_LISTED = 64  # features in the list beside the number box


def _f32(a: Any) -> bytes:
    return np.asarray(a, dtype="<f4").tobytes()


def _i32(a: Any) -> bytes:
    return np.asarray(a, dtype="<i4").tobytes()


class FeatureTraits(traitlets.HasTraits):
    """The synced traits one feature's dashboard is drawn from (dashboard.js's fromTraits reads them): the feature
    dashboard's, and the graph panel's dashboard below its graph (ie_lab/widgets/graph_panel.py)."""

    hold_sync: Any  # the widget's own (anywidget.AnyWidget), which every class mixing these traits in also is

    feature = traitlets.Int(0).tag(sync=True)
    n_features = traitlets.Int(0).tag(sync=True)
    address = traitlets.Unicode("").tag(sync=True)
    n_tokens = traitlets.Int(0).tag(sync=True)
    n_fired = traitlets.Int(0).tag(sync=True)
    density = traitlets.Float(0.0).tag(sync=True)
    max_act = traitlets.Float(0.0).tag(sync=True)
    ctx_tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)  # every context's tokens, one after another
    ctx_len = traitlets.Bytes(b"").tag(sync=True)  # int32 [contexts]: tokens per context
    ctx_meta = traitlets.Bytes(b"").tag(sync=True)  # int32 [contexts, 3]: prompt, peak position, peak index in window
    ctx_values = traitlets.Bytes(b"").tag(sync=True)  # float32 [sum of ctx_len]: the feature at each token
    hist_counts = traitlets.Bytes(b"").tag(sync=True)  # int32 [bins]
    hist_edges = traitlets.Bytes(b"").tag(sync=True)  # float32 [bins + 1]
    logit_tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)  # promoted, then suppressed
    logit_values = traitlets.Bytes(b"").tag(sync=True)  # float32, the same order
    n_promoted = traitlets.Int(0).tag(sync=True)
    logit_note = traitlets.Unicode("").tag(sync=True)
    list_ids = traitlets.Bytes(b"").tag(sync=True)  # int32: the corpus's strongest features (largest activation)
    list_max = traitlets.Bytes(b"").tag(sync=True)  # float32: their largest activation
    list_density = traitlets.Bytes(b"").tag(sync=True)  # float32: their density
    steer_prompt = traitlets.Unicode("").tag(sync=True)
    steer_scale = traitlets.Float(0.0).tag(sync=True)
    baseline = traitlets.Unicode("").tag(sync=True)
    steered = traitlets.Unicode("").tag(sync=True)
    notes = traitlets.Unicode("").tag(sync=True)

    def _put(self, d: FeatureData) -> None:
        self.data = d
        with self.hold_sync():
            self.ctx_tokens = [t for c in d.contexts for t in c.tokens]
            self.ctx_len = _i32([len(c.tokens) for c in d.contexts])
            self.ctx_meta = _i32([[c.prompt, c.position, c.at] for c in d.contexts])
            self.ctx_values = _f32(np.concatenate([c.values for c in d.contexts]) if d.contexts else [])
            self.hist_counts = _i32(d.hist_counts)
            self.hist_edges = _f32(d.hist_edges)
            self.logit_tokens = list(d.promoted_tokens) + list(d.suppressed_tokens)
            self.logit_values = _f32(np.concatenate([d.promoted_values, d.suppressed_values]))
            self.n_promoted = len(d.promoted_tokens)
            self.logit_note = d.logit_note
            s = d.steering
            self.steer_prompt, self.steer_scale = (s.prompt, s.scale) if s else ("", 0.0)
            self.baseline, self.steered = (s.baseline, s.steered) if s else ("", "")
            self.n_tokens, self.n_fired, self.density, self.max_act = d.n_tokens, d.n_fired, d.density, d.max_activation
            self.notes = "; ".join(d.notes)
            self.error = ""
            self.feature = d.feature  # last: the front end redraws on it


class FeatureDashboard(FeatureTraits, _base.Panel):
    """One SAE feature's dashboard; ``show(f)`` (or the front end's ``select``) switches to another feature."""

    _esm = _static.bundle("dashboard.js")
    COMMANDS = {"select": {"feature": _base.integer(0, (1 << 31) - 1)}}

    def __init__(
        self,
        session: Any,
        sae: Any,
        corpus: EncodedCorpus,
        feature: int,
        *,
        listed: int = 16,
        **options: Any,
    ):
        if isinstance(listed, bool) or not isinstance(listed, int) or not 1 <= listed <= MAX_LISTED:
            raise InputError(f"listed={listed!r}: an int from 1 to {MAX_LISTED} (features in the list).")
        self._session, self._sae, self._corpus, self._options = session, sae, corpus, options
        feature = check_feature(feature, corpus.d_sae)
        data = feature_data(session, sae, feature, corpus, **options)  # checks every option before the panel exists
        peak = corpus.maxima()
        order = peak.topk(min(listed, corpus.d_sae)).indices
        order = order[peak[order] > 0]
        super().__init__(
            n_features=corpus.d_sae,
            address=corpus.address,
            list_ids=_i32(order.numpy()),
            list_max=_f32(peak[order].numpy()),
            list_density=_f32((corpus.counts()[order].float() / max(1, corpus.n_rows)).numpy()),
        )
        self._put(data)

    def show(self, feature: int) -> None:
        """Switch to another feature (any index of the SAE)."""
        self._put(
            feature_data(
                self._session, self._sae, check_feature(feature, self.n_features), self._corpus, **self._options
            )
        )

    def on_select(self, feature: int) -> None:
        if feature >= self.n_features:
            self._reject(f"no feature {feature} here: features run from 0 to {self.n_features - 1}")
            return
        self.show(feature)

    def __repr__(self) -> str:
        return (
            f"FeatureDashboard(feature {self.feature} of {plural(self.n_features, 'feature')} at {self.address}: "
            f"fires on {self.n_fired} of {plural(self.n_tokens, 'token')}; {plural(len(self.data.contexts), 'context')})"
        )


def for_session(session: Any, sae: Any, feature: Any, acts: Any, *, listed: int = 16, **options: Any):
    """The panel over a Session: the corpus encoded once (a list of texts captured through the session first)."""
    from ..sae import SAE

    session.facts  # refuses a closed session before any work  # noqa: B018
    if not isinstance(sae, SAE):
        raise InputError(f"feature_dashboard needs an SAE (ie_lab.load_sae(...)), got {type(sae).__name__}.")
    check_feature(feature, sae.d_sae)
    corpus = acts if isinstance(acts, EncodedCorpus) else encode_corpus(session, sae, acts)
    return FeatureDashboard(session, sae, corpus, feature, listed=listed, **options)
