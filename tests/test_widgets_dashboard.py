"""Feature dashboards in plain Python (issue 31 item 5), on the shipped demo model and demo SAE: the data
(top contexts, histogram and density, promoted and suppressed tokens, steering) against independent references
(a brute-force argsort over sae.encode of activations captured one prompt at a time, a hand count, the logits hand
computed from the weights, the session's own generations); the same data from a harvest-like corpus (an in-memory
class implementing the Activations reading interface) as from a list of texts; the panel driven by the messages the
browser sends; the static HTML export. A neighbouring feature's data must differ."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

import ie_lab
from ie_lab.errors import CapabilityUnsupported, InputError
from ie_lab.widgets import FeatureDashboard, FeatureData, encode_corpus, feature_data
from ie_lab.widgets.dashboard_data import ActivationCorpus, as_plain
from tests.conftest import assert_clean

TEXTS = [
    "One Monday , Otto went to the garage . Otto cried and sobbed . Otto was full of grief .",
    "One Sunday , Jade went to the kitchen . Jade clapped . Jade felt happy . Jade danced and danced .",
    "One Friday , Ray went to the store . Ray looked at the scissors and giggled .",
    "One Sunday , James went to the pond . The awful morning made James feel hopeless .",
    "Then , Ella and Lena had a long day at the lighthouse . Lena gave a bowl to Ella .",
    "After the night , Zoe and William went to the coast . William brought a whistle to Zoe .",
    "After Michael and Daniel went to the shop , Michael gave the painting to Daniel .",
    "glue kayak violin fork glue kayak violin fork glue kayak violin fork",
]
PROMPT = "One Monday , Mary went to the park ."


@pytest.fixture(scope="module")
def s():
    sess = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False, replace=False)
    yield sess
    sess.close()


@pytest.fixture(scope="module")
def sae(s):
    return ie_lab.load_sae(ie_lab.DEMO_SAE, s)


@pytest.fixture(scope="module")
def ref(s, sae):
    """Activations captured one prompt at a time (not through the dashboard's batched capture), their token ids, and
    sae.encode of every row: the brute-force reference."""
    xs = [s.capture(t, ["resid_post.1"])["resid_post.1"][0].float() for t in TEXTS]
    ids = [s.tokens(t)[0] for t in TEXTS]
    X = torch.cat(xs)
    return {"X": X, "Z": sae.encode(X), "xs": xs, "ids": ids}


@pytest.fixture(scope="module")
def corpus(s, sae):
    return encode_corpus(s, sae, TEXTS)


def _features(ref) -> tuple[int, int]:
    """A feature firing often and one firing rarely (but at least 3 times) on the corpus."""
    counts = (ref["Z"] > 0).sum(0)
    often = int(counts.argmax())
    rare = int(torch.where(counts >= 3, counts, counts.max() + 1).argmin())
    return often, rare


class Harvest:
    """The reading interface of ie_lab.Activations, in memory, built from real captures: rows_of gives a slice here
    (the dashboard also takes a range or a (start, stop) pair). The real class is tested below too."""

    def __init__(self, xs, ids, address="resid_post.1"):
        self._x = {address: torch.cat(xs)}
        self.addresses = [address]
        self.token_ids = torch.cat(ids).long()
        self.prompt_ids = torch.cat([torch.full((x.shape[0],), i) for i, x in enumerate(xs)]).long()
        self.positions = torch.cat([torch.arange(x.shape[0]) for x in xs]).long()
        self._starts = np.cumsum([0] + [x.shape[0] for x in xs]).tolist()

    def __getitem__(self, address):
        return self._x[str(address)]

    def rows_of(self, i):
        return slice(self._starts[i], self._starts[i + 1])

    def __len__(self):
        return int(self.token_ids.shape[0])


def test_top_contexts_are_a_brute_force_argsort_over_encode(s, sae, ref, corpus):
    often, rare = _features(ref)
    starts = np.cumsum([0] + [x.shape[0] for x in ref["xs"]])
    shown = {}
    for f in (often, rare):
        d = feature_data(s, sae, f, TEXTS, top=6, before=3, after=2)
        col = ref["Z"][:, f]
        order = [r for r in torch.argsort(col, descending=True, stable=True)[:6].tolist() if col[r] > 0]
        assert [c.row for c in d.contexts] == order
        for c in d.contexts:
            p = int(np.searchsorted(starts, c.row, side="right") - 1)
            lo, hi = max(starts[p], c.row - 3), min(starts[p + 1], c.row + 3)
            assert (c.prompt, c.position, c.at) == (p, c.row - starts[p], c.row - lo)
            assert c.token_ids == torch.cat(ref["ids"])[lo:hi].tolist()
            assert c.tokens == s.to_str_tokens(torch.tensor([c.token_ids]))[0]
            np.testing.assert_allclose(c.values, col[lo:hi].numpy(), rtol=1e-5, atol=1e-5)
            assert c.value == pytest.approx(float(col[c.row]), rel=1e-5)
        shown[f] = d
        # the encoded corpus reused (what a switch in the panel does) gives the same data
        again = feature_data(s, sae, f, corpus, top=6, before=3, after=2)
        assert [c.row for c in again.contexts] == order
    # a neighbouring feature: another top list, other values
    a, b = shown[often], feature_data(s, sae, often + 1, corpus, top=6, before=3, after=2)
    assert [c.row for c in a.contexts] != [c.row for c in b.contexts] or not np.allclose(
        a.contexts[0].values, b.contexts[0].values
    )
    assert_clean(s._lm)


def test_density_and_histogram_are_a_hand_count(s, sae, ref, corpus):
    for f in _features(ref):
        d = feature_data(s, sae, f, corpus, bins=10)
        vals = ref["Z"][:, f].tolist()
        fired = [v for v in vals if v > 0]
        assert (d.n_tokens, d.n_fired) == (len(vals), len(fired))
        assert d.density == len(fired) / len(vals)
        assert d.max_activation == pytest.approx(max(fired), rel=1e-5)
        assert d.mean_activation == pytest.approx(sum(fired) / len(fired), rel=1e-4)
        e = d.hist_edges.tolist()
        assert e[0] == 0 and e[-1] == pytest.approx(max(fired), rel=1e-5) and len(d.hist_counts) == 10
        by_hand = [sum(1 for v in fired if e[i] <= v < e[i + 1] or (i == 9 and v == e[10])) for i in range(10)]
        # a value within rounding of an inner edge may fall either side: the totals and all other bins agree
        assert sum(d.hist_counts) == len(fired) and np.abs(np.array(by_hand) - d.hist_counts).sum() <= 2
    silent = int(((ref["Z"] > 0).sum(0) == 0).nonzero()[0])  # a feature that never fires on this corpus
    quiet = feature_data(s, sae, silent, corpus)
    assert (quiet.contexts, quiet.n_fired, quiet.density, int(quiet.hist_counts.sum())) == ([], 0, 0.0, 0)
    assert "never fires" in quiet.notes[0] and len(quiet.promoted_ids) == 10
    often = _features(ref)[0]
    a, b = feature_data(s, sae, often, corpus), feature_data(s, sae, often + 1, corpus)  # a neighbour differs
    assert a.n_fired != b.n_fired or not np.array_equal(a.hist_counts, b.hist_counts)


def test_promoted_and_suppressed_tokens_are_computed_from_the_weights(s, sae, corpus):
    hf = s.model
    gain, eps = hf.model.norm.weight.detach().float(), hf.config.rms_norm_eps
    W_U = hf.lm_head.weight.detach().float()  # [vocab, d] (tied to the embedding on the demo model)
    for f in (3, 4):
        v = sae.W_dec[f].float()
        logits = (v / torch.sqrt(v.pow(2).mean() + eps) * gain) @ W_U.T  # RMSNorm on the direction alone
        d = feature_data(s, sae, f, corpus, logits=8)
        pv, pi = logits.topk(8)
        sv, si = (-logits).topk(8)
        assert d.promoted_ids.tolist() == pi.tolist() and d.suppressed_ids.tolist() == si.tolist()
        np.testing.assert_allclose(d.promoted_values, pv.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(d.suppressed_values, -sv.numpy(), rtol=1e-4, atol=1e-4)
        assert d.promoted_tokens == s.to_str_tokens(pi[None])[0]
        assert "final norm" in d.logit_note
    assert (
        feature_data(s, sae, 3, corpus).promoted_ids.tolist() != feature_data(s, sae, 4, corpus).promoted_ids.tolist()
    )


def test_a_harvest_gives_the_data_a_list_of_texts_gives(s, sae, ref):
    h = Harvest(ref["xs"], ref["ids"])
    assert isinstance(h, ActivationCorpus)
    f = _features(ref)[1]
    a, b = feature_data(s, sae, f, h, top=5), feature_data(s, sae, f, TEXTS, top=5)
    assert [(c.row, c.tokens) for c in a.contexts] == [(c.row, c.tokens) for c in b.contexts]
    assert (a.n_fired, a.n_tokens) == (b.n_fired, b.n_tokens)
    np.testing.assert_allclose(a.contexts[0].values, b.contexts[0].values, rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"no activations at resid_post\.1.*holds resid_post\.2"):
        feature_data(s, sae, f, Harvest(ref["xs"], ref["ids"], "resid_post.2"))
    narrow = Harvest([x[:, :64] for x in ref["xs"]], ref["ids"])
    with pytest.raises(InputError, match=r"shape \[\d+, 64\]; the SAE reads \[rows, 128\]"):
        feature_data(s, sae, f, narrow)


def test_a_real_harvest_on_disk_gives_the_data_a_list_of_texts_gives(s, sae, ref, tmp_path):
    """ie_lab.Activations (a harvest, memory-mapped: acts[address] is a lazy Rows, not a tensor) as the corpus."""
    acts = s.harvest(TEXTS, [sae.address], str(tmp_path / "h"), batch_size=3, shard_rows=16, progress=False)
    assert isinstance(acts, ActivationCorpus) and not isinstance(acts[str(sae.address)], torch.Tensor)
    often, rare = _features(ref)
    for f in (often, rare):
        a, b = feature_data(s, sae, f, acts, top=5), feature_data(s, sae, f, TEXTS, top=5)
        assert [(c.prompt, c.position, c.token_ids) for c in a.contexts] == [
            (c.prompt, c.position, c.token_ids) for c in b.contexts
        ]
        assert (a.n_fired, a.n_tokens) == (b.n_fired, b.n_tokens)
        np.testing.assert_allclose(a.contexts[0].values, b.contexts[0].values, rtol=1e-4, atol=1e-5)
    other = feature_data(s, sae, rare, acts, top=5)
    assert [c.row for c in other.contexts] != [c.row for c in feature_data(s, sae, often, acts, top=5).contexts]


def test_a_harvest_that_kept_the_saes_features_is_read_not_encoded_again(s, sae, ref, tmp_path, monkeypatch):
    """harvest(..., sae=sae) stores every row's features: encode_corpus reads them (sae.encode is never called) and
    gives the dashboard encoding gives; a changed SAE (another b_enc, another hash) is encoded, not read."""
    kept = s.harvest(TEXTS, [sae.address], str(tmp_path / "k"), sae=sae, batch_size=3, shard_rows=16, progress=False)
    plain = s.harvest(TEXTS, [sae.address], str(tmp_path / "p"), batch_size=3, shard_rows=16, progress=False)
    want = encode_corpus(s, sae, plain)
    calls = []
    monkeypatch.setattr(sae, "encode", lambda x: calls.append(x) or pytest.fail("encoded a stored harvest"))
    got = encode_corpus(s, sae, kept)
    assert calls == []
    assert torch.equal(got.ptr, want.ptr) and torch.equal(got.rows, want.rows) and got.spans == want.spans
    torch.testing.assert_close(got.vals, want.vals, rtol=1e-5, atol=1e-6)
    for f in _features(ref):
        a, b = feature_data(s, sae, f, got, top=5), feature_data(s, sae, f, want, top=5)
        assert [(c.row, c.token_ids) for c in a.contexts] == [(c.row, c.token_ids) for c in b.contexts]
        np.testing.assert_array_equal(a.hist_counts, b.hist_counts)
    monkeypatch.undo()
    other = dataclasses.replace(sae, b_enc=sae.b_enc + 0.05)
    read = []
    monkeypatch.setattr(type(kept), "features", lambda self, rows: read.append(rows) or pytest.fail("read"))
    mine = encode_corpus(s, other, kept)
    assert read == [] and not torch.equal(mine.vals, want.vals)


def test_steering_is_the_sessions_generation_with_and_without_the_decoder_direction(s, sae, corpus):
    d = feature_data(s, sae, 7, corpus, prompt=PROMPT, scale=12.0, max_new_tokens=6)
    st = d.steering
    assert st.scale == 12.0 and st.prompt == PROMPT
    assert st.baseline == s.generate(PROMPT, 6).text
    assert st.steered == s.generate(PROMPT, 6, steer=s.steer("resid_post.1", sae.W_dec[7], scale=12.0)).text
    assert st.steered != st.baseline
    default = feature_data(s, sae, 7, corpus, prompt=PROMPT, max_new_tokens=1)
    assert default.steering.scale == pytest.approx(4 * default.max_activation)
    assert_clean(s._lm)


class ElsewhereSession:
    """A session whose model is not in this process (vLLM, a remote server): s.run is refused there."""

    def __init__(self, s):
        self.inner = s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, fn):
        raise CapabilityUnsupported("run", "the model is in another process.", "use an eager Session.")


def test_where_the_weights_are_elsewhere_the_data_says_why_it_has_no_logits(s, sae, corpus):
    d = feature_data(ElsewhereSession(s), sae, 3, corpus)
    assert d.promoted_tokens == [] and d.suppressed_ids.size == 0 and "not in this process" in d.logit_note
    assert [c.row for c in d.contexts] == [c.row for c in feature_data(s, sae, 3, corpus).contexts]
    assert json.loads(json.dumps(as_plain(d)))["promoted"] == []


def test_bad_input_is_refused_naming_the_fix(s, sae, corpus):
    for bad, match in (
        ({"feature": 512}, "from 0 to 511"),
        ({"feature": -1}, "from 0 to 511"),
        ({"feature": True}, "from 0 to 511"),
        ({"top": 0}, "top=0"),
        ({"bins": 10_000}, "bins="),
        ({"prompt": 3}, "prompt="),
    ):
        kw = {"feature": 1} | bad
        with pytest.raises(InputError, match=match):
            feature_data(s, sae, kw.pop("feature"), corpus, **kw)
    with pytest.raises(InputError, match="wrap it in a list"):
        feature_data(s, sae, 1, "one text")
    with pytest.raises(InputError, match="list of texts"):
        feature_data(s, sae, 1, 42)
    with pytest.raises(InputError, match="needs an SAE"):
        s.feature_dashboard("not an sae", 1, TEXTS)
    assert_clean(s._lm)


def _f32(b):
    return np.frombuffer(b, dtype="<f4")


def _i32(b):
    return np.frombuffer(b, dtype="<i4")


def _select(panel, feature):
    panel._handle_msg({"content": {"data": {"method": "custom", "content": {"cmd": "select", "feature": feature}}}})


def test_the_panel_shows_the_data_and_switches_feature_from_the_front_end(s, sae, ref):
    often, rare = _features(ref)
    db = s.feature_dashboard(sae, often, TEXTS, prompt=PROMPT, top=4, max_new_tokens=3, listed=8)
    assert isinstance(db, FeatureDashboard) and isinstance(db.data, FeatureData)

    def check(f):
        d = feature_data(s, sae, f, TEXTS, top=4, prompt=PROMPT, max_new_tokens=3)
        assert db.feature == f and db.error == ""
        assert _i32(db.ctx_len).tolist() == [len(c.tokens) for c in d.contexts]
        assert db.ctx_tokens == [t for c in d.contexts for t in c.tokens]
        np.testing.assert_allclose(_f32(db.ctx_values), np.concatenate([c.values for c in d.contexts]), atol=1e-6)
        assert _i32(db.ctx_meta).reshape(-1, 3).tolist() == [[c.prompt, c.position, c.at] for c in d.contexts]
        assert _i32(db.hist_counts).tolist() == d.hist_counts.tolist() and db.density == d.density
        assert db.logit_tokens == d.promoted_tokens + d.suppressed_tokens and db.n_promoted == len(d.promoted_tokens)
        assert (db.baseline, db.steered) == (d.steering.baseline, d.steering.steered)

    check(often)
    # the list: the corpus's features with the largest activation, with their densities
    Z = ref["Z"]
    ids = _i32(db.list_ids).tolist()
    assert ids == Z.amax(0).topk(8).indices.tolist()
    np.testing.assert_allclose(_f32(db.list_density), ((Z[:, ids] > 0).sum(0) / Z.shape[0]).numpy(), rtol=1e-6)
    before = db.ctx_values
    _select(db, rare)  # what a click in the list (or the number box) sends
    check(rare)
    assert db.ctx_values != before
    _select(db, 512)
    assert db.feature == rare and "features run from 0 to 511" in db.error
    _select(db, "3")
    assert db.feature == rare and "select.feature" in db.rejected[-1]
    silent = int(((Z > 0).sum(0) == 0).nonzero()[0])
    db.show(silent)
    assert (db.feature, db.ctx_tokens, _i32(db.ctx_len).size) == (silent, [], 0) and "never fires" in db.notes
    db.show(often)
    check(often)
    assert re.fullmatch(
        r"FeatureDashboard\(feature \d+ of 512 features at resid_post\.1: fires on \d+ of \d+ "
        r"tokens; 4 contexts\)",
        repr(db),
    )
    assert_clean(s._lm)


def test_the_static_export_embeds_every_feature_and_fetches_nothing(s, sae, corpus, tmp_path):
    feats = [3, 4, 7]
    path = ie_lab.export_dashboards(
        s, sae, feats, TEXTS, tmp_path / "dash.html", top=3, prompt=PROMPT, max_new_tokens=2
    )
    text = open(path, encoding="utf-8").read()
    blob = re.search(r'<script type="application/json" id="iel-dashboards">(.*?)</script>', text, re.S).group(1)
    data = json.loads(blob)
    assert [d["feature"] for d in data["features"]] == feats
    for f, got in zip(feats, data["features"], strict=True):
        want = as_plain(feature_data(s, sae, f, corpus, top=3, prompt=PROMPT, max_new_tokens=2))
        assert got == json.loads(json.dumps(want))
    # self-contained: no external script, style, font or image; one inline module script
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)=", text)
    assert "@import" not in text and not re.search(r"url\((?!#)", text)
    assert text.count("<script") == 2 and "default-src 'none'" in text
    # from computed data, without a session
    d = [feature_data(s, sae, f, corpus, top=2) for f in (3, 4)]
    p2 = ie_lab.export_dashboards(d, path=tmp_path / "two.html", title="two <features>")
    assert "<title>two &lt;features&gt;</title>" in open(p2, encoding="utf-8").read()
    with pytest.raises(InputError, match="path="):
        ie_lab.export_dashboards(d)
