#!/usr/bin/env bash
# Every CPU benchmark issue 16 asks for, in one go, on a quiet machine (2 cores, nothing else running):
#   bash benchmarks/quiet_run.sh            # ~28 minutes; logs in $IE_LAB_QUIET_LOGS (default /tmp/ie_lab_quiet_run)
#   IE_LAB_QUIET_NO_VLLM=1 bash benchmarks/quiet_run.sh   # without the ie_vllm cells (~19 minutes)
#
# Steps, in order, each timed (one "[step] ... s" line), results where benchmarks/render.py reads them:
#   1 eager_batch.py --model bench20m   -> results/eager_batch-cpu.json             (~3 min: 7 repeats of ~5 s, then
#     its cross-process rows: 4 variants x 3 rounds, a ~10 s process each)
#   2 eager_batch.py --model demo       -> results/eager_batch-demo-cpu.json        (~2.5 min: 15 repeats of ~0.7 s,
#     then the same cross-process rows)
#   3 patch_sweep_batch.py --model demo -> results/patch_sweep_batch-demo-cpu.json  (~0.3 min: 4 layers x 32 positions)
#   4 patch_sweep_batch.py bench20m     -> results/patch_sweep_batch-bench20m-cpu.json (~0.5 min: 8 x 16; the README's)
#   5 remote.py (its defaults: 7 repeats, 1 thread each side, 16 clients x 8 requests) -> results/remote-cpu.json
#     (~1 min)
#   6 python -m benchmarks.run, engines ie_eager, bare, ie_vllm; models bench20m and demo; --repeats 3
#     -> results/sidebyside/cpu/<model>__<engine>__<workload>.json (18 cells per engine; ~4 min bare, ~5 min
#     ie_eager, ~9 min ie_vllm: each cell is its own process, ~8 s of imports, ~25 s for vLLM's; the other
#     engines' cells (interp, tl, nnsight, graph mode) are left as they are)
#   7 python -m benchmarks.run, engines tl and nnsight, workload generate_x8 only (the peers' rows the eager
#     generate_x8 target compares with, from the same quiet run; ~2 min)
#   8 python benchmarks/render.py -> results-latest.md, the README block, charts/
# Estimated wall time from the last runs' cell times and loads: ~28 minutes with --repeats 3; the ie_vllm cells
# are the largest part, so if the budget is short, IE_LAB_QUIET_NO_VLLM=1 drops them
# (then the "vLLM generate_x8 >= 4x eager" target shows "not measured" unless older cells remain).
# Every step runs even if an earlier one fails (a benchmark that finds wrong tokens reports nothing and exits 1);
# the script exits 1 if any step failed, naming them.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
py=.venv/bin/python
[ -x "$py" ] || py=python
logs="${IE_LAB_QUIET_LOGS:-/tmp/ie_lab_quiet_run}"
mkdir -p "$logs"
failed=()
start=$SECONDS

step() { # step NAME COMMAND...: runs it, its output to the terminal and to $logs/NAME.log, then one timing line
	local name=$1 t0=$SECONDS rc
	shift
	echo "=== [$name] $*"
	"$@" 2>&1 | tee "$logs/$name.log"
	rc=${PIPESTATUS[0]}
	[ "$rc" -eq 0 ] || failed+=("$name (rc $rc)")
	printf '[%s] rc %s, %d s (total %d s)\n' "$name" "$rc" $((SECONDS - t0)) $((SECONDS - start)) | tee -a "$logs/times.txt"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (read the figures only if this is near 0)" | tee "$logs/times.txt"
step eager_batch-bench20m "$py" benchmarks/eager_batch.py --model bench20m --repeats 7 --threads 2
step eager_batch-demo "$py" benchmarks/eager_batch.py --model demo --repeats 15 --threads 2
step patch_sweep-demo "$py" benchmarks/patch_sweep_batch.py --model demo --repeats 7 --threads 2
step patch_sweep-bench20m "$py" benchmarks/patch_sweep_batch.py --model bench20m --repeats 5 --threads 2
step remote "$py" benchmarks/remote.py
engines=(--engine ie_eager --engine bare)
[ -n "${IE_LAB_QUIET_NO_VLLM:-}" ] || engines+=(--engine ie_vllm)
# --timeout bounds one stuck cell (a vLLM cell takes ~40 s) so it cannot eat the whole budget
step sidebyside "$py" -m benchmarks.run "${engines[@]}" --repeats 3 --threads 2 --timeout 300 \
	--out benchmarks/results/sidebyside/cpu
step sidebyside-peers-x8 "$py" -m benchmarks.run --engine tl --engine nnsight --workload generate_x8 --repeats 3 \
	--threads 2 --timeout 300 --out benchmarks/results/sidebyside/cpu
step render "$py" benchmarks/render.py
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$logs/times.txt"
printf 'total %d s; per-step times in %s/times.txt\n' $((SECONDS - start)) "$logs"
if [ ${#failed[@]} -gt 0 ]; then
	echo "FAILED: ${failed[*]} (logs in $logs)"
	exit 1
fi
