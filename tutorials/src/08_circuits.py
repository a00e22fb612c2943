# %% [markdown]
# # Tutorial 8 — Circuits: attribution graphs and interventions
#
# Why does the demo model continue *"Mary felt sad and"* the way it does? We build the prompt's **attribution
# graph** through the demo model's transcoders (one per layer, each standing in for its layer's MLP), prune it to
# what matters, label its strongest features from a few texts of the model's own kind, and then **intervene**:
# switch the features the graph says drive the answer off, and watch the prediction move.
#
# Background: docs/CIRCUITS.md (transcoders, the graph, pruning, interventions).

# %%
import torch
import ie_lab
from ie_lab.widgets import encode_corpus, feature_data

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
tcs = ie_lab.load_transcoders(ie_lab.DEMO_TRANSCODERS, s)
print(tcs)
prompt = "One Monday , Mary went to the park . Mary felt sad and"

# %% [markdown]
# ## What the model says
# The demo model was trained on mood stories: after *"felt sad and"* it expects another sad word. The next-token
# distribution, its five most probable tokens:

# %%
base = s.generate(prompt, 8)
probs = base.steps[0].logits.float().softmax(-1)
top = probs.topk(5)
for p, i in zip(top.values.tolist(), top.indices.tolist()):
    print(f"{s.tokenizer.decode([i])!r:15} {p:.3f}")
print("greedy continuation:", repr(base.text))

# %% [markdown]
# The probability of the whole group of sad adjectives (and of the happy ones) is a steadier measure than any one
# token, so we track it from here on.

# %%
SAD = "sad unhappy gloomy miserable lonely upset heartbroken hopeless sorry weary tearful".split()
HAPPY = "happy joyful glad cheerful delighted excited proud thrilled merry".split()
vocab = s.tokenizer.get_vocab()


def mass(p, words):
    return float(p[[vocab[w] for w in words if w in vocab]].sum())


# %%
# NBVAL_CHECK_OUTPUT
print(f"sad words: {mass(probs, SAD):.2f}   happy words: {mass(probs, HAPPY):.2f}")

# %% [markdown]
# ## The attribution graph
# `ie_lab.attribution_graph` replaces each MLP by its transcoder plus an error node, freezes attention patterns and
# norm scales at this prompt, and measures every direct linear edge between the nodes: embeddings, transcoder
# features (at each layer and position), errors, biases and the top logits. Every feature's and logit's incoming
# edges sum to its value (the graph records how closely: below 1e-3 here). `max_features=256` keeps the 256 features
# with the largest writes (the others' writes join their layer's error node): the prompt has 645 active features,
# and the edges then take three backward batches instead of six (far fewer features would fold ones that matter
# into the error nodes).

# %%
g = ie_lab.attribution_graph(s, prompt, tcs, batch_size=128, max_features=256)
print(g)
print("complete:", g.info["completeness_max_relative_error"] < 1e-3)
for n in g.of_kind("logit")[:5]:
    print(f"{n.token!r:15} p={n.probability:.3f}  demeaned logit {n.value:+.2f}")

# %% [markdown]
# ## Pruning
# Most of the graph carries little influence on the logits. `prune` keeps the features that carry 80 % of it and the
# edges that carry 98 %; each feature's **influence** is its logit-weighted share over every path into the logits.

# %%
small = g.prune(node_threshold=0.8, edge_threshold=0.98)
print(small)
infl = small.influence()
strongest = sorted(
    ((float(infl[i]), n) for i, n in enumerate(small.nodes) if n.kind == "feature"), key=lambda x: -x[0]
)[:6]
for v, n in strongest:
    print(f"influence {v:.3f}  {n}  at {n.token!r}")

# %% [markdown]
# The strongest features sit at the last position (`and`), in every layer. What writes most directly into the top
# logit? Its incoming edges, largest first:

# %%
top_logit = g.of_kind("logit")[0]
into = g.edges_into(top_logit)
for n, w in sorted(into.items(), key=lambda kv: -abs(kv[1]))[:6]:
    print(f"{w:+6.2f}  {n}")

# %% [markdown]
# ## What are these features?
# A feature's label comes from where it fires. We encode a few stories of the model's own kind (sad ones, happy
# ones, one of another kind) with each layer's transcoder and read the feature's top contexts and the tokens its
# decoder direction promotes (`feature_data`, the data of a feature dashboard: docs/SAE.md "Feature dashboards").

# %%
corpus = [
    "One Monday , Otto went to the garage . Otto cried and sobbed . Otto felt lonely and gloomy .",
    "One Sunday , Jade went to the kitchen . Jade clapped . Jade felt happy and proud . Jade danced and sang .",
    "One Friday , Ray went to the store . Ray felt miserable and upset . Ray sighed .",
    "One Tuesday , Lucy went to the beach . Lucy laughed and giggled . Lucy felt cheerful and glad .",
    "One Saturday , Tom went to the library . Tom felt heartbroken and hopeless . Tom wept .",
    "One Thursday , Anna went to the garden . Anna felt joyful and excited . Anna smiled .",
    "When Mary and John went to the store , John gave a drink to Mary .",
]
encoded = {L: encode_corpus(s, tcs[L], corpus) for L in tcs.layers}
for _, n in strongest[:3]:
    d = feature_data(s, tcs[n.layer], n.index, encoded[n.layer], top=3, before=5, after=1)
    print(f"layer {n.layer} feature {n.index}: fires on {round(d.density * 100)} % of the corpus's tokens")
    for c in d.contexts:
        print(f"   {c.value:5.1f}  " + " ".join(f"[{t}]" if i == c.at else t for i, t in enumerate(c.tokens)))
    print("   promotes:", d.promoted_tokens[:6])

# %% [markdown]
# All three fire on `felt`, the token before a story's mood word (the bracketed token; the word after it is the
# mood word), in sad and happy stories alike, and on `and` in our prompt: "a mood word comes next" features.
# The strongest one's decoder direction promotes sad adjectives, so it writes "say a sad word" into the residual;
# the graph gives it by far the largest edge into the top logit. Does it drive the answer?

# %% [markdown]
# ## The graph panel
# The same graph, drawn: tokens along the bottom, layers upward, logits on top. Hover a node for its edges, click a
# feature for its dashboard over the corpus above, shift-click several and group them into a supernode, change the
# thresholds and re-prune (docs/CIRCUITS.md, "The graph panel").

# %%
panel = s.graph_panel(g, transcoders=tcs, corpus=corpus)
panel

# %% [markdown]
# ## Intervening on the graph's features
# `intervene={node: value}` on `generate`, `capture` or `generate_stream` clamps a transcoder feature: the
# transcoder is spliced in with its error term kept, so everything not intervened on is exactly the plain run, and
# the feature is set to `value` (0 ablates it) before decoding. A graph node is clamped at its own position of the
# prompt only (the generated tokens see the change through attention, but the feature is not clamped at their
# positions; a `(layer, feature)` pair clamps every position). First the strongest feature alone, then every strong
# feature at the last position.

# %%
f = strongest[0][1]
one = s.generate(prompt, 8, intervene={f: 0.0})
drivers = {n: 0.0 for _, n in strongest if n.position == f.position}
many = s.generate(prompt, 8, intervene=drivers)
for name, r in (("plain", base), (f"ablate {f}", one), (f"ablate {len(drivers)} features", many)):
    p = r.steps[0].logits.float().softmax(-1)
    print(f"{name:45} sad {mass(p, SAD):.2f}  happy {mass(p, HAPPY):.3f}  -> {r.text!r}")

# %%
# NBVAL_CHECK_OUTPUT
p_one = one.steps[0].logits.float().softmax(-1)
p_many = many.steps[0].logits.float().softmax(-1)
print("ablating the strongest feature lowers the sad words' probability:", mass(p_one, SAD) < mass(probs, SAD) - 0.3)
print("ablating the drivers all but removes them:", mass(p_many, SAD) < 0.05)

# %% [markdown]
# Without its strongest driver the model still picks a sad word, with far less confidence; with every driver off,
# sad adjectives all but vanish and it reaches for a sad verb instead: the mood itself is carried elsewhere too
# (the error nodes and the earlier positions hold what the transcoders miss).
#
# The graph's edge into the top logit predicted the single ablation's effect, to first order: with the final norm's
# scale frozen, removing the feature's write changes the demeaned logit by minus its edge.

# %%
def demeaned(r, token):
    lg = r.steps[0].logits.float()
    return float(lg[token] - lg.mean())


effect = demeaned(one, top_logit.index) - demeaned(base, top_logit.index)
print(f"edge {into[f]:+.2f}   ablation's effect {effect:+.2f}")

# %% [markdown]
# **Exercise.** Clamp the strongest feature *up* (twice its activation) instead of off. What happens to the sad
# words' probability?

# %%
# Your code here

# %% [markdown]
# **Solution.** Hidden until you want it: click the `⋯` below (or the bar to its left) to show the code
# and its output.

# %% [solution]
up = s.generate(prompt, 8, intervene={f: 2 * f.activation})
print(f"sad {mass(up.steps[0].logits.float().softmax(-1), SAD):.2f} -> {up.text!r}")
s.close()
