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
from .errors import AddressError, did_you_mean

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


def _shape(model: Any) -> _Shape:
    lm = getattr(model, "_lm", model)
    binding = getattr(lm, "binding", None)
    if binding is not None:
        lb = binding.layers[0]
        st = binding.structure
        return _Shape(binding.family, lb.post_attn_norm is not None or lb.attn_multiplier is not None,
                      lb.post_mlp_norm is not None or lb.mlp_multiplier is not None, lb.post_attn_norm is not None,
                      lb.input_norm is not None, lb.parallel, bool(st["gated_mlp"]), st["qk_norm"], st["moe_layers"])
    if isinstance(model, str):
        from .arch import quirks

        placement = quirks.NORM_PLACEMENT.get(model, "pre")
        post = placement in ("sandwich", "post")
        return _Shape(model, post, post, post, placement in ("pre", "sandwich"), model in quirks.ALWAYS_PARALLEL,
                      model not in quirks.UNGATED_MLP, model in quirks.ALWAYS_QK_NORM, ())
    facts = model if isinstance(model, ArchFacts) else ArchFacts.from_config(model)
    mult = bool(facts.residual_multiplier and facts.residual_multiplier != 1)
    post = facts.sandwich_norms or mult
    return _Shape(facts.model_type, post, post, facts.sandwich_norms, facts.pre_norms, facts.parallel_block,
                  facts.gated_mlp, facts.qk_norm, facts.moe_layers)


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
    "hook_result": "per-head outputs (z times each head's slice of W_O) are a computation, not a module output: "
                   "take z.L and the output projection's weight.",
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
    return re.compile("^" + re.escape(template).replace(re.escape("{L}"), r"(\d+)") + "$")


def to_engine(address: AddressLike, model: Any, engine: str = "transformerlens") -> str:
    """The other engine's name for an ie_lab address on this model (or family name / config)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    addr = Address.parse(address)
    if addr.head is not None or addr.stream is not None:
        raise AddressError(f"translate the whole point ({addr.without_head()}) and slice heads on the other side.")
    s = _shape(model)
    name = addr.name
    L = addr.layer
    lm = getattr(model, "_lm", model)
    if getattr(lm, "binding", None) is not None:
        from .errors import CapabilityUnsupported, PointAbsent
        from .eager.taps import resolve

        try:
            resolve(lm, addr.check(lm.facts))
        except (PointAbsent, CapabilityUnsupported) as e:
            raise AddressError(f"{addr} has no name in {engine} on this model: {e}") from None
    elif name in ("router_logits", "expert_weights", "expert_indices") and L not in s.moe_layers:
        raise AddressError(f"layer {L} of {s.family} has no router, so {name} does not exist there.")
    fq = _FOREIGN.get(s.family, {})
    eng_name = {"transformerlens": "TransformerLens", "transformerlens_bridge": "TransformerBridge",
                "nnterp": "nnterp"}[engine]

    def differs(why: str) -> AddressError:
        return AddressError(f"{addr} has no faithful {eng_name} name on {s.family}: {why}")

    emb_mult = bool(getattr(getattr(lm, "facts", None), "embedding_multiplier", None)) or s.family in quirks.EMBEDDING_MULTIPLIER
    if name == "embeddings" and engine.startswith("transformerlens"):
        if emb_mult:
            raise differs("TransformerLens' embedding hooks include the family's embedding multiplier, which "
                          "ie_lab's embeddings (the embedding module's output) do not; that product is resid_pre.0.")
        if fq.get("tl_embed_after_norm") and engine == "transformerlens":
            raise differs("HookedTransformer's hook_embed is taken after the embedding norm (that is resid_pre.0); "
                          "TransformerBridge's embed.hook_out is this point.")
    if fq.get("modules_add_residual") and name in ("attn_out", "mlp_out", "attn_out_post", "mlp_out_post"):
        raise differs("its attention and MLP modules add the residual themselves, so the other engine's module-output "
                      "names hold contribution + residual (resid_mid / resid_post), not this point.")
    if fq.get("tl_scores_are_pattern") and name == "attn_scores" and engine.startswith("transformerlens"):
        raise differs("TransformerLens' hook_attn_scores on this family holds the post-softmax pattern.")
    if fq.get("qk_norm_after_rope") and name in ("q_norm_in", "k_norm_in") and engine.startswith("transformerlens"):
        raise differs("this family normalises queries and keys after RoPE, but hook_q / hook_k are taken before it.")
    if fq.get("no_v_module") and name == "value" and engine == "transformerlens_bridge":
        raise differs("latent attention has no value projection module for attn.v.hook_out to sit on.")
    if fq.get("no_gate_router") and name == "router_logits" and engine == "transformerlens_bridge":
        raise differs("its router is not the mlp.gate module that TransformerBridge hooks.")
    if name == "resid_mid" and engine == "transformerlens_bridge" and not s.pre_norms:
        return f"blocks.{L}.mlp.hook_in"  # no ln2 on post-norm-only families: the MLP reads the residual itself
    if engine == "transformerlens":
        # Block-level outputs: which ie_lab point TransformerLens' name stands for depends on the family.
        if name in ("attn_out", "attn_out_post", "mlp_out", "mlp_out_post"):
            post = s.post_attn if name.startswith("attn") else s.post_mlp
            hook = "hook_attn_out" if name.startswith("attn") else "hook_mlp_out"
            if name.endswith("_post") or not post:
                return f"blocks.{L}.{hook}"
            raise AddressError(
                f"{addr} has no TransformerLens legacy name on {s.family}: there blocks.{L}.{hook} is taken after the "
                f"post-sublayer norm/multiplier, i.e. it is {name}_post.{L}. The raw output is "
                f"{to_engine(addr, model, 'transformerlens_bridge')} on TransformerBridge."
            )
    if name in ("q_norm_in", "k_norm_in", "q_norm_out", "k_norm_out") and not s.qk_norm:
        raise AddressError(f"{s.family} has no QK-norm, so {name} does not exist there (TransformerLens' hook_q / "
                           "hook_k are then plain projections with no ie_lab point).")
    if engine == "transformerlens_bridge":
        if name in ("attn_out_post", "mlp_out_post"):
            post, norm = (s.post_attn, s.post_norm) if name.startswith("attn") else (s.post_mlp, s.post_norm)
            if not post:
                return to_engine(Address(name[:-5], L), model, engine)  # equal to the raw output here
            if not norm:
                raise AddressError(f"{addr} on {s.family} is the raw output times a residual multiplier; "
                                   "TransformerBridge has no hook for that product.")
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
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    s = _shape(model)
    text = name.strip()
    fq = _FOREIGN.get(s.family, {})
    lm = getattr(model, "_lm", model)
    emb_mult = bool(getattr(getattr(lm, "facts", None), "embedding_multiplier", None)) or s.family in quirks.EMBEDDING_MULTIPLIER
    if engine.startswith("transformerlens") and text in ("hook_embed", "embed.hook_out"):
        if emb_mult or (fq.get("tl_embed_after_norm") and text == "hook_embed"):
            return Address("resid_pre", 0)  # scaled / normalised embedding: what layer 0 reads
    if fq.get("modules_add_residual"):
        m = re.fullmatch(r"blocks\.(\d+)\.(attn|mlp)\.hook_out|(attentions|mlps)_output\[(\d+)\]", text)
        if m:
            L = int(m.group(1) or m.group(4))
            which = m.group(2) or ("attn" if m.group(3) == "attentions" else "mlp")
            return Address("resid_mid" if which == "attn" else "resid_post", L)
        if re.fullmatch(r"blocks\.\d+\.hook_(attn|mlp)_out", text):
            raise AddressError(f"{text} on {s.family}: its modules add the residual themselves, so this name's "
                               "tensor is not a sublayer output ie_lab can vouch for; capture attn_out / mlp_out.")
    if fq.get("tl_scores_are_pattern") and re.fullmatch(r"blocks\.\d+\.attn\.hook_attn_scores", text):
        raise AddressError(f"{text} on {s.family} holds the post-softmax pattern in TransformerLens: use attn_probs.")
    if fq.get("qk_norm_after_rope") and re.fullmatch(r"blocks\.\d+\.attn\.hook_[qk]", text):
        raise AddressError(f"{text} is taken before RoPE, but {s.family} normalises rotated queries/keys: no ie_lab "
                           "point holds it.")
    m = re.fullmatch(r"blocks\.(\d+)\.hook_(attn|mlp)_out", text)
    if m and engine.startswith("transformerlens"):  # the legacy alias is also live on TransformerBridge
        L, which = int(m.group(1)), m.group(2)
        post = s.post_attn if which == "attn" else s.post_mlp
        return Address(f"{which}_out_post" if post else f"{which}_out", L)
    if engine == "transformerlens_bridge":
        m = re.fullmatch(r"blocks\.(\d+)\.mlp\.(gate|in)\.hook_out", text)
        if m:
            L, which = int(m.group(1)), m.group(2)
            if which == "gate":
                return Address("router_logits" if L in s.moe_layers else "mlp_pre", L)
            return Address("mlp_pre_linear" if s.gated else "mlp_pre", L)
    m = re.fullmatch(r"blocks\.(\d+)\.attn\.hook_([qk])", text)
    if m and not s.qk_norm:
        raise AddressError(f"{text} is the plain {m.group(2)} projection on {s.family} (no QK-norm); ie_lab has no such "
                           "point: attn_scores holds q·k.")
    for point, template in _templates(engine):
        m = _to_regex(template).match(text)
        if m:
            if point == "resid_mid" and s.parallel:
                raise AddressError(f"{text} does not exist on {s.family}: attention and MLP run in parallel, so there "
                                   "is no residual between them.")
            return Address(point, int(m.group(1)) if m.groups() else None)
    tail = re.sub(r"^blocks\.\d+\.(attn\.|mlp\.)?", "", text)
    if tail.startswith(("q_norm.", "k_norm.")) and tail.endswith("hook_normalized"):
        tail = "ln1.hook_normalized"
    if tail in _NO_EQUIVALENT or text in _NO_EQUIVALENT:
        raise AddressError(f"{text} has no faithful ie_lab equivalent: {_NO_EQUIVALENT.get(tail) or _NO_EQUIVALENT[text]}")
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
