"""How each family's decoder layers are bound on vLLM's module tree: one row per layer kind, not branches.

``bind_vllm`` finds a model's embedding, final norm and, per layer, the modules points are read at (``LayerSites``),
by asking each row of ``LAYER_KINDS`` in order whether it knows the layer (by vLLM's class name or by the modules
the layer holds) and letting the first that does bind it. sites.py turns the bound modules into one ``Site`` per
point. A new layer kind is one function and one row here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class LayerSites:
    """One layer's modules. They are vLLM's (``Any``: their attributes, such as head counts and partition sizes,
    are read off each family's own classes, which torch types only as Tensor | Module)."""

    index: int
    layer: Any
    fused: bool  # layer returns (h, residual) with the add deferred
    attn_mod: Any
    attn_core: Any
    o_proj: Any
    q_norm: Any  # None where the family has no QK norm
    k_norm: Any
    post_attn_norm: Any  # a plain norm applied to attention's output (Gemma 2); None elsewhere
    mid_norm: Any  # the norm between attention and the MLP: its input is resid_mid (None: parallel)
    mlp: Any
    down_proj: Any  # None on sparse MoE layers
    router: Any  # None on dense layers
    post_mlp_norm: Any
    up_proj: Any = None  # the MLP's input projection; None on sparse MoE layers
    out_scale: float | None = None  # the layer scales each sublayer's output before adding it (Granite)
    gated: bool = False  # up_proj's output is [gate | up] (a merged gate_up_proj) on each rank
    post_norm: bool = False  # norms only after each sublayer (EXAONE 4): mid_norm is then the MLP itself
    kv_replicated: bool = False  # fewer KV heads than TP ranks: every rank holds the same heads
    parallel: bool = False  # attention and MLP both read the layer's one normed input (no resid_mid, no mid_norm)
    mlp_out_mod: Any = None  # whose output is mlp_out, where that is not the MLP module's (Falcon)
    sinks: torch.Tensor | None = None  # every head's attention-sink logit, gathered over ranks (GPT-OSS)
    # A layer whose token mixer is not attention (a state-space block): the mixer module, whose input is mixer_in
    # and whose output is mixer_out. attn_mod, attn_core and o_proj are then None (no attention point exists),
    # and so are mid_norm and mlp on a mixer-only block (Mamba 2: no MLP, no resid_mid).
    mixer: Any = None
    # The layer sums its MLP's parts inline (Granite-MoE-hybrid: sparse MoE + shared MLP, no module returns the
    # sum) and returns (stream, resid_mid): mlp_out_post is read off the layer's output as stream - resid_mid.
    mlp_from_layer: bool = False
    # Falcon-H1: the mixer runs beside attention on the same layer (both read the layer's one normed input, both
    # outputs added to the stream), so the layer has the mixer's points and attention's. Each branch's input and
    # output are scaled outside its module, by its own factor: mixer_in_scale multiplies the mixer's input (vLLM
    # applies it before the mixer module, transformers inside it), mixer_scale / attn_scale the outputs before the
    # add. None: 1 (or out_scale where the layer scales every sublayer alike).
    mixer_beside: bool = False
    mixer_in_scale: float | None = None
    mixer_scale: float | None = None
    attn_scale: float | None = None
    # The mixer writes its output into this positional argument (a buffer the layer allocates) and returns None
    # (vLLM's ShortConv, LFM2): mixer_out is read there after the call, and steered by writing it in place.
    mixer_out_arg: int | None = None
    # The MLP module scales its down projection's output before returning it (Falcon-H1's down multiplier): eager
    # then reads mlp_out at the down projection (mlp_out_mod) and mlp_out_post as that times this factor.
    mlp_scale: float | None = None
    # A second MLP the layer runs after `mlp` and adds to its output inline (Granite-MoE-shared: the MoE block, then
    # the shared MLP; no module returns the sum): mlp_out is the sum of the two modules' outputs, read where this
    # one returns, with the MoE block's output kept from the same layer call (Partner).
    mlp_side: Any = None


def _tp_size() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001
        return 1


def _router(mlp: nn.Module) -> nn.Module | None:
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)  # GPT-OSS: router


def _sites(i: int, layer: Any, fused: bool = False, **modules: Any) -> LayerSites:
    """A LayerSites with every module not named None (a layer kind names only the modules it has)."""
    roles: tuple[str, ...] = (
        "attn_mod",
        "attn_core",
        "o_proj",
        "q_norm",
        "k_norm",
        "post_attn_norm",
        "mid_norm",
        "mlp",
    )
    roles += ("down_proj", "router", "post_mlp_norm")
    base = {r: modules.pop(r, None) for r in roles}
    return LayerSites(i, layer, fused, **base, **modules)


def _mamba2(i: int, layer: Any) -> LayerSites:
    """A mixer-only block: input norm, then the Mamba 2 mixer, the residual add deferred to the next fused add+norm
    as on Llama-style layers. Matched by class: other hybrids name a mixer `mixer` too (Falcon-H1 keeps its Mamba
    beside attention under that name) and are not bound here."""
    return _sites(i, layer, True, mixer=layer.mixer)


def _zamba2(i: int, layer: Any) -> LayerSites:
    """Zamba 2's two layer kinds, each one block around a Mamba 2 mixer with explicit adds (the layer takes the stream
    and returns stream + mixer output). A hybrid layer first runs the transformer block shared across hybrid layers on
    the stream concatenated with the embeddings, and its output (through the layer's own linear) joins the mixer's
    input before the input norm, not the stream: from the stream's side the layer has one sublayer, the mixer, as
    eager binds it (quirks.SINGLE_SUBLAYER_BLOCKS). The shared block's attention and MLP are bound on neither backend
    (one module called from several layers, on an input twice the stream's width)."""
    dec = getattr(layer, "mamba_decoder", layer)  # the hybrid layer wraps the Mamba layer
    return _sites(i, layer, mixer=dec.mamba)  # vLLM's MambaMixer2: takes the normed input, returns its output


def _granite_moe_hybrid(i: int, layer: Any) -> LayerSites:
    """Explicit adds as on Granite, each sublayer's output times residual_multiplier; a Mamba 2 mixer or attention,
    then the MoE block and shared MLP summed inside the layer."""
    attn = getattr(layer, "self_attn", None)
    moe = layer.block_sparse_moe
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=None if attn is None else attn.attn,
        o_proj=None if attn is None else attn.o_proj,
        mid_norm=layer.post_attention_layernorm,
        mlp=moe if moe is not None else layer.shared_mlp,
        router=None if moe is None else _router(moe),
        out_scale=float(layer.residual_multiplier),
        mixer=getattr(layer, "mamba", None),
        mlp_from_layer=True,
    )


def _falcon_h1(i: int, layer: Any) -> LayerSites:
    """A Mamba 2 mixer beside attention, explicit adds. vLLM's layer multiplies each branch's input by its own factor
    before the branch's module (attention_in_multiplier, ssm_in_multiplier) and each output after it
    (attention_out_multiplier, ssm_out_multiplier); the MLP's multipliers and the key multiplier stay inside the
    modules, as in transformers. None is folded into a weight."""
    attn, ff = layer.self_attn, layer.feed_forward
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.o_proj,
        mid_norm=layer.pre_ff_layernorm,
        mlp=ff,
        down_proj=ff.down_proj,
        up_proj=ff.gate_up_proj,
        gated=True,
        mlp_out_mod=ff.down_proj,
        mlp_scale=float(ff.down_multiplier),
        mixer=layer.mamba.mamba,  # vLLM's MambaMixer2 inside its SSM wrapper
        mixer_beside=True,
        mixer_in_scale=float(layer.ssm_in_multiplier),
        mixer_scale=float(layer.ssm_out_multiplier),
        attn_scale=float(layer.attn_out_multiplier),
    )


def _lfm2(i: int, layer: Any) -> LayerSites:
    """LFM2 and LFM2-MoE, Llama-style deferred adds: operator_norm, a short convolution or attention (QK-norm), then
    ffn_norm (a fused add+norm whose input is resid_mid) and a dense gated MLP or a sparse MoE block."""
    attn, ff = getattr(layer, "self_attn", None), layer.feed_forward
    moe = hasattr(ff, "experts")
    rot = getattr(getattr(attn, "rotary_emb", None), "_forward_method", None)
    if getattr(rot, "__name__", "forward_native") != "forward_native":
        # quirks.VLLM_NATIVE_OPS: the backend starts this engine with the kernel disabled, but vLLM caches
        # rotary modules by their sizes across engines, so one built earlier in this process may be reused
        raise RuntimeError(
            "ie_lab: LFM2's rotary embedding runs vLLM's kernel, which mis-rotates its per-head query "
            "and key (quirks.VLLM_NATIVE_OPS). ie_lab starts this family's engine with that kernel disabled, "
            "so this rotary module was built for an earlier engine in this process (vLLM reuses rotary "
            "modules of the same size): start this Session in a fresh process"
        )
    sites = _sites(
        i,
        layer,
        True,
        attn_mod=attn,
        attn_core=None if attn is None else attn.attn,
        o_proj=None if attn is None else attn.out_proj,
        q_norm=None if attn is None else attn.q_layernorm,
        k_norm=None if attn is None else attn.k_layernorm,
        mid_norm=layer.ffn_norm,
        mlp=ff,
        down_proj=None if moe else ff.w2,
        router=_router(ff) if moe else None,
        up_proj=None if moe else ff.w13,
        gated=not moe,
        mixer=getattr(layer, "short_conv", None),
        mixer_out_arg=None if attn is not None else 1,
    )
    total_kv = getattr(attn, "total_num_kv_heads", None)
    sites.kv_replicated = bool(total_kv is not None and total_kv < _tp_size())
    return sites


def _opt(i: int, layer: Any) -> LayerSites:
    """OPT: explicit adds, the MLP's linears on the layer."""
    if not getattr(layer, "do_layer_norm_before", True):
        raise RuntimeError("ie_lab: OPT layers that normalise after each sublayer (OPT-350m) are not bound on vLLM")
    attn = layer.self_attn
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.out_proj,
        mid_norm=layer.final_layer_norm,
        mlp=layer.fc2,
        down_proj=layer.fc2,
        up_proj=layer.fc1,
    )


def _llama_like(i: int, layer: Any) -> LayerSites:
    """Llama-like layers (GPT-OSS names its attention attn); most defer the residual add to the next fused add+norm.
    Three layouts: sandwich norms (Gemma 2/3), post-norm only (OLMo 2, EXAONE 4), and Cohere's parallel block."""
    attn = getattr(layer, "self_attn", None) or layer.attn
    mlp: Any = (
        getattr(layer, "mlp", None)
        or getattr(layer, "block_sparse_moe", None)
        or getattr(layer, "feed_forward", None)  # Llama 4
    )
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    moe = hasattr(mlp, "experts")
    # Post-norm layers (no input norm) take and return a residual but keep the whole stream in hidden.
    post_norm = not sandwich and not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    # Apertus names its pre-MLP norm feedforward_layernorm
    mid = getattr(layer, "post_attention_layernorm", None) or getattr(layer, "feedforward_layernorm", None)
    # Cohere: one input norm feeds both sublayers; it takes a residual argument but returns the whole
    # stream in hidden (the residual it hands on is ignored by the next layer and the final norm)
    parallel = mid is None and not sandwich and not post_norm
    fused = "residual" in inspect.signature(layer.forward).parameters and not post_norm and not parallel
    common = dict(
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.o_proj,
        q_norm=getattr(attn, "q_norm", None),
        k_norm=getattr(attn, "k_norm", None),
        mlp=mlp,
        down_proj=None if moe else mlp.down_proj,
        router=_router(mlp) if moe else None,  # Cohere 2 MoE: a sparse block beside attention
    )
    if parallel:
        sites = _sites(i, layer, **common, parallel=True)
    elif post_norm:
        sites = _sites(
            i,
            layer,
            **common,
            post_attn_norm=layer.post_attention_layernorm,
            mid_norm=mlp,
            post_mlp_norm=layer.post_feedforward_layernorm,
            post_norm=True,
        )
    else:
        sites = _sites(
            i,
            layer,
            fused,
            **common,
            post_attn_norm=layer.post_attention_layernorm if sandwich else None,
            mid_norm=layer.pre_feedforward_layernorm if sandwich else mid,
            post_mlp_norm=getattr(layer, "post_feedforward_layernorm", None) if sandwich else None,
        )
    if not moe and hasattr(mlp, "gate_up_proj"):
        sites.up_proj, sites.gated = mlp.gate_up_proj, True
    elif not moe and hasattr(mlp, "up_proj"):  # an ungated MLP (Apertus: up, xIELU, down)
        sites.up_proj = mlp.up_proj
    if not fused and getattr(layer, "residual_multiplier", None) is not None:
        sites.out_scale = float(layer.residual_multiplier)
    if type(layer).__name__ == "GraniteMoeSharedDecoderLayer" and layer.shared_mlp is not None:
        # Granite-MoE-shared (and its sliding-window variant, which vLLM runs on the same class): the layer
        # calls the MoE block on a copy of mlp_in, then the shared MLP, and adds the two outputs itself
        sites.mlp_side = layer.shared_mlp
    total_kv = getattr(attn, "total_num_kv_heads", None)
    sites.kv_replicated = bool(total_kv is not None and total_kv < _tp_size())
    return sites


def _falcon(i: int, layer: Any) -> LayerSites:
    """Falcon's parallel blocks (7B: one input norm; 40B / 180B: ln_attn and ln_mlp), explicit add. With tensor
    parallelism both halves are summed before one all-reduce (refused at load). FalconMLP returns (x, bias) for the
    layer to add."""
    attn, mlp = layer.self_attention, layer.mlp
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.dense,
        mlp=mlp,
        down_proj=mlp.dense_4h_to_h,
        up_proj=mlp.dense_h_to_4h,
        parallel=True,
        mlp_out_mod=mlp.dense_4h_to_h,
    )


def _gptj(i: int, layer: Any) -> LayerSites:
    """GPT-J: a parallel block, explicit add."""
    attn, mlp = layer.attn, layer.mlp
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.out_proj,
        mlp=mlp,
        down_proj=mlp.fc_out,
        up_proj=mlp.fc_in,
        parallel=True,
    )


def _gpt2(i: int, layer: Any) -> LayerSites:
    """GPT-2: explicit residual adds inside the block."""
    attn = layer.attn
    return _sites(
        i,
        layer,
        attn_mod=attn,
        attn_core=attn.attn,
        o_proj=attn.c_proj,
        mid_norm=layer.ln_2,
        mlp=layer.mlp,
        down_proj=layer.mlp.c_proj,
        up_proj=layer.mlp.c_fc,
    )


def _named(*classes: str) -> Callable[[Any], bool]:
    return lambda layer: type(layer).__name__ in classes


def _holds(*present: str, absent: str = "") -> Callable[[Any], bool]:
    return lambda layer: all(hasattr(layer, n) for n in present) and not (absent and hasattr(layer, absent))


@dataclass(frozen=True)
class LayerKind:
    """One kind of decoder layer vLLM runs: which layers it is (``matches``) and how its modules bind (``bind``)."""

    layers: str  # whose layers, in words
    matches: Callable[[Any], bool]
    bind: Callable[[int, Any], LayerSites]


# Asked in this order, the first that matches binds the layer: the class-named kinds first (their layers also hold
# modules a later, structural row would match), the structural rows from the most specific to GPT-2's.
LAYER_KINDS: tuple[LayerKind, ...] = (
    LayerKind("Mamba 2 (mixer-only blocks)", _named("Mamba2DecoderLayer"), _mamba2),
    LayerKind("Zamba 2 (Mamba and hybrid layers)", _named("Zamba2MambaDecoderLayer", "Zamba2HybridLayer"), _zamba2),
    LayerKind(
        "Granite-MoE-hybrid",
        _named("GraniteMoeHybridMambaDecoderLayer", "GraniteMoeHybridAttentionDecoderLayer"),
        _granite_moe_hybrid,
    ),
    LayerKind("Falcon-H1 (Mamba beside attention)", _named("FalconH1ParallelHybrid"), _falcon_h1),
    LayerKind(
        "LFM2 and LFM2-MoE",
        _named(
            "Lfm2ShortConvDecoderLayer",
            "Lfm2AttentionDecoderLayer",
            "Lfm2MoeShortConvDecoderLayer",
            "Lfm2MoeAttentionDecoderLayer",
        ),
        _lfm2,
    ),
    LayerKind("OPT", _holds("fc1", "self_attn"), _opt),
    LayerKind(
        "Llama-like (self_attn, or attn beside an input norm)",
        lambda layer: hasattr(layer, "self_attn") or (hasattr(layer, "attn") and hasattr(layer, "input_layernorm")),
        _llama_like,
    ),
    LayerKind("Falcon", _holds("self_attention", absent="post_attention_layernorm"), _falcon),
    LayerKind("GPT-J", _holds("ln_1", absent="ln_2"), _gptj),
    LayerKind("GPT-2", _holds("ln_1"), _gpt2),
)

# Where a vLLM model keeps its trunk, its embedding, its final norm and its layers, in the order asked.
_TRUNK = ("model", "transformer", "backbone")
_EMBED = ("embed_tokens", "wte", "word_embeddings", "embedding", "embeddings")  # embeddings: Mamba 2
_FINAL = (
    "norm",
    "ln_f",
    "final_layer_norm",
    "norm_f",
    "final_layernorm",
)  # norm_f: Mamba 2; final_layernorm: Falcon-H1
_LAYERS = ("layers", "h")


def _first_of(obj: Any, names: tuple[str, ...]) -> Any:
    """The first of obj's attributes by these names that is set (truthy, as `a or b` reads them), else None."""
    return next((v for v in (getattr(obj, n, None) for n in names) if v), None)


def bind_vllm(model: nn.Module) -> tuple[Any, Any, list[LayerSites]]:
    """(embedding, final norm or None, per-layer sites) of a vLLM model, read off its module tree."""
    trunk: Any = _first_of(model, _TRUNK)
    if trunk is None:
        raise RuntimeError(f"ie_lab: cannot find the trunk of {type(model).__name__}")
    trunk = getattr(trunk, "decoder", None) or trunk  # OPT: OPTModel holds the decoder
    embed, final, layers = _first_of(trunk, _EMBED), _first_of(trunk, _FINAL), _first_of(trunk, _LAYERS)
    if embed is None or layers is None:
        raise RuntimeError(f"ie_lab: {type(model).__name__} is not bound on vLLM yet")
    out = []
    for i, layer in enumerate(layers):
        kind = next((k for k in LAYER_KINDS if k.matches(layer)), None)
        if kind is None:
            raise RuntimeError(f"ie_lab: layer type {type(layer).__name__} is not bound on vLLM yet")
        out.append(kind.bind(i, layer))
    return embed, final, out
