"""Which tensors to ask each engine for on one model, in its own names.

Runs in ie_lab's environment: the names come from ie_lab.mappers (TransformerLens, nnterp) and the module paths
from ie_lab's binding (plain hooks, nnsight). A point the engine has no faithful name for is "not asked", with the
mapper's reason; a point the family does not have (PointAbsent) is listed once per model and asked of nobody.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ie_lab import points as P
from ie_lab.address import Address
from ie_lab.errors import AddressError, CapabilityUnsupported, PointAbsent

from . import spec as S
from .spec import layers_for


@dataclass
class Ask:
    address: str
    name: str  # the engine's name for it, as shown in the tables
    spec: dict | None  # what the worker is sent; None: not asked
    reason: str = ""  # why not asked


@dataclass
class ModelPlan:
    family: str
    layers: list[int]
    addresses: list[str]  # every point ie_lab serves here, in registry order
    absent: dict[str, str] = field(default_factory=dict)  # point absent on this family -> ie_lab's reason
    ie_lab_refused: dict[str, str] = field(default_factory=dict)  # exists, but ie_lab's eager backend refuses it


def addresses(lm: Any, family: str) -> ModelPlan:
    from ie_lab.eager.taps import resolve

    layers = layers_for(lm.facts.n_layers)
    plan = ModelPlan(family, layers, [])
    for p in P.all_points():
        if p.multi_stream_only:
            continue
        for L in layers if p.scope is P.Scope.LAYER else [None]:
            a = Address(p.name, L)
            try:
                resolve(lm, a.check(lm.facts))
            except PointAbsent as e:
                plan.absent[str(a)] = str(e)
                continue
            except CapabilityUnsupported as e:
                plan.ie_lab_refused[str(a)] = str(e)
            plan.addresses.append(str(a))
    return plan


# ---- module paths (plain hooks and nnsight) ----------------------------------------------------------------------


def _module_specs(lm: Any) -> tuple[dict[int, str], Any]:
    names = {id(m): n for n, m in lm.hf.named_modules() if n}
    return names, lm.binding


def module_spec(lm: Any, address: str, tokens: int = 22) -> tuple[dict | None, str]:
    """(spec, reason): the HF module whose input or output is this point, read off the binding's roles.

    Deliberately not ie_lab's own ``taps.resolve``: where there is a choice it takes the *outer* module (the
    attention module's output rather than its output projection's, the MLP module rather than the last linear),
    so a binder that picked the wrong inner module shows up as a difference.
    """
    names, b = _module_specs(lm)
    a = Address.parse(address)
    name, L = a.name, a.layer

    def out(m, ops=()):
        return {"kind": "module", "path": names[id(m)], "side": "output", "ops": list(ops)}, ""

    def inp(m, ops=()):
        return {"kind": "module", "path": names[id(m)], "side": "input", "ops": list(ops)}, ""

    def scale(mult):
        return [f"scale:{mult!r}"] if mult not in (None, 1, 1.0) else []

    if name == "embeddings":
        return out(b.embed)
    if name == "final_norm":
        return out(b.final_norm) if b.final_norm is not None else (None, "no final norm")
    if name == "lm_head":
        return out(b.lm_head)
    lb = b.layers[L]
    if name == "resid_pre":
        return inp(lb.layer)
    if name == "resid_post":
        return out(lb.layer)
    if name == "attn_in":
        return inp(lb.attn)
    if name in ("q_norm_in", "q_norm_out", "k_norm_in", "k_norm_out"):
        m = lb.q_norm if name.startswith("q") else lb.k_norm
        if m is None:
            return None, "no QK-norm module"
        return inp(m) if name.endswith("_in") else out(m)
    if name == "value":
        if lb.v_proj is not None:
            return out(lb.v_proj)
        return None, "the values come out of a fused QKV projection: no module holds them alone"
    if name in ("attn_scores", "attn_probs"):
        return None, "computed inside the attention function, not a module boundary"
    if name == "z":
        # z is the kernel's output, attn_probs @ value: where a sub-norm sits between it and the output projection
        # that norm's input is the module boundary holding it; where the module itself reshapes it on the way (a
        # rotation, a grouped low-rank projection) no boundary holds it
        if getattr(lb, "z_sub_norm", None) is not None:
            return inp(lb.z_sub_norm)
        if getattr(lb, "z_at_kernel_why", ""):
            return None, f"no module boundary holds z: {lb.z_at_kernel_why}"
        return inp(lb.o_proj)
    if name == "attn_out":
        return out(lb.attn)
    if name == "attn_out_post":
        if lb.post_attn_norm is not None:
            return out(lb.post_attn_norm, scale(lb.attn_multiplier))
        return out(lb.attn, scale(lb.attn_multiplier))
    if name == "resid_mid":
        if lb.parallel:
            return None, "parallel block"
        return inp(lb.pre_mlp_norm if lb.pre_mlp_norm is not None else lb.mlp_in_module)
    if name == "mlp_in":
        return inp(lb.mlp_in_module)
    if name in ("mlp_pre", "mlp_pre_linear"):
        if lb.sparse_moe:
            return None, "sparse MoE layer"
        if lb.fused_gate_up is not None:
            gate_half = 0 if lb.fused_gate_first else 1
            half = gate_half if name == "mlp_pre" else 1 - gate_half
            return out(lb.fused_gate_up, [f"chunk:{half}"])
        if name == "mlp_pre":
            return out(lb.gate_proj if lb.gate_proj is not None else lb.up_proj)
        return out(lb.up_proj) if lb.gate_proj is not None else (None, "ungated MLP")
    if name == "mlp_act":
        return inp(lb.down_proj) if lb.down_proj is not None else (None, "no down projection")
    if name == "router_logits":
        if lb.router is None:
            return None, "no router module"
        if lb.router_output == -1:
            return None, "the router returns several expert-wide tensors, none its linear map"
        spec, _ = out(lb.router)
        # where the router returns several expert-wide tensors (Llama 4: top-k scores, then logits), the one the
        # binder measured as its linear map: every engine reads that element of the same module's output
        index = {} if lb.router_output is None else {"index": lb.router_output}
        return dict(spec, width=lm.facts.n_experts, tokens=tokens, **index), ""
    if name == "expert_weights" and lb.router is not None and lb.router_weights_output is not None:
        # the router hands the routing weights out dense, as one of its outputs, and the experts' input is scaled by
        # them (Llama 4: top-k sigmoid scores scattered into zeros, then the logits): that element of its output
        spec, _ = out(lb.router)
        return dict(spec, width=lm.facts.n_experts, tokens=tokens, index=lb.router_weights_output), ""
    if name in ("expert_weights", "expert_indices"):
        return None, "the top-k selection happens inside the MoE block: no module outputs it"
    mlp = lb.mlp if lb.mlp is not None else lb.mlp_out_module
    if name == "mlp_out":
        return out(mlp)
    if name == "mlp_out_post":
        if lb.post_mlp_norm is not None:
            return out(lb.post_mlp_norm, scale(lb.mlp_multiplier))
        return out(mlp, scale(lb.mlp_multiplier))
    return None, f"no module boundary known for {name}"


def _describe(spec: dict) -> str:
    ops = "".join(f" {o}" for o in spec.get("ops", []))
    index = f"[{spec['index']}]" if spec.get("index") is not None else ""
    return f"{spec['path']}.{spec['side']}{index}{ops}"


def asks(lm: Any, plan: ModelPlan, engine: str) -> list[Ask]:
    """One Ask per (address, engine name): TransformerLens gets both its native and its legacy spelling."""
    from ie_lab.mappers import to_engine

    out: list[Ask] = []
    for address in plan.addresses:
        a = Address.parse(address)
        if engine == "tl":
            names, reasons = [], []
            for which in ("transformerlens_bridge", "transformerlens"):
                try:
                    n = to_engine(a, lm, which)
                except AddressError as e:
                    reasons.append(f"{which}: {e}")
                    continue
                if n not in names:
                    names.append(n)
            if not names:
                out.append(Ask(address, "", None, "; ".join(reasons)))
            for n in names:
                out.append(Ask(address, n, {"name": n}))
        elif engine == "nnterp":
            try:
                n = to_engine(a, lm, "nnterp")
                out.append(Ask(address, n, {"accessor": n}))
            except AddressError as e:
                out.append(Ask(address, "", None, str(e)))
        elif engine == "interp":
            asked = S.engine_name(plan.family, a.name, engine)
            if asked != a.name:  # the engine serves this tensor under another point's name (spec.ENGINE_NAMES)
                other = str(Address(asked, a.layer))
                out.append(Ask(address, other, {"address": other}))
                continue
            spec = {"address": address}
            if a.name in ("expert_weights", "expert_indices"):  # interp-engine lists the top-k; densified
                spec["dense_experts"] = lm.facts.n_experts
            out.append(Ask(address, address, spec))
        elif engine == "vllm":
            out.append(Ask(address, address, {"address": address}))
        elif engine == "nnsight":
            spec, why = module_spec(lm, address)
            out.append(Ask(address, _describe(spec) if spec else "", spec, why))
        elif engine == "hf":
            n_layers = lm.facts.n_layers
            if a.name == "resid_pre":
                hs: dict[str, Any] = {"kind": "hidden_states", "index": a.layer, "n_layers": n_layers}
                out.append(Ask(address, f"hidden_states[{a.layer}]", hs))
                continue
            if a.name == "resid_post" and a.layer < n_layers - 1:
                hs = {"kind": "hidden_states", "index": a.layer + 1, "n_layers": n_layers}
                out.append(Ask(address, f"hidden_states[{a.layer + 1}]", hs))
                continue
            if a.name == "attn_probs":
                hs = {"kind": "attentions", "index": a.layer, "n_layers": n_layers}
                out.append(Ask(address, f"attentions[{a.layer}]", hs))
                continue
            spec, why = module_spec(lm, address)
            out.append(Ask(address, _describe(spec) if spec else "", spec, why))
        else:
            raise ValueError(engine)
    return out
