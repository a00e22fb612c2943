"""What the vLLM backend serves of each point and can do of each capability: its own column of the shared tables.

ie_lab/points.py says what a point is and ie_lab/capabilities.py which capabilities there are; each backend
declares here, in its own package, its verdict on every one of them, so a backend is added without editing a
shared table. Plain data (no torch, no vLLM): the points table, the docs and the CLI read it without an engine.
"""

from __future__ import annotations

from ..arch import quirks
from ..point_kinds import BackendVerdict, Verdict

# The backend's column heading in the generated tables.
LABEL = "vLLM"

_OK = BackendVerdict(Verdict.SERVED)
_TP_NOTE = "Sharded across tensor-parallel ranks, so ie_lab gathers the slices before returning it."
_TP = BackendVerdict(Verdict.SERVED, _TP_NOTE)
_MHC = BackendVerdict(
    Verdict.UNIMPLEMENTED,
    "No multi-stream family has been checked against eager on vLLM yet; use backend='eager'.",
)
_MIXER = BackendVerdict(
    Verdict.SERVED,
    "The mixer module's input and output on vLLM's layer, on the hybrid and state-space families vLLM runs on CPU "
    "and ie_lab has checked against eager (Mamba 2, Granite-MoE-hybrid, Falcon-H1's Mamba beside attention, "
    "LFM2's and LFM2-MoE's short convolutions, Zamba 2's Mamba 2 mixers); others are refused at load with vLLM's own reason.",
)
_MIXER_STATE = BackendVerdict(
    Verdict.UNIMPLEMENTED,
    "vLLM keeps mixer states in its own paged state cache, which ie_lab does not read; use backend='eager'.",
)
_LATENT = BackendVerdict(
    Verdict.UNIMPLEMENTED, "No latent-attention family is served by the vLLM backend yet; use backend='eager'."
)

# One verdict per point of the registry, in its order (tests/test_points_registry.py holds the two to each other).
# "served": read from one module's input or output by a hook, so graph mode can also compile a static tap for it;
# "served by recompute": rebuilt after the request from other captured tensors.
# fmt: off
POINTS: dict[str, BackendVerdict] = {
    "embeddings": _OK,
    "resid_pre": _OK,
    "attn_in": _OK,
    "q_norm_in": _TP,
    "q_norm_out": _TP,
    "k_norm_in": _TP,
    "k_norm_out": _TP,
    "value": _TP,
    "attn_scores": BackendVerdict(Verdict.RECOMPUTE, "Paged attention never materialises the matrix; rebuilt from captured post-RoPE q and k."),
    "attn_probs": BackendVerdict(Verdict.RECOMPUTE, "Paged attention never materialises the probabilities; rebuilt from captured post-RoPE q and k."),
    "z": _TP,
    "attn_gate": BackendVerdict(Verdict.UNIMPLEMENTED, "The gate is a real module on vLLM's tree but is not wired up yet; use backend='eager'."),
    "q_latent": _LATENT,
    "kv_latent": _LATENT,
    "k_nope": _LATENT,
    "attn_out": _OK,
    "attn_result": BackendVerdict(Verdict.UNIMPLEMENTED, "Not computed on vLLM yet: the output projection's weight lives in the workers, sharded by rank, and no worker-side product is wired. Capture z.L and apply the projection's per-head columns yourself, or use backend='eager'."),
    "attn_out_post": _OK,
    "mixer_in": _MIXER,
    "mixer_out": _MIXER,
    "mixer_out_post": _MIXER,
    "mixer_state": _MIXER_STATE,
    "mixer_conv_state": _MIXER_STATE,
    "resid_mid": BackendVerdict(Verdict.SERVED, "Captured everywhere; on families where vLLM fuses the residual add into the next norm it is rebuilt as h + residual."),
    "mlp_in": _OK,
    "mlp_pre": BackendVerdict(Verdict.SERVED, "vLLM merges the gate and up projections into one gate_up_proj: the point is the gate half of its output (each rank's shard split, then gathered); c_fc's output on GPT-2."),
    "mlp_pre_linear": BackendVerdict(Verdict.SERVED, "The up half of vLLM's merged gate_up_proj output (each rank's shard split, then gathered)."),
    "mlp_act": _TP,
    "router_logits": BackendVerdict(Verdict.SERVED, "The router is replicated across ranks, so tensor parallelism does not affect it."),
    "expert_weights": BackendVerdict(Verdict.UNREACHABLE, "The top-k selection happens inside vLLM's fused MoE kernel and is never materialised. Use backend='eager'."),
    "expert_indices": BackendVerdict(Verdict.UNREACHABLE, "As expert_weights: the selection lives inside the fused MoE kernel. Use backend='eager'."),
    "mlp_out": _OK,
    "mlp_out_post": _OK,
    "resid_post": BackendVerdict(Verdict.SERVED, "vLLM layers defer the residual add to the next layer; ie_lab adds h + residual so it equals the HF layer output."),
    "final_norm": BackendVerdict(Verdict.SERVED, "Computed over every position of the request, not only the decoded ones."),
    "lm_head": BackendVerdict(Verdict.UNREACHABLE, "vLLM's compute_logits folds scaling and soft-capping into the unembedding, so no hook sees the bare W_U·x. Use the logit lens or backend='eager'."),
    "resid_streams": _MHC,
    "attn_stream_collapse": _MHC,
    "mlp_stream_collapse": _MHC,
    "attn_stream_write": _MHC,
    "mlp_stream_write": _MHC,
    "attn_stream_mix": _MHC,
    "mlp_stream_mix": _MHC,
}
# fmt: on


def tappable(name: str) -> bool:
    """vLLM reads the point from one module's input or output (its verdict is plain "served"), so a hook serves it
    and graph mode can compile a static tap for it. Recomputed points are rebuilt after the request."""
    return POINTS[name].verdict is Verdict.SERVED


def recomputed(name: str) -> bool:
    """vLLM rebuilds the point from other captured tensors after the request instead of reading it."""
    return POINTS[name].verdict is Verdict.RECOMPUTE


def tappable_names() -> tuple[str, ...]:
    """Names of the points vLLM reads with a module hook, which are also the ones graph mode can tap."""
    return tuple(n for n in POINTS if tappable(n))


# This backend's cell of each capability (ie_lab/capabilities.py): "yes ...", "no: <why>", or what it does.
CAPABILITIES: dict[str, str] = {
    "capture": "yes",
    "attn_scores / attn_probs": "yes (rebuilt from the post-RoPE q/k the paged-attention kernel received)",
    "streaming generation (greedy, sampling, stop strings, top-n logprobs)": "yes",
    "capture during generation (from the cached forwards)": (
        "yes (covers the positions the model ran: prompt + every generated token but the last)"
    ),
    "steering (add, orthogonal, cap, norm_scaled_add, ablate, swap; position masks)": (
        "yes (per request, with the same arithmetic functions)"
    ),
    "logit lens, linear transports, fitting a tuned lens": (
        "logit lens only (read out inside the worker, top-k returned); no transports or fitting"
    ),
    "concurrent requests batched together": "yes",
    "tensor parallelism": "yes (sharded points gathered across ranks)",
    "activation patching and sweeps": (
        "no: patching replaces activations mid-forward for one request, which vLLM's batched kernels do not expose"
    ),
    "gradients": "no: vLLM runs inference-only kernels with no autograd graph",
    "SAE splicing (reconstruction at the point, error term, feature ablation and clamping, feature activations)": (
        "yes (in the worker, per request, with the same arithmetic; not in graph mode)"
    ),
    "transcoder splicing and interventions on graph features (intervene=)": (
        "yes (in the worker, per request: features encoded from mlp_in.L, written at mlp_out.L with the same "
        "arithmetic; a graph's nodes from an eager Session of the same checkpoint; not in graph mode)"
    ),
    "direct logit attribution": (
        "no: it needs the pieces of the residual stream, each head's write (attn_result) and the final norm's scale "
        "of one run together, which the vLLM backend does not read out yet"
    ),
    "run(fn) on the model object": "no: the weights live inside vLLM's workers, not in this process",
    "ie_lab.load(): an in-process model for the free functions (ie_lab.capture and the others)": (
        "no: vLLM keeps the model inside its engine, which only a Session drives"
    ),
    "model families": "the families verified point by point against eager: "
    + ", ".join(f"`{f}`" for f in sorted(quirks.VLLM_VERIFIED))
    + "; others are refused at load (docs/VLLM.md lists the limits)",
    "points absent on a family": "refused the same way",
    "attn_scores on families that compute attention in their own module (Bloom, Falcon, GPT-J)": (
        "GPT-J's are served, rebuilt from vLLM's post-RoPE q and k and checked against eager's (read from GPT-J's "
        "own attention step); Falcon's are refused: transformers never hands them out, so scores rebuilt from vLLM's "
        "q and k would have nothing to be checked against (Bloom is not served on vLLM)"
    ),
    "attn_probs on those families running sdpa": "yes (rebuilt from q and k, checked against transformers' eager path)",
}
