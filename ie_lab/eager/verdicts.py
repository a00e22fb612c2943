"""What the eager backend serves of each point and can do of each capability: its own column of the shared tables.

ie_lab/points.py says what a point is and ie_lab/capabilities.py which capabilities there are; each backend
declares here, in its own package, its verdict on every one of them, so a backend is added without editing a
shared table. Plain data (no torch): the points table, the docs and the CLI read it without loading a model.
"""

from __future__ import annotations

from ..point_kinds import BackendVerdict, Verdict

# The backend's column heading in the generated tables.
LABEL = "eager"

_OK = BackendVerdict(Verdict.SERVED)
_MHC = BackendVerdict(Verdict.SERVED, "Only on trunks that carry several residual streams (hyper-connections).")
_MIXER_STATE = BackendVerdict(
    Verdict.SERVED,
    "Read after the forward from where the mixer leaves it, as the binder measured at load: the cache transformers "
    "fills for the layer (a capture runs the forward with one), the cache the model returns (xLSTM), or the mixer "
    "module itself (RecurrentGemma, put back as it was after); capture only.",
)

# One verdict per point of the registry, in its order (tests/test_points_registry.py holds the two to each other):
# every point is served here, where the model has it (points.absence); a reason says how where that is not plain.
# fmt: off
POINTS: dict[str, BackendVerdict] = {
    "embeddings": _OK,
    "resid_pre": _OK,
    "attn_in": _OK,
    "q_norm_in": _OK,
    "q_norm_out": _OK,
    "k_norm_in": _OK,
    "k_norm_out": _OK,
    "value": _OK,
    "attn_scores": BackendVerdict(Verdict.SERVED, "Read inside the attention call; on fused kernels (sdpa) rebuilt from the post-RoPE q and k the kernel received; on GPT-J and CodeGen, which compute attention in their own module, from the q and k its attention step receives, divided as that step divides them; on differential attention (DiffLlama), the one pattern per head both kernel calls share."),
    "attn_probs": BackendVerdict(Verdict.SERVED, "The eager kernel's own probabilities; on fused kernels (sdpa) rebuilt from the post-RoPE q and k the kernel received; on differential attention (DiffLlama), the one pattern per head both kernel calls share, before the layer combines head pairs."),
    "z": _OK,
    "attn_gate": _OK,
    "q_latent": _OK,
    "kv_latent": _OK,
    "k_nope": _OK,
    "attn_out": _OK,
    "attn_result": BackendVerdict(Verdict.SERVED, "Computed from z as the output projection reads it and that projection's weight, in the same forward, only when asked."),
    "attn_out_post": _OK,
    "mixer_in": _OK,
    "mixer_out": _OK,
    "mixer_out_post": _OK,
    "mixer_state": _MIXER_STATE,
    "mixer_conv_state": _MIXER_STATE,
    "resid_mid": _OK,
    "mlp_in": _OK,
    "mlp_pre": _OK,
    "mlp_pre_linear": _OK,
    "mlp_act": _OK,
    "router_logits": _OK,
    "expert_weights": BackendVerdict(Verdict.SERVED, "Read from the routing weights the experts module is called with, or, where the router hands them out dense and the experts' input is scaled by them (Llama 4), from the router's output."),
    "expert_indices": _OK,
    "mlp_out": _OK,
    "mlp_out_post": _OK,
    "resid_post": _OK,
    "final_norm": _OK,
    "lm_head": _OK,
    "resid_streams": _MHC,
    "attn_stream_collapse": _MHC,
    "mlp_stream_collapse": _MHC,
    "attn_stream_write": _MHC,
    "mlp_stream_write": _MHC,
    "attn_stream_mix": _MHC,
    "mlp_stream_mix": _MHC,
}
# fmt: on

# This backend's cell of each capability (ie_lab/capabilities.py): "yes ...", "no: <why>", or what it does.
CAPABILITIES: dict[str, str] = {
    "capture": "yes",
    "attn_scores / attn_probs": "yes",
    "streaming generation (greedy, sampling, stop strings, top-n logprobs)": "yes",
    "capture during generation (from the cached forwards)": "yes",
    "steering (add, orthogonal, cap, norm_scaled_add, ablate, swap; position masks)": "yes",
    "logit lens, linear transports, fitting a tuned lens": "yes",
    "concurrent requests batched together": "no: operations on one Session queue behind a lock",
    "tensor parallelism": "no: the eager backend runs transformers' own forward, unsharded, in this process",
    "activation patching and sweeps": "yes",
    "gradients": "yes (gradients(), attribution_patch(), capture(..., grad=True), fit_jacobian_lens())",
    "direct logit attribution": "yes (logit_attribution(): by layer, sublayer point or head; attn_result per head)",
    "run(fn) on the model object": "yes",
    "SAE splicing (reconstruction at the point, error term, feature ablation and clamping, feature activations)": "yes",
    "transcoder splicing and interventions on graph features (intervene=)": "yes",
    "ie_lab.load(): an in-process model for the free functions (ie_lab.capture and the others)": "yes (an EagerModel)",
    "model families": (
        "every family the binder can measure (docs/FAMILIES.md: each model type of transformers' causal-LM mapping, "
        "bound with its invariants run on a tiny instance, or refused with the structure the probe measured)"
    ),
    "points absent on a family": "refused with PointAbsent naming the reason and a substitute",
    "attn_scores on families that compute attention in their own module (Bloom, Falcon, GPT-J)": (
        "on Bloom and Falcon the pre-softmax matrix never leaves the module; GPT-J's (and CodeGen's) are served, "
        "rebuilt from the q and k its own attention step receives, checked at load against the probabilities that "
        "step returns"
    ),
    "attn_probs on those families running sdpa": "no: their probabilities exist only on the eager code path",
}
