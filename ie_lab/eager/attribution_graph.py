"""attribution_graph(): the attribution graph of one prompt through transcoders, on the eager backend.

The local replacement model (docs/CIRCUITS.md): each MLP's output is its transcoder's output plus an error node (the
true MLP output minus the transcoder's, a constant); every attention pattern and every norm's scale is frozen at
its value on this prompt. A cross-layer transcoder's layer-l feature writes into the MLP output of every layer
l' >= l (its edges sum those writes; each layer's error is its output less every write into it); a skip
transcoder's skip path (x @ W_skip) stays live, a linear path from the MLP's input to its output. The model is then linear (jointly homogeneous) in what the nodes write: the embeddings
(the stack's input per position), each active feature's decoder row times its activation, each error, and every
bias (each parameter named ``bias`` the frozen model adds: attention and norm biases, the head's; the transcoders'
b_dec and, into their own features, b_enc). So each target (a feature's pre-activation, a demeaned logit) is exactly
the sum of its incoming edges.

How: one clean forward records each MLP's input and output, each norm's input and output (its scale fitted from
the two, ops/attribution.freeze_norm) and the logits. Then one forward of batch_size copies of the prompt (fewer
when there are fewer targets), its autograd graph kept for every batch of targets' backward, in which
  * the stack's input and each MLP's output are leaves holding their clean values (stop-gradient at the MLPs: no
    path runs through an MLP or a feature's nonlinearity),
  * each norm returns its clean output plus its frozen linear map of (input - input.detach()): the same values,
    the frozen scale's gradient,
  * each attention call gets its query and key detached (arch/attention_tap.editing): the pattern is a constant,
and per batch of at most batch_size targets, one backward (retain_graph until the last) of the sum of the copies'
targets gives each copy's gradients (target b seeds copy b; torch.autograd.grad, so none accumulate across
batches); an edge is the gradient at the source's write dotted with the write. Every hook is removed when the
forward ends or fails: the backward needs none.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..address import Address
from ..arch.attention_tap import editing
from ..core.graph import Graph, GraphOrigin, Node, completeness
from ..core.inputs import prepare, prepare_prompts, str_tokens
from ..core.transcoder_splice import replaces_mlp
from ..errors import CapabilityUnsupported, InputError, shown_value
from ..ops.attribution import FrozenNorm, freeze_norm
from .attribution import _norm_forms, _param
from .model import lm_of
from .writers import Writers

# Relative; beyond it the family's frozen model is not the linear one this builds. A 16-bit model's own rounding
# moves a row's sum by a few percent (the demo model in bfloat16: 5e-2 at most, 2e-3 typically), a missed
# nonlinearity by its whole size.
COMPLETENESS_TOL = {torch.float32: 1e-2, torch.float64: 1e-2}
COMPLETENESS_TOL_16BIT = 0.25


def attribution_graph(
    model: Any,
    prompt: Any,
    transcoders: Any,
    *,
    max_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_features: int | None = None,
    batch_size: int = 32,
) -> Graph:
    """The attribution graph of prompt's last position through the transcoders' local replacement model.

    Logit nodes: the most probable next tokens until their probabilities sum to desired_logit_prob, at most
    max_logits; each one's target is its logit minus the mean logit over the vocabulary (demeaned, as circuit-tracer
    does). max_features: at most that many feature nodes, the largest writes (activation x decoder row norm) kept;
    the others' writes join their layer's error node, so every row still sums to its target. batch_size: targets
    per backward pass (memory grows with it: batch_size copies of the prompt's activations)."""
    for name, v, lo in (("max_logits", max_logits, 1), ("batch_size", batch_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{name} must be an integer >= {lo}, got {shown_value(v)}.")
    if max_features is not None and (
        isinstance(max_features, bool) or not isinstance(max_features, int) or max_features < 0
    ):
        raise InputError(f"max_features must be None or an integer >= 0, got {shown_value(max_features)}.")
    if (
        isinstance(desired_logit_prob, bool)
        or not isinstance(desired_logit_prob, (int, float))
        or not 0 < desired_logit_prob <= 1
    ):
        raise InputError(f"desired_logit_prob must be a probability in (0, 1], got {shown_value(desired_logit_prob)}.")
    graph = build_graph(model, prompt, transcoders, max_logits, float(desired_logit_prob), max_features, batch_size)
    worst = float(completeness(graph).max()) if len(graph.nodes) else 0.0
    graph.info["completeness_max_relative_error"] = worst
    lm = lm_of(model)
    if worst > COMPLETENESS_TOL.get(lm.dtype, COMPLETENESS_TOL_16BIT):
        raise CapabilityUnsupported(
            f"attribution_graph on {lm.binding.family}",
            f"the edges into a node miss its value by {worst:.2g} (relative): this family's frozen model is not linear "
            "in the nodes' writes the way ie_lab builds it (a nonlinearity outside the MLPs, attention and norms)",
            "report the family; logit_attribution and gradients still work on it",
        )
    return graph


def _check_model(lm: Any, transcoders: Any) -> dict[int, Any]:
    if getattr(lm, "binding", None) is None or getattr(lm, "hf", None) is None:
        raise CapabilityUnsupported(
            "attribution_graph",
            f"it runs the model's forward and backward in this process (the eager backend); this is {type(lm).__name__}",
            "open the model with ie_lab.Session(path) (eager) or ie_lab.load(path)",
        )
    b, f = lm.binding, lm.facts
    if not hasattr(transcoders, "layers") or not all(
        hasattr(t, a) for t in transcoders for a in ("W_enc", "W_dec", "address_in", "address_out", "activate")
    ):  # duck-typed: ie_lab/transcoders.py sits above this backend
        raise InputError(f"transcoders must be what ie_lab.load_transcoders returns, got {type(transcoders).__name__}.")
    why = None
    if f.final_logit_softcap:
        why = "its logits are soft-capped (tanh): a demeaned logit is not linear in the residual"
    for lb in b.layers:
        if lb.parallel:
            why = "attention and MLP read the same input (a parallel block)"
        elif lb.sparse_moe:
            why = f"layer {lb.index}'s MLP is a sparse mixture of experts"
        elif not lb.uses_attention_interface:
            why = f"layer {lb.index}'s attention does not go through transformers' attention interface"
        elif lb.attn_alpha is not None or lb.mlp_alpha is not None:
            why = "its residual is scaled per sublayer"
    if getattr(f, "n_streams", 1) not in (None, 1):
        why = "its residual is several streams"
    if why is not None:
        raise CapabilityUnsupported(
            f"attribution_graph on {b.family}",
            f"{why}, so freezing attention patterns and norm scales does not make it linear in the MLPs' writes",
            "a family with sequential attention and dense MLP blocks (Llama, GPT-2, Qwen, Mistral, ...)",
        )
    by_layer = {}
    for t in transcoders:
        L = t.layer
        if not replaces_mlp(t):
            raise InputError(
                f"the transcoder at layer {L} reads {t.address_in} and predicts {t.address_out}; an attribution graph "
                f"replaces each MLP, so its transcoder reads mlp_in.{L} (or resid_mid.{L}, before the MLP's norm) and "
                f"predicts mlp_out.{L} (or mlp_out_post.{L}, the MLP with its post-norm)."
            )
        if max(getattr(t, "writes_to", [L])) >= len(b.layers):
            raise InputError(
                f"a transcoder writing layer {max(t.writes_to)}, but the model has {len(b.layers)} layers."
            )
        by_layer[L] = t
    missing = sorted({c for t in by_layer.values() for c in getattr(t, "clt_layers", ())} - set(by_layer))
    if missing:
        raise InputError(
            f"the cross-layer transcoder's layers {missing} are missing: its graph needs every layer of it (each "
            "layer's output holds the earlier layers' writes); pass the whole ie_lab.load_transcoders(...) result."
        )
    return by_layer


def _writes(t: Any) -> list[tuple[int, torch.Tensor]]:
    """(layer, decoder [d_sae, d]) for every layer a transcoder's features write: its own, and a CLT's later ones."""
    return [(L, t.decoder(L)) for L in t.writes_to] if hasattr(t, "writes_to") else [(t.layer, t.W_dec)]


def _norm_modules(lm: Any, outs: dict[int, Address]) -> list[nn.Module]:
    """The norms whose scale is frozen: all but a post-MLP norm inside what a transcoder replaces (one that
    predicts mlp_out_post)."""
    b = lm.binding
    mods = [m for lb in b.layers for m in (lb.input_norm, lb.post_attn_norm, lb.pre_mlp_norm)]
    mods += [lb.post_mlp_norm for lb in b.layers if outs[lb.index].name != "mlp_out_post"]
    mods.append(b.final_norm)
    return [m for m in dict.fromkeys(mods) if m is not None]


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def build_graph(
    model: Any,
    prompt: Any,
    transcoders: Any,
    max_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_features: int | None = None,
    batch_size: int = 32,
    *,
    freeze_norms: bool = True,
    freeze_patterns: bool = True,
) -> Graph:
    """The graph, unchecked. freeze_norms / freeze_patterns off: the edges of a model that is not frozen (the
    tests' wrong answers, which completeness must catch)."""
    lm = lm_of(model)
    if prepare_prompts(lm, prompt) is not None:
        raise InputError("attribution_graph reads one prompt; call it once per prompt.")
    by_layer = _check_model(lm, transcoders)
    n_layers = len(lm.binding.layers)
    outs = {L: by_layer[L].address_out if L in by_layer else Address.parse(f"mlp_out.{L}") for L in range(n_layers)}
    for t in by_layer.values():
        for L in getattr(t, "decoders", {}):
            if t.output_at(L) != outs[L]:
                raise InputError(f"layer {t.layer}'s transcoder writes {t.output_at(L)}, but layer {L} is {outs[L]}.")
    ids = prepare(lm, prompt)[0]
    if ids.shape[0] != 1:
        raise InputError(f"attribution_graph reads one prompt; got a batch of {ids.shape[0]}.")
    with lm.lock:  # one lock over every forward: no other call's hooks or steering between the clean run and the edges
        return _build(
            lm,
            ids,
            by_layer,
            outs,
            max_logits,
            desired_logit_prob,
            max_features,
            batch_size,
            freeze_norms,
            freeze_patterns,
        )


def _build(
    lm: Any,
    ids: torch.Tensor,
    by_layer: dict[int, Any],
    outs: dict[int, Address],
    max_logits: int,
    desired_logit_prob: float,
    max_features: int | None,
    batch_size: int,
    freeze_norms: bool,
    freeze_patterns: bool,
) -> Graph:
    n_layers = len(lm.binding.layers)
    ins = {L: by_layer[L].address_in if L in by_layer else Address.parse(f"mlp_in.{L}") for L in range(n_layers)}
    with torch.no_grad():
        clean = _clean_run(lm, ids, ins, outs)
    S = ids.shape[1]
    # features, their writes, the errors
    feats: list[tuple[int, int, int, float, float]] = []  # layer, position, index, activation, pre-activation
    for L, t in by_layer.items():
        x = clean["mlp_in"][L].float()
        pre = t.pre_activations(x)
        act = t.activate(pre)
        for p, i in act.nonzero().tolist():
            feats.append((L, p, i, float(act[p, i]), float(pre[p, i])))
    if max_features is not None and len(feats) > max_features:  # a CLT feature's size: all its decoders together
        size = {L: torch.stack([W.pow(2).sum(1) for _, W in _writes(t)]).sum(0).sqrt() for L, t in by_layer.items()}
        order = sorted(range(len(feats)), key=lambda j: -abs(feats[j][3]) * float(size[feats[j][0]][feats[j][2]]))
        feats = sorted(feats[j] for j in order[:max_features])
    errors = _errors(clean, by_layer, feats, n_layers, S)
    # logit nodes
    last = clean["logits"].float()
    probs = last.softmax(-1)
    top = probs.sort(descending=True)
    logit_ids: list[int] = []
    run = 0.0
    for tok, pr in zip(top.indices.tolist(), top.values.tolist()):
        if len(logit_ids) >= max_logits or run >= desired_logit_prob:
            break
        logit_ids.append(tok)
        run += pr
    demeaned = last - last.mean()
    # the edges, batch by batch of targets
    targets: list[tuple] = [("feature",) + f[:3] for f in feats] + [("logit", tok) for tok in logit_ids]
    bias_names, bias_rows = _bias_names(lm, by_layer)
    n_f, n_e, n_emb = len(feats), n_layers * S, S
    n_src = n_f + n_e + n_emb + len(bias_names)
    rows = torch.zeros(len(targets), n_src)
    frozen = _freeze(lm, clean, outs) if freeze_norms else {}
    if targets:
        # one frozen forward of min(batch_size, targets) copies, reused by every batch's backward
        fwd = _frozen_forward(
            lm, ids, min(batch_size, len(targets)), clean, frozen, bias_rows, freeze_patterns, ins, outs, by_layer
        )
        for start in range(0, len(targets), batch_size):
            chunk = targets[start : start + batch_size]
            last = start + batch_size >= len(targets)
            rows[start : start + len(chunk)] = _edges(
                fwd, chunk, clean, by_layer, feats, errors, bias_names, bias_rows, S, retain=not last
            )
        del fwd
    # nodes, in the adjacency's order
    toks = _token_texts(lm, ids[0].tolist())
    origin = GraphOrigin(weakref.ref(lm), dict(by_layer), tuple(ids[0].tolist()))  # for intervene= (its nodes)
    nodes = [
        Node("feature", L, p, i, token=toks[p], activation=a, value=pre, origin=origin) for (L, p, i, a, pre) in feats
    ]
    nodes += [Node("error", L, p, token=toks[p]) for L in range(n_layers) for p in range(S)]
    nodes += [Node("embedding", None, p, token=toks[p]) for p in range(S)]
    nodes += [Node("bias", name=n) for n in bias_names]
    vocab = _token_texts(lm, logit_ids)
    nodes += [
        Node("logit", index=tok, token=v, value=float(demeaned[tok]), probability=float(probs[tok]))
        for tok, v in zip(logit_ids, vocab)
    ]
    n = len(nodes)
    adj = torch.zeros(n, n)
    adj[:n_f, :n_src] = rows[:n_f]
    adj[n - len(logit_ids) :, :n_src] = rows[n_f:]
    # a bias that reaches no target (q and k biases under frozen patterns, those inside the replaced MLPs) is no node
    first_bias = n_f + n_e + n_emb
    keep = [j for j in range(n) if not first_bias <= j < n_src or bool(adj[:, j].any())]
    if len(keep) < n:
        nodes, adj = [nodes[j] for j in keep], adj[keep][:, keep]
    info = {
        "target": "logit minus the mean logit over the vocabulary (demeaned), at the last position",
        "replacement": "MLPs -> transcoders + error nodes; attention patterns and norm scales frozen at this prompt",
        "transcoder_layers": sorted(by_layer),
        "n_layers": n_layers,
        "frozen": {"norms": freeze_norms, "patterns": freeze_patterns},
    }
    return Graph(nodes, adj, ids[0].tolist(), toks, info)


def _errors(clean: dict, by_layer: dict[int, Any], feats: list, n_layers: int, S: int) -> dict[int, torch.Tensor]:
    """Each layer's error node [S, d]: its output less every kept feature's write into it (a CLT's earlier layers'
    too), its b_dec and its skip path's write."""
    errors = {L: clean["mlp_out"][L].float().clone() for L in range(n_layers)}
    for L, t in by_layer.items():
        acts = torch.zeros(S, t.d_sae, device=errors[L].device)
        for fl, p, i, a, _ in feats:
            if fl == L:
                acts[p, i] = a
        for L2, W in _writes(t):
            errors[L2] -= acts @ W.to(acts.device).float()
        errors[L] -= t.b_dec.to(acts.device).float()
        if getattr(t, "W_skip", None) is not None:
            errors[L] -= t.skip(clean["mlp_in"][L].float())
    return errors


def _last_only(lm: Any) -> dict[str, int]:
    """logits_to_keep=1 where the model's forward takes it: the head runs on the last position alone (a [copies,
    positions, vocab] tensor and its gradient would dwarf the rest on a large vocabulary)."""
    import inspect

    try:
        takes = "logits_to_keep" in inspect.signature(lm.hf.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"logits_to_keep": 1} if takes else {}


def _token_texts(lm: Any, ids: list[int]) -> list[str]:
    if lm.tokenizer is None:
        return [str(t) for t in ids]
    return list(str_tokens(lm, torch.tensor([ids]))[0])


def _clean_run(lm: Any, ids: torch.Tensor, ins: dict[int, Address], outs: dict[int, Address]) -> dict[str, Any]:
    """The clean forward's records; "mlp_in" holds what each layer's transcoder reads (ins[L]: mlp_in.L, or
    resid_mid.L), "mlp_out" what each layer's replacement stands for (outs[L]: mlp_out.L, or mlp_out_post.L where the
    transcoder predicts the MLP with its post-norm)."""
    n_layers = len(lm.binding.layers)
    out: dict[str, Any] = {"mlp_in": {}, "mlp_out": {}, "norm": {}}

    def keep(kind: str, L: int | None) -> Callable:
        def edit(t: torch.Tensor, off: int) -> torch.Tensor:
            if L is None:
                out[kind] = t[0].detach().clone()
            else:
                out[kind][L] = t[0].detach().clone()
            return t

        return edit

    edits = [(Address.parse("resid_pre.0"), keep("embed", None))]
    for L in range(n_layers):
        edits += [
            (ins[L], keep("mlp_in", L)),
            (outs[L], keep("mlp_out", L)),
        ]
    handles = []

    def norm_hook(m: nn.Module, args: tuple, kwargs: dict, y: Any) -> None:
        out["norm"][id(m)] = (_first_tensor(args, kwargs)[0].detach().clone(), y[0].detach().clone())

    try:
        for m in _norm_modules(lm, outs):
            handles.append(m.register_forward_hook(norm_hook, with_kwargs=True))
        with Writers(lm, edits) as w:
            w.shape = (int(ids.shape[0]), int(ids.shape[1]))
            logits = lm.hf(input_ids=ids, use_cache=False, **_last_only(lm)).logits
    finally:
        for h in handles:
            h.remove()
    out["logits"] = logits[0, -1].detach()
    return out


def _freeze(lm: Any, clean: dict, outs: dict[int, Address]) -> dict[int, FrozenNorm]:
    tol = 1e-4 if lm.dtype in (torch.float32, torch.float64) else 3e-2
    frozen = {}
    for m in _norm_modules(lm, outs):
        if id(m) not in clean["norm"]:
            continue
        x, y = clean["norm"][id(m)]
        fz = freeze_norm(x, y, _param(m, "weight"), _param(m, "bias"), tol, _norm_forms(m))
        if fz is None:
            raise CapabilityUnsupported(
                f"attribution_graph on {lm.binding.family}",
                f"the norm {type(m).__name__} is not input * gain / scale (centred or not, plus a bias) on this run, "
                "so its scale cannot be frozen",
                "a family whose norms are LayerNorm or RMSNorm",
            )
        frozen[id(m)] = fz
    return frozen


def _bias_names(lm: Any, by_layer: dict) -> tuple[list[str], dict[str, Any]]:
    """The bias nodes: every module's own `bias` parameter (what reaches a target is found by the backward: q and
    k biases and the MLPs' inside reach none), then each transcoder's b_dec and b_enc."""
    names, rows = [], {}
    for name, m in lm.hf.named_modules():
        p = m._parameters.get("bias")
        if isinstance(p, torch.Tensor) and p.dim() == 1:
            names.append(name + ".bias")
            rows[name + ".bias"] = m
    for L in sorted(by_layer):
        names += [f"transcoder.{L}.b_dec", f"transcoder.{L}.b_enc"]
    return names, rows


def _feature_columns(feats: list) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer: the feature nodes' columns, positions, indices and activations, as tensors."""
    out: dict[int, list] = {}
    for j, (L, p, i, a, _) in enumerate(feats):
        out.setdefault(L, []).append((j, p, i, a))
    return {
        L: (
            torch.tensor([r[0] for r in rs]),
            torch.tensor([r[1] for r in rs]),
            torch.tensor([r[2] for r in rs]),
            torch.tensor([r[3] for r in rs]),
        )
        for L, rs in out.items()
    }


def _frozen_forward(
    lm: Any,
    ids: torch.Tensor,
    B: int,
    clean: dict,
    frozen: dict[int, FrozenNorm],
    bias_mods: dict[str, nn.Module],
    freeze_patterns: bool,
    ins: dict[int, Address],
    outs: dict[int, Address],
    by_layer: dict[int, Any],
    qk_layer: int | None = None,
) -> dict[str, Any]:
    """One forward of B copies of the prompt through the frozen model, its autograd graph kept for every batch's
    backward: the logits, each MLP's live input, the leaves (the stack's input, each MLP's output) and each bias
    module's output; with qk_layer, that layer's live query and key too ("qk", qk_attribution's targets; its pattern
    stays frozen). Every hook and edit is gone when this returns or raises (the backward needs none of them)."""
    S = ids.shape[1]
    n_layers = len(lm.binding.layers)
    leaves: dict[Any, torch.Tensor] = {}
    live_in: dict[int, torch.Tensor] = {}
    bias_out: dict[str, torch.Tensor] = {}

    def leaf(kind: Any, value: torch.Tensor) -> Callable:
        skip = getattr(by_layer.get(kind), "W_skip", None) if isinstance(kind, int) else None

        def edit(t: torch.Tensor, off: int) -> torch.Tensor:
            v = value.to(t.dtype).expand(B, -1, -1).clone().requires_grad_(True)
            leaves[kind] = v
            if skip is not None:  # a skip transcoder's linear path stays live: the same value, its gradient
                x = live_in[kind]
                return v + ((x - x.detach()).float() @ skip.to(x.device).float()).to(t.dtype)
            return v

        return edit

    def read_in(L: int) -> Callable:
        def edit(t: torch.Tensor, off: int) -> torch.Tensor:
            live_in[L] = t
            return t

        return edit

    edits = [(Address.parse("resid_pre.0"), leaf("embed", clean["embed"]))]
    for L in range(n_layers):
        edits += [
            (ins[L], read_in(L)),
            (outs[L], leaf(L, clean["mlp_out"][L])),
        ]
    handles = []

    def norm_hook(m: nn.Module, args: tuple, kwargs: dict, y: Any) -> Any:
        fz = frozen.get(id(m))
        if fz is None or not isinstance(y, torch.Tensor):
            return None
        x = _first_tensor(args, kwargs)
        lin = fz.apply((x - x.detach()).float()).to(y.dtype)
        return y.detach() + lin

    def bias_hook(name: str) -> Callable:
        def record(m: nn.Module, args: tuple, y: Any) -> None:
            if isinstance(y, torch.Tensor):
                bias_out[name] = y

        return record

    qk: dict[str, torch.Tensor] = {}

    def detach(L: int) -> Callable:
        def edit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
            if L == qk_layer:
                qk.update(q=q, k=k)
            return q.detach(), k.detach(), v

        return edit

    editors = {id(lb.attn): detach(lb.index) for lb in lm.binding.layers} if freeze_patterns else {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        try:
            for m in _norm_modules(lm, outs):
                handles.append(m.register_forward_hook(norm_hook, with_kwargs=True))
            for name, m in bias_mods.items():
                handles.append(m.register_forward_hook(bias_hook(name)))
            stack.enter_context(editing(editors))
            w = stack.enter_context(Writers(lm, edits))
            w.shape = (B, S)
            logits = lm.hf(input_ids=ids.expand(B, -1).contiguous(), use_cache=False, **_last_only(lm)).logits
        finally:
            for h in handles:
                h.remove()
    return {"logits": logits, "live_in": live_in, "leaves": leaves, "bias_out": bias_out, "copies": B, "qk": qk}


def _edges(
    fwd: dict[str, Any],
    chunk: list[tuple],
    clean: dict,
    by_layer: dict,
    feats: list,
    errors: dict,
    bias_names: list[str],
    bias_mods: dict[str, nn.Module],
    S: int,
    retain: bool,
) -> torch.Tensor:
    """[len(chunk), sources]: each target's incoming edges, from one backward through the shared forward: target b
    seeds copy b (copies past len(chunk) get no seed, so no gradient). torch.autograd.grad returns this backward's
    gradients alone (nothing accumulates across batches); retain keeps the forward's graph for the next batch."""
    B = len(chunk)
    logits, live_in, leaves, bias_out = fwd["logits"], fwd["live_in"], fwd["leaves"], fwd["bias_out"]
    n_layers = len(errors)
    with torch.enable_grad():
        total = logits.new_zeros(())
        for b, tgt in enumerate(chunk):
            if tgt[0] == "logit":
                row = logits[b, -1].float()
                total = total + row[tgt[1]] - row.mean()
            elif tgt[0] in ("q", "k"):  # qk_attribution: (side, head, position, dim) of the live query or key
                total = total + fwd["qk"][tgt[0]][b, tgt[1], tgt[2], tgt[3]].float()
            else:
                _, L, p, i = tgt
                W = by_layer[L].W_enc[:, i].to(live_in[L].device)
                total = total + live_in[L][b, p].float() @ W
        names = [n for n in bias_names if n in bias_out]
        keys: list[Any] = ["embed", *range(n_layers), *names]
        tensors = [leaves["embed"]] + [leaves[L] for L in range(n_layers)] + [bias_out[n] for n in names]
        got = torch.autograd.grad(total, tensors, allow_unused=True, retain_graph=retain)
    # the first B copies: the ones this batch seeded
    n = fwd["copies"]
    grads = {k: (None if g is None else g.reshape(n, -1, g.shape[-1])[:B]) for k, g in zip(keys, got)}
    rows = torch.zeros(B, len(feats) + n_layers * S + S + len(bias_names))
    # features: activation x (gradient at the MLP's output . decoder row)
    at = {L: grads[L].float() for L in range(n_layers) if grads[L] is not None}
    for L, (cols, pos, idx, acts) in _feature_columns(feats).items():
        # gradient . each decoder row, summed over the layers the features write (a CLT's: L and every later one)
        per = sum(at[L2] @ W.to(at[L2].device).float().T for L2, W in _writes(by_layer[L]) if L2 in at)
        if isinstance(per, torch.Tensor):  # [B, S, d_sae]
            rows[:, cols] = (per[:, pos, idx] * acts.to(per.device)).cpu()
    base = len(feats)
    for L, gl in at.items():
        rows[:, base + L * S : base + (L + 1) * S] = (gl * errors[L].to(gl.device)).sum(-1).cpu()
    base += n_layers * S
    g = grads["embed"]
    if g is not None:
        rows[:, base : base + S] = (g.float() * clean["embed"].float().to(g.device)).sum(-1).cpu()
    base += S
    for k, name in enumerate(bias_names):
        col = base + k
        if name.startswith("transcoder."):
            L = int(name.split(".")[1])
            if name.endswith("b_dec") and L in at:
                rows[:, col] = (at[L].sum(1) @ by_layer[L].b_dec.to(at[L].device)).cpu()
            elif name.endswith("b_enc"):
                for b, tgt in enumerate(chunk):
                    if tgt[0] == "feature" and tgt[1] == L:
                        rows[b, col] = float(by_layer[L].b_enc[tgt[3]])
            continue
        gb = grads.get(name)
        if gb is None:
            continue
        bias = bias_mods[name]._parameters["bias"]
        assert bias is not None
        gsum = gb.float().sum(1)
        rows[:, col] = (gsum @ bias.detach().float().to(gsum.device)).cpu()
    return rows
