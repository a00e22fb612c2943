"""Translating ie_lab addresses to and from TransformerLens and nnsight/nnterp names.

The spellings live in the point registry (``Point.tl_legacy``, ``Point.tl_bridge``, ``Point.nnterp``);
this module adds what depends on the model: TransformerLens' block-level ``hook_attn_out`` /
``hook_mlp_out`` are taken where the sublayer's output joins the residual, so they are ``attn_out`` /
``mlp_out`` on a plain pre-norm family but ``attn_out_post`` / ``mlp_out_post`` on families with a
post-sublayer norm (Gemma 2/3, OLMo 2) or a residual multiplier (Granite). Names with no faithful
equivalent are refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from . import points as _points
from .address import Address, AddressLike
from .arch import quirks
from .arch.config_facts import ArchFacts
from .errors import AddressError, InputError, did_you_mean

ENGINES = ("transformerlens", "transformerlens_bridge", "nnterp")


@dataclass(frozen=True)
class _Shape:
    """The structural facts a translation depends on."""

    family: str
    post_attn: bool  # attention's output is transformed (norm and/or multiplier) before the residual add
    post_mlp: bool
    post_norm: bool  # that transform is a norm (TransformerBridge then names it ln1_post / ln2_post)
    pre_norms: bool
    parallel: bool
    gated: bool
    qk_norm: bool
    moe_layers: tuple[int, ...]
    moe_everywhere: bool = False  # from a family name: every layer routes (the layer count is not known)
    live: bool = False  # measured on a loaded model (absent points are then refused by taps.resolve)
    attn_in_module: bool = False  # attention weights computed inside the family's own module (no scores)
    probs_need_eager: bool = False  # ... and under sdpa even the probabilities never leave it
    attn_gate: bool = False
    # From a family name: facts that the checkpoint's config decides, with the config keys that decide them.
    depends: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def need(self, fact: str, what: str) -> None:
        """Refuse when `what` hangs on a fact that a family name alone does not settle."""
        keys = dict(self.depends).get(fact)
        if keys:
            raise AddressError(
                f"{what} on {self.family} depends on the checkpoint's config ({', '.join(keys)}), which a family "
                "name does not give: pass the loaded model (or its Session), or its config."
            )

    def routes(self, layer: int | None) -> bool:
        """Whether this layer's MLP is a routed mixture of experts."""
        if layer is None:
            return False
        self.need("moe_layers", f"whether layer {layer} routes to experts")
        return self.moe_everywhere or layer in self.moe_layers


# Config keys that switch a structural fact on or off per checkpoint (the ones ArchFacts.from_config reads).
_SWITCHES = {
    "parallel": ("use_parallel_residual", "parallel_attn", "parallel_block", "new_decoder_architecture"),
    "qk_norm": ("use_qk_norm", "qk_layernorm", "qk_norm"),
    "moe_layers": ("decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace"),
    "post": ("residual_multiplier",),
}


def _attention_facts(family: str) -> tuple[bool, bool]:
    """(attention computed in the family's own module, its probabilities only on the eager code path). The
    second comes from the model class transformers registers: one that supports sdpa is loaded with it."""
    if family not in quirks.ATTENTION_IN_MODULE:
        return False, False
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family, ""), None)
    return True, bool(getattr(cls, "_supports_sdpa", False))


def _family_facts(name: str) -> ArchFacts:
    """A family name resolved the way a loaded model's config would be: transformers' config class for that
    model_type, read by ArchFacts.from_config with the quirks table. Refuses names it cannot resolve."""
    from transformers import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        raise AddressError(
            f"unknown model family {name!r}: transformers has no model_type of that name."
            f"{did_you_mean(name, list(CONFIG_MAPPING.keys()))} Pass the loaded model (or its "
            "Session), or its config, and the structure is read from it."
        )
    _require_measured(name)
    return ArchFacts.from_config(CONFIG_MAPPING[name]())


def _require_measured(family: str) -> None:
    if family not in quirks.STRUCTURE_MEASURED:
        raise AddressError(
            f"ie_lab has not measured the block structure of {family!r} (where its norms sit, whether its sublayers "
            "run in parallel), so without the model it cannot say which tensor another engine's name holds there. "
            "Pass the loaded model (or its Session): the binder measures it."
        )


def _shape(model: Any) -> _Shape:
    lm = getattr(model, "_lm", model)
    binding = getattr(lm, "binding", None)
    if binding is not None:
        lb = binding.layers[0]
        st = binding.structure
        return _Shape(
            binding.family,
            lb.post_attn_norm is not None or lb.attn_multiplier is not None,
            lb.post_mlp_norm is not None or lb.mlp_multiplier is not None,
            lb.post_attn_norm is not None,
            lb.input_norm is not None,
            lb.parallel,
            bool(st["gated_mlp"]),
            st["qk_norm"],
            st["moe_layers"],
            live=True,
        )
    by_name = isinstance(model, str)
    if by_name:
        facts = _family_facts(model.strip())
    elif isinstance(model, ArchFacts):
        facts = model
    elif isinstance(getattr(lm, "facts", None), ArchFacts):  # a model computed elsewhere (vLLM): its config's facts
        facts = lm.facts
    else:
        try:
            facts = ArchFacts.from_config(model)
        except (TypeError, ValueError) as e:
            raise InputError(
                f"model must be a loaded model, a Session, a family name (a transformers model_type such "
                f"as 'llama'), a config or ArchFacts; got {type(model).__name__} ({e})."
            ) from None
    if not by_name:
        _require_measured(facts.model_type)
    raw = facts.raw or {}
    depends: list[tuple[str, tuple[str, ...]]] = []
    if by_name:
        always = {"parallel": quirks.ALWAYS_PARALLEL, "qk_norm": quirks.ALWAYS_QK_NORM}
        for fact, keys in _SWITCHES.items():
            present = tuple(k for k in keys if k in raw)
            if present and facts.model_type not in always.get(fact, ()) and (fact != "moe_layers" or facts.is_moe):
                depends.append((fact, present))
    mult = bool(facts.residual_multiplier and facts.residual_multiplier != 1)
    post = facts.sandwich_norms or mult
    in_module, probs_eager = _attention_facts(facts.model_type)
    attn_impl = raw.get("_attn_implementation") or raw.get("attn_implementation")
    return _Shape(
        facts.model_type,
        post,
        post,
        facts.sandwich_norms,
        facts.pre_norms,
        facts.parallel_block,
        facts.gated_mlp,
        facts.qk_norm,
        facts.moe_layers,
        moe_everywhere=by_name and facts.is_moe,
        attn_in_module=in_module,
        probs_need_eager=probs_eager and attn_impl != "eager",
        attn_gate=bool(raw.get("attn_output_gate") or raw.get("use_gated_attention") or raw.get("gated_attention")),
        depends=tuple(depends),
    )


def _structure(s: _Shape, layer: int | None) -> _points.Structure:
    """The registry's view of this shape at one layer (a family name may only say that every layer routes)."""
    return _points.Structure(
        s.family,
        qk_norm=s.qk_norm,
        parallel=s.parallel,
        gated_mlp=s.gated,
        moe_layers=(layer,) if layer is not None and s.routes(layer) else (),  # routes(None) is False too
        attn_gate=s.attn_gate,
    )


def _refuse_absent(addr: Address, s: _Shape) -> None:
    """Without a loaded model: the registry's structural absence (points.absence, which taps.resolve refuses on a
    loaded model), so that no name is handed out for a point the family does not have; first, that the family
    name settles each fact the point needs."""
    name, L = addr.name, addr.layer
    needs = addr.point.needs
    if _points.Needs.SEQUENTIAL in needs:
        s.need("parallel", f"whether it has a residual between attention and MLP ({name})")
    if _points.Needs.QK_NORM in needs:
        s.need("qk_norm", f"whether it normalises queries and keys ({name})")
    layer = L if {_points.Needs.MOE, _points.Needs.DENSE_MLP} & set(needs) else None  # routes() asks the config
    a = _points.absence(addr.point, _structure(s, layer), L)
    if a is not None and a.need is not _points.Needs.QK_NORM:  # refused in to_engine, saying what hook_q is then
        raise AddressError(f"{addr} does not exist on {s.family}: {a.why}")
    if name == "attn_scores" and s.attn_in_module and s.family not in quirks.SCORES_AT_ATTENTION_STEP:
        raise AddressError(
            f"{s.family} computes attention inside its own module, so the pre-softmax scores never "
            "leave it (capture attn_probs)."
        )
    if name == "attn_probs" and s.probs_need_eager:
        raise AddressError(
            f"{s.family}'s attention probabilities exist only on its eager code path, and the default "
            "is sdpa: load the model with attn_implementation='eager' and pass it."
        )


_FOREIGN = quirks.FOREIGN_ENGINE_CONVENTIONS

# Names of other engines that have no ie_lab equivalent, and why.
_NO_EQUIVALENT = {
    "hook_pos_embed": "positional embeddings are not a point of their own; on learned-position families "
    "resid_pre.0 - embeddings is that sum.",
    "hook_q": "ie_lab has no pre-RoPE query point except on QK-norm families (q_norm_in / q_norm_out); the post-RoPE "
    "queries are what attn_scores is built from.",
    "hook_k": "as hook_q, for keys (k_norm_in / k_norm_out on QK-norm families).",
    "hook_rot_q": "post-RoPE queries are not exposed as a point; attn_scores is q·k from them.",
    "hook_rot_k": "post-RoPE keys are not exposed as a point; attn_scores is q·k from them.",
    "ln1.hook_scale": "norm scales are not points; attn_in is the normalised output.",
    "ln2.hook_scale": "norm scales are not points; mlp_in is the normalised output.",
    "ln1.hook_normalized": "it is x / RMS before the norm's own weight is applied (equal to attn_in only on models with "
    "folded norms); the weighted output is attn_in (TransformerBridge: blocks.L.ln1.hook_out).",
    "ln2.hook_normalized": "it is x / RMS before the norm's own weight is applied; the weighted output is mlp_in "
    "(TransformerBridge: blocks.L.ln2.hook_out).",
    "ln_final.hook_normalized": "it is x / RMS before the final norm's weight; the weighted output is final_norm "
    "(TransformerBridge: ln_final.hook_out).",
    "hook_attn_in": "it is the pre-norm residual (resid_pre.L, repeated per head), not the normalised attn_in.",
    "hook_mlp_in": "it is the pre-norm residual (resid_mid.L), not the normalised mlp_in.",
    "hook_expert_weights": "HookedTransformer's is the softmax over all experts before top-k; ie_lab's expert_weights "
    "holds only the selected experts' weights (zeros elsewhere): take router_logits.L.softmax(-1).",
    "hook_expert_indices": "TransformerLens holds k expert indices per token; ie_lab's expert_indices is a dense 0/1 "
    "mask: take expert_indices.L.nonzero().",
    "gate.hook_expert_indices": "TransformerBridge holds k expert indices per token; ie_lab's expert_indices is a dense "
    "0/1 mask: take expert_indices.L.nonzero().",
    "logits": "the final logits are the model output (after any soft-capping or scaling), not a point: capture "
    "lm_head for the raw unembedding.",
}


def _templates(engine: str) -> list[tuple[str, str]]:
    """(point name, template) pairs for an engine, from the registry."""
    attr = {"transformerlens": "tl_legacy", "transformerlens_bridge": "tl_bridge", "nnterp": "nnterp"}[engine]
    out = []
    for p in _points.all_points():
        for t in getattr(p, attr):
            out.append((p.name, t))
    return out


def _to_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{L}"), r"([0-9]+)") + "$")


def to_engine(address: AddressLike, model: Any, engine: str = "transformerlens") -> str:
    """The other engine's name for an ie_lab address on this model (a loaded model or Session, a config, or a
    family name; see docs/MAPPERS.md for what a family name can and cannot settle)."""
    if engine not in ENGINES:
        raise InputError(
            f"unknown engine {engine!r}: engine must be one of {', '.join(map(repr, ENGINES))}."
            f"{did_you_mean(str(engine), ENGINES)}"
        )
    addr = Address.parse(address)
    if addr.head is not None or addr.stream is not None:
        raise AddressError(f"translate the whole point ({addr.without_head()}) and slice heads on the other side.")
    s = _shape(model)
    name = addr.name
    L = addr.layer
    lm = getattr(model, "_lm", model)
    if getattr(lm, "binding", None) is not None:
        from .eager.taps import resolve
        from .errors import CapabilityUnsupported, PointAbsent

        try:
            resolve(lm, addr.check(lm.facts))
        except (PointAbsent, CapabilityUnsupported) as e:
            raise AddressError(f"{addr} has no name in {engine} on this model: {e}") from None
    else:
        _refuse_absent(addr, s)
    fq = _FOREIGN.get(s.family, {})
    eng_name = {
        "transformerlens": "TransformerLens",
        "transformerlens_bridge": "TransformerBridge",
        "nnterp": "nnterp",
    }[engine]

    def differs(why: str) -> AddressError:
        return AddressError(f"{addr} has no faithful {eng_name} name on {s.family}: {why}")

    emb_mult = (
        bool(getattr(getattr(lm, "facts", None), "embedding_multiplier", None))
        or s.family in quirks.EMBEDDING_MULTIPLIER
    )
    if name == "embeddings" and engine.startswith("transformerlens"):
        if emb_mult:
            raise differs(
                "TransformerLens' embedding hooks include the family's embedding multiplier, which "
                "ie_lab's embeddings (the embedding module's output) do not; that product is resid_pre.0."
            )
        if fq.get("tl_embed_after_norm") and engine == "transformerlens":
            raise differs(
                "HookedTransformer's hook_embed is taken after the embedding norm (that is resid_pre.0); "
                "TransformerBridge's embed.hook_out is this point."
            )
    if fq.get("modules_add_residual") and name in ("attn_out", "mlp_out", "attn_out_post", "mlp_out_post"):
        raise differs(
            "its attention and MLP modules add the residual themselves, so the other engine's module-output "
            "names hold contribution + residual (resid_mid / resid_post), not this point."
        )
    if fq.get("tl_scores_are_pattern") and name == "attn_scores" and engine.startswith("transformerlens"):
        raise differs("TransformerLens' hook_attn_scores on this family holds the post-softmax pattern.")
    if fq.get("qk_norm_after_rope") and name in ("q_norm_in", "k_norm_in") and engine.startswith("transformerlens"):
        raise differs("this family normalises queries and keys after RoPE, but hook_q / hook_k are taken before it.")
    if fq.get("mlp_adds_residual") and name in ("mlp_out", "mlp_out_post") and engine != "transformerlens":
        raise differs(
            "its MLP module adds the residual itself, so the other engine's MLP module-output name holds "
            "contribution + residual (resid_post), not this point."
        )
    if fq.get("q_proj_holds_gate") and name == "q_norm_in" and engine == "transformerlens":
        raise differs(
            "its query projection emits each head's query and output gate together, so hook_q holds both halves; "
            "q_norm_in is the query half alone."
        )
    if fq.get("value_normed") and name == "value" and engine.startswith("transformerlens"):
        raise differs("it normalises values after v_proj (v_norm), but hook_v / v.hook_out are taken before it.")
    if (
        fq.get("tl_sublayer_outputs_differ")
        and name in ("attn_out", "attn_out_post", "mlp_out", "mlp_out_post")
        and engine.startswith("transformerlens")
    ):
        raise differs(
            "with its post-sublayer norms, TransformerBridge's hook_attn_out / hook_mlp_out and attn / mlp.hook_out "
            "hold other tensors than the raw or normed sublayer output (measured by validator/)."
        )
    if fq.get("z_sub_normed") and name == "z" and engine.startswith("transformerlens"):
        raise differs(
            "it normalises the heads' output (attn_sub_norm) before the output projection, and hook_z / o.hook_in "
            "are taken after that norm; z is the kernel's output, attn_probs @ value."
        )
    if fq.get("nnterp_attention_is_wrapper") and name in ("attn_in", "attn_out") and engine == "nnterp":
        raise differs(
            "nnterp's attention accessors sit on the norm_attn_norm wrapper (input norm, attention and the norm "
            "after it), so they hold the wrapper's input and output, not the attention module's."
        )
    if fq.get("mlp_module_partial") and name in ("mlp_out", "mlp_out_post") and engine != "transformerlens":
        raise differs(
            "the layer adds a shared MLP beside its MoE block, so the other engine's MLP module-output name holds "
            "the MoE part alone; ie_lab's mlp_out is their sum."
        )
    if fq.get("no_v_module") and name == "value" and engine == "transformerlens_bridge":
        raise differs("latent attention has no value projection module for attn.v.hook_out to sit on.")
    if fq.get("no_gate_router") and name == "router_logits" and engine == "transformerlens_bridge":
        raise differs("its router is not the mlp.gate module that TransformerBridge hooks.")
    if name == "resid_mid" and engine == "transformerlens_bridge" and not s.pre_norms:
        return f"blocks.{L}.mlp.hook_in"  # no ln2 on post-norm-only families: the MLP reads the residual itself
    if engine == "transformerlens":
        # Block-level outputs: which ie_lab point TransformerLens' name stands for depends on the family.
        if name in ("attn_out", "attn_out_post", "mlp_out", "mlp_out_post"):
            hook = "hook_attn_out" if name.startswith("attn") else "hook_mlp_out"
            s.need(
                "post",
                f"which tensor blocks.{L}.{hook} holds (the sublayer output times a residual multiplier "
                "unless it is 1)",
            )
            post = s.post_attn if name.startswith("attn") else s.post_mlp
            if name.endswith("_post") or not post:
                return f"blocks.{L}.{hook}"
            raise AddressError(
                f"{addr} has no TransformerLens legacy name on {s.family}: there blocks.{L}.{hook} is taken after the "
                f"post-sublayer norm/multiplier, i.e. it is {name}_post.{L}. The raw output is "
                f"{to_engine(addr, model, 'transformerlens_bridge')} on TransformerBridge."
            )
    if _points.Needs.QK_NORM in addr.point.needs and not s.qk_norm:  # (by name: settled above)
        raise AddressError(
            f"{s.family} has no QK-norm, so {name} does not exist there (TransformerLens' hook_q / "
            "hook_k are then plain projections with no ie_lab point)."
        )
    if engine == "transformerlens_bridge":
        if name in ("attn_out_post", "mlp_out_post"):
            s.need("post", f"whether {name} differs from the raw sublayer output (a residual multiplier other than 1)")
            post, norm = (s.post_attn, s.post_norm) if name.startswith("attn") else (s.post_mlp, s.post_norm)
            if not post:
                return to_engine(Address(name[:-5], L), model, engine)  # equal to the raw output here
            if not norm:
                raise AddressError(
                    f"{addr} on {s.family} is the raw output times a residual multiplier; "
                    "TransformerBridge has no hook for that product."
                )
        if name == "mlp_pre" and not s.gated:
            return f"blocks.{L}.mlp.in.hook_out"
        if name == "mlp_pre_linear" and not s.gated:
            raise AddressError(f"{s.family}'s MLP is not gated, so there is no mlp_pre_linear.")
    for point, template in _templates(engine):
        if point == name:
            return template.replace("{L}", str(L))
    raise AddressError(f"{engine} has no name for {name}: {_points.get(name).definition}")


def from_engine(name: str, model: Any, engine: str = "transformerlens") -> Address:
    """The ie_lab address for another engine's name on this model; refused where no faithful equivalent exists."""
    addr = _from_engine(name, model, engine)
    lm = getattr(model, "_lm", model)
    facts = lm if isinstance(lm, ArchFacts) else getattr(lm, "facts", None)
    if facts is None and not isinstance(model, str):
        facts = ArchFacts.from_config(model)  # a config (it was read once already, so it reads)
    if facts is not None:
        addr.check(facts)  # a model or config knows its layer count; a family name does not
    return addr


def _from_engine(name: str, model: Any, engine: str) -> Address:
    if engine not in ENGINES:
        raise InputError(
            f"unknown engine {engine!r}: engine must be one of {', '.join(map(repr, ENGINES))}."
            f"{did_you_mean(str(engine), ENGINES)}"
        )
    if not isinstance(name, str):
        raise InputError(
            f"name must be the other engine's name as a string (e.g. 'blocks.3.hook_resid_post'), "
            f"got {type(name).__name__}."
        )
    s = _shape(model)
    text = name.strip()
    fq = _FOREIGN.get(s.family, {})
    lm = getattr(model, "_lm", model)
    emb_mult = (
        bool(getattr(getattr(lm, "facts", None), "embedding_multiplier", None))
        or s.family in quirks.EMBEDDING_MULTIPLIER
    )
    if engine.startswith("transformerlens") and text in ("hook_embed", "embed.hook_out"):
        if emb_mult or (fq.get("tl_embed_after_norm") and text == "hook_embed"):
            return Address("resid_pre", 0)  # scaled / normalised embedding: what layer 0 reads
    if fq.get("modules_add_residual"):
        m = re.fullmatch(r"blocks\.([0-9]+)\.(attn|mlp)\.hook_out|(attentions|mlps)_output\[([0-9]+)\]", text)
        if m:
            L = int(m.group(1) or m.group(4))
            which = m.group(2) or ("attn" if m.group(3) == "attentions" else "mlp")
            return Address("resid_mid" if which == "attn" else "resid_post", L)
        if re.fullmatch(r"blocks\.[0-9]+\.hook_(attn|mlp)_out", text):
            raise AddressError(
                f"{text} on {s.family}: its modules add the residual themselves, so this name's "
                "tensor is not a sublayer output ie_lab can vouch for; capture attn_out / mlp_out."
            )
    if fq.get("mlp_adds_residual"):
        m = re.fullmatch(r"blocks\.([0-9]+)\.mlp\.hook_out|mlps_output\[([0-9]+)\]", text)
        if m:  # the MLP module's output is MLP + residual: the block's output
            return Address("resid_post", int(m.group(1) or m.group(2)))
    if fq.get("q_proj_holds_gate") and re.fullmatch(r"blocks\.[0-9]+\.attn\.(hook_q|q\.hook_out)", text):
        raise AddressError(
            f"{text} on {s.family} holds each head's query and output gate together: no ie_lab point holds it "
            "(q_norm_in is the query half, attn_gate the activated gate)."
        )
    if fq.get("value_normed") and re.fullmatch(r"blocks\.[0-9]+\.attn\.(hook_v|v\.hook_out)", text):
        raise AddressError(
            f"{text} on {s.family} is taken before the value norm (v_norm): no ie_lab point holds it; value is "
            "the normed value attention mixes."
        )
    if fq.get("tl_sublayer_outputs_differ") and re.fullmatch(
        r"blocks\.[0-9]+\.(hook_(attn|mlp)_out|(attn|mlp)\.hook_out)", text
    ):
        raise AddressError(
            f"{text} on {s.family} holds another tensor than the raw or normed sublayer output (its post-sublayer "
            "norms; measured by validator/): capture attn_out / mlp_out (or their _post) instead."
        )
    if fq.get("z_sub_normed") and re.fullmatch(r"blocks\.[0-9]+\.attn\.(hook_z|o\.hook_in)", text):
        raise AddressError(
            f"{text} on {s.family} is taken after the heads' sub-norm (attn_sub_norm): no ie_lab point holds it; z "
            "is the kernel's output before that norm."
        )
    if fq.get("nnterp_attention_is_wrapper") and re.fullmatch(r"attentions_(input|output)\[[0-9]+\]", text):
        raise AddressError(
            f"{text} on {s.family} sits on the norm_attn_norm wrapper (input norm, attention, post-attention norm): "
            "capture attn_in / attn_out (the attention module's own input and output) instead."
        )
    if fq.get("mlp_module_partial") and re.fullmatch(r"blocks\.[0-9]+\.mlp\.hook_out|mlps_output\[[0-9]+\]", text):
        raise AddressError(
            f"{text} on {s.family} is the MoE block's output alone; the layer adds a shared MLP beside it, and "
            "mlp_out is their sum: no ie_lab point holds the MoE part."
        )
    if fq.get("tl_scores_are_pattern") and re.fullmatch(r"blocks\.[0-9]+\.attn\.hook_attn_scores", text):
        raise AddressError(f"{text} on {s.family} holds the post-softmax pattern in TransformerLens: use attn_probs.")
    if fq.get("qk_norm_after_rope") and re.fullmatch(r"blocks\.[0-9]+\.attn\.hook_[qk]", text):
        raise AddressError(
            f"{text} is taken before RoPE, but {s.family} normalises rotated queries/keys: no ie_lab point holds it."
        )
    m = re.fullmatch(r"blocks\.([0-9]+)\.hook_(attn|mlp)_out", text)
    if m and engine.startswith("transformerlens"):  # the legacy alias is also live on TransformerBridge
        L, which = int(m.group(1)), m.group(2)
        s.need("post", f"which tensor {text} holds (the sublayer output times a residual multiplier unless it is 1)")
        post = s.post_attn if which == "attn" else s.post_mlp
        return Address(f"{which}_out_post" if post else f"{which}_out", L)
    if engine == "transformerlens_bridge":
        m = re.fullmatch(r"blocks\.([0-9]+)\.mlp\.(gate|in)\.hook_out", text)
        if m:
            L, which = int(m.group(1)), m.group(2)
            if which == "gate":
                return Address("router_logits" if s.routes(L) else "mlp_pre", L)
            return Address("mlp_pre_linear" if s.gated else "mlp_pre", L)
    m = re.fullmatch(r"blocks\.([0-9]+)\.attn\.hook_([qk])", text)
    if m:
        s.need("qk_norm", f"which tensor {text} holds (a QK-norm's input, or a plain projection)")
    if m and not s.qk_norm:
        raise AddressError(
            f"{text} is the plain {m.group(2)} projection on {s.family} (no QK-norm); ie_lab has no such "
            "point: attn_scores holds q·k."
        )
    for point, template in _templates(engine):
        m = _to_regex(template).match(text)
        if m:
            if _points.Needs.SEQUENTIAL in _points.get(point).needs:
                s.need("parallel", f"whether {text} exists (attention and MLP in sequence or in parallel)")
                why = _points.absent_reason(point, _structure(s, None))
                if why is not None:
                    raise AddressError(f"{text} does not exist on {s.family}: {why}")
            return Address(point, int(m.group(1)) if m.groups() else None)
    tail = re.sub(r"^blocks\.[0-9]+\.(attn\.|mlp\.)?", "", text)
    if tail.startswith(("q_norm.", "k_norm.")) and tail.endswith("hook_normalized"):
        tail = "ln1.hook_normalized"
    if tail in _NO_EQUIVALENT or text in _NO_EQUIVALENT:
        raise AddressError(
            f"{text} has no faithful ie_lab equivalent: {_NO_EQUIVALENT.get(tail) or _NO_EQUIVALENT[text]}"
        )
    known = [t.replace("{L}", "0") for _, t in _templates(engine)]
    raise AddressError(f"unknown {engine} name {text!r}.{did_you_mean(text, known)}")


def table(model: Any, layer: int = 0) -> list[dict[str, str]]:
    """Every point with its names in each engine on this model (empty where none), for docs and the picker."""
    rows = []
    for p in _points.all_points():
        if p.multi_stream_only:
            continue
        addr = Address(p.name, layer if p.scope is _points.Scope.LAYER else None)
        row = {"address": str(addr)}
        for engine in ENGINES:
            try:
                row[engine] = to_engine(addr, model, engine)
            except AddressError:
                row[engine] = ""
        rows.append(row)
    return rows
