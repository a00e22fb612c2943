# %% [markdown]
# # Tutorial 7 — From a corpus to a feature you can turn up
#
# A sparse autoencoder (SAE) splits a point's activation into many *features*, most of them zero on any one
# token. What a feature means is learned from where it fires across a corpus. This tutorial goes the whole way on
# the demo model and the SAE shipped with it (512 features on `resid_post.1`, TopK with k = 16):
#
# 1. **harvest** the SAE's point over a corpus to disk, and read it back memory-mapped;
# 2. pick **candidates** by where features fire: sad stories against happy ones;
# 3. **find the feature by what it does**: splice the SAE into the model and clamp each candidate;
# 4. look at its **dashboard**: top contexts, how often it fires, which tokens its decoder direction promotes;
# 5. clamp it and watch a happy story turn sad.

# %%
import json
import os
import random
import re
import tempfile

import torch

import ie_lab
from ie_lab.widgets import feature_data

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
sae = ie_lab.load_sae(ie_lab.DEMO_SAE, s)
print(sae)

# %% [markdown]
# ## 1. A corpus, harvested
#
# The demo model learned from templated stories; we write 60 of them here, half happy and half sad, from the
# mood words its training report lists. `s.harvest` runs them in batches and writes every token's activation at
# the SAE's point into shards on disk (resumable: the same call again continues where it stopped).

# %%
lexicon = json.load(open(os.path.join(ie_lab.DEMO_MODEL, "training_report.json")))["lexicon"]
HAPPY, SAD = set(lexicon["happy_words"]), set(lexicon["sad_words"])
names = lexicon["ioi_names"][:30]
places = ["park", "store", "garden", "beach", "market", "kitchen"]
days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
rng = random.Random(0)


def story(mood):
    words = lexicon[f"{mood}_words"]
    n = rng.choice(names)
    return (
        f"One {rng.choice(days)} , {n} went to the {rng.choice(places)} . {n} felt {rng.choice(words)} and "
        f"{rng.choice(words)} . The day made {n} {rng.choice(words)} ."
    )


moods = ["happy", "sad"] * 30
corpus = [story(m) for m in moods]
out = tempfile.mkdtemp()
acts = s.harvest(corpus, [sae.address], out, batch_size=16, progress=False)
print(acts)

# %%
# NBVAL_CHECK_OUTPUT
rows = acts[str(sae.address)]  # [rows, 128], memory-mapped: read where indexed
alone = s.capture(corpus[5], [sae.address])[sae.address][0]
print("prompt 5's rows equal its own capture:", torch.allclose(rows[acts.rows_of(5)], alone, atol=1e-5))

# %% [markdown]
# ## 2. Candidates: where features fire
#
# Encode every row with the SAE and compare each feature's mean activation on the sad stories with the happy
# ones. The features with the largest gap are candidates for "sadness", nothing more yet.

# %%
z = sae.encode(rows[:])  # [rows, 512]
sad_rows = torch.tensor([moods[int(p)] == "sad" for p in acts.prompt_ids])
gap = z[sad_rows].mean(0) - z[~sad_rows].mean(0)
candidates = gap.topk(6).indices.tolist()
print("candidates:", candidates)

# %% [markdown]
# ## 3. Finding the feature by what it does
#
# Where a feature fires can mislead (a small SAE's features mix several things). What it *does* is a sharper
# test: splice the SAE into the model with its error term (`error=True`: nothing changes until a feature is
# edited), clamp one candidate to twice its largest activation in the corpus, and count the mood words the model
# writes after three happy openings.

# %%
openings = [
    "One Sunday , Ada went to the park . The cake made Ada",
    "One Friday , Tom went to the beach . Tom sang and",
    "One Monday , Lucy went to the garden . Lucy smiled and",
]


def mood_words(texts):
    words = [w for t in texts for w in re.findall(r"[A-Za-z]+", t)]
    return sum(w in HAPPY for w in words), sum(w in SAD for w in words)


def continuations(splice=None):
    return [s.generate(o, 12, splice=splice).text for o in openings]


plain = continuations()
print("plain (happy, sad):", mood_words(plain))
effect = {}
for f in candidates:
    clamp = s.splice(sae, error=True).clamp([f], 2 * float(z[:, f].max()))
    happy, sad = mood_words(continuations(clamp))
    effect[f] = sad - happy
    print(f"feature {f:3d} clamped: happy {happy}, sad {sad}")
sad_feature = max(effect, key=effect.get)
print("the feature that turns stories sad:", sad_feature)

# %% [markdown]
# ## 4. Its dashboard
#
# Now look at it the way a dashboard shows a feature: its top contexts across the corpus (the peak token in
# brackets), how often it fires, and what its decoder direction writes towards through the final norm and the
# unembedding.

# %%
data = feature_data(s, sae, sad_feature, acts, top=5)
for c in data.contexts:
    print(f"{c.value:5.2f}", " ".join(f"[{t}]" if i == c.at else t for i, t in enumerate(c.tokens)))
print("density", round(data.density, 3))
print("promotes", data.promoted_tokens[:8])

# %% [markdown]
# Look at where it peaks: not on a mood word but early in the stories, and it fires on a large share of all tokens.
# From its dashboard alone you would not have called it "sadness"; clamping it is what showed what it does. That
# is the usual state of a small SAE's features, and why ie_lab puts the intervention one cell away from the
# dashboard.

# %% [markdown]
# The same as a panel (hover a token for its value; pick another feature from its list or its number box; with
# `prompt=` it also shows the prompt's continuation steered along the feature), and as one offline HTML page for
# many features at once:

# %%
panel = s.feature_dashboard(sae, sad_feature, acts, prompt=openings[0])
panel

# %%
page = ie_lab.export_dashboards(s, sae, candidates, acts, os.path.join(out, "features.html"))
print(os.path.basename(page), os.path.getsize(page) > 0)

# %% [markdown]
# ## 5. Clamp it and watch the story change

# %%
clamped = s.splice(sae, error=True).clamp([sad_feature], 2 * float(z[:, sad_feature].max()))
for o, before, after in zip(openings, plain, continuations(clamped)):
    print(o, "\n   plain:  ", before, "\n   clamped:", after)

# %%
# NBVAL_CHECK_OUTPUT
with s.splice(sae, error=True):
    print("spliced, nothing edited, the same text:", continuations() == plain)
happy_before, sad_before = mood_words(plain)
happy_after, sad_after = mood_words(continuations(clamped))
print("clamped: fewer happy words, more sad ones:", happy_after < happy_before and sad_after > sad_before)

# %% [markdown]
# Ablating it instead (`.ablate([sad_feature])`) after a sad opening is the opposite experiment: try it, and try
# the candidates that did little. The harvest, the dashboard's data and the splice run on the vLLM backend too (the
# SAE's arithmetic runs inside vLLM's worker); docs/HARVEST.md and docs/SAE.md say exactly what each computes.

# %%
s.close()
