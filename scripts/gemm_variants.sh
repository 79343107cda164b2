#!/usr/bin/env bash
# The grouped GEMM's trial variants (ULTRAEP_GEMM_VARIANT, ultraep/compute/device.py) side by
# side in one GPU call, within about 240 s; everything goes to $OUT.
#   1. per variant, at once (correctness, not timing): the compute GPU tests, and the SHA-256
#      of forward/dgrad/wgrad outputs on one uneven problem (every variant must give the
#      default's bits: the accumulation order per element is the same in all);
#   2. per variant, one after the other: `bench grouped-gemm` on the cases that miss the bar
#      and one small-expert case, uniform sizes;
#   3. one table: variant x case x op, TFLOPS and the ratio to the better baseline / dense.
# Run from the repository root: PYTHONPATH=$PWD bash scripts/gemm_variants.sh
#   GEMM_VARIANTS  variants to run (default: all of VARIANTS)
#   GEMM_REPEATS   timed calls per bench figure (default 10)
#   GEMM_BUDGET_S  seconds for the whole script (default 235)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/ultraep-cupy-cache}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the test processes share the GPU (the JAX test)
PY=${PYTHON:-python3}
read -r -a VARIANTS <<< "${GEMM_VARIANTS:-$($PY -c 'from ultraep.compute.device import VARIANTS; print(*VARIANTS)')}"
CASES=("8x4096 N4096 K7168" "8x4096 N7168 K2048" "32x1024 N7168 K2048" "32x256 N4096 K7168" "qwen3 down")
BUDGET_S=${GEMM_BUDGET_S:-235}
start=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; git rev-parse HEAD; date -u; } > "$OUT/machine.txt" 2>&1

# Prints "op dtype sha256" lines for the variant in $ULTRAEP_GEMM_VARIANT.
BITS_PY=$(cat <<'EOF'
import hashlib

import cupy
import numpy as np

from ultraep.compute import check_errors, grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
from ultraep.runtime.dtypes import BFLOAT16

# Odd m-tile counts (a cluster's second block past its expert), empty and 1-row experts,
# K and N off every tile multiple (an odd number of wgrad m-tiles).
counts = np.array([300, 0, 1, 129, 513, 0, 260, 77])
offsets = cupy.asarray(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
rows, k, n = int(counts.sum()) + 5, 392, 584
rng = cupy.random.default_rng(7)
x = rng.standard_normal((rows, k), dtype=np.float32).astype(BFLOAT16)
dy = rng.standard_normal((rows, n), dtype=np.float32).astype(BFLOAT16)
w = rng.standard_normal((len(counts), k, n), dtype=np.float32).astype(BFLOAT16)
for dtype in (BFLOAT16, np.float32):
    for op, call, shape in (("forward", lambda o: grouped_mm(x, w, offsets, out=o), (rows, n)),
                            ("dgrad", lambda o: grouped_mm_dgrad(dy, w, offsets, out=o), (rows, k)),
                            ("wgrad", lambda o: grouped_mm_wgrad(x, dy, offsets, out=o), (len(counts), k, n))):
        out = cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)
        call(out)
        check_errors()
        print(op, np.dtype(dtype).name, hashlib.sha256(out.get().tobytes()).hexdigest()[:16])
EOF
)

echo "== 1. tests and output bits, all variants at once"
pids=()
for v in "${VARIANTS[@]}"; do
  ( ULTRAEP_GEMM_VARIANT=$v timeout 110 $PY -m pytest -m gpu -q -p no:cacheprovider tests/compute \
      > "$OUT/tests-$v.log" 2>&1; echo "exit $?" >> "$OUT/tests-$v.log"
    ULTRAEP_GEMM_VARIANT=$v timeout 40 $PY -c "$BITS_PY" > "$OUT/bits-$v.txt" 2>&1 ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for v in "${VARIANTS[@]}"; do  # pytest's summary line, then its exit status
  echo "$v: $(tail -2 "$OUT/tests-$v.log" | head -1) ($(tail -1 "$OUT/tests-$v.log"))"
done
echo "phase 1 took $((SECONDS - start)) s"

echo "== 2. bench grouped-gemm, one variant at a time"
for v in "${VARIANTS[@]}"; do
  left=$((BUDGET_S - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then echo "$v: skipped, the time budget is spent"; continue; fi
  limit=$((left < 50 ? left : 50))
  ULTRAEP_GEMM_VARIANT=$v timeout "$limit" $PY -m ultraep.bench grouped-gemm --cases "${CASES[@]}" --sizes uniform \
      --repeats "${GEMM_REPEATS:-10}" --json "$OUT/gemm-$v.json" > "$OUT/bench-$v.log" 2>&1
  code=$?
  echo "$v: exit $code after $((SECONDS - start)) s"
  [ "$code" -eq 0 ] || tail -5 "$OUT/bench-$v.log"
done

echo "== 3. comparison"
$PY - "$OUT" "${VARIANTS[@]}" <<'EOF'
import json
import sys
from pathlib import Path

out, variants = Path(sys.argv[1]), sys.argv[2:]
runs, bits = {}, {}
for v in variants:
    path = out / f"gemm-{v}.json"
    runs[v] = {(r["case"], r["op"]): r for r in json.loads(path.read_text())["rows"]} if path.exists() else {}
    text = (out / f"bits-{v}.txt").read_text() if (out / f"bits-{v}.txt").exists() else ""
    bits[v] = [line for line in text.splitlines() if len(line.split()) == 3 and line.split()[0] in ("forward", "dgrad", "wgrad")]
reference = bits.get("default") or bits[variants[0]]
for v in variants:
    verdict = "no output" if not bits[v] else "same bits as default" if bits[v] == reference else "BITS DIFFER"
    print(f"{v}: {verdict}")


def cell(row):
    if not row or row.get("ours") is None:
        return "-"
    ratio = lambda key: f"{row[key]:.2f}" if row.get(key) is not None else "-"  # noqa: E731
    return f"{row['ours']:.0f} {ratio('vs_best')}/{ratio('vs_dense')}"


keys = list(dict.fromkeys(k for v in variants for k in runs[v]))
header = ["case", "op", "best", "dense"] + variants
lines = [header]
for key in keys:
    any_row = next(runs[v][key] for v in variants if key in runs[v])
    best = max([x for x in (any_row.get("loop"), any_row.get("torch_grouped")) if x is not None], default=None)
    lines.append([key[0], key[1], f"{best:.0f}" if best else "-", f"{any_row['dense']:.0f}" if any_row.get("dense") else "-"]
                 + [cell(runs[v].get(key)) for v in variants])
widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
print("TFLOPS, then ours / better of loop and torch._grouped_mm, ours / cuBLAS dense (each variant's own run;")
print("best and dense columns: the first variant's run). Bar: >= 1.00 / and >= 0.92 dense at >= 1024 rows/expert.")
for line in lines:
    print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
EOF
echo "total $((SECONDS - start)) s"
