"""The demo model is vivid at the defaults the notebooks use (issue 19), read from the notebooks' own sources.

Notebook 05's steering panel (its stories, address and coefficient) turns held-out sad openings happy without the
text falling apart, and the quickstart's first generation is a story, not a loop ("Mary felt sad and sad").
A retrained demo model, or a notebook edited to other defaults, has to keep both.
"""

import ast
import random
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import train_demo_model as tdm  # noqa: E402

HAPPY, SAD = set(tdm.HAPPY_WORDS), set(tdm.SAD_WORDS)


def _source(name):
    return ast.parse((REPO / "notebooks" / "src" / name).read_text())


def _first_call(tree, method):
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == method]
    return min(calls, key=lambda n: (n.lineno, n.col_offset))


def _lists(tree, *names):
    found = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id in names:
                    found[t.id] = ast.literal_eval(n.value)
    return [found[k] for k in names]


def _moods(text):
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w in HAPPY for w in words), sum(w in SAD for w in words)


def _falls_apart(text):
    """A word three times running ("day day day") or a special token other than the end of text."""
    w = text.split()
    return any(x.startswith("<|") and x != "<|eos|>" for x in w) or any(
        w[i] == w[i + 1] == w[i + 2] for i in range(len(w) - 2)
    )


def _loops(text):
    """Degenerate as a story: a word paired with itself ("sad and sad") or a whole sentence said twice."""
    if re.search(r"\b(\w+) and \1\b", text):
        return True
    sentences = [x.strip() for x in text.split(".")][:-1]  # the last piece may be cut off mid-sentence
    return len(set(sentences)) < len(sentences)


@pytest.fixture(scope="module")
def session():
    import ie_lab

    torch.set_num_threads(1)
    s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
    yield s
    s.close()


def _held_out_sad_openings(n=40, seed=19):
    """Openings the notebooks never show: held-out names, every kind of sad sentence the corpus has."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name = rng.choice(tdm.HELDOUT_NAMES)
        opening = f"One {rng.choice(tdm.DAYS)} , {name} went to the {rng.choice(tdm.PLACES)} . "
        out.append(opening + tdm.mood_sentence(rng, "sad", name, rng.choice(tdm.NAMES)))
    return out


def test_notebook_05s_panel_turns_sad_openings_happy_without_the_text_falling_apart(session):
    tree = _source("05_steering_panel.py")
    happy, sad = _lists(tree, "happy", "sad")
    call = _first_call(tree, "steering_panel")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg not in ("positive", "negative")}
    address, scale, n_new = kw["address"], kw["scale"], kw["max_new_tokens"]
    vector = session.mean_difference(happy, sad, address)
    spec = session.steer(address, vector, scale=scale)
    sad_before = flipped = broken = 0
    openings = _held_out_sad_openings()
    for o in openings:
        b = session.generate(o, n_new).text
        t = session.generate(o, n_new, steer=spec).text
        bh, bs = _moods(b)
        h, sd = _moods(t)
        sad_before += bs > 0 and bh == 0
        flipped += h > 0 and sd == 0
        broken += _falls_apart(t)
    n = len(openings)
    # measured on the shipped model: 40/40 sad, 40/40 turned, 0 broken (layer 1 or 2 at 8: 6 and 8 broken;
    # coefficient 4: 10 turned; 12: 39 broken)
    assert sad_before >= 0.9 * n, (sad_before, n)
    assert flipped >= 0.9 * n, f"{address} x {scale} turned {flipped} of {n} sad openings happy"
    assert broken <= 0.05 * n, f"{address} x {scale}: {broken} of {n} continuations fell apart"


def test_quickstarts_first_generation_is_a_story_not_a_loop(session):
    call = _first_call(_source("01_quickstart.py"), "generate")
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    text = session.generate(*args, **kwargs).text
    assert not _loops(text), text
    assert not _falls_apart(text), text
    assert len(re.findall(r"[A-Za-z]+", text)) >= 12, text  # a few sentences, not a word or two


def test_the_steering_panels_own_defaults_turn_sad_openings_happy(session):
    """A panel given only the two prompt lists (no address, no coefficient) visibly steers: its greedy
    continuation changes and turns happy, and so do held-out sad openings at its address and coefficient."""
    happy, sad = _lists(_source("05_steering_panel.py"), "happy", "sad")
    story = "One Monday , Fiona went to the farm . Fiona cried and sobbed ."
    sp = session.steering_panel(story, positive=happy, negative=sad, max_new_tokens=24)
    try:
        assert sp.steered_ids != sp.baseline_ids, (sp.address, sp.scale, sp.steered_text)
        assert _moods(sp.baseline_text)[0] == 0, sp.baseline_text  # the story is sad to begin with
        h, sd = _moods(sp.steered_text)
        assert h > 0 and sd == 0, f"{sp.address} x {sp.scale}: {sp.steered_text!r}"
        assert not _falls_apart(sp.steered_text), sp.steered_text
        spec = session.steer(sp.address, sp.vector, scale=sp.scale)
    finally:
        sp.close()
    openings = _held_out_sad_openings()
    flipped = broken = changed = 0
    for o in openings:
        b = session.generate(o, 24)
        t = session.generate(o, 24, steer=spec)
        h, sd = _moods(t.text)
        changed += t.ids != b.ids
        flipped += h > 0 and sd == 0
        broken += _falls_apart(t.text)
    n = len(openings)
    # measured on the shipped model at resid_post.0 x 8: 40/40 turned, 0 broken (the old resid_post.2 x 4: 0 turned)
    assert changed == n
    assert flipped >= 0.9 * n, f"{sp.address} x {sp.scale} turned {flipped} of {n} sad openings happy"
    assert broken <= 0.05 * n, f"{sp.address} x {sp.scale}: {broken} of {n} continuations fell apart"
