#!/usr/bin/env bash
# Issue 7 in one call. On a machine with N >= 2 GPUs: every GPU test, then the weight-sync
# (fan-out 1..N-1, direct and relay, beside cudaMemcpy and NCCL batch_isend_irecv),
# dispatch (beside NCCL all_to_all_single) and moe-layer benchmarks with one rank per GPU.
# On a one-GPU machine the same as a dry run: $DRY_RUN_RANKS ranks share the GPU
# (time-sliced), NCCL columns say "not run". Logs, JSON and summary.txt land in $OUT
# (8 files: what the device tool brings back).
#
#   ULTRAEP_GIT_COMMIT=<sha> bash scripts/multi_gpu_check.sh
#   CHECK_SIZE=small          small benchmark sizes (the one-GPU dry run fits in about 2 minutes)
#   GPU_TESTS="tests ..."     pytest arguments for the GPU tests (default: tests)
#   TESTS_TIMEOUT_S=300 BENCH_TIMEOUT_S=90   caps, so the whole run fits one 600 s device call
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
rm -f "$OUT"/bench-*.json "$OUT"/summary.txt  # a reused $OUT must not report an earlier run
# NVLink multicast stays off (device README): a program using it can put a shared host's
# GPUs out of service. Exported here so every rank and every test inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ULTRAEP_GIT_COMMIT=${ULTRAEP_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUPY_CACHE_DIR=/tmp/ultraep-cupy-cache
export ULTRAEP_MPIEXEC=${ULTRAEP_MPIEXEC:-$(command -v mpirun || echo /usr/bin/mpirun)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the benchmarks' ranks import this tree even if the install failed
PY=${PYTHON:-python3}

GPUS=$($PY -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
if [ "$GPUS" -ge 2 ]; then
  RANKS=$GPUS MODE="$GPUS GPUs, one rank per GPU"
elif [ "$GPUS" -eq 1 ]; then
  RANKS=${DRY_RUN_RANKS:-4} MODE="DRY RUN: ${DRY_RUN_RANKS:-4} ranks share one GPU (time-sliced, not figures of merit)"
else
  echo "multi_gpu_check: no GPU visible" >&2
  exit 1
fi
# Relay trees serve experts with more replicas than the threshold: keep one relayed fan-out.
RELAY_THRESHOLD=$(( RANKS > 4 ? 3 : (RANKS > 2 ? RANKS - 2 : 1) ))
FANOUTS=$(seq -s ' ' 1 $((RANKS - 1)))
if [ "${CHECK_SIZE:-full}" = small ]; then
  WEIGHT_SYNC_ARGS="--hidden 2048 --ffn 768 --blocks 132 --repeats 5"
  DISPATCH_ARGS="--tokens 2048 --hidden 4096 --repeats 3"
  MOE_ARGS="--tokens 1024 --hidden 1024 --ffn 512 --repeats 2"
else
  WEIGHT_SYNC_ARGS="--repeats 20"
  DISPATCH_ARGS="--tokens 4096 16384 --hidden 4096 7168 --repeats 10"
  MOE_ARGS="--tokens 8192 --hidden 2048 --ffn 1024 --repeats 5"
fi

status=0
# Install and the GPU tests: scripts/gpu_check.sh without its benchmarks (machine.txt,
# install.log, gpu-tests.log). Test scripts start their own rank counts (2 or 4); ranks
# map to GPUs local_rank % count, so with 4+ GPUs every test rank has its own GPU.
timeout "${TESTS_TIMEOUT_S:-300}" env GPU_BENCHES= GPU_TESTS="${GPU_TESTS:-tests}" bash scripts/gpu_check.sh || status=1
{ echo "mode: $MODE"; nvidia-smi topo -m; env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='; } \
  >> "$OUT/machine.txt" 2>&1

bench() {  # name, args...: one benchmark, its table into bench.log, JSON into $OUT
  local name=$1
  shift
  echo "== bench $name $*" | tee -a "$OUT/bench.log"
  timeout "${BENCH_TIMEOUT_S:-90}" $PY -m ultraep.bench "$name" "$@" --json "$OUT/bench-$name.json" 2>&1 \
    | tee -a "$OUT/bench.log" || status=1
}
# shellcheck disable=SC2086  # the argument strings split into words on purpose
bench weight-sync --fanouts $FANOUTS --relay-threshold $RELAY_THRESHOLD $WEIGHT_SYNC_ARGS
# shellcheck disable=SC2086
bench dispatch --ranks "$RANKS" --experts $((32 * RANKS)) $DISPATCH_ARGS
# shellcheck disable=SC2086
bench moe-layer --ranks "$RANKS" $MOE_ARGS

$PY - "$OUT" "$MODE" > "$OUT/summary.txt" 2>&1 <<'EOF' || status=1
"""The figures issue 7 asks for, read back from the JSON of this run."""
import json
import re
import sys
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
print(f"multi_gpu_check summary: {mode}")
log = (out / "gpu-tests.log").read_text() if (out / "gpu-tests.log").exists() else ""
totals = re.findall(r"^=+ (.* in [\d.]+s.*) =+$", log, re.M)
print("GPU tests:", totals[-1] if totals else "NOT RUN or cut off (see gpu-tests.log)")


def rows(name):
    path = out / f"bench-{name}.json"
    if not path.exists():
        print(f"{name}: NO RESULT (see bench.log)")
        return None
    data = json.loads(path.read_text())
    print(f"{name}: {data['meta']['device']}, {data['ranks']} ranks, commit {data['meta']['git_commit']}")
    return data["rows"]


def fmt(value, digits=2):
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-" if value is None else str(value)


def versus(ratio, rate, what):
    """'x1.23 <what> (456 GB/s)', or what was not run and why."""
    return f"{what} {rate}" if isinstance(rate, str) else f"x{fmt(ratio)} {what} ({fmt(rate, 0)} GB/s)"


for row in rows("weight-sync") or []:
    print(f"  fan-out {row['fanout']}: tile {fmt(row['tile_gb_s'], 0)} GB/s, x{fmt(row['tile_vs_memcpy'])} memcpy/replica, "
          f"{versus(row['tile_vs_nccl'], row['nccl_gb_s'], 'NCCL batch_isend_irecv')}, "
          f"relay ({row.get('relays')} relays) x{fmt(row.get('relay_vs_direct'))} direct")
for row in rows("dispatch") or []:
    print(f"  {row['tokens']} tokens x {row['hidden']}: dispatch {fmt(row['dispatch_GBps'], 0)} GB/s, "
          f"combine {fmt(row['combine_GBps'], 0)} GB/s; dispatch "
          f"{versus(row['dispatch/a2a'], row['a2a_GBps'], 'all_to_all_single')}, combine x{fmt(row['combine/a2a'])}")
for row in rows("moe-layer") or []:
    print(f"  {row['policy']:8s} {fmt(row['tokens_per_s'], 0)} tokens/s, {fmt(100 * row['vs_ideal'], 1)} % of ideal, "
          f"busiest rank {fmt(row['rows_max_mean'], 3)} x mean rows")
EOF
cat "$OUT/summary.txt"
echo "multi_gpu_check: exit $status"
exit $status
