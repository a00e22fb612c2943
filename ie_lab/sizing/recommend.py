"""Which GPUs a model fits on, with what vLLM settings, how many tokens of KV cache, and how fast at best.

`size(model)` reads a config (nothing is downloaded), counts the parameters on the meta device (params.py), lays
out the cache (kv.py), and for each GPU of the table (gpus.py) finds the smallest tensor-parallel size whose
memory holds the weights, the activations of one scheduler step, the framework's own overhead and the KV cache
for the tokens asked for. The roofline gives the best any engine can do: decode reads every active weight and the
sequence's cache once per token (memory-bandwidth bound), prefill does 2 FLOPs per active parameter per token plus
attention (compute bound).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..arch.config_facts import ArchFacts
from ..errors import InputError
from .gpus import GIB, GPU, GPUS, find_gpu
from .kv import CacheLayout, cache_layout
from .params import (
    DTYPE_BYTES,
    WEIGHT_ONLY,
    ParamCount,
    Quantization,
    config_dict,
    count_params,
    quantization,
    resolve_config,
    weight_bytes,
)

# What vLLM reserves besides weights and KV cache, per GPU: the CUDA context, CUDA graphs and NCCL buffers (vLLM
# measures this at start-up; 1.5 GiB is what a typical H100/A100 start-up log reports as non-torch + graph memory).
OVERHEAD_BYTES = 1.5 * GIB
# vLLM's default scheduler step: up to this many tokens in one forward (chunked prefill), this many sequences.
MAX_NUM_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256
TP_SIZES = (1, 2, 4, 8)
DEFAULT_TOKENS = 8192


@dataclass(frozen=True)
class Plan:
    """One GPU type at its smallest tensor-parallel size that fits (or the largest tried, when none does)."""

    gpu: GPU
    tp: int
    fits: bool
    kv_tokens: int | None  # tokens of KV cache the memory left holds for one sequence (None: no per-token cache)
    concurrent: int  # sequences of `tokens` tokens the cache holds at once
    weights_per_gpu: float
    kv_budget_per_gpu: float
    decode_tps: float  # one sequence, tokens per second, at most
    prefill_s: float  # seconds to prefill `tokens` tokens, at least
    gpu_memory_utilization: float
    max_model_len: int
    why: str = ""

    def vllm_args(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tp,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }

    def command(self, model: str = "MODEL") -> str:
        return (
            f"vllm serve {model} --tensor-parallel-size {self.tp} --max-model-len {self.max_model_len} "
            f"--gpu-memory-utilization {self.gpu_memory_utilization}"
        )


@dataclass
class Sizing:
    """The sizer's answer for one model: parameters, bytes, cache, and a plan per GPU. repr: the verdict."""

    name: str
    facts: ArchFacts
    params: ParamCount
    dtype: str  # the dtype of every weight not quantized, and of activations
    quant: Quantization | None
    kv_dtype: str
    layout: CacheLayout
    tokens: int
    gpu_memory_utilization: float = 0.9
    gpus: tuple[GPU, ...] = GPUS
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # what `vllm serve` is given: the folder sized, the config's hub id, else a placeholder to fill in
    serve_as: str = "MODEL"

    # ---- bytes ----
    @property
    def weights_bytes(self) -> float:
        return weight_bytes(self.params, self.dtype, self.quant)

    @property
    def active_weights_bytes(self) -> float:
        """Bytes one decode step reads at batch 1: routed experts at experts_per_token / n_experts."""
        return self.weights_bytes * self.params.active / max(1, self.params.total)

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes each further token adds to one sequence's cache (full-attention and latent layers)."""
        return self.layout.per_token * _KV_BYTES[self.kv_dtype]

    @property
    def state_bytes(self) -> float:
        """Bytes of fixed-size state (SSM, linear attention) one sequence keeps whatever its length."""
        return self.layout.state * DTYPE_BYTES[self.dtype]

    def kv_bytes(self, tokens: int) -> float:
        """Bytes one sequence of `tokens` tokens keeps: K/V (window-bounded on sliding layers), latents, states."""
        return self._kv_per_gpu(tokens, 1)

    def _kv_per_gpu(self, tokens: int, tp: int) -> float:
        kvb, sb = _KV_BYTES[self.kv_dtype], DTYPE_BYTES[self.dtype]
        # K/V heads split across ranks down to one head per rank (vLLM replicates below that); a latent is
        # replicated on every rank; SSM heads split
        shard = 1 if self.layout.latent else max(1, min(tp, self.facts.n_kv_heads or 1))
        out = 0.0
        for layer in self.layout.layers:
            kept = tokens if layer.window is None else min(tokens, layer.window)
            out += layer.per_token * kept * kvb / shard + layer.state * sb / tp
        return out

    def activation_bytes(self, tp: int = 1) -> float:
        """Peak activations of one scheduler step (MAX_NUM_BATCHED_TOKENS tokens) per GPU, and the logits."""
        f, d = self.facts, self.raw
        mlp = max(f.d_mlp, int(d.get("moe_intermediate_size") or 0) * max(1, f.experts_per_token))
        per_token = 4 * f.d_model + (f.q_width + 2 * f.kv_width + 2 * mlp) / tp
        return MAX_NUM_BATCHED_TOKENS * per_token * DTYPE_BYTES[self.dtype] + MAX_NUM_SEQS * f.vocab_size * 4 / tp

    # ---- roofline ----
    def prefill_flops(self, tokens: int) -> float:
        """2 FLOPs per active parameter per token, plus causal attention (QK^T and PV over the keys each query
        sees: half the prefix on full layers, the window on sliding ones)."""
        f, d = self.facts, self.raw
        heads = f.n_heads
        dk = (int(d.get("qk_nope_head_dim") or 0) + int(d.get("qk_rope_head_dim") or 0)) or f.head_dim
        dv = f.value_head_dim
        attn = 0.0
        for layer in self.layout.layers:
            if layer.kind == "state":
                continue
            pairs = tokens * tokens / 2 if layer.window is None else tokens * min(tokens, layer.window)
            attn += 2 * pairs * heads * (dk + dv)
        return 2 * self.params.active * tokens + attn

    def decode_tokens_per_s(self, gpu: GPU, tp: int = 1, context: int | None = None) -> float:
        """One sequence's decode speed at best: each step reads the active weights and the cache once."""
        ctx = self.tokens if context is None else context
        read = self.active_weights_bytes / tp + self._kv_per_gpu(ctx, tp)
        t_mem = read / (gpu.bandwidth_gbs * 1e9)
        t_compute = 2 * self.params.active / tp / (gpu.bf16_tflops * 1e12)
        return 1 / max(t_mem, t_compute)

    def prefill_seconds(self, gpu: GPU, tp: int = 1, tokens: int | None = None) -> float:
        n = self.tokens if tokens is None else tokens
        return self.prefill_flops(n) / (tp * gpu.bf16_tflops * 1e12)

    # ---- plans ----
    def plan(self, gpu: "str | GPU", tp: int | None = None) -> Plan:
        """The smallest tensor-parallel size on `gpu` that holds the weights and `tokens` tokens of cache."""
        g = find_gpu(gpu)
        sizes = (tp,) if tp else TP_SIZES
        last = None
        for t in sizes:
            if not self._tp_divides(t):
                continue
            last = self._plan_at(g, t)
            if last.fits:
                return last
        if last is None:
            raise InputError(f"no tensor-parallel size in {sizes} divides the {self.facts.n_heads} attention heads.")
        return last

    def _tp_divides(self, tp: int) -> bool:
        heads = self.facts.n_heads or int(self.raw.get("num_heads") or self.raw.get("mamba_n_heads") or 1)
        return heads % tp == 0

    def _plan_at(self, g: GPU, tp: int) -> Plan:
        util = self.gpu_memory_utilization
        w = self.weights_bytes / tp
        budget = g.memory_bytes * util - w - self.activation_bytes(tp) - OVERHEAD_BYTES
        per_seq = self._kv_per_gpu(self.tokens, tp)
        if self.layout.per_token:
            kv_tokens = _max_tokens(lambda n: self._kv_per_gpu(n, tp), budget) if budget > 0 else 0
        else:
            kv_tokens = None  # only windows and fixed states: a sequence's cache stops growing
        concurrent = int(budget // per_seq) if budget > 0 and per_seq > 0 else (0 if budget <= 0 else MAX_NUM_SEQS)
        max_pos = self.facts.max_positions
        why = ""
        if budget <= 0:
            why = (
                f"the weights ({w / GIB:.1f} GiB per GPU) and activations leave no room at "
                f"gpu_memory_utilization={util}"
            )
        elif concurrent < 1:
            why = f"{self.tokens} tokens of KV cache need {per_seq / GIB:.1f} GiB per GPU, {budget / GIB:.1f} GiB are left"
        fits = not why
        return Plan(
            gpu=g,
            tp=tp,
            fits=fits,
            kv_tokens=kv_tokens,
            concurrent=max(0, concurrent),
            weights_per_gpu=w,
            kv_budget_per_gpu=max(0.0, budget),
            decode_tps=self.decode_tokens_per_s(g, tp),
            prefill_s=self.prefill_seconds(g, tp),
            gpu_memory_utilization=util,
            max_model_len=min(self.tokens, max_pos) if isinstance(max_pos, int) and max_pos > 0 else self.tokens,
            why=why,
        )

    def plans(self) -> list[Plan]:
        return [self.plan(g) for g in self.gpus]

    def best(self) -> Plan | None:
        """The smallest GPU set that fits: least total memory, then fewest GPUs."""
        ok = [p for p in self.plans() if p.fits]
        return min(ok, key=lambda p: (p.tp * p.gpu.memory_gib, p.tp)) if ok else None

    # ---- text ----
    def summary(self) -> str:
        p = self.params
        q = (
            f" ({self.quant.method} at {self.quant.bits_per_weight:.2f} bits per packed weight, the rest in {self.dtype})"
            if self.quant
            else f" in {self.dtype}"
        )
        moe = f", {p.active / 1e9:.2f}B active per token" if p.active != p.total else ""
        mtp = (
            f"; the checkpoint's {p.mtp_layers} multi-token-prediction layer(s) add ~{p.mtp_params / 1e9:.2f}B "
            "that transformers does not build (vLLM loads them only for speculative decoding)"
            if p.mtp_layers and p.mtp_params
            else ""
        )
        counts = ", ".join(f"{n} {_KIND_WORDS[k]}" for k, n in self.layout.counts().items())
        state = f" + {self.state_bytes / 2**20:.1f} MiB of fixed state per sequence" if self.layout.state else ""
        window = (
            " (sliding-window layers stop growing at their window)"
            if any(layer.window for layer in self.layout.layers)
            else ""
        )
        return (
            f"{self.name}: {p.total / 1e9:.2f}B parameters{moe} ({p.source}){mtp}\n"
            f"weights {self.weights_bytes / GIB:.1f} GiB{q}\n"
            f"KV cache {self.kv_bytes_per_token / 1024:.1f} KiB per token{state}{window} in {self.kv_dtype}; "
            f"layers: {counts}"
        )

    def verdict(self) -> str:
        b = self.best()
        if b is None:
            return f"{self.name} does not fit {self.tokens} tokens on 8 of any GPU in the table; quantize it."
        cache = f"~{_k(b.kv_tokens)} tokens of KV cache" if b.kv_tokens is not None else "a fixed-size cache"
        where = "one" if b.tp == 1 else f"{b.tp}x"
        return f"{self.name} on {where} {b.gpu.name} with {cache}: {b.command(self.serve_as)}"

    def rows(self) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        for p in self.plans():
            out.append(
                (
                    p.gpu.name,
                    f"{p.tp}" if p.fits else f"> {p.tp}",
                    ("~" + _k(p.kv_tokens) if p.kv_tokens is not None else "fixed") if p.fits else "—",
                    f"{p.concurrent}" if p.fits else "—",
                    f"{p.decode_tps:,.0f}" if p.fits else "—",
                    f"{p.prefill_s:.2f}" if p.fits else "—",
                    f"tp={p.tp} max_model_len={p.max_model_len} util={p.gpu_memory_utilization}" if p.fits else p.why,
                )
            )
        return out

    HEAD = ("GPU", "GPUs", "KV tokens", "seqs", "decode tok/s", "prefill s", "vLLM settings")

    def __repr__(self) -> str:
        head = list(self.HEAD)
        head[3] = f"seqs of {self.tokens}"
        rows = [tuple(head)] + self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        notes = "".join(f"\nnote: {n}" for n in self.notes())
        return (
            f"{self.summary()}\n{self.verdict()}\n\n"
            + "\n".join(lines)
            + "\n(decode: one sequence, memory-bandwidth bound; prefill: compute bound at the datasheet's dense bf16"
            " peak; both are limits no engine exceeds)" + notes
        )

    def notes(self) -> list[str]:
        """What the numbers leave out or cap: unsized mixer state, an unknown quantization, the model's context."""
        out = list(self.layout.notes)
        if self.quant is not None and self.quant.note:
            out.append(self.quant.note)
        max_pos = self.facts.max_positions
        if isinstance(max_pos, int) and 0 < max_pos < self.tokens:
            out.append(
                f"the model's context is {max_pos} tokens (max_position_embeddings): max_model_len stops there, the "
                f"cache is still sized for {self.tokens}"
            )
        return out

    def _repr_html_(self) -> str:
        from .view import sizing_html

        return sizing_html(self)


_KV_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
_KIND_WORDS = {
    "attention": "full-attention",
    "sliding": "sliding-window",
    "latent": "latent-attention",
    "state": "state",
}


def _k(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 1000:.0f}k" if n >= 10_000 else f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _max_tokens(kv, budget: float) -> int:
    """The largest token count whose cache fits the budget (kv is non-decreasing in the count)."""
    lo, hi = 0, 1
    while kv(hi) <= budget and hi < 1 << 40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv(mid) <= budget else (lo, mid)
    return lo


def size(
    model: Any,
    gpu: "str | GPU | None" = None,
    dtype: str | None = None,
    tokens: int | None = None,
    kv_dtype: str | None = None,
    gpu_memory_utilization: float = 0.9,
) -> Sizing:
    """Size a model from its config: a config object or dict, a local folder with config.json, or a model type
    name (its config class's default, reference size). Nothing is downloaded and no weights are read.

    dtype: None reads the checkpoint (its quantization_config, else its torch dtype, bf16 for fp32 checkpoints as
    vLLM serves them); "bfloat16"/"float16"/"float32" sizes every weight unquantized at that dtype; "int4"/"int8"/
    "fp8" sizes weight-only quantization of the matrices. tokens: the context one sequence needs (default 8192).
    kv_dtype: the cache's dtype ("fp8" halves it; default the weights' dtype). gpu: one GPU of the table by name
    (default: every one)."""
    if tokens is None:
        tokens = DEFAULT_TOKENS
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise InputError(f"tokens must be a positive integer (the context one sequence needs), got {tokens!r}.")
    if (
        isinstance(gpu_memory_utilization, bool)
        or not isinstance(gpu_memory_utilization, (int, float))
        or not 0 < gpu_memory_utilization <= 1
    ):
        raise InputError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}.")
    choices = sorted(DTYPE_BYTES) + sorted(WEIGHT_ONLY)
    if dtype is not None and dtype not in choices:
        raise InputError(f"unknown dtype {dtype!r}; use one of {choices} (or leave it out to read the checkpoint).")
    if kv_dtype is not None and kv_dtype not in _KV_BYTES:
        raise InputError(f"unknown kv_dtype {kv_dtype!r}; use one of {sorted(_KV_BYTES)}.")
    gpus = (find_gpu(gpu),) if gpu is not None else GPUS
    config = resolve_config(model)
    d = config_dict(config)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else None
    # the config object, not its dict: ArchFacts reads computed properties (Jamba's layers_block_type) off it; a
    # multimodal wrapper gives its language model's facts
    facts = ArchFacts.from_config(config)
    raw = facts.raw
    params = count_params(config)
    ckpt_dtype = str(d.get("torch_dtype") or d.get("dtype") or (text or {}).get("dtype") or "bfloat16")
    ckpt_dtype = ckpt_dtype.removeprefix("torch.")
    quant: Quantization | None
    if dtype is None:
        unquantized = ckpt_dtype if ckpt_dtype in ("bfloat16", "float16") else "bfloat16"
        quant = quantization(d.get("quantization_config") or (text or {}).get("quantization_config"))
    elif dtype in WEIGHT_ONLY:
        unquantized, quant = "bfloat16", Quantization(dtype, WEIGHT_ONLY[dtype])
    else:
        unquantized, quant = dtype, None
    name = _name(model, d)
    return Sizing(
        name=name,
        serve_as=_serve_as(model, d),
        facts=facts,
        params=params,
        dtype=unquantized,
        quant=quant,
        kv_dtype=kv_dtype or unquantized,
        layout=cache_layout(raw, facts),
        tokens=tokens,
        gpu_memory_utilization=float(gpu_memory_utilization),
        gpus=gpus,
        raw=raw,
    )


def _serve_as(model: Any, d: dict[str, Any]) -> str:
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if os.path.isdir(text):
            return text
        if os.path.isfile(text):
            return os.path.dirname(text) or "."
        if "/" in text:
            return text  # a hub id from the local cache
        return "MODEL"  # a model type: its reference size has no checkpoint of its own
    name = str(d.get("_name_or_path") or "")
    return name if name and "/" in name else "MODEL"


def _name(model: Any, d: dict[str, Any]) -> str:
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model).rstrip("/")
        if os.path.isdir(text):
            return os.path.basename(text)
        if os.path.isfile(text):
            return os.path.basename(os.path.dirname(os.path.abspath(text))) or str(d.get("model_type"))
        return text
    return str(d.get("_name_or_path") or d.get("model_type") or "model")
