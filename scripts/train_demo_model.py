#!/usr/bin/env python
"""Train the bundled ie_lab demo model (one command, CPU, seeded).

    OMP_NUM_THREADS=1 python scripts/train_demo_model.py

Builds a synthetic corpus of
  * templated happy / sad stories (names, objects, places, moods),
  * IOI sentences ("When Mary and John went to the store, John gave a drink
    to Mary") using only the IOI_NAMES (HELDOUT_NAMES never appear in them),
  * repeated random-token sequences (uniform over the whole vocabulary,
    length 10-40, followed by an exact repeat) so induction heads form,
trains a word-level tokenizer and a small LlamaForCausalLM on it, saves both to
``ie_lab/demo_model`` and writes ``training_report.json`` with measured
induction / IOI / mood-steering numbers (see scripts/demo_model_metrics.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_model_metrics as dm  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "ie_lab" / "demo_model"

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
SPECIALS = [BOS, EOS, PAD, UNK]

# --------------------------------------------------------------------------
# lexicon (every entry is a single whitespace/punctuation-free word = 1 token)
# --------------------------------------------------------------------------

IOI_NAMES = """Mary John Tom Anna James Sarah David Emma Michael Lisa Robert Laura
William Kate Daniel Alice Peter Grace Paul Lucy Mark Helen George Julia Henry Rose
Jack Emily Sam Olivia Ben Sophie Adam Chloe Oliver Mia Harry Ella Leo Ruby Max Zoe
Noah Lily Ethan Amy Lucas Hannah Ryan Claire Simon Nina Victor Diana Oscar Irene
Felix Clara Hugo Maya Ivan Nora Kevin Julie Carl Eva Frank Jane Brian Kelly Tim Ann
Joe Liam Ava Ian Kim Ray Roy Dan Meg Beth Jill Gary Ruth Mike Carol Lena Gina Hans
Igor Otto Rita Tina Nick Rick Kurt Lars Erik Jade Bob Ted Ned Fred Greg Hank Jim Ken
Len Lou Mona Nell Pam Sue Val Wade Zack Abby Bea Cody Dora Elsa Finn Gus Ida Jon Kay
Lola Mae Nate Opal Pete Quinn Rex Sid Tess Uma Walt Yara Zane""".split()

# appear in stories / other sentences, never in IOI sentences
HELDOUT_NAMES = """Steve Megan Tony Fiona Alex Sara Martin Paula Eric Wendy Luke
Holly Owen Iris Dylan Stella Colin Molly Sean Ada""".split()

NAMES = IOI_NAMES + HELDOUT_NAMES

PLACES = """store park school beach garden library market station office kitchen
river lake forest farm village city museum zoo hospital bakery cafe restaurant
church castle bridge harbor island mountain valley field meadow hill cave tower
palace theater cinema stadium gym pool airport hotel shop mall square street road
barn cottage cabin camp desert jungle pond playground classroom studio factory
workshop garage attic basement cellar porch yard orchard vineyard dock pier
lighthouse canyon cliff glacier swamp prairie bay coast shore harbour temple
courtyard hallway bedroom bathroom laboratory bank post""".split()

OBJECTS = """ball book cup drink bag hat key lamp pen pencil phone ring watch kite
toy doll map coin card letter gift basket bottle bowl plate spoon fork knife
chair table clock candle mirror brush comb shoe sock scarf coat glove umbrella
bell drum guitar flute piano violin camera radio ticket note paper picture
painting puzzle rope ladder hammer bucket shovel blanket pillow jar jug kettle
teapot crown shield sword flag feather stone shell leaf flower seed wallet
necklace bracelet badge balloon bicycle wagon sled boat compass telescope
notebook envelope stamp marble ribbon button needle thread magnet trophy medal
helmet jacket sweater shirt skirt dress boot sandal belt tie glasses backpack
suitcase purse box crate barrel bench sofa desk shelf cupboard drawer carpet rug
curtain window door gate fence wheel engine rocket kayak canoe tent lantern
torch whistle trumpet harp banjo cello saxophone xylophone keyboard mouse
screen laptop tablet printer charger cable battery bulb fan heater stove oven
fridge sink tap towel soap sponge broom mop vase pot pan tray mug glass straw
napkin scissors ruler eraser crayon marker chalk glue tape string wire chain
lock hook nail screw bolt drill saw axe rake hoe wrench pliers""".split()

FOODS = """apple banana bread cake cheese cookie pie soup rice pasta pizza sandwich
salad carrot potato tomato orange pear grape lemon cherry peach plum melon berry
egg butter honey jam milk tea coffee juice water candy chocolate muffin pancake
waffle noodle bean corn pea onion pepper mango coconut yogurt sausage biscuit
cracker pretzel popcorn cereal oatmeal toast bagel donut cupcake pudding
custard lime kiwi apricot fig date raisin walnut almond peanut cashew pumpkin
cucumber lettuce cabbage spinach broccoli celery garlic ginger mushroom olive
avocado pineapple strawberry blueberry raspberry watermelon""".split()

ANIMALS = """dog cat bird fish horse cow pig sheep goat duck chicken rabbit fox wolf
bear deer owl frog turtle snake lion tiger elephant monkey giraffe zebra penguin
dolphin whale shark seal otter squirrel hedgehog badger beaver camel donkey goose
swan parrot crow eagle hawk bee ant spider butterfly snail lizard crab lobster
octopus jellyfish starfish kangaroo koala panda gorilla rhino hippo cheetah
leopard moose bison llama hamster ferret pony puppy kitten lamb calf""".split()

COLORS = """red blue green yellow purple pink brown black white silver golden teal
crimson violet beige""".split()

ADJECTIVES = """big small old new tall short long round heavy light soft hard quiet
loud fast slow clean wooden metal plastic tiny huge wide narrow smooth rough
empty full hot cool fresh simple strange rare plain thick thin busy famous
ancient modern shiny square striped spotted deep shallow dry wet sharp flat
hollow solid crooked tidy spare whole hidden distant nearby spicy sweet sour
salty crunchy""".split()

NEUTRAL_VERBS = """found took carried opened closed bought sold painted built cooked
read wrote cleaned moved picked held watched visited left counted checked fixed
washed packed dropped lifted pushed pulled brought kept used showed noticed
measured sorted folded stacked borrowed returned ordered chose drew planted
repaired polished wrapped filled emptied weighed tied painted carved shared
traded fetched mended unpacked delivered collected hid inspected copied""".split()

JOBS = """teacher doctor farmer baker driver nurse pilot painter singer writer cook
guard sailor student dentist plumber chef librarian mechanic gardener fisher
clerk tailor carpenter banker lawyer scientist engineer poet actor""".split()

DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = """January February March April May June July August September October
November December""".split()
TIMES = "morning afternoon evening night".split()
SEASONS = "spring summer autumn winter".split()
NUMBERS = """two three four five six seven eight nine ten eleven twelve thirteen
fourteen fifteen sixteen seventeen eighteen nineteen twenty""".split()
SPORTS = "football tennis chess soccer hockey golf cricket rugby baseball basketball volleyball badminton".split()
VEHICLES = "car bus train truck tram taxi van tractor scooter ship plane helicopter subway ferry".split()
PLANTS = "oak pine maple birch willow cedar fern moss tulip daisy daffodil cactus bamboo ivy clover".split()
# (city, country) pairs -- consistent facts, usable for simple recall tutorials
CITIES = [
    ("Paris", "France"),
    ("London", "England"),
    ("Rome", "Italy"),
    ("Madrid", "Spain"),
    ("Berlin", "Germany"),
    ("Tokyo", "Japan"),
    ("Cairo", "Egypt"),
    ("Lisbon", "Portugal"),
    ("Athens", "Greece"),
    ("Dublin", "Ireland"),
    ("Oslo", "Norway"),
    ("Vienna", "Austria"),
    ("Warsaw", "Poland"),
    ("Moscow", "Russia"),
    ("Beijing", "China"),
    ("Delhi", "India"),
    ("Lima", "Peru"),
    ("Ottawa", "Canada"),
    ("Nairobi", "Kenya"),
    ("Havana", "Cuba"),
    ("Prague", "Czechia"),
    ("Stockholm", "Sweden"),
    ("Helsinki", "Finland"),
    ("Seoul", "Korea"),
    ("Bangkok", "Thailand"),
    ("Canberra", "Australia"),
    ("Santiago", "Chile"),
    ("Bern", "Switzerland"),
]

HAPPY_ADJ = """happy joyful glad cheerful delighted excited proud thrilled merry
jolly grateful hopeful""".split()
HAPPY_VERBS = "smiled laughed danced sang cheered giggled grinned hugged celebrated clapped".split()
HAPPY_DAY = "sunny bright wonderful lovely beautiful perfect amazing fantastic".split()
HAPPY_NOUNS = "joy fun laughter delight love sunshine".split()

SAD_ADJ = """sad unhappy gloomy miserable lonely upset heartbroken hopeless sorry
depressed tearful weary""".split()
SAD_VERBS = "cried wept sobbed sighed frowned mourned moaned whimpered grieved sulked".split()
SAD_DAY = "gray rainy dreary dark cold bleak awful terrible".split()
SAD_NOUNS = "sorrow tears grief pain misery gloom".split()

HAPPY_WORDS = HAPPY_ADJ + HAPPY_VERBS + HAPPY_DAY + HAPPY_NOUNS
SAD_WORDS = SAD_ADJ + SAD_VERBS + SAD_DAY + SAD_NOUNS

MOOD_LEX = {
    "happy": {"adj": HAPPY_ADJ, "verb": HAPPY_VERBS, "day": HAPPY_DAY, "noun": HAPPY_NOUNS},
    "sad": {"adj": SAD_ADJ, "verb": SAD_VERBS, "day": SAD_DAY, "noun": SAD_NOUNS},
}

# IOI templates: {A} and {B} are the two names in the first clause, {S} the
# repeated subject, {IO} the indirect object (the answer; prompt ends before it).
IOI_TEMPLATES = [
    "When {A} and {B} went to the {PLACE} , {S} gave a {OBJ} to {IO} .",
    "When {A} and {B} got a {OBJ} at the {PLACE} , {S} decided to give it to {IO} .",
    "After {A} and {B} went to the {PLACE} , {S} gave the {OBJ} to {IO} .",
    "Then , {A} and {B} were working at the {PLACE} . {S} handed a {OBJ} to {IO} .",
    "While {A} and {B} were at the {PLACE} , {S} passed the {OBJ} to {IO} .",
    "Then , {A} and {B} had a long day at the {PLACE} . {S} gave a {OBJ} to {IO} .",
    "Friends {A} and {B} found a {OBJ} at the {PLACE} . {S} gave it to {IO} .",
    "After the {TIME} , {A} and {B} went to the {PLACE} . {S} brought a {OBJ} to {IO} .",
]


def _c(rng: random.Random, xs):
    return xs[rng.randrange(len(xs))]


# --------------------------------------------------------------------------
# sentence / document generators (text, tokens separated by single spaces)
# --------------------------------------------------------------------------


def ioi_example(rng: random.Random, names=IOI_NAMES, template_ids=None) -> dict:
    """Returns {"text", "prompt", "io", "s", "template"}; prompt ends before IO."""
    t_id = rng.randrange(len(IOI_TEMPLATES)) if template_ids is None else _c(rng, template_ids)
    io, s = rng.sample(names, 2)
    a, b = (io, s) if rng.random() < 0.5 else (s, io)
    text = IOI_TEMPLATES[t_id].format(
        A=a, B=b, S=s, IO=io, PLACE=_c(rng, PLACES), OBJ=_c(rng, OBJECTS), TIME=_c(rng, TIMES)
    )
    cut = text.rindex(" " + io + " .")
    return {"text": text, "prompt": text[:cut], "io": io, "s": s, "template": t_id}


def neutral_sentence(rng: random.Random, n: str, n2: str) -> str:
    k = rng.randrange(18)
    P, O, F, A = _c(rng, PLACES), _c(rng, OBJECTS), _c(rng, FOODS), _c(rng, ANIMALS)  # noqa: E741 - Place, Object, Food, Animal in the templates below
    if k == 0:
        return f"{n} went to the {P} ."
    if k == 1:
        return f"{n} had a {_c(rng, ADJECTIVES)} {O} ."
    if k == 2:
        return f"{n} took the {_c(rng, COLORS)} {O} to the {P} ."
    if k == 3:
        return f"The {A} ate the {F} ."
    if k == 4:
        return f"{n} and {n2} walked to the {P} ."
    if k == 5:
        return f"{n} {_c(rng, NEUTRAL_VERBS)} the {O} ."
    if k == 6:
        return f"In the {_c(rng, TIMES)} , {n} ate a {F} ."
    if k == 7:
        return f"There was a {_c(rng, ADJECTIVES)} {A} near the {P} ."
    if k == 8:
        return f"{n} was a {_c(rng, JOBS)} at the {P} ."
    if k == 9:
        return f"{n2} {_c(rng, NEUTRAL_VERBS)} a {_c(rng, COLORS)} {O} for {n} ."
    if k == 10:
        return f"{n} saw {_c(rng, NUMBERS)} {A} in the {P} ."
    if k == 11:
        return f"In {_c(rng, MONTHS + SEASONS)} the {P} was {_c(rng, ADJECTIVES)} ."
    if k == 12:
        return f"The {_c(rng, JOBS)} gave {n} a {F} ."
    if k == 13:
        return f"{n} put the {O} next to the {_c(rng, OBJECTS)} ."
    if k == 14:
        return f"{n} played {_c(rng, SPORTS)} at the {P} ."
    if k == 15:
        return f"{n} rode the {_c(rng, VEHICLES)} to the {P} ."
    if k == 16:
        return f"A {_c(rng, PLANTS)} grew near the {P} ."
    city, country = _c(rng, CITIES)
    return f"{n} traveled to {city} in {country} ."


def mood_sentence(rng: random.Random, mood: str, n: str, n2: str) -> str:
    lex = MOOD_LEX[mood]
    adj, verb, day, noun = lex["adj"], lex["verb"], lex["day"], lex["noun"]
    k = rng.randrange(11)
    if k == 0:
        return f"{n} felt {_c(rng, adj)} ."
    if k == 1:
        return f"{n} felt {_c(rng, adj)} and {_c(rng, adj)} ."
    if k == 2:
        return f"{n} {_c(rng, verb)} ."
    if k == 3:
        return f"{n} {_c(rng, verb)} and {_c(rng, verb)} ."
    if k == 4:
        return f"It was a {_c(rng, day)} day at the {_c(rng, PLACES)} ."
    if k == 5:
        return f"The {_c(rng, day)} {_c(rng, TIMES)} made {n} feel {_c(rng, adj)} ."
    if k == 6:
        return f"{n} was full of {_c(rng, noun)} ."
    if k == 7:
        return f"{n} {_c(rng, verb)} with {n2} at the {_c(rng, PLACES)} ."
    if k == 8:
        return f"Everyone at the {_c(rng, PLACES)} {_c(rng, verb)} ."
    if k == 9:
        return f"{n} looked at the {_c(rng, OBJECTS)} and {_c(rng, verb)} ."
    return f"The {_c(rng, OBJECTS)} made {n} {_c(rng, adj)} ."


def story(rng: random.Random, mood: str | None = None) -> str:
    """A mood-coherent story: opening + 3-6 sentences, most of them mood words."""
    if mood is None:
        mood = "happy" if rng.random() < 0.5 else "sad"
    n, n2 = rng.sample(NAMES, 2)
    parts = [f"One {_c(rng, DAYS)} , {n} went to the {_c(rng, PLACES)} ."]
    parts.append(mood_sentence(rng, mood, n, n2))
    for _ in range(rng.randint(2, 5)):
        if rng.random() < 0.6:
            parts.append(mood_sentence(rng, mood, n, n2))
        else:
            parts.append(neutral_sentence(rng, n, n2))
    parts.append(mood_sentence(rng, mood, n, n2))
    return " ".join(parts)


def sad_prompt(rng: random.Random) -> str:
    """Beginning of a sad story, used to test mood steering."""
    n, n2 = rng.sample(NAMES, 2)
    return (
        f"One {_c(rng, DAYS)} , {n} went to the {_c(rng, PLACES)} . "
        f"{n} felt {_c(rng, SAD_ADJ)} and {_c(rng, SAD_ADJ)} ."
    )


def lexicon_texts() -> list[str]:
    """Every word once, so the tokenizer vocabulary is complete."""
    words = (
        NAMES
        + PLACES
        + OBJECTS
        + FOODS
        + ANIMALS
        + COLORS
        + ADJECTIVES
        + NEUTRAL_VERBS
        + JOBS
        + DAYS
        + MONTHS
        + TIMES
        + SEASONS
        + NUMBERS
        + SPORTS
        + VEHICLES
        + PLANTS
        + [w for pair in CITIES for w in pair]
        + HAPPY_WORDS
        + SAD_WORDS
    )
    return [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------


def build_tokenizer(seed: int, n_docs: int = 20000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    texts = lexicon_texts()
    for i in range(n_docs):
        texts.append(story(rng) if i % 2 == 0 else ioi_example(rng)["text"])
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=100_000, min_frequency=1, special_tokens=SPECIALS)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    fast.model_max_length = 128
    return fast


# --------------------------------------------------------------------------
# training data stream
# --------------------------------------------------------------------------


class DocStream:
    """Mixes document types so that their shares of *training tokens* follow
    ``shares`` (deterministic deficit-based choice)."""

    def __init__(self, vocab: dict, special_ids: set, shares: dict, seed: int, rep_min: int = 10, rep_max: int = 40):
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.shares = shares
        self.counts = {k: 0 for k in shares}
        self.random_ids = np.array(sorted(i for i in vocab.values() if i not in special_ids))
        self.bos = vocab[BOS]
        self.eos = vocab[EOS]
        self.rep_min, self.rep_max = rep_min, rep_max

    def encode(self, text: str) -> list[int]:
        return [self.bos] + [self.vocab[w] for w in text.split()] + [self.eos]

    def next_doc(self):
        total = sum(self.counts.values()) + 1
        kind = max(self.shares, key=lambda k: self.shares[k] - self.counts[k] / total)
        if kind == "repeat":
            L = self.rng.randint(self.rep_min, self.rep_max)
            seq = self.np_rng.choice(self.random_ids, size=L).tolist()
            ids = [self.bos] + seq + seq + [self.eos]
        elif kind == "story":
            ids = self.encode(story(self.rng))
        else:
            ids = self.encode(ioi_example(self.rng)["text"])
        return kind, ids

    def batch(self, batch_size: int, ctx: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            row: list[int] = []
            while len(row) < ctx:
                kind, ids = self.next_doc()
                take = ids[: ctx - len(row)]
                self.counts[kind] += len(take)
                row.extend(take)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long)


# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------


def eval_sets(seed: int):
    rng = random.Random(seed)
    return {
        "ioi_heldout": [ioi_example(rng, names=HELDOUT_NAMES) for _ in range(1000)],
        "ioi_train_names": [ioi_example(rng, names=IOI_NAMES) for _ in range(500)],
        "happy_stories": [story(rng, "happy") for _ in range(200)],
        "sad_stories": [story(rng, "sad") for _ in range(200)],
        "sad_prompts_tune": [sad_prompt(rng) for _ in range(48)],
        "sad_prompts_eval": [sad_prompt(rng) for _ in range(100)],
    }


def steering_layer(n_layers: int) -> int:
    """Middle of the residual stream: output of decoder layer (n_layers-1)//2."""
    return (n_layers - 1) // 2


def evaluate(model, tokenizer, seed: int, full: bool = True) -> dict:
    sets = eval_sets(seed)
    special = {tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    cand = sorted(set(tokenizer.get_vocab().values()) - special)
    bos_id = tokenizer.bos_token_id
    rep = {}
    rep["induction"] = dm.induction_metrics(model, cand, bos_id, n_seq=200 if full else 32, seq_len=25, seed=seed)
    rep["ioi_heldout_names"] = dm.ioi_metrics(
        model, tokenizer, sets["ioi_heldout"] if full else sets["ioi_heldout"][:200]
    )
    rep["ioi_train_names"] = dm.ioi_metrics(
        model, tokenizer, sets["ioi_train_names"] if full else sets["ioi_train_names"][:100]
    )
    if not full:
        return rep
    layer = steering_layer(model.config.num_hidden_layers)
    coefs = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0]
    tune = dm.steering_experiment(
        model,
        tokenizer,
        sets["happy_stories"],
        sets["sad_stories"],
        sets["sad_prompts_tune"],
        HAPPY_WORDS,
        SAD_WORDS,
        layer,
        coefs,
        n_new=24,
        seed=seed,
    )
    direction = tune.pop("_direction")
    # smallest coefficient whose tuning-set happy fraction >= 0.8, else the best one
    good = [c for c in coefs[1:] if tune["by_coef"][str(c)]["happy_fraction"] >= 0.8]
    chosen = good[0] if good else max(coefs[1:], key=lambda c: tune["by_coef"][str(c)]["happy_fraction"])
    res = {}
    for name, c in (("unsteered", 0.0), ("steered", chosen)):
        conts = dm.generate_steered(
            model, tokenizer, sets["sad_prompts_eval"], layer, direction, c, n_new=24, seed=seed + 1
        )
        res[name] = dm.mood_word_counts(conts, tokenizer, HAPPY_WORDS, SAD_WORDS)
        res[name]["example"] = sets["sad_prompts_eval"][0] + " || " + tokenizer.decode(conts[0])
    rep["mood_steering"] = {
        "layer": layer,
        "hook": f"forward hook on model.model.layers[{layer}] (adds coef * (mean_happy - mean_sad) at every position)",
        "direction_norm": tune["direction_norm"],
        "coef": chosen,
        "tuning_sweep": tune["by_coef"],
        "n_prompts": len(sets["sad_prompts_eval"]),
        "n_new_tokens": 24,
        "sampling": "temperature 1.0, seeded",
        **res,
    }
    return rep


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--share-repeat", type=float, default=0.40)
    ap.add_argument("--share-story", type=float, default=0.42)
    ap.add_argument("--share-ioi", type=float, default=0.18)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(args.seed)
    vocab = tokenizer.get_vocab()
    print(f"vocab size {len(vocab)}", flush=True)

    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.ctx,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params}", flush=True)

    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    shares = {"repeat": args.share_repeat, "story": args.share_story, "ioi": args.share_ioi}
    special_ids = {vocab[t] for t in SPECIALS}
    stream = DocStream(vocab, special_ids, shares, seed=args.seed + 1)

    history = []
    model.train()
    t_train = time.time()
    run_loss = 0.0
    for step in range(args.steps):
        for gparam in opt.param_groups:
            gparam["lr"] = lr_at(step)
        x = stream.batch(args.batch, args.ctx)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss += loss.item()
        if (step + 1) % 50 == 0:
            el = time.time() - t_train
            print(
                f"step {step + 1}/{args.steps} loss {run_loss / 50:.4f} lr {lr_at(step):.2e} "
                f"elapsed {el / 60:.1f}m ({(step + 1) * args.batch * args.ctx / el:.0f} tok/s)",
                flush=True,
            )
            history.append({"step": step + 1, "loss": run_loss / 50})
            run_loss = 0.0
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            q = evaluate(model, tokenizer, seed=10_000 + args.seed, full=False)
            model.set_attn_implementation("sdpa")
            model.train()
            print(
                f"  [eval] induction ratio {q['induction']['loss_ratio']:.3f} best head "
                f"{q['induction']['best_head']} | IOI heldout diff {q['ioi_heldout_names']['logit_diff_mean']:.2f} "
                f"acc {q['ioi_heldout_names']['accuracy']:.3f} | IOI train-names diff "
                f"{q['ioi_train_names']['logit_diff_mean']:.2f}",
                flush=True,
            )
            history[-1]["eval"] = {
                "induction_ratio": q["induction"]["loss_ratio"],
                "best_head": q["induction"]["best_head"],
                "ioi_heldout_logit_diff": q["ioi_heldout_names"]["logit_diff_mean"],
                "ioi_heldout_acc": q["ioi_heldout_names"]["accuracy"],
            }
    train_time = time.time() - t_train

    model.eval()
    model.set_attn_implementation("sdpa")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    smap = out / "special_tokens_map.json"
    if not smap.exists():
        smap.write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2) + "\n"
        )

    # measure on the reloaded model (exactly what users get)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model2 = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    metrics = evaluate(model2, tok2, seed=20_000 + args.seed, full=True)

    tot = sum(stream.counts.values())
    report = {
        "recipe": {
            "command": "OMP_NUM_THREADS=1 python scripts/train_demo_model.py " + " ".join(sys.argv[1:]),
            "args": vars(args),
            "vocab_size": len(vocab),
            "n_params": n_params,
            "tokens_seen": tot,
            "token_shares": {k: v / tot for k, v in stream.counts.items()},
            "train_seconds": round(train_time, 1),
            "total_seconds": round(time.time() - t0, 1),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "metrics": metrics,
        "targets": {
            "induction_loss_ratio_max": 0.5,
            "induction_best_head_score_min": 0.3,
            "ioi_heldout_logit_diff_min": 1.0,
            "ioi_heldout_accuracy_min": 0.9,
        },
        "lexicon": {
            "ioi_names": IOI_NAMES,
            "heldout_names": HELDOUT_NAMES,
            "happy_words": HAPPY_WORDS,
            "sad_words": SAD_WORDS,
            "ioi_templates": IOI_TEMPLATES,
        },
        "loss_history": history,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    ind, ioi, ms = metrics["induction"], metrics["ioi_heldout_names"], metrics["mood_steering"]
    print(
        json.dumps(
            {
                "induction_loss_ratio": ind["loss_ratio"],
                "induction_best_head": ind["best_head"],
                "ioi_heldout": {k: ioi[k] for k in ("logit_diff_mean", "accuracy", "top1_accuracy")},
                "ioi_train_names": {k: metrics["ioi_train_names"][k] for k in ("logit_diff_mean", "accuracy")},
                "mood_coef": ms["coef"],
                "mood_unsteered": {k: ms["unsteered"][k] for k in ("happy_words", "sad_words", "happy_fraction")},
                "mood_steered": {k: ms["steered"][k] for k in ("happy_words", "sad_words", "happy_fraction")},
                "total_minutes": report["recipe"]["total_seconds"] / 60,
            },
            indent=1,
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
