#!/usr/bin/env bash
# The side-by-side matrix on one GPU: the same workloads and cell format as the CPU run, on a real 1-8B checkpoint
# (bfloat16), every engine in its own process. Budget: <= 10 minutes on one H200 (model loads dominate; repeats 3).
#   bash benchmarks/gpu.sh [checkpoint]        # default meta-llama/Llama-3.2-1B (needs it in the HF cache)
# Cells land in benchmarks/results/sidebyside/cuda/; then `python benchmarks/render.py`.
# NOT YET RUN: no GPU was lent to the task that wrote it (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
export IE_LAB_BENCH_GPU_MODEL="${1:-${IE_LAB_BENCH_GPU_MODEL:-meta-llama/Llama-3.2-1B}}"
py=.venv/bin/python; [ -x "$py" ] || py=python
# first the gpu-marked tests: graph mode (compiled trunk + CUDA graphs, static taps) against the default
# eager-hook vLLM mode on a tiny model, and the eager backend on CUDA against CPU
timeout 180 "$py" -m pytest -q -m gpu tests/test_gpu.py || echo "gpu tests FAILED (see above)"
# graph-mode steering under CUDA graphs (PIECEWISE on a GPU): the CPU test file, run where the trunk is CUDA-graphed
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_vllm_graph_steer.py || echo "graph steering FAILED (see above)"
timeout 400 "$py" -m benchmarks.run --gpu --repeats 3 --timeout 120 \
  --engine bare --engine ie_eager --engine ie_vllm --engine ie_vllm_graph --engine interp --engine tl --engine nnsight "${@:2}"
# vLLM modes on the same checkpoint (fp32): graph-mode steering (static steering buffers, CUDA graphs PIECEWISE) vs
# graph-mode plain generation vs hooks-mode steering, and generation-only vs hooks mode; -> results/vllm_modes-cuda.json
timeout 420 "$py" benchmarks/vllm_modes.py --repeats 5 --model "$IE_LAB_BENCH_GPU_MODEL" \
  || echo "vllm_modes FAILED (see above)"
# projection in the worker vs a full capture projected on the client, k = 16 and 4,096: time and bytes per request
# (the random 12M Llama: the ratio is about the payload, not the model) -> results/vllm_projection-cuda.json
timeout 300 "$py" benchmarks/vllm_projection.py --repeats 7 || echo "vllm_projection FAILED (see above)"
"$py" benchmarks/render.py > /dev/null
