#!/usr/bin/env bash
# One call on the lent GPU machine: install the package (no deps: nothing can be
# downloaded there), run every GPU test and every GPU benchmark, write results to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export ULTRAEP_GIT_COMMIT=${ULTRAEP_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUPY_CACHE_DIR=/tmp/ultraep-cupy-cache
export ULTRAEP_MPIEXEC=${ULTRAEP_MPIEXEC:-$(command -v mpirun || echo /usr/bin/mpirun)}
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; echo "commit $ULTRAEP_GIT_COMMIT"; date -u; } > "$OUT/machine.txt" 2>&1
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || export PYTHONPATH=$PWD
status=0
$PY -m pytest -m gpu -v -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40 || status=1
for bench in ${GPU_BENCHES-peer-copy plan-kernel weight-sync dispatch balancer}; do
  echo "== bench $bench" | tee -a "$OUT/bench.log"
  $PY -m ultraep.bench "$bench" --json "$OUT/bench-$bench.json" 2>&1 | tee -a "$OUT/bench.log" || status=1
done
exit $status
