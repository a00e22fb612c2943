# %% [markdown]
# # Porting from TransformerLens and nnsight
#
# A hook name is a claim about which tensor you get. `ie_lab.mappers` translates names both ways and is
# *model-aware*: TransformerLens' `blocks.L.hook_mlp_out` is taken where the MLP's output joins the residual,
# which is the raw MLP output on Llama but the post-norm output on Gemma 2.
#
# Pass the Session itself (or a loaded model): the answer is for the structure ie_lab measured on this
# checkpoint. A config or a family name works without weights; a family name refuses where the checkpoint's
# config decides the answer.

# %%
import ie_lab
from ie_lab.mappers import from_engine, to_engine

s = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)

# %%
# NBVAL_CHECK_OUTPUT
for name in ["blocks.2.hook_resid_post", "blocks.2.hook_mlp_out", "blocks.1.attn.hook_pattern",
             "blocks.1.attn.hook_z", "blocks.3.mlp.hook_post", "ln_final.hook_normalized"]:
    try:
        print(f"{name:30} -> {from_engine(name, s)}")
    except ie_lab.AddressError as e:
        print(f"{name:30} -> refused: {e}")

# %%
# NBVAL_CHECK_OUTPUT
for family in ["llama", "gemma2", "olmo2"]:
    print(family, "blocks.5.hook_mlp_out ->", from_engine("blocks.5.hook_mlp_out", family))

# %%
# NBVAL_CHECK_OUTPUT
for engine in ["transformerlens", "transformerlens_bridge", "nnterp"]:
    print(engine, "<-", to_engine("resid_post.2", s, engine), "|", to_engine("mlp_out.2", s, engine))

# %% [markdown]
# | TransformerLens | nnsight / nnterp | ie_lab |
# | --- | --- | --- |
# | `model.run_with_cache(toks, names_filter=...)` | `with model.trace(toks): x = model.layers_output[2].save()` | `s.capture(toks, ["resid_post.2"])` |
# | hooks that edit activations | `model.layers_output[2][:] += v` | `with s.steer("resid_post.2", v):` |
# | `cache["pattern", 1]` | `model.attention_probabilities[1]` | `s.capture(toks, ["attn_probs.1"])` |

# %% [markdown]
# ## Holding the model as TransformerLens and nnsight do
#
# nnsight's `LanguageModel(model, tokenizer=tok)` and TransformerLens' `from_pretrained(..., hf_model=model,
# tokenizer=tok)` hold a model object with its tokenizer: `Session(model, tokenizer)` takes the same pair (or
# `tokenizer=`).
#
# `prepend_bos` is TransformerLens' switch, on the Session or on any call that reads text: `None` (the default)
# keeps what the tokenizer does by itself (this one adds its BOS), `True` puts one BOS first (the tokenizer's, or
# its EOS where it has none, as TransformerLens does), `False` leaves it off. docs/SESSION.md has the exact rules.

# %%
from transformers import AutoModelForCausalLM, AutoTokenizer

hf_model = AutoModelForCausalLM.from_pretrained(ie_lab.DEMO_MODEL)
tokenizer = AutoTokenizer.from_pretrained(ie_lab.DEMO_MODEL)
held = ie_lab.Session(hf_model, tokenizer, progress=False)  # as LanguageModel(hf_model, tokenizer=tokenizer)

# %%
# NBVAL_CHECK_OUTPUT
print(held.to_str_tokens("Mary went to the store"))                     # the tokenizer's own choice: its BOS first
print(held.to_str_tokens("Mary went to the store", prepend_bos=False))  # TransformerLens' prepend_bos=False
print(held.capture("Mary went to the store", ["resid_post.2"], prepend_bos=False)["resid_post.2"].shape)
held.close()
