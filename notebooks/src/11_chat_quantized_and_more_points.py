# %% [markdown]
# # Models as people download them: chat conventions, quantized checkpoints, and points some families hide
#
# Three things a real checkpoint brings that the demo model does not:
#
# 1. **Chat conventions.** gpt-oss writes its reasoning in a harmony *analysis channel*, Qwen3 and DeepSeek-R1
#    between `<think>` markers, and every chat model ends its turn with its own token. ie_lab reads which one a
#    tokenizer speaks from its special tokens and its template (never from the model's name), names each part of a
#    conversation as a span of tokens, and stops generation at the end of the assistant's turn.
# 2. **Quantized checkpoints** (compressed-tensors: GPTQ/AWQ-style int4, int8): points read what the quantized
#    model computes.
# 3. **Points some families compute in their own code**: GPT-J's attention scores, DiffLlama's attention pattern,
#    Llama 4's router weights.
#
# Everything here runs offline on tiny random models built on the spot, so the *text* they generate is noise;
# the structure is what to look at.

# %%
import tempfile

import torch

import ie_lab
from ie_lab import tiny
from ie_lab.toy import chat_model, tiny_model

# %% [markdown]
# ## A harmony conversation, part by part
#
# `ie_lab.toy.chat_model("harmony")` is a tiny model whose tokenizer speaks gpt-oss's harmony format. A message's
# `reasoning` goes into the analysis channel; `to_chat` returns the ids and a span for every part.

# %%
# NBVAL_CHECK_OUTPUT
h = ie_lab.Session(*chat_model("harmony"), progress=False)
chat = ie_lab.to_chat(
    h,
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning": "The user asks about rain.", "content": "Take an umbrella."},
    ],
    add_generation_prompt=False,
)
print(chat.convention.style, "| turn ends:", h.tokenizer.convert_ids_to_tokens(list(chat.convention.turn_end_ids)))
for span in chat.parts(role="assistant"):
    print(f"{span.part:>10}  tokens {span.start}:{span.end}  {span.text!r}")

# %% [markdown]
# A capture of the conversation can be sliced by span: here the residual stream over the reasoning only.

# %%
# NBVAL_CHECK_OUTPUT
analysis = chat.parts("analysis")[0]
cache = h.capture(chat, ["resid_post.1"])
print(tuple(cache["resid_post.1"][:, analysis.slice].shape))
stops = sorted(h.tokenizer.convert_ids_to_tokens(sorted(chat.stop_ids)))
print("generation stops at:", stops)

# %% [markdown]
# A reply splits into its channels by the same markers:

# %%
# NBVAL_CHECK_OUTPUT
reply = h.tokenizer(
    "<|channel|>analysis<|message|>Rain is likely.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Take an umbrella.<|return|>",
    add_special_tokens=False,
)["input_ids"]
print([(p.part, p.text) for p in ie_lab.split_channels(h, reply)])
h.close()

# %% [markdown]
# ## A quantized checkpoint
#
# `tiny.save_quantized` writes a compressed-tensors checkpoint of a model (attention int8 weights and activations,
# MLP int4 weights in groups), the format GPTQ/AWQ models are published in. `ie_lab.load` sees its
# `quantization_config`, says so on its load line, and its points are the quantized model's.

# %%
model, tok = tiny_model("llama")
path = tempfile.mkdtemp()
tiny.save_quantized(
    model, path, {"W8A8": [r"re:.*self_attn\.[qkvo]_proj$"], "W4A16": [r"re:.*mlp\.(gate|up|down)_proj$"]}
)
tok.save_pretrained(path)
q = ie_lab.Session(path, progress=False)

# %%
# NBVAL_CHECK_OUTPUT
c = q.capture("the cat sat on the mat", ["mlp_in.0", "mlp_out.0"])
with torch.no_grad():
    unquantized = model.model.layers[0].mlp(c["mlp_in.0"])
gap = float((unquantized - c["mlp_out.0"]).norm() / c["mlp_out.0"].norm())
print("the unquantized MLP is more than 1% away:", gap > 0.01)
print(q.grad_support().available, "-", q.grad_support().reasons[0][:80], "...")
q.close()

# %% [markdown]
# Gradients: the int8 *activation* quantization runs under `torch.no_grad()` inside compressed-tensors, so the
# verdict refuses and names the linears that cut the graph; weight-only schemes keep exact gradients.
#
# ## Points some families compute in their own code
#
# GPT-J computes attention in its own `_attn` method rather than through transformers' attention functions.
# ie_lab reads the scores there, before the softmax, with the causal mask as `-inf`, so `softmax(attn_scores)` is
# exactly `attn_probs`.

# %%
# NBVAL_CHECK_OUTPUT
from transformers import GPTJConfig

from ie_lab import toy

config = GPTJConfig(vocab_size=512, n_embd=128, n_layer=2, n_head=4, rotary_dim=16, n_positions=256, bos_token_id=1, eos_token_id=2)
g = ie_lab.Session(tiny.build(config), toy.tokenizer(), progress=False)
c = g.capture("the cat sat on the mat", ["attn_scores.0", "attn_probs.0"])
print(tuple(c["attn_scores.0"].shape))
print("softmax(scores) == probs:", torch.allclose(c["attn_scores.0"].softmax(-1), c["attn_probs.0"], atol=1e-6))
g.close()

# %% [markdown]
# The same holds for CodeGen's scores, DiffLlama's attention pattern (one softmax map per head, which its
# differential attention applies in pairs: docs/BINDER.md says how the pairs combine) and Llama 4's router weights
# (`expert_weights`: the top-k sigmoid scores its experts are scaled by). `ie-lab points <model_type>` lists what
# each family serves, and why the rest is absent.
