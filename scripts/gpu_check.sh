#!/usr/bin/env bash
# One call on the lent GPU machine: install the package (no deps: nothing can be
# downloaded there), run every GPU test (once as is, once with each process held to an SM
# share under MPS, less the tests that trap a kernel on purpose: under MPS a trap ends
# every client of the GPU), then the GPU benchmarks; results go to $OUT.
#   GPU_TESTS           test paths (default: tests)
#   GPU_SHARD           i/n: only the i-th (from 0) of n interleaved shares of those paths' files that
#                       hold GPU tests (scripts/gpu_shard.py), so that n calls run them all
#   GPU_MPS_SHARE       SM % for the second test pass (default 25; empty: skip it). At 25 % that pass
#                       alone outlasts a 10-minute device call: run it in a call of its own
#   GPU_BENCHES         benchmarks run as they are (default below)
#   GPU_EMULATED_BENCHES  multi-rank benchmarks run with --emulate-ep (ranks under MPS, 100/R % each)
#   GPU_EP_SHARES       how those ranks share the SMs, each way a run of its own (ULTRAEP_EP_SHARES; default:
#                       the launcher's first that works), e.g. "green percent" to compare them in one call
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUPY_CACHE_DIR=/tmp/ultraep-cupy-cache
export ULTRAEP_MPIEXEC=${ULTRAEP_MPIEXEC:-$(command -v mpirun || echo /usr/bin/mpirun)}
PY=${PYTHON:-python3}
# the commit every JSON records: $ULTRAEP_GIT_COMMIT, else HEAD, flagged where the tree differs from it (a stale .git)
commit=$($PY -c 'from ultraep.bench.report import git_commit; print(git_commit())' 2>/dev/null)
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; echo "commit $commit"; date -u; } > "$OUT/machine.txt" 2>&1
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || export PYTHONPATH=$PWD
TESTS=${GPU_TESTS:-tests}
if [ -n "${GPU_SHARD-}" ]; then
  TESTS=$($PY scripts/gpu_shard.py "$GPU_SHARD" $TESTS) || exit 2
  echo "GPU_SHARD=$GPU_SHARD: $(echo $TESTS | wc -w) test files" | tee "$OUT/gpu-shard.txt"
fi
status=0
$PY -m pytest -m gpu -v -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu-tests.log" | tail -40 || status=1
if [ -n "${GPU_MPS_SHARE-25}" ]; then
  echo "== gpu tests, each process held to ${GPU_MPS_SHARE:-25} % of the SMs under MPS"
  $PY -m ultraep.runtime.mps --percent "${GPU_MPS_SHARE:-25}" -- \
    $PY -m pytest -m "gpu and not traps" -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu-tests-mps.log" | tail -15 || status=1
fi
for bench in ${GPU_BENCHES-peer-copy plan-kernel weight-sync dispatch balancer grouped-gemm stream-wait}; do
  echo "== bench $bench" | tee -a "$OUT/bench.log"
  $PY -m ultraep.bench "$bench" --json "$OUT/bench-$bench.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
done
for bench in ${GPU_EMULATED_BENCHES-dispatch balancer moe-layer moe-fused grouped-gemm}; do
  extra=""
  [ "$bench" = moe-layer ] && extra="--phases"  # where each policy's steps go, beside the ratios
  [ "$bench" = grouped-gemm ] && extra="--ranks 4 --sizes uniform"  # its default is one process
  for shares in ${GPU_EP_SHARES:-default}; do
    tag=mps; [ "$shares" = default ] || tag="mps-$shares"
    echo "== bench $bench --emulate-ep $extra ($shares)" | tee -a "$OUT/bench.log"
    ULTRAEP_EP_SHARES=${shares#default} $PY -m ultraep.bench "$bench" --emulate-ep $extra \
      --json "$OUT/bench-$bench-$tag.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
  done
done
exit $status
