# %% [markdown]
# # Tutorial 6 — Scaling up: Colab, GPUs, vLLM and real checkpoints
#
# Everything in these tutorials runs on the demo model on a CPU. The same calls work on real checkpoints.
# Cells that need a download or a GPU start with `# NBVAL_SKIP`: CI skips them; run them yourself on Colab
# (Runtime → Change runtime type → GPU).

# %% [markdown]
# ## Will it fit? Sizing needs only the config

# %%
# NBVAL_CHECK_OUTPUT
import ie_lab

gemma2_2b = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
             "tie_word_embeddings": True}
est = ie_lab.sizing.estimate(gemma2_2b, "bfloat16")
print(f"~{est.n_params / 1e9:.1f}B parameters, {est.weights_bytes / 2**30:.1f} GiB of weights in bf16")

# %%
ie_lab.sizing.table(gemma2_2b, "bfloat16", context=8192)

# %% [markdown]
# ## Which GPU, which vLLM settings, how much KV cache: the sizing panel
#
# `ie_lab.sizing.size` counts the parameters on the meta device (exact on MoE, latent-attention, state-space and
# hybrid trunks alike), reads the checkpoint's quantization, lays out the cache layer by layer (sliding windows,
# MLA latents, SSM state), and for each GPU finds the smallest tensor-parallel size that holds the weights and the
# tokens you ask for, with a roofline of decode and prefill speed. It takes a config dict, a folder with
# `config.json`, or a model type (its reference size); nothing is downloaded. `docs/SIZING.md` has the rules.

# %%
# NBVAL_CHECK_OUTPUT
qwen3_32b = {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
             "tie_word_embeddings": False, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
s = ie_lab.sizing.size(qwen3_32b, gpu="A100 80GB", tokens=8192)
print(s.verdict())

# %%
ie_lab.sizing.panel(qwen3_32b, tokens=32768)  # every GPU of the table; the smallest set that fits is starred

# %% [markdown]
# ## GPT-2 and Gemma 2 on a GPU

# %%
# NBVAL_SKIP
s = ie_lab.Session("openai-community/gpt2")           # CUDA if present, with one line saying so
cache = s.capture("The Eiffel Tower is in", ["resid_post.6", "attn_probs.5"])
print(s.logit_lens("The Eiffel Tower is in", k=3))

# %%
# NBVAL_SKIP
g = ie_lab.Session("google/gemma-2-2b", dtype="bfloat16")
print(g.describe())                                      # sandwich norms, sliding windows, softcaps: measured
from ie_lab.mappers import from_engine
print(from_engine("blocks.5.hook_mlp_out", g))           # mlp_out_post.5 on Gemma 2

# %% [markdown]
# ## Many requests at once: the vLLM backend
# On a GPU machine, `pip install 'ie_lab[vllm]'` and pass `backend="vllm"`: concurrent requests are batched,
# each with its own captures and steering. See the `08_vllm_backend` notebook and `docs/VLLM.md`.

# %%
# NBVAL_SKIP
import asyncio
v = ie_lab.Session("google/gemma-2-2b", backend="vllm")
async def many():
    return await asyncio.gather(*[v.agenerate(f"Story {i}:", 64) for i in range(32)])
results = asyncio.run(many())
