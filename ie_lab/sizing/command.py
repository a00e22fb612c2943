"""`ie-lab size MODEL_OR_CONFIG`: the sizer's verdict on the command line (docs/CLI.md, docs/SIZING.md)."""

from __future__ import annotations

import argparse
import sys

from ..errors import IELabError, InputError
from .gpus import GPUS
from .params import DTYPE_BYTES, WEIGHT_ONLY


def _positive(text: str) -> int:
    try:
        # "32k" is 32768, as context lengths are quoted
        n = int(text.replace("_", "").replace(",", "").lower().removesuffix("k")) * (
            1024 if text.lower().endswith("k") else 1
        )
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 8192 or 32k)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive token count")
    return n


def add_size_command(sub) -> None:
    p = sub.add_parser(
        "size",
        allow_abbrev=False,
        help="which GPUs a model fits on, with what vLLM settings and how much KV cache",
        description="Size a model from its config alone (nothing is downloaded, no weights are read): parameters "
        "counted on the meta device, weight bytes (the checkpoint's quantization included), KV cache per token "
        "(sliding windows, latent attention, SSM state), the smallest GPU set that fits with its vLLM settings, and "
        "a roofline of decode and prefill speed per GPU.",
    )
    p.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        help="a local folder with config.json, a config.json file, or a model type such as 'qwen3' (its config "
        "class's reference size)",
    )
    p.add_argument("--gpu", help=f"one GPU of the table (default: all): {', '.join(g.name for g in GPUS)}")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES) + sorted(WEIGHT_ONLY),
        help="weights at this dtype, or weight-only quantized to int4/int8/fp8 (default: what the checkpoint states)",
    )
    p.add_argument(
        "--tokens", type=_positive, default=None, help="context one sequence needs, e.g. 32768 or 32k (default 8192)"
    )
    p.add_argument("--kv-dtype", choices=("bfloat16", "float16", "float32", "fp8"), help="the KV cache's dtype")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of GPU memory (default 0.9)")
    p.set_defaults(run=_size_cmd, takes_extra=False)


def _size_cmd(args: argparse.Namespace) -> int:
    from .recommend import size

    try:
        s = size(
            args.model,
            gpu=args.gpu,
            dtype=args.dtype,
            tokens=args.tokens,
            kv_dtype=args.kv_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        print(repr(s))
    except IELabError as e:
        # 2: a command line that cannot work as written (an unknown model or GPU); 1: a refusal (a family ie_lab
        # does not bind), as every ie-lab command answers (docs/CLI.md)
        print(f"ie-lab size: {e}", file=sys.stderr)
        return 2 if isinstance(e, InputError) else 1
    return 0
