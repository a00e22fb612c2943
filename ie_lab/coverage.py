"""Which transformers families ie_lab binds: every model type in transformers' causal-LM mapping, tried.

For each model type the survey builds a tiny random instance from the family's own config class (small
hidden size, two layers, a few heads, a 512-token vocabulary; per-type overrides only where a config needs
them: ie_lab/tiny.py, the one tiny-model builder, holds those sizes and ``build_tiny``), loads it with `ie_lab.load` and either runs the invariants (residual identities, probs x value = z,
down projection of mlp_act = mlp_out, final norm + unembedding = logits) or records the refusal. The result
is one JSON per transformers version (ie_lab/coverage_data/, written by `python -m ie_lab.coverage --write` in
that version's environment) and the
table in docs/FAMILIES.md (`python -m ie_lab.docs_gen`); tests/test_families_coverage.py checks both for drift.

A load that fails with anything but an IELabError is recorded as a defect, and so is a bound family on which
capturing any registry point at any layer raises another exception class: every family ie_lab does not bind must be
refused with a reason that names the missing structure, and every point it does not serve likewise.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TypedDict

# The survey's sizes and builder live in the one tiny-model builder; these names stay here for their callers (tests
# patch OVERRIDES in place: it is the same dict the builder reads).
from .tiny import MAX_PARAMS, OVERRIDES, VLLM_WIDE, VLLM_WIDTHS, VOCAB, build_tiny, tiny_config

__all__ = [
    "MAX_PARAMS",
    "OVERRIDES",
    "VLLM_WIDE",
    "VLLM_WIDTHS",
    "VOCAB",
    "build_tiny",
    "category",
    "causal_lm_types",
    "check_invariants",
    "classify",
    "survey",
    "tiny_config",
    "vllm_served",
    "vllm_serves",
]


def vllm_serves(config: Any) -> bool:
    """Whether ie_lab's vLLM backend serves a model of this config, as the backend decides: the config's own model
    type (vLLM builds that class: a wrapper's towers and all; GPT-SW3 saves as gpt2) and its trunk's (a wrapper's
    text config: Llama 4's is llama4_text) are both verified."""
    from .arch import quirks
    from .arch.config_facts import ArchFacts

    try:
        return {config.model_type, ArchFacts.from_config(config).model_type} <= quirks.VLLM_VERIFIED
    except Exception:  # noqa: BLE001 - a config ie_lab cannot read is served nowhere
        return False


def vllm_served(model_type: str) -> bool:
    """vllm_serves of the survey's instance of this model type."""
    try:
        return vllm_serves(tiny_config(model_type))
    except Exception:  # noqa: BLE001 - a config the survey cannot build is served nowhere
        return False


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal-LM class name, exactly transformers' auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tokenizer():
    from .toy import tokenizer

    return tokenizer()


class _Tol(TypedDict):
    atol: float
    rtol: float


def check_invariants(lm) -> None:
    """The identities a wrong-but-plausible tensor cannot satisfy (tests/test_invariants.py, on one instance),
    and on MoE layers the routing points (each token routed to k experts, weights only on those).

    Raises AssertionError naming the first identity that fails."""
    import torch
    import torch.nn.functional as F

    from .eager.capture import capture_batch  # x below is one [2, 9] id tensor: one Cache per call

    g = torch.Generator().manual_seed(0)
    x = torch.randint(4, min(VOCAB, lm.facts.vocab_size), (2, 9), generator=g)
    f = lm.facts
    tol = _Tol(atol=2e-4, rtol=1e-4)
    for lb in lm.binding.layers:
        L = lb.index
        sub = "mixer_out_post" if lb.mixer_kind else "attn_out_post"  # a mixer layer's sublayer has its own name
        if lb.mlp_only:  # a single-sublayer trunk's MLP block: its MLP is its one sublayer
            sub = "mlp_out_post"
        if not lb.has_mlp or lb.mlp_only:  # a single-sublayer block: one residual add
            c = capture_batch(lm, x, [f"resid_pre.{L}", f"{sub}.{L}", f"resid_post.{L}"])
            torch.testing.assert_close(
                c[f"resid_pre.{L}"] + c[f"{sub}.{L}"], c[f"resid_post.{L}"], **tol, msg=f"one-sublayer block, layer {L}"
            )
        elif lb.attn_hc is not None:  # a hyper-connection layer: the identities hold per stream
            _stream_identities(lm, x, lb, tol)
        else:
            _two_sublayer_identities(lm, x, lb, sub, tol)
        if lb.has_mlp and not lb.sparse_moe:
            gates: list[torch.Tensor] = []  # a gate after the down projection (RWKV's receptance): its output
            gate = getattr(lb, "mlp_out_gate", None)
            h = gate.register_forward_hook(lambda m, a, o, g=gates: g.append(o.detach())) if gate is not None else None
            try:
                c = capture_batch(lm, x, [f"mlp_act.{L}", f"mlp_out.{L}"])
            finally:
                if h is not None:
                    h.remove()
            with torch.no_grad():
                down = lb.down_proj(c[f"mlp_act.{L}"])
                if gates:
                    pre = gates[0]
                    down = down * (torch.sigmoid(pre) if lb.mlp_out_gate_fn == "sigmoid" else F.softplus(pre))
                torch.testing.assert_close(
                    down,
                    c[f"mlp_out.{L}"],
                    **tol,
                    msg=f"down_proj(mlp_act){' * mlp_out_gate' if gates else ''} = mlp_out, layer {L}",
                )
        # compressed entries have no per-token value there; differential attention no single pattern
        if lb.uses_attention_interface and not lb.kv_compressor and lb.kernel_calls == 1:
            gate = [f"attn_gate.{L}"] if lb.attn_gate is not None else []
            c = capture_batch(lm, x, [f"attn_probs.{L}", f"value.{L}", f"z.{L}", *gate])
            probs, value = c[f"attn_probs.{L}"], c[f"value.{L}"]
            b, s, _ = value.shape
            d_v = c[f"z.{L}"].shape[-1] // f.n_heads  # latent attention: the value head is not the query head
            v = value.reshape(b, s, -1, d_v).transpose(1, 2)
            v = v.repeat_interleave(f.n_heads // v.shape[1], dim=1)
            z = (probs @ v).transpose(1, 2).reshape(b, s, f.n_heads * d_v)
            if gate:  # z is o_proj's input: the kernel's output times the output gate
                z = z * c[gate[0]]
            torch.testing.assert_close(z, c[f"z.{L}"], **tol, msg=f"attn_probs @ value (* attn_gate) = z, layer {L}")
            assert torch.all(probs.triu(1) == 0), f"attention is not causal at layer {L}"
        if lb.kv_up is not None:  # latent attention: kv_b_proj(kv_latent) holds each head's k_nope, then its value
            c = capture_batch(lm, x, [f"kv_latent.{L}", f"k_nope.{L}", f"value.{L}"])
            with torch.no_grad():
                up = lb.kv_up(c[f"kv_latent.{L}"])
            blocks, d = up.reshape(*up.shape[:2], f.n_heads, -1), f.qk_nope_head_dim
            for part, name in ((blocks[..., :d], "k_nope"), (blocks[..., d:], "value")):
                torch.testing.assert_close(
                    part.flatten(2), c[f"{name}.{L}"], **tol, msg=f"kv_up(kv_latent) per head = {name}, layer {L}"
                )
    _between_layers(lm, x, tol)
    _routing_and_head(lm, x, tol)


def _between_layers(lm, x, tol: _Tol) -> None:
    """What a layer hands on is what the next reads: resid_pre.{L+1} = resid_post.L, times the factor the binder
    measured where the trunk rescales the stream between them (RWKV halves it every rescale_every layers), and after
    the last layer the final norm reads it so scaled. (Several streams: _stream_identities checks them.)"""
    import torch

    from .eager.capture import capture_batch

    if lm.facts.n_streams > 1:
        return
    n = lm.facts.n_layers
    layers = lm.binding.layers
    c = capture_batch(lm, x, [f"{p}.{L}" for L in range(n) for p in ("resid_pre", "resid_post")])
    for L in range(n - 1):
        s = layers[L].stream_scale or 1.0
        msg = f"resid_pre.{L + 1} = {s:g} * resid_post.{L}"
        torch.testing.assert_close(c[f"resid_post.{L}"] * s, c[f"resid_pre.{L + 1}"], **tol, msg=msg)
    norm = lm.binding.final_norm
    if layers[-1].stream_scale is not None and norm is not None and lm.binding.stream_head is None:
        with torch.no_grad():
            normed = norm(c[f"resid_post.{n - 1}"] * layers[-1].stream_scale)
        msg = f"final_norm = norm({layers[-1].stream_scale:g} * resid_post.{n - 1})"
        torch.testing.assert_close(normed, capture_batch(lm, x, ["final_norm"])["final_norm"], **tol, msg=msg)


def _stream_identities(lm, x, lb, tol: _Tol) -> None:
    """A hyper-connection layer (several residual streams): each stream at resid_mid is the streams entering the
    layer mixed by attn_stream_mix (carried on unmixed where the trunk has no matrix) plus its attn_stream_write
    weight times attn_out, and likewise from resid_mid to resid_post with the MLP; the collapse each sublayer
    reads is what its norm turns into attn_in / mlp_in; resid_streams stacks the resid_pre streams; the next layer
    reads what this one wrote."""
    import torch

    from .eager.capture import capture_batch

    L, n = lb.index, lm.facts.n_streams
    last = L + 1 == lm.facts.n_layers
    names = [f"{p}.{L}.stream-{s}" for p in ("resid_pre", "resid_mid", "resid_post") for s in range(n)]
    names += [f"{p}.{L}" for p in ("resid_streams", "attn_in", "attn_out", "mlp_in", "mlp_out")]
    names += [f"{k}_stream_{r}.{L}" for k in ("attn", "mlp") for r in ("collapse", "write")]
    names += [f"{k}_stream_mix.{L}" for k in ("attn", "mlp") if lb.stream_mix]
    names += [] if last else [f"resid_pre.{L + 1}.stream-{s}" for s in range(n)]
    c = capture_batch(lm, x, names)

    def stack(p: str, layer: int = L) -> torch.Tensor:
        return torch.stack([c[f"{p}.{layer}.stream-{s}"] for s in range(n)], dim=-2)

    torch.testing.assert_close(c[f"resid_streams.{L}"], stack("resid_pre"), **tol, msg=f"resid_streams, layer {L}")
    for before, after, k in (("resid_pre", "resid_mid", "attn"), ("resid_mid", "resid_post", "mlp")):
        x_in = stack(before).double()
        if lb.stream_mix:  # [.., i, j]: stream i's weight in stream j
            x_in = torch.einsum("bsij,bsid->bsjd", c[f"{k}_stream_mix.{L}"].double(), x_in)
        want = x_in + c[f"{k}_stream_write.{L}"].double().unsqueeze(-1) * c[f"{k}_out.{L}"].double().unsqueeze(-2)
        torch.testing.assert_close(
            want.to(x_in.dtype),
            stack(after).double(),
            **tol,
            msg=f"{before} mixed + {k}_stream_write * {k}_out = {after}, layer {L}",
        )
    with torch.no_grad():
        for k, norm in (("attn", lb.input_norm), ("mlp", lb.pre_mlp_norm)):
            collapse = c[f"{k}_stream_collapse.{L}"]
            torch.testing.assert_close(
                norm(collapse) if norm is not None else collapse,
                c[f"{k}_in.{L}"],
                **tol,
                msg=f"{k}_in = norm({k}_stream_collapse), layer {L}",
            )
    if not last:
        torch.testing.assert_close(
            stack("resid_pre", L + 1), stack("resid_post"), **tol, msg=f"resid_post.{L} = resid_pre.{L + 1}"
        )


def _two_sublayer_identities(lm, x, lb, sub: str, tol: _Tol) -> None:
    """resid_pre + sub = resid_mid and resid_mid + mlp_out_post = resid_post (or their parallel sum; or, where the
    residual is taken after the input norms, alpha * the sublayer's input + sub)."""
    import torch

    from .eager.capture import capture_batch

    L = lb.index
    if getattr(lb, "attn_alpha", None) is not None:
        # the residual is each sublayer's input norm's output times alpha (MiniMax): resid_mid = alpha * attn_in +
        # attn_out_post, resid_post = mlp_alpha * mlp_in + mlp_out_post
        sub_in = "mixer_in" if sub.startswith("mixer") else "attn_in"
        names = ["resid_pre", sub_in, sub, "resid_mid", "mlp_in", "mlp_out_post", "resid_post"]
        c = capture_batch(lm, x, [f"{n}.{L}" for n in names])
        for normed, norm, base, alpha, out, step in (
            ("resid_pre", lb.input_norm, sub_in, lb.attn_alpha, "resid_mid", sub),
            ("resid_mid", lb.pre_mlp_norm, "mlp_in", lb.mlp_alpha, "resid_post", "mlp_out_post"),
        ):
            with torch.no_grad():
                torch.testing.assert_close(
                    norm(c[f"{normed}.{L}"]), c[f"{base}.{L}"], **tol, msg=f"norm({normed}) = {base}, layer {L}"
                )
            torch.testing.assert_close(
                alpha * c[f"{base}.{L}"] + c[f"{step}.{L}"],
                c[f"{out}.{L}"],
                **tol,
                msg=f"{alpha:g} * {base} + {step} = {out}, layer {L}",
            )
        return
    beside = getattr(lb, "par_mixer", None) is not None  # a mixer beside attention adds to resid_mid too (Falcon-H1)
    names = ["resid_pre", sub, "mlp_out_post", "resid_post"] + ([] if lb.parallel else ["resid_mid"])
    c = capture_batch(lm, x, [f"{n}.{L}" for n in names] + ([f"mixer_out_post.{L}"] if beside else []))
    if lb.parallel:
        torch.testing.assert_close(
            c[f"resid_pre.{L}"] + c[f"{sub}.{L}"] + c[f"mlp_out_post.{L}"],
            c[f"resid_post.{L}"],
            **tol,
            msg=f"parallel residual sum, layer {L}",
        )
    else:
        stream, what = c[f"resid_pre.{L}"], "resid_pre"
        if getattr(lb, "stream_norm", None) is not None:  # the layer normalises the stream first (RWKV's pre_ln)
            with torch.no_grad():
                stream, what = lb.stream_norm(stream), f"{lb.names.get('stream_norm', 'stream_norm')}(resid_pre)"
        torch.testing.assert_close(
            stream + c[f"{sub}.{L}"] + (c[f"mixer_out_post.{L}"] if beside else 0),
            c[f"resid_mid.{L}"],
            **tol,
            msg=f"{what} + {sub}{' + mixer_out_post' if beside else ''} = resid_mid, layer {L}",
        )
        torch.testing.assert_close(
            c[f"resid_mid.{L}"] + c[f"mlp_out_post.{L}"],
            c[f"resid_post.{L}"],
            **tol,
            msg=f"resid_mid + mlp_out_post = resid_post, layer {L}",
        )


def _routing_and_head(lm, x, tol: _Tol) -> None:
    """On MoE layers, each token routed to k experts with weights only on those; the head and logits; and every
    registry point served or refused with an IELabError."""
    import torch

    from .eager.capture import capture_batch
    from .errors import IELabError
    from .ops.lens import postprocess_logits

    f = lm.facts
    for lb in lm.binding.layers:
        if not lb.sparse_moe:
            continue
        L, k = lb.index, f.experts_per_token
        try:
            c = capture_batch(lm, x, [f"router_logits.{L}", f"expert_weights.{L}", f"expert_indices.{L}"])
        except IELabError:
            continue  # a routing point refused with a reason is honest; a crash of another class is not
        w, sel = c[f"expert_weights.{L}"], c[f"expert_indices.{L}"]
        if k:
            assert torch.all(sel.sum(-1) == k), f"expert_indices: not exactly {k} experts per token, layer {L}"
        assert torch.all((w != 0) <= (sel == 1)), f"expert_weights outside the selected experts, layer {L}"
    try:
        c = capture_batch(lm, x, ["final_norm", "lm_head"])
    except IELabError:  # no final norm, or one module the trunk runs twice: refused, the unembedding still checks
        c = capture_batch(lm, x, ["lm_head"])
    with torch.no_grad():
        if "final_norm" in c:
            torch.testing.assert_close(
                lm.binding.lm_head(c["final_norm"] * (lm.binding.head_input_scale or 1.0)),
                c["lm_head"],
                **tol,
                msg=lambda m: "lm_head(final_norm) = lm_head",
            )
        logits = lm.hf(input_ids=x, use_cache=False).logits  # a cache of mixer layers alone cannot count positions
    torch.testing.assert_close(
        postprocess_logits(f, c["lm_head"]), logits, **tol, msg=lambda m: "post-processed lm_head = the model's logits"
    )
    # Every registry point at every layer is served or refused with an IELabError: any other exception escapes
    # (and the row is a defect).
    from . import points

    for p in points.all_points():
        for a in [p.name] if p.scope is points.Scope.TRUNK else [f"{p.name}.{L}" for L in range(f.n_layers)]:
            try:
                capture_batch(lm, x[:1], [a])
            except IELabError:
                pass


def classify(model_type: str, on_bound: Any = None) -> dict[str, Any]:
    """One row of the table: how ie_lab answers a tiny instance of this model type. on_bound(lm), where given, is
    called with the bound model once every invariant passed (scripts/upstream.py reads its binding there)."""
    from .errors import IELabError
    from .loading import load

    row: dict[str, Any] = {"model_type": model_type}
    try:
        model = build_tiny(model_type)
    except Exception as e:  # noqa: BLE001 - any failure to build is recorded, not raised
        row.update(status="untested", reason=f"no tiny instance: {type(e).__name__}: {_first_line(e)}")
        return row
    try:
        lm = load(model, _tokenizer(), quiet=True)
    except IELabError as e:
        row.update(status="refused", error=type(e).__name__, reason=_first_line(e))
        return row
    except Exception as e:  # noqa: BLE001 - a crash of another class is the defect this table exposes
        row.update(status="defect", error=type(e).__name__, reason=f"load crashed: {_first_line(e)}")
        return row
    try:
        check_invariants(lm)
    except Exception as e:  # noqa: BLE001
        row.update(status="defect", error=type(e).__name__, reason=f"bound, but an invariant fails: {_first_line(e)}")
        return row
    row.update(status="bound", vllm=vllm_serves(model.config))
    if on_bound is not None:
        on_bound(lm)
    mixers = sorted({lb.mixer_kind for lb in lm.binding.layers if lb.mixer_kind})
    if mixers:
        # A hybrid trunk: its non-attention layers serve mixer_in / mixer_out, and refuse the attention points.
        row["note"] = f"mixer layers ({', '.join(mixers)}) serve mixer_in/mixer_out; attention points refused there"
    return row


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# How a refusal is filed in the table, first match wins: (category, words its reason contains).
_CATEGORIES = (
    ("not causal as loaded (later tokens change earlier outputs)", ("is not causal as loaded",)),
    ("encoder-decoder", ("encoder-decoder",)),
    ("hyper-connections (parallel residual streams)", ("parallel residual streams",)),
    ("state-space / recurrent / hybrid", ("state-space", "recurrent", "linear-attention", "mamba", " conv")),
    ("attention output transformed before o_proj", ("transformed before the output projection",)),
    ("a fact under no spelling ie_lab reads", ("under any spelling ie_lab reads",)),
    (
        "attention without an output projection ie_lab knows (BERT-style and others)",
        ("attention has no output projection",),
    ),
    ("no attention module", ("no attention module",)),
    ("residual identities fail", ("residual identities",)),
    ("final norm rescaled before lm_head", ("final norm's output is changed",)),
    ("probe forward failed", ("probe forward failed",)),
)


def category(row: dict[str, Any]) -> str:
    if row["status"] == "bound":
        return "bound, eager and vLLM" if row.get("vllm") else "bound, eager"
    if row["status"] != "refused":
        return row["status"]
    for name, words in _CATEGORIES:
        if any(w in row["reason"] for w in words):
            return name
    return "other structure"


def survey(types: list[str] | None = None) -> dict[str, Any]:
    import transformers

    types = sorted(types or causal_lm_types())
    rows = [classify(mt) for mt in types]
    for r in rows:
        r["category"] = category(r)
    return {"transformers": transformers.__version__, "rows": rows}


DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coverage_data")


def line(version: str) -> str:
    """A transformers version's line, major.minor ("5.19.0" -> "5.19"): what a survey and a validator sweep are
    kept per."""
    return ".".join(version.split(".")[:2])


def line_key(version: str) -> tuple[int, ...]:
    """Sorts versions by line, oldest first."""
    return tuple(int(p) for p in line(version).split("."))


def data_path(version: str) -> str:
    return os.path.join(DATA_DIR, f"transformers-{line(version)}.json")


def installed_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def load_surveys() -> list[dict[str, Any]]:
    """Every committed survey, oldest transformers first."""
    out = []
    for name in sorted(os.listdir(DATA_DIR)) if os.path.isdir(DATA_DIR) else ():
        if name.endswith(".json"):
            with open(os.path.join(DATA_DIR, name), encoding="utf-8") as f:
                out.append(json.load(f))
    return sorted(out, key=lambda s: line_key(s["transformers"]))


def write_survey() -> str:
    data = survey()
    os.makedirs(DATA_DIR, exist_ok=True)
    path = data_path(data["transformers"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


_CELL = {"bound, eager and vLLM": "✅ vLLM too", "bound, eager": "✅", "defect": "🐞", "untested": "❔"}


def markdown(surveys: list[dict[str, Any]] | None = None) -> str:
    """docs/FAMILIES.md body: counts per version, then one row per model type with one column per version."""
    surveys = load_surveys() if surveys is None else surveys
    versions = [s["transformers"] for s in surveys]
    by = [{r["model_type"]: r for r in s["rows"]} for s in surveys]
    lines = [
        "## Counts",
        "",
        "| | " + " | ".join(f"transformers {v}" for v in versions) + " |",
        "| --- |" + " --- |" * len(versions),
    ]
    cats: list[str] = []
    for s in surveys:
        for r in s["rows"]:
            if r["category"] not in cats:
                cats.append(r["category"])
    order = ["bound, eager and vLLM", "bound, eager"]
    cats = order + sorted(c for c in cats if c not in order)
    lines.append("| model types in the causal-LM mapping | " + " | ".join(str(len(s["rows"])) for s in surveys) + " |")
    lines.append(
        "| **bound (all invariants pass)** | "
        + " | ".join(f"**{sum(r['status'] == 'bound' for r in s['rows'])}**" for s in surveys)
        + " |"
    )
    for c in cats:
        lines.append(f"| {c} | " + " | ".join(str(sum(r["category"] == c for r in s["rows"])) for s in surveys) + " |")
    lines += [
        "",
        "## Every model type",
        "",
        "✅ bound on eager with every invariant passing (vLLM too: served by the vLLM backend as well); "
        "⛔ refused by `ie_lab.load` with an `IELabError` (its category, then the refusal); 🐞 a defect: the "
        "load crashed with another exception class, or it bound and an invariant fails; ❔ no tiny instance "
        "could be built from the config class (the reason is the construction error); — not in that "
        "version's mapping; * a note (the reason column says it).",
        "",
        "| model type | " + " | ".join(versions) + " | reason (newest version that refuses it) |",
        "| --- |" + " --- |" * len(versions) + " --- |",
    ]
    types = sorted({mt for b in by for mt in b})
    for mt in types:
        cells, reason = [], ""
        for b in by:
            r = b.get(mt)
            if r is None:
                cells.append("—")
                continue
            cells.append(_CELL.get(r["category"], f"⛔ {r['category']}") + (" *" if r.get("note") else ""))
            if r["status"] != "bound":
                reason = r.get("reason", "").split(" Instead:")[0].replace("|", "\\|")
            elif r.get("note"):
                reason = r["note"]
        lines.append(f"| `{mt}` | " + " | ".join(cells) + f" | {reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    import time

    if sys.argv[1:] == ["--write"]:
        print("wrote", write_survey())
        sys.exit(0)
    for mt in sys.argv[1:] or sorted(causal_lm_types()):
        t = time.time()
        r = classify(mt)
        print(f"{time.time() - t:5.2f}s", json.dumps(r), flush=True)
