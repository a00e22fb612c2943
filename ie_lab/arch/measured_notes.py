"""The sentences the binder adds to a model's notes: measured structure a user reading the points should know of."""

from __future__ import annotations

from .binding import Binding


def _layers_text(layers: list[int], n: int) -> str:
    return (
        "every layer"
        if len(layers) == n
        else ("layer " if len(layers) == 1 else "layers ") + ", ".join(str(i) for i in layers)
    )


def measured_quirks(binding: Binding) -> list[str]:
    """One sentence per measured structure a user reading the points should know of, where the binder found one: a
    norm on the stream itself, a stream rescaled between layers, an MLP gated after its down projection or reading
    the previous token (RWKV has all four)."""
    notes, n = [], len(binding.layers)
    for lb in binding.layers:
        if lb.stream_norm is not None:
            name, sub = lb.names.get("stream_norm", "a norm"), "mixer" if lb.mixer_kind else "attn"
            notes.append(
                f"layer {lb.index} normalises the residual stream itself ({name}) before its first sublayer: "
                f"resid_mid.{lb.index} = {name}(resid_pre.{lb.index}) + {sub}_out_post.{lb.index}, and resid_pre."
                f"{lb.index} is the layer's input."
            )
    scales: dict[float, list[int]] = {}
    for lb in binding.layers:
        if lb.stream_scale is not None:
            scales.setdefault(lb.stream_scale, []).append(lb.index)
    for s, layers in scales.items():
        last = layers[-1] == n - 1
        notes.append(
            f"the trunk multiplies the stream by {s:g} after {_layers_text(layers, n)}, outside any module: "
            f"resid_pre.{{L+1}} = {s:g} * resid_post.L there"
            + (", and the final norm (and the logit lens) reads the last layer's output so scaled" if last else "")
            + " (RWKV in eval mode: every rescale_every layers)."
        )
    gated = [lb.index for lb in binding.layers if lb.mlp_out_gate is not None]
    if gated:
        lb = binding.layers[gated[0]]
        notes.append(
            f"the MLP on {_layers_text(gated, n)} multiplies its down projection's output by "
            f"{lb.mlp_out_gate_fn}({lb.names.get('mlp_out_gate', 'a gate')}): mlp_out is that gated product, "
            "mlp_act the down projection's input (no gated branch before it: mlp_pre_linear is absent)."
        )
    shifted = [lb.index for lb in binding.layers if lb.mlp_token_shift]
    if shifted:
        notes.append(
            f"the MLP on {_layers_text(shifted, n)} mixes each position's input with the previous position's before "
            "its projections (a token shift): mlp_pre, mlp_act and mlp_out at position t depend on mlp_in at t-1 "
            "and t, so writing mlp_in at t also moves the MLP at t+1."
        )
    twice = [lb.index for lb in binding.layers if lb.kernel_calls > 1 and lb.kernel_same_qk]
    if twice:
        half = binding.facts.n_heads // 2
        notes.append(
            f"the attention on {_layers_text(twice, n)} calls its kernel {binding.layers[twice[0]].kernel_calls} "
            "times with the same queries and keys, once per half of the values (differential attention): "
            "attn_scores and attn_probs are the one pattern per head all calls share, and the layer then combines "
            f"head j's output with head j + {half}'s as out_j - lambda * out_(j+{half}) and normalises it before "
            "o_proj, so z there is not attn_probs @ value (the differential map of pair j is attn_probs[:, j] - "
            f"lambda * attn_probs[:, j + {half}], lambda read from the layer's lambda parameters)."
        )
    return notes
