"""Nominating: which module of a live tree stands for each role, found by name (arch.spellings).

`nominate` builds the Binding the probe forward then measures (arch.binder): a nomination the tensors do not confirm
is dropped or refused there. It refuses here only where the tree lacks a role every layer needs (no decoder layer
list, no attention or mixer, no output or down projection), naming what the layer holds instead.
"""

from __future__ import annotations

from torch import nn

from ..errors import StructureError
from .binding import Binding, LayerBinding
from .config_facts import ArchFacts
from .spellings import (
    ATTN_HC_NAMES,
    ATTN_NAMES,
    CHANNEL_MIX_DOWN_NAMES,
    CHANNEL_MIX_UP_NAMES,
    DOWN_NAMES,
    EXPERTS_NAMES,
    FINAL_NORM_NAMES,
    FUSED_GATE_UP_NAMES,
    FUSED_QKV_NAMES,
    GATE_NAMES,
    K_NORM_NAMES,
    MIXER_NAMES,
    MLP_HC_NAMES,
    MLP_NAMES,
    MLP_OUT_GATE_NAMES,
    O_NAMES,
    Q_NORM_NAMES,
    ROUTER_NAMES,
    SIDE_MLP_NAMES,
    STREAM_HEAD_NAMES,
    SUBLAYER_WRAPPER_NAMES,
    UP_NAMES,
    V_NAMES,
    child,
    is_norm,
    reads_shared_kv,
)


def _find_layers(model: nn.Module, n_layers: int, embed: nn.Module | None = None) -> tuple[str, nn.ModuleList]:
    """The shallowest ModuleList as long as the config's layer count; of those, one beside the token embedding first
    (a multimodal wrapper's vision tower may have as many layers as its text trunk: GOT-OCR 2)."""
    best: tuple[str, nn.ModuleList] | None = None

    def beside_embed(name: str) -> bool:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        return embed is not None and any(c is embed for c in parent.children())

    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers and n_layers > 0:
            key = (not beside_embed(name), name.count("."))
            if best is None or key < (not beside_embed(best[0]), best[0].count(".")):
                best = (name, m)
    if best is None:
        raise StructureError(
            f"could not find the decoder layers: no ModuleList of length {n_layers} (the config's layer count)"
            f"{_layer_lists_found(model)}."
        )
    return best


def _layer_lists_found(model: nn.Module) -> str:
    """What the trunk holds instead of one list of the config's length: several layer stacks (HRM's H and L modules,
    run in cycles), or layers that each hold several attention sublayers (LongCat-Flash)."""
    stacks = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and child(m[0], ATTN_NAMES + SUBLAYER_WRAPPER_NAMES) is not None
    ]
    if not stacks:
        return ""
    text = ", ".join(f"{n} ({len(m)})" for n, m in stacks)
    multi = [f for _, m in stacks if (f := child(m[0], ATTN_NAMES)) is not None and isinstance(f[1], nn.ModuleList)]
    if multi:
        attr, lst = multi[0]
        k = len(lst) if isinstance(lst, nn.ModuleList) else 0
        return (
            f"; its layer list {text} holds layers whose {attr} is a ModuleList of {k} attention sublayers (each "
            "decoder layer runs several attention and MLP sublayers), and ie_lab binds one attention per layer"
        )
    if len(stacks) > 1:
        return (
            f"; the trunk has several layer stacks instead ({text}), which its forward runs in its own order (possibly "
            "several times), so no layer index names one block"
        )
    return f"; the only layer list is {text}"


def _find_final_norm(model: nn.Module, layers_path: str) -> tuple[str, nn.Module] | None:
    trunk_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    trunk = model.get_submodule(trunk_path) if trunk_path else model
    found = child(trunk, FINAL_NORM_NAMES)
    if found and is_norm(found[1]):
        return (f"{trunk_path}.{found[0]}" if trunk_path else found[0]), found[1]
    return None


def nominate(model: nn.Module, facts: ArchFacts) -> Binding:
    """Every layer's roles, found by name, and the trunk's embedding, final norm, unembedding and stream head: the
    Binding before anything is measured (arch.binder's probe forward confirms, corrects or refuses it)."""
    family = facts.model_type
    embed = model.get_input_embeddings()  # type: ignore[operator]  # transformers' PreTrainedModel method
    lm_head = model.get_output_embeddings()  # type: ignore[operator]  # (the nn.Module annotation cannot see it)
    layers_path, layer_list = _find_layers(model, facts.n_layers, embed)
    if embed is None or lm_head is None:
        raise StructureError(f"{family}: the model exposes no input or output embeddings; is it a causal LM?")
    fn = _find_final_norm(model, layers_path)

    layers: list[LayerBinding] = []
    for i, layer in enumerate(layer_list):
        declared = facts.mixer_kinds[i] if i < len(facts.mixer_kinds) else ""
        if i < len(facts.block_sublayers) and facts.block_sublayers[i] == "mlp":
            layers.append(_mlp_only_layer(i, layer, family))  # a single-sublayer trunk's MLP or MoE block
            continue
        a = child(layer, ATTN_NAMES) or child(layer, SUBLAYER_WRAPPER_NAMES)
        mixer = child(layer, MIXER_NAMES + ATTN_NAMES) if declared else None
        if declared and mixer is None:
            mixer = _nested_mixer(layer)  # inside a decoder-layer wrapper (Zamba's hybrid layers: mamba_decoder)
        if mixer is None and a is None:
            mixer = child(layer, MIXER_NAMES)
            if mixer is not None and any(facts.mixer_kinds):
                # a hybrid whose config calls this layer attention keeps it where its mixers sit (RecurrentGemma)
                a, mixer = mixer, None
        if mixer is not None:
            lb = _mixer_layer(i, layer, mixer, declared, family)
            if lb is not None:
                layers.append(lb)
                continue
        if a is None:
            kind = facts.layer_kinds[i] if i < len(facts.layer_kinds) else "global"
            what = " (a linear-attention layer: those are not bound yet)" if kind == "linear" else ""
            kids = ", ".join(n for n, _ in layer.named_children())
            raise StructureError(
                f"{family} layer {i}: no attention module among {ATTN_NAMES}{what}; the layer holds ({kids})."
            )
        attn_name, attn = a
        wrapper = None
        if attn_name in SUBLAYER_WRAPPER_NAMES:
            # its norms are the layer's norms; the attention proper sits one level down
            inner_attn = child(attn, ATTN_NAMES)
            if inner_attn is None:
                kids = ", ".join(n for n, _ in attn.named_children())
                raise StructureError(
                    f"{family} layer {i}: no attention module among {ATTN_NAMES} inside {attn_name} ({kids})."
                )
            wrapper, attn_name, attn = attn, f"{attn_name}.{inner_attn[0]}", inner_attn[1]
        inner = child(attn, ATTN_NAMES)
        if child(attn, O_NAMES) is None and inner is not None and child(inner[1], O_NAMES) is not None:
            # A wrapper around the attention proper (GPT-Neo's attn.attention): bind the module that projects.
            attn_name, attn = f"{attn_name}.{inner[0]}", inner[1]
        o = child(attn, O_NAMES)
        if o is None and (child(attn, EXPERTS_NAMES) or child(attn, DOWN_NAMES)) and child(layer, MLP_NAMES) is None:
            raise StructureError(
                f"{family} layer {i}: the block's one sublayer ({attn_name}) is an MLP or mixture of experts, with no "
                "attention or mixer beside it (a single-sublayer block, as trunks interleaving state-space, attention "
                "and MLP blocks have); such blocks are not bound yet."
            )
        if o is None and child(attn, EXPERTS_NAMES) is not None:
            raise StructureError(
                f"{family} layer {i}: the attention routes each token's heads to experts, each with its own output "
                f"projection ({attn_name}.experts: a mixture of attention heads, as JetMoE's), so no single output "
                "projection reads z and attn_out is a routed sum; mixture-of-heads attention is not bound yet."
            )
        if o is None:
            raise StructureError(f"{family} layer {i}: attention has no output projection among {O_NAMES}.")
        mlp_found = child(layer, MLP_NAMES)
        mlp = mlp_found[1] if mlp_found else None
        host = mlp if mlp is not None else layer
        names = {"attn": attn_name, "o_proj": f"{attn_name}.{o[0]}"}
        lb = LayerBinding(
            index=i,
            layer=layer,
            attn=attn,
            o_proj=o[1],
            mlp=mlp,
            mlp_in_module=host,
            mlp_out_module=host,
            names=names,
            wrapper=wrapper,
        )
        _find_side_mlp(lb)
        experts = child(host, EXPERTS_NAMES)
        sub = facts.block_sublayers[i] if i < len(facts.block_sublayers) else ""
        if sub == "attention" and mlp_found is None:
            # An attention-only block of a single-sublayer trunk (the config names it; the probe must find
            # resid_post = resid_pre + attn_out_post): the MLP points are refused here by the registry.
            lb.has_mlp = False
            lb.mlp_in_module = lb.mlp_out_module = attn  # never read
        elif experts is not None and mlp_found is not None:  # mlp is mlp_found's module
            lb.sparse_moe = True
            lb.experts = experts[1]
            r = child(mlp_found[1], ROUTER_NAMES)
            lb.router = r[1] if r else None
            names["mlp"] = mlp_found[0]
        else:
            fgu = child(host, FUSED_GATE_UP_NAMES)
            gate = child(host, GATE_NAMES)
            up = child(host, UP_NAMES)
            down = child(host, DOWN_NAMES)
            if down is None and up is None and gate is None and isinstance(mlp, nn.Sequential):
                up, down = _sequential_up_down(mlp) or (None, None)  # CTRL's Sequential(Linear, ReLU, Linear)
            if down is None and mlp is None:
                raise StructureError(
                    f"{family} layer {i}: an attention block with no MLP among {MLP_NAMES} beside it (a "
                    "single-sublayer block, as trunks interleaving state-space, attention and MLP blocks have); such "
                    "blocks are not bound yet."
                )
            if down is None:
                raise StructureError(f"{family} layer {i}: MLP has no down projection among {DOWN_NAMES}.")
            lb.down_proj = down[1]
            if fgu is not None:
                lb.fused_gate_up = fgu[1]
            else:
                lb.gate_proj = gate[1] if gate else None
                lb.up_proj = up[1] if up else None
            if mlp is None:  # linears directly on the layer: mlp_in is the up projection's input
                mlp_in = lb.up_proj or lb.gate_proj or lb.fused_gate_up
                if mlp_in is None:  # the probe would find no mlp_in input: refuse as it would, naming why
                    raise StructureError(f"{family} layer {i}: MLP has no up projection among {UP_NAMES + GATE_NAMES}.")
                lb.mlp_in_module = mlp_in
                lb.mlp_out_module = lb.down_proj
            names["mlp"] = mlp_found[0] if mlp_found else "(on the layer)"
        lb.attn_sinks = isinstance(getattr(attn, "sinks", None), nn.Parameter)
        qn, kn = child(attn, Q_NORM_NAMES), child(attn, K_NORM_NAMES)
        if qn and kn:
            lb.q_norm, lb.k_norm = qn[1], kn[1]
        elif qn and reads_shared_kv(attn):
            lb.q_norm = qn[1]  # its keys are another layer's (measured after the probe: measure_kv_sources)
        v = child(attn, V_NAMES)
        fused = child(attn, FUSED_QKV_NAMES)
        if v is not None and isinstance(v[1], nn.Linear):
            lb.v_proj = v[1]
        elif fused is not None:
            lb.fused_qkv = fused[1]
        if isinstance(getattr(attn, "compressor", None), nn.Module):
            types = facts.raw.get("layer_types") if facts.raw else None
            lb.kv_compressor = str(types[i]) if isinstance(types, (list, tuple)) and i < len(types) else "compressed"
        if facts.n_streams > 1:
            ahc, mhc = child(layer, ATTN_HC_NAMES), child(layer, MLP_HC_NAMES)
            if ahc is None or mhc is None:
                kids = ", ".join(n for n, _ in layer.named_children())
                raise StructureError(
                    f"{family} layer {i}: the config states {facts.n_streams} residual streams, but the layer has no "
                    f"hyper-connection modules among {ATTN_HC_NAMES} and {MLP_HC_NAMES} (it holds {kids})."
                )
            lb.attn_hc, lb.mlp_hc = ahc[1], mhc[1]
            names.update(attn_hc=ahc[0], mlp_hc=mhc[0])
        layers.append(lb)

    binding = Binding(
        facts=facts,
        embed=embed,
        final_norm=fn[1] if fn else None,
        lm_head=lm_head,
        layers=layers,
        layers_path=layers_path,
        family=family,
    )
    if facts.n_streams > 1:
        trunk_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
        found = child(model.get_submodule(trunk_path) if trunk_path else model, STREAM_HEAD_NAMES)
        binding.stream_head = found[1] if found else None
    return binding


def _sequential_up_down(mlp: nn.Sequential) -> tuple[tuple[str, nn.Module], tuple[str, nn.Module]] | None:
    """An MLP built as nn.Sequential(linear, activation..., linear): a Sequential calls its children in order, so
    the first linear is the up projection and the last the down projection (mlp_act is the last one's input)."""
    kids = list(mlp.named_children())
    linear = [k for k in kids if isinstance(k[1], nn.Linear)]
    if len(kids) < 3 or len(linear) != 2 or linear != [kids[0], kids[-1]]:
        return None
    return (f"{kids[0][0]}", kids[0][1]), (f"{kids[-1][0]}", kids[-1][1])


def _mixer_layer(
    i: int, layer: nn.Module, found: tuple[str, nn.Module], declared: str, family: str
) -> LayerBinding | None:
    """A layer whose token mixer is not attention: the mixer module stands where attention would, and the MLP is
    found as on any layer. The probe checks that the mixer does not call transformers' attention interface."""
    name, mixer = found
    mlp_found = child(layer, MLP_NAMES)
    if mlp_found is None:
        # A mixer-only block: the probe must find resid_post = resid_pre + the mixer's contribution, or refuse.
        return LayerBinding(
            index=i,
            layer=layer,
            attn=mixer,
            o_proj=mixer,
            mlp=None,
            mlp_in_module=mixer,  # never read: the registry refuses every MLP point on this layer
            mlp_out_module=mixer,
            names={"mixer": name},
            mixer_kind=declared or name,
            value_source="none",
            has_mlp=False,
        )
    mlp = mlp_found[1]
    lb = LayerBinding(
        index=i,
        layer=layer,
        attn=mixer,
        o_proj=mixer,
        mlp=mlp,
        mlp_in_module=mlp,
        mlp_out_module=mlp,
        names={"mixer": name, "mlp": mlp_found[0]},
        mixer_kind=declared or name,
        value_source="none",
    )
    _find_side_mlp(lb)
    _bind_mlp_parts(lb, mlp, family)
    return lb


def _nested_mixer(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """A declared mixer one level down: a child of the layer that holds it (Zamba's hybrid layer wraps its Mamba
    layer, norm and mixer, as mamba_decoder beside the shared transformer block). The probe then checks that
    resid_pre + the mixer's output is the layer's output."""
    for name, kid in layer.named_children():
        inner = child(kid, MIXER_NAMES)
        if inner is not None:
            return f"{name}.{inner[0]}", inner[1]
    return None


def _mlp_only_layer(i: int, layer: nn.Module, family: str) -> LayerBinding:
    """A block whose one sublayer is an MLP or MoE (single-sublayer trunks): no token mixer. The probe must find
    resid_post = resid_pre + the MLP's output, or refuse."""
    found = child(layer, MLP_NAMES + MIXER_NAMES + ATTN_NAMES)
    if found is None or not (child(found[1], EXPERTS_NAMES) or child(found[1], DOWN_NAMES)):
        kids = ", ".join(n for n, _ in layer.named_children())
        raise StructureError(
            f"{family} layer {i}: the config names an MLP block, but no child of the layer ({kids}) has experts or a "
            f"down projection among {DOWN_NAMES}."
        )
    name, mlp = found
    lb = LayerBinding(
        index=i,
        layer=layer,
        attn=mlp,  # never read: the registry refuses the attention and mixer points on an MLP-only block
        o_proj=mlp,
        mlp=mlp,
        mlp_in_module=mlp,
        mlp_out_module=mlp,
        names={"mlp": name},
        value_source="none",
        mlp_only=True,
    )
    _bind_mlp_parts(lb, mlp, family)
    return lb


def _bind_mlp_parts(lb: LayerBinding, mlp: nn.Module, family: str) -> None:
    """The router and experts, or the projections, of an MLP module found on a layer."""
    experts = child(mlp, EXPERTS_NAMES)
    if experts is not None:
        lb.sparse_moe, lb.experts = True, experts[1]
        r = child(mlp, ROUTER_NAMES)
        lb.router = r[1] if r else None
        return
    down = child(mlp, DOWN_NAMES)
    gate_after = child(mlp, MLP_OUT_GATE_NAMES)
    if down is None and gate_after is not None and child(mlp, CHANNEL_MIX_DOWN_NAMES) is not None:
        # a channel mix (RWKV): its value projection is the down projection, its key the up projection, and its
        # receptance a gate after the down projection (the probe keeps it only where it explains the output)
        down, up = child(mlp, CHANNEL_MIX_DOWN_NAMES), child(mlp, CHANNEL_MIX_UP_NAMES)
        assert down is not None
        lb.down_proj, lb.up_proj, lb.mlp_out_gate = down[1], up[1] if up else None, gate_after[1]
        return
    if down is None:
        raise StructureError(f"{family} layer {lb.index}: MLP has no down projection among {DOWN_NAMES}.")
    lb.down_proj = down[1]
    fgu = child(mlp, FUSED_GATE_UP_NAMES)
    if fgu is not None:
        lb.fused_gate_up = fgu[1]
    else:
        gate, up = child(mlp, GATE_NAMES), child(mlp, UP_NAMES)
        lb.gate_proj = gate[1] if gate else None
        lb.up_proj = up[1] if up else None


def _find_side_mlp(lb: LayerBinding) -> None:
    """Nominate a side MLP on the layer (SIDE_MLP_NAMES); the probe keeps it only where it reads the MLP's input."""
    side = child(lb.layer, SIDE_MLP_NAMES)
    if side is not None and lb.mlp is not None and side[1] is not lb.mlp:
        lb.mlp_side = side[1]
        lb.names["mlp_side"] = side[0]
