"""The architecture diagram and address picker: ``session.picker()`` and ``ie_lab.cheatsheet(family_or_config)``.

The kernel sends one description of the model (structure flags, and per point: definition, width with this
model's numbers, other engines' names, per-backend verdicts, and on which layers it is served); the front
end draws one block in forward order and a card for the point under the pointer. Clicking a served point
sends ``select``; the kernel checks it and sets ``picker.address`` (an :class:`ie_lab.Address`) and
``picker.addresses`` (multi-select with shift).
"""

from __future__ import annotations

import re
from typing import Any

import traitlets

from .. import points as _points
from ..address import Address
from ..arch import quirks
from ..arch.config_facts import ArchFacts
from ..errors import AddressError, IELabError, plural
from ..points import Scope, Width, width_of
from . import _base, _static

_ENGINES = (
    ("transformerlens", "TransformerLens"),
    ("transformerlens_bridge", "TransformerBridge"),
    ("nnterp", "nnterp"),
)


def _width(p: _points.Point, f: ArchFacts) -> tuple[str, str]:
    """(formula with this model's numbers, shape of a capture)."""
    w = p.width
    if w is Width.ATTN:
        return f"n_heads × q × k = {f.n_heads} × q × k", f"[batch, {f.n_heads}, q, k]"
    if w is Width.STATE:  # one final state per sequence: no position axis, its layout set by the mixer's kind
        return "per mixer kind (see the definition)", "[batch, …] (one final state per sequence, no seq axis)"
    if w is Width.HEADS_D_MODEL:  # one d_model vector per head: an axis of its own
        return f"n_heads × d_model = {f.n_heads} × {f.d_model}", f"[batch, seq, {f.n_heads}, {f.d_model}]"
    n = width_of(w, f)
    formula = {
        Width.HEADS: f"n_heads × head_dim = {f.n_heads} × {f.value_head_dim} = {n}",
        Width.KV_HEADS: f"n_kv_heads × head_dim = {f.n_kv_heads} × {f.value_head_dim} = {n}",
    }.get(w, f"{w.value} = {n}")
    return formula, f"[batch, seq, {n}]"


def _template(name: str, layer: int | None) -> str:
    if layer is None:
        return name
    return re.sub(rf"(?<=\.){layer}(?=\.|$)|(?<=\[){layer}(?=\])", "{L}", name)


def _positions(f: ArchFacts) -> list[str]:
    """Per layer: "learned", "sinusoidal", "alibi", "none" (a NoPE layer) or "rope" / "rope:<rotary dims>"
    (partial)."""
    raw = f.raw or {}
    mt = f.model_type
    if mt in quirks.LEARNED_POSITIONS:
        return ["learned"] * f.n_layers
    if mt in quirks.ALIBI_POSITIONS or (mt in quirks.ALIBI_SWITCH and raw.get(quirks.ALIBI_SWITCH[mt])):
        return ["alibi"] * f.n_layers
    if mt in quirks.SINUSOIDAL_POSITIONS:
        return ["sinusoidal"] * f.n_layers
    switch = quirks.ROPE_SWITCH.get(mt)
    if (switch and raw.get(switch[0]) != switch[1]) or not (
        raw.get("rope_parameters") or raw.get("rope_theta") or raw.get("rotary_dim") or raw.get("rotary_pct")
    ):
        return ["none"] * f.n_layers  # no rotary embedding is built: the attention layers see no positions
    rope = raw.get("rope_parameters")
    if not isinstance(rope, dict):
        rope = {}
    frac = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    dims = raw.get("rotary_dim") or raw.get("rotary_emb_base_dim")
    if not dims and frac is not None and float(frac) < 1:
        dims = int(f.head_dim * float(frac))
    kind = f"rope:{int(dims)}" if dims and int(dims) < f.head_dim else "rope"
    no_rope = raw.get("no_rope_layers")  # SmolLM3: 1 = this layer uses RoPE, 0 = no positional encoding
    return [
        ("none" if isinstance(no_rope, (list, tuple)) and i < len(no_rope) and not no_rope[i] else kind)
        for i in range(f.n_layers)
    ]


def attention_label(position: str, head_dim: int) -> str:
    """The attention module's label in the diagram, from how this layer encodes positions."""
    if position in ("learned", "sinusoidal"):  # positions were added to the embedding, not inside attention
        return "attention (q·kᵀ, softmax)"
    if position == "alibi":
        return "attention (ALiBi, q·kᵀ, softmax)"
    if position == "none":
        return "attention (NoPE, q·kᵀ, softmax)"
    if position.startswith("rope:"):
        return f"attention (RoPE on {position[5:]} of {head_dim} dims)"
    return "attention (RoPE, q·kᵀ, softmax)"


def _labels(f: ArchFacts, st: dict[str, Any]) -> None:
    """Adds what the diagram's labels are drawn from: positions per layer, embedding label, parallel norms."""
    pos = _positions(f)
    st["positions"] = pos
    st["attn_labels"] = [attention_label(p, f.head_dim) for p in pos]
    st["embed_label"] = {"learned": "token + position embedding", "sinusoidal": "token + sinusoidal positions"}.get(
        pos[0] if pos else "", "token embedding"
    )


def _structure_from_facts(f: ArchFacts) -> dict[str, Any]:
    raw = f.raw or {}
    switch = quirks.SEPARATE_NORMS_SWITCH.get(f.model_type)  # (key that turns it on, key of the count, counts)
    separate = f.model_type in quirks.SEPARATE_PARALLEL_NORMS or (
        switch is not None and bool(raw.get(switch[0])) and raw.get(switch[1]) in switch[2]
    )
    st = {
        "parallel_block": f.parallel_block,
        "sandwich_norms": f.sandwich_norms,
        "pre_norms": f.pre_norms,
        "gated_mlp": f.gated_mlp,
        "qk_norm": f.qk_norm,
        "moe_layers": list(f.moe_layers),
        "attn_gate": bool(raw.get("attn_output_gate") or raw.get("use_gated_attention") or raw.get("gated_attention")),
        "n_streams": f.n_streams,
        "parallel_norms": ("separate" if separate else "shared") if f.parallel_block and f.pre_norms else "none",
    }
    _mixers(st, _points.Structure.from_facts(f))
    _labels(f, st)
    return st


def _structure_from_binding(lm: Any) -> dict[str, Any]:
    st = dict(lm.binding.structure)
    st["moe_layers"] = list(st["moe_layers"])
    st["gated_mlp"] = bool(st["gated_mlp"]) if st["gated_mlp"] is not None else False
    st["attn_gate"] = any(getattr(lb, "attn_gate", None) is not None for lb in lm.binding.layers)
    st["n_streams"] = lm.facts.n_streams
    _mixers(st, _points.Structure.from_binding(lm.binding))
    # measured: one norm module feeding both branches, or a norm per branch (both reading the layer input)
    first = lm.binding.layers[0]
    if st["parallel_block"] and first.input_norm is not None:
        separate = first.pre_mlp_norm is not None and first.pre_mlp_norm is not first.input_norm
        st["parallel_norms"] = "separate" if separate else "shared"
    else:
        st["parallel_norms"] = "none"
    _labels(lm.facts, st)
    return st


def _mixers(st: dict[str, Any], s: _points.Structure) -> None:
    """Hybrid and state-space trunks: which layers mix tokens without attention, and which have no MLP."""
    st["attn_gate"] = st["attn_gate"] or s.attn_gate
    st["mixer_layers"], st["mixer_kinds"], st["no_mlp_layers"] = (
        list(s.mixer_layers),
        list(s.mixer_kinds),
        list(s.no_mlp_layers),
    )
    st["mlp_only_layers"] = list(s.mlp_only_layers)  # single-sublayer trunks: blocks with no token mixer
    # hyper-connections that mix the streams by a matrix, and latent attention's compressed latents
    st["stream_mix"], st["q_latent"], st["kv_latent"] = s.stream_mix, s.q_latent, s.kv_latent
    st["kv_compressed_layers"] = list(s.kv_compressed_layers)
    st["heads_projected"] = s.heads_projected  # attn_result: a slice of the output projection is one head's write
    # the mixer layers that leave a recurrent / convolution state (mixer_state, mixer_conv_state)
    st["state_layers"], st["conv_state_layers"] = list(s.state_layers), list(s.conv_state_layers)


def _served_by_structure(p: _points.Point, layer: int | None, st: dict, backend: str, family: str) -> tuple[bool, str]:
    """Config-only verdict (no weights): the backend's verdict, then the structure's."""
    v = p.verdict(backend)
    if not v.verdict.ok:
        return False, v.reason
    why = _points.absent_reason(
        p,
        _points.Structure(
            family,
            qk_norm=bool(st["qk_norm"]),
            parallel=bool(st["parallel_block"]),
            gated_mlp=bool(st["gated_mlp"]),
            moe_layers=tuple(st["moe_layers"]),
            attn_gate=bool(st["attn_gate"]),
            n_streams=int(st["n_streams"]),
            stream_mix=bool(st.get("stream_mix", False)),
            q_latent=bool(st.get("q_latent", False)),
            kv_latent=bool(st.get("kv_latent", False)),
            kv_compressed_layers=tuple(st.get("kv_compressed_layers", ())),
            mixer_layers=tuple(st.get("mixer_layers", ())),
            mixer_kinds=tuple(st.get("mixer_kinds", ())),
            no_mlp_layers=tuple(st.get("no_mlp_layers", ())),
            mlp_only_layers=tuple(st.get("mlp_only_layers", ())),
            heads_projected=bool(st.get("heads_projected", True)),
        ),
        layer,
    )
    return (False, why) if why is not None else (True, v.reason)


def _ambiguous_names(model_ref: Any, family: str, st: dict) -> dict[tuple[str, str, str], str]:
    """Other engines' names that mean a different tensor on this family than on a plain pre-norm one (Llama).

    Returns {(point there, point here): warning}, e.g. TransformerLens' hook_mlp_out is mlp_out on Llama but
    mlp_out_post on Gemma 2.
    """
    from .. import mappers

    L = next((i for i in range(len(st.get("layer_kinds", ())) or 1) if i not in st["moe_layers"]), 0)
    out: dict[tuple[str, str, str], tuple[list[str], str]] = {}
    for engine, label in _ENGINES:
        spellings = {
            t
            for p in _points.all_points()
            if not p.multi_stream_only
            for t in {"transformerlens": p.tl_legacy, "transformerlens_bridge": p.tl_bridge, "nnterp": p.nnterp}[engine]
        }
        if engine.startswith("transformerlens"):
            spellings |= {"blocks.{L}.hook_attn_out", "blocks.{L}.hook_mlp_out"}
        for t in sorted(spellings):
            name = t.replace("{L}", str(L))
            try:
                there = mappers.from_engine(name, "llama", engine)
                here = mappers.from_engine(name, model_ref, engine)
            except (AddressError, IELabError, KeyError, ValueError):
                continue
            if there.name != here.name:
                key = (there.name, here.name, t)
                labels = out.get(key, ([],))[0] + [label]
                out[key] = (
                    labels,
                    f"{' / '.join(labels)}: {t} is {here.name} on {family}, not {there.name} as on "
                    "plain pre-norm families (Llama): same name, different tensor.",
                )
    return {k: v[1] for k, v in out.items()}


def describe(facts: ArchFacts, backend: str, *, lm: Any = None) -> dict[str, Any]:
    """Everything the picker draws, as plain JSON-able data (no tensors)."""
    from .. import mappers

    # What the binder measured, on a model bound in this process; a vLLM session binds in its worker, so its
    # picker draws from the config with the vLLM backend's verdicts.
    measured = lm is not None and getattr(lm, "binding", None) is not None
    model_ref: Any = lm if measured else facts
    st = _structure_from_binding(lm) if measured else _structure_from_facts(facts)
    n = facts.n_layers
    tables: dict[int, dict[str, Any]] = {}
    if measured:
        from ..eager.points_table import points_table

        for layer in range(n):
            tables[layer] = {r.name: r for r in points_table(lm, layer).rows}
    ambiguous = _ambiguous_names(model_ref, facts.model_type, st)
    from ..points_table import layer_kinds_text

    # Per layer, what mixes tokens there: "attention" or the mixer's kind as the model names it (never a label
    # written per family); the front end labels the layer selector and draws the mixer block from it.
    mixers = ["attention"] * n
    for i, k in zip(st["mixer_layers"], st["mixer_kinds"]):
        mixers[i] = k
    for i in st.get("mlp_only_layers", ()):  # an MLP-only block (single-sublayer trunks): no token mixer at all
        mixers[i] = "moe" if i in st["moe_layers"] else "mlp"
    pts = []
    for p in _points.all_points():
        if p.multi_stream_only and st["n_streams"] <= 1:
            continue
        layers: list[int | None] = list(range(n)) if p.scope is Scope.LAYER else [None]
        served, why = [], {}
        for L in layers:
            if measured:
                row = tables[L if L is not None else 0][p.name]
                ok = row.served and (L is None or Address.parse(row.example).layer == L)
                reason = (
                    row.reason
                    if row.served == ok
                    else _points.absent_reason(  # shown on another layer
                        p, _points.Structure.from_binding(lm.binding), L
                    )
                )
            else:
                ok, reason = _served_by_structure(p, L, st, backend, facts.model_type)
            served.append("1" if ok else "0")
            if not ok:
                why[str(L if L is not None else 0)] = reason
        rep = next((L for L, s in zip(layers, served) if s == "1"), layers[0])
        addr = Address(p.name, rep)
        names = {}
        for engine, _label in _ENGINES:
            try:
                names[engine] = _template(mappers.to_engine(addr, model_ref, engine), rep)
            except (AddressError, IELabError, KeyError, ValueError):
                names[engine] = ""
        warnings = [w for (a, b, _), w in ambiguous.items() if p.name in (a, b)]
        formula, shape = _width(p, facts)
        pts.append(
            {
                "name": p.name,
                "scope": p.scope.value,
                "width": formula,
                "shape": shape,
                "definition": p.definition,
                "note": p.note,
                "heads": p.head_axis,
                "steerable": p.steerable,
                "verdicts": {
                    b: {
                        "verdict": p.verdict(b).verdict.value,
                        "ok": p.verdict(b).verdict.ok,
                        "reason": p.verdict(b).reason,
                    }
                    for b in _points.BACKENDS
                },
                "names": names,
                "warnings": sorted(set(warnings)),
                "served": "".join(served),
                "why": why,
            }
        )
    return {
        "family": facts.model_type,
        "backend": backend,
        "n_layers": n,
        "d_model": facts.d_model,
        "n_heads": facts.n_heads,
        "n_kv_heads": facts.n_kv_heads,
        "head_dim": facts.head_dim,
        "d_mlp": facts.d_mlp,
        "n_experts": facts.n_experts,
        "vocab_size": facts.vocab_size,
        "layer_kinds": list(facts.layer_kinds),
        "layer_mixers": mixers,
        "layer_kinds_text": layer_kinds_text(mixers),
        "structure": st,
        "points": pts,
        # how the card's snippet reaches this model (set by Picker: the caller's variable, docs/WIDGETS.md)
        "handle": {"var": "s", "kind": "family"},
    }


class Picker(_base.Panel):
    """An SVG of one block of this model; click a point to set ``address`` (shift-click adds to ``addresses``)."""

    _esm = _static.bundle("picker.js")
    COMMANDS = {"select": {"address": _base.text(80), "multi": _base.boolean}, "clear": {}}

    spec = traitlets.Dict().tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    selected = traitlets.List(traitlets.Unicode()).tag(sync=True)
    address = traitlets.Instance(Address, allow_none=True)
    addresses = traitlets.Tuple()

    def __init__(
        self,
        facts: ArchFacts,
        backend: str = "eager",
        *,
        lm: Any = None,
        layer: int | None = None,
        handle: dict[str, str] | None = None,
    ):
        if backend not in _points.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {_points.BACKENDS}")
        self._facts = facts
        spec = describe(facts, backend, lm=lm)
        # {"var": the variable name snippets use, "kind": "session" (var.capture), "model" (ie_lab.capture(var))
        # or "family" (no model loaded: the snippet says to make a Session first)}
        spec["handle"] = dict(handle or {"var": "s", "kind": "session" if lm is not None else "family"})
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise AddressError(
                f"layer must be a layer number (an integer 0..{facts.n_layers - 1}) or None, got {layer!r}."
            )
        L = facts.n_layers // 2 if layer is None else layer
        if not 0 <= L < facts.n_layers:
            raise AddressError(f"layer {L} is out of range: this model has {plural(facts.n_layers, 'layer')}.")
        super().__init__(spec=spec, layer=L)
        self._points = {p["name"]: p for p in spec["points"]}

    @property
    def layer_kind(self) -> str:
        """What mixes tokens on the shown layer: "attention", or a mixer's kind on a hybrid or state-space trunk."""
        return str(self.spec["layer_mixers"][self.layer])

    # ---- from Python ---------------------------------------------------------------------------
    def select(self, address: Any, multi: bool = False) -> Address:
        """Select a point as a click would; returns the Address."""
        a = Address.parse(address).check(self._facts)
        if a.head is not None or a.stream is not None:
            raise AddressError("the picker selects whole points; add .head-H / .stream-S in code.")
        info = self._points.get(a.name)
        if info is None:
            raise AddressError(f"{a.name} does not exist on {self._facts.model_type}.")
        idx = a.layer if a.layer is not None else 0
        if info["served"][idx] != "1":
            raise AddressError(f"{a} is not served here: {info['why'].get(str(idx), '')}")
        current = list(self.addresses) if multi else []
        if multi and a in current:
            current.remove(a)
        else:
            current.append(a)
        with self.hold_trait_notifications():
            self.addresses = tuple(current)
            self.address = a if (a in current) else (current[-1] if current else None)
            if a.layer is not None:
                self.layer = a.layer
            self.selected = [str(x) for x in current]
            self.error = ""  # an earlier refusal no longer describes what is on screen
        return a

    def clear(self) -> None:
        with self.hold_trait_notifications():
            self.addresses = ()
            self.address = None
            self.selected = []
            self.error = ""

    # ---- from the front end (validated by the base class) ----------------------------------------
    def on_select(self, address: str, multi: bool) -> None:
        try:
            self.select(address, multi)
        except IELabError as e:
            self._reject(str(e))

    def on_clear(self) -> None:
        self.clear()

    def __repr__(self) -> str:
        s = self.spec
        sel = ", ".join(self.selected) if self.selected else "none"
        kinds = f"; {s['layer_kinds_text']}" if s["layer_kinds_text"] else ""
        return (
            f"Picker({s['family']}, {plural(s['n_layers'], 'layer')}{kinds}, backend={s['backend']}; layer {self.layer}; "
            f"selected: {sel})"
        )


def cheatsheet(
    family_or_config: Any, backend: str = "eager", layer: int | None = None, *, var_name: str | None = None
) -> Picker:
    """The picker for a family name, a config (object or dict) or ArchFacts: no weights are loaded.

    Structure comes from the config and ie_lab's quirks table; on a loaded model use ``session.picker()``,
    which draws what the binder measured instead. The card's snippet names the session (or model) by
    ``var_name``: by default the variable your code holds it in; for a family, ``s`` (made by the line it shows).
    """
    src = family_or_config
    if callable(getattr(type(src), "picker", None)):  # a Session, whatever its backend: the measured truth
        return src.picker(layer=layer, var_name=_base.var_name(src, var_name, "s"))
    if hasattr(src, "binding"):  # a model from ie_lab.load: the measured truth too
        var = _base.var_name(src, var_name, "lm")
        return Picker(src.facts, src.backend, lm=src, layer=layer, handle={"var": var, "kind": "model"})
    # no model yet: the snippet's first line makes the session it names
    family_handle = {"var": "s" if var_name is None else _base.var_name(src, var_name, "s"), "kind": "family"}
    if isinstance(src, ArchFacts):
        facts = src
    elif isinstance(src, str):
        from transformers import CONFIG_MAPPING

        if src not in CONFIG_MAPPING:
            from ..errors import did_you_mean

            raise AddressError(
                f"unknown family {src!r}.{did_you_mean(src, list(CONFIG_MAPPING.keys()))} "
                "Pass a transformers model_type, a config, or a config dict."
            )
        facts = ArchFacts.from_config(CONFIG_MAPPING[src]())
    else:
        try:
            facts = ArchFacts.from_config(src)
        except (TypeError, ValueError) as e:
            raise AddressError(
                f"family_or_config must be a family name (a transformers model_type such as 'llama'), "
                f"a config (object or dict), ArchFacts or a Session; could not read "
                f"{type(src).__name__}: {e}"
            ) from None
    return Picker(facts, backend, layer=layer, handle=family_handle)
