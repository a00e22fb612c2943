"""The accelerators the sizer knows: memory, memory bandwidth and dense bf16 tensor throughput.

Numbers are the vendors' datasheet figures for dense math (not the "with sparsity" figures, which are twice as
large), so a roofline built on them is an upper bound no real run reaches. Memory is what the device reports to
the framework (GiB), a little under the marketed size. Each row names its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total
    bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s (10^9 bytes per second)
    bf16_tflops: float  # dense bf16 (fp16 where the card has no bf16) tensor-core peak, 10^12 FLOP/s
    bf16: bool = True  # False: no bf16 (vLLM serves bf16 checkpoints in fp16 there)
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


GPUS: tuple[GPU, ...] = (
    # NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOPS mixed-precision fp16 (Turing has no bf16).
    GPU("T4 16GB", 15.0, 320, 65, bf16=False, source="nvidia.com/en-us/data-center/tesla-t4 (datasheet)"),
    # NVIDIA L4 datasheet: 24 GB, 300 GB/s, bf16 242 TFLOPS with sparsity -> 121 dense.
    GPU("L4 24GB", 22.0, 300, 121, source="nvidia.com/en-us/data-center/l4 (datasheet)"),
    # NVIDIA A10 datasheet: 24 GB GDDR6, 600 GB/s, bf16 125 TFLOPS dense (250 with sparsity).
    GPU("A10 24GB", 22.0, 600, 125, source="nvidia.com/en-us/data-center/products/a10-gpu (datasheet)"),
    # Ada Lovelace whitepaper, appendix table: RTX 4090 1008 GB/s; bf16 tensor with fp32 accumulate 165.2 dense.
    GPU("RTX 4090 24GB", 23.6, 1008, 165.2, source="NVIDIA Ada GPU architecture whitepaper v2.1, table 2"),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, bf16 733 TFLOPS with sparsity -> 366 dense.
    GPU("L40S 48GB", 44.4, 864, 366, source="nvidia.com/en-us/data-center/l40s (datasheet)"),
    # NVIDIA A100 datasheet: 40 GB HBM2 1555 GB/s (SXM), bf16 312 TFLOPS dense.
    GPU("A100 40GB", 39.4, 1555, 312, source="nvidia.com/en-us/data-center/a100 (datasheet, SXM)"),
    # NVIDIA A100 datasheet: 80 GB HBM2e 2039 GB/s (SXM), bf16 312 TFLOPS dense.
    GPU("A100 80GB", 79.1, 2039, 312, source="nvidia.com/en-us/data-center/a100 (datasheet, SXM)"),
    # NVIDIA H100 datasheet: 80 GB HBM3 3.35 TB/s (SXM), bf16 1979 TFLOPS with sparsity -> 989 dense.
    GPU("H100 80GB", 79.1, 3350, 989, source="nvidia.com/en-us/data-center/h100 (datasheet, SXM)"),
    # NVIDIA H200 datasheet: 141 GB HBM3e 4.8 TB/s (SXM), bf16 1979 TFLOPS with sparsity -> 989 dense.
    GPU("H200 141GB", 139.8, 4800, 989, source="nvidia.com/en-us/data-center/h200 (datasheet, SXM)"),
    # NVIDIA HGX B200 datasheet: 180 GB HBM3e 8 TB/s per GPU, bf16 4.5 PFLOPS with sparsity -> 2250 dense.
    GPU("B200 180GB", 178.0, 8000, 2250, source="nvidia.com/en-us/data-center/hgx (HGX B200 datasheet)"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 5.3 TB/s, bf16 1307.4 TFLOPS dense.
    GPU("MI300X 192GB", 191.5, 5300, 1307.4, source="amd.com/en/products/accelerators/instinct/mi300/mi300x"),
)


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def find_gpu(name: "str | GPU") -> GPU:
    """A GPU of the table by a loose name ("a100-80", "H100", "rtx4090"): the unique row whose name contains it."""
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"gpu must be a name from the sizer's table, got {name!r}; one of: {names()}.")
    want = _norm(name).replace("gb", "")
    exact = [g for g in GPUS if _norm(g.name) == _norm(name)]
    if exact:
        return exact[0]
    first = [g for g in GPUS if _norm(g.name.split()[0]) == _norm(name)]  # "L4", "A10": the model word itself
    if len(first) == 1:
        return first[0]
    hits = [g for g in GPUS if want in _norm(g.name).replace("gb", "")]
    if len(hits) == 1:
        return hits[0]
    if not hits:  # "a100-80": the model word and the size in any order
        parts = [p for p in name.lower().replace("-", " ").replace("_", " ").replace("gb", " ").split() if p]
        hits = [g for g in GPUS if all(p in g.name.lower() for p in parts)]
        if len(hits) == 1:
            return hits[0]
    raise InputError(
        f"gpu {name!r} is {'ambiguous' if hits else 'not in the sizer table'}"
        + (f" (it matches {', '.join(g.name for g in hits)})" if hits else "")
        + f"; use one of: {names()}."
    )


def names() -> str:
    return ", ".join(repr(g.name) for g in GPUS)
