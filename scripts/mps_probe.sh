#!/usr/bin/env bash
# Can MPS give each emulated EP rank a disjoint set of SMs on this machine? Starts a private
# control daemon in static SM partitioning mode (-S), carves one partition per rank, runs a
# tiny kernel in every rank at once whose blocks hold their SMs for 20 ms, and checks that
# no rank had to wait for SMs another rank held; then does the same under today's
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE mode for comparison. Every step is bounded by a
# timeout, every daemon it starts is stopped (by its pid if "quit" fails), and the daemon's
# logs are printed at the end. Needs python with cupy; does not import ultraep.
#   PROBE_RANKS   ranks (default 4)
#   PROBE_CHUNKS  chunks per partition (default: the free chunks / ranks, from lspart)
#   PYTHON        interpreter (default python3)
set -uo pipefail
RANKS=${PROBE_RANKS:-4}
PY=${PYTHON:-python3}
CONTROL=nvidia-cuda-mps-control
ROOT=$(mktemp -d /tmp/ultraep-mps-probe.XXXXXX)
DAEMON_PIDS=()   # control daemons this script started
PIPES=()         # their pipe directories
VERDICT="static partitioning: not tried"

say() { printf '\n== %s\n' "$*"; }

control() {  # control PIPE_DIR COMMAND: one command to the daemon listening on PIPE_DIR
  CUDA_MPS_PIPE_DIRECTORY=$1 timeout 15 "$CONTROL" <<< "$2" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || echo "(control command '$2' exited $rc)"
  return $rc
}

server_pids() { control "$1" get_server_list | grep -Eo '^[0-9]+$'; }

stop_daemon() {  # stop_daemon PIPE_DIR: quit, then kill the control daemon and servers it still has
  local pipe=$1 servers pidfile pid
  [ -e "$pipe.stopped" ] && return 0
  touch "$pipe.stopped"
  servers=$(server_pids "$pipe" 2>/dev/null)
  control "$pipe" quit > /dev/null 2>&1
  pidfile=$pipe/nvidia-cuda-mps-control.pid
  pid=$( [ -s "$pidfile" ] && cat "$pidfile")
  for _ in $(seq 100); do  # up to 10 s for the daemon to go
    [ -e "$pipe/control" ] || { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; } || break
    sleep 0.1
  done
  for pid in $pid $servers; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "pid $pid still alive after quit: killing it"
      kill "$pid" 2>/dev/null; sleep 1; kill -9 "$pid" 2>/dev/null
    fi
  done
}

dump_logs() {
  for f in "$ROOT"/*/log/*.log "$ROOT"/*/daemon.out; do
    [ -s "$f" ] || continue
    echo "---- $f (last 60 lines)"; tail -n 60 "$f"
  done
}

cleanup() {
  trap - EXIT INT TERM
  local pipe pid
  for pipe in "${PIPES[@]}"; do stop_daemon "$pipe"; done
  for pid in "${DAEMON_PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null; sleep 1; kill -9 "$pid" 2>/dev/null; fi
    wait "$pid" 2>/dev/null
  done
  say "daemon logs"; dump_logs
  say "left running (should be empty)"; pgrep -a -f 'nvidia-cuda-mps-(control|server)' || echo none
  rm -rf "$ROOT"
  say "VERDICT: $VERDICT"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_daemon() {  # start_daemon NAME ARGS...: a daemon with its own pipe/log dirs; sets PIPE and LOGDIR
  local name=$1; shift
  PIPE=$ROOT/$name/pipe LOGDIR=$ROOT/$name/log
  mkdir -p "$PIPE" "$LOGDIR"
  PIPES+=("$PIPE")
  echo "\$ $CONTROL $*   (CUDA_MPS_PIPE_DIRECTORY=$PIPE)"
  CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGDIR "$CONTROL" "$@" > "$ROOT/$name/daemon.out" 2>&1 &
  local pid=$! exited=""
  DAEMON_PIDS+=("$pid")
  for _ in $(seq 200); do
    [ -e "$PIPE/control" ] && { echo "daemon up (pid $pid${exited:+, detached})"; return 0; }
    if [ -z "$exited" ] && ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid"; exited=$?
      # -d forks and exits 0 with the daemon running on; anything else is a failure
      [ "$exited" -eq 0 ] || { echo "daemon exited $exited:"; cat "$ROOT/$name/daemon.out"; return 1; }
    fi
    sleep 0.1
  done
  echo "daemon did not create $PIPE/control within 20 s"; cat "$ROOT/$name/daemon.out"; return 1
}

# The per-rank check: wait until every rank is ready (so the kernels overlap), then for
# about two seconds launch one full wave (8 blocks of 256 threads per SM the rank is told it
# has) of blocks that each hold their SM for 20 ms and record %smid. A rank that owns its
# SMs finishes each wave in ~20 ms; one whose SMs are also another rank's waits for
# residency and takes ~40 ms or more. The timing is the proof: %smid may be numbered per
# client under MPS, so equal ids across ranks need not be the same physical SM.
cat > "$ROOT/rank_check.py" << 'EOF'
import json, os, pathlib, sys, time
rank, ranks, out = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
import cupy as cp
sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
source = r"""
extern "C" __global__ void hold(unsigned* smid_of_block, unsigned long long hold_ns) {
  unsigned smid; unsigned long long t0, t;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < hold_ns);
  if (threadIdx.x == 0) smid_of_block[blockIdx.x] = smid;
}"""
kernel = cp.RawKernel(source, "hold")
blocks, hold_ns = 8 * sms, 20_000_000
smids = cp.full(blocks, 0xFFFFFFFF, dtype=cp.uint32)
begin, end = cp.cuda.Event(), cp.cuda.Event()
kernel((blocks,), (256,), (smids, cp.uint64(hold_ns)))  # compile and warm up before the barrier
cp.cuda.Device().synchronize()
(out / f"ready{rank}").touch()
deadline = time.monotonic() + 60
while sum((out / f"ready{r}").exists() for r in range(ranks)) < ranks:
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: the other ranks were not ready within 60 s")
    time.sleep(0.005)
seen, wave_ms, start = set(), [], time.monotonic()
while time.monotonic() - start < 2.0:
    smids.fill(0xFFFFFFFF)
    begin.record()
    kernel((blocks,), (256,), (smids, cp.uint64(hold_ns)))
    end.record()
    end.synchronize()
    wave_ms.append(cp.cuda.get_elapsed_time(begin, end))
    seen.update(int(s) for s in cp.asnumpy(smids))
wave_ms.sort()
(out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "sms_reported": sms,
    "partition": os.environ.get("CUDA_MPS_SM_PARTITION"), "launches": len(wave_ms), "smids": sorted(seen),
    "wave_ms_median": wave_ms[len(wave_ms) // 2], "wave_ms_max": wave_ms[-1], "hold_ms": hold_ns / 1e6,
    "slow_waves": sum(ms > 1.3 * hold_ns / 1e6 for ms in wave_ms)}))
EOF

cat > "$ROOT/compare.py" << 'EOF'
import json, pathlib, sys
out, ranks = pathlib.Path(sys.argv[1]), int(sys.argv[2])
results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks) if (out / f"rank{r}.json").exists()]
def ranges(ids):
    spans, start = [], None
    for i, s in enumerate(ids):
        if start is None: start = s
        if i + 1 == len(ids) or ids[i + 1] != s + 1:
            spans.append(f"{start}-{s}" if s > start else f"{s}"); start = None
    return ",".join(spans)
for r in results:
    print(f"rank {r['rank']}: {r['sms_reported']} SMs reported; one full wave of {r['hold_ms']:g} ms blocks took "
          f"{r['wave_ms_median']:.1f} ms median, {r['wave_ms_max']:.1f} ms max, {r['slow_waves']} of {r['launches']} "
          "waves over 1.3x; "
          f"%smid seen: {ranges(r['smids'])}   partition={r['partition']}")
if len(results) < ranks:
    print(f"only {len(results)} of {ranks} ranks reported"); sys.exit(2)
shared = {(a["rank"], b["rank"]): len(set(a["smids"]) & set(b["smids"]))
          for i, a in enumerate(results) for b in results[i + 1:]}
print("pairs with equal %smid values: " + (", ".join(f"{p}: {n}" for p, n in shared.items() if n) or "none")
      + " (under MPS %smid may be numbered per client: the wave times decide)")
slow = [r["rank"] for r in results if r["wave_ms_max"] > 1.3 * r["hold_ms"]]
print(f"ranks whose wave took over 1.3x the hold time (they waited for SMs another rank held): {slow or 'none'}")
sys.exit(1 if slow else 0)
EOF

run_ranks() {  # run_ranks NAME ENV_OF_RANK_FUNCTION: every rank at once, each bounded by 120 s
  local name=$1 env_of=$2 out=$ROOT/$1/ranks r pids=() failed=0
  mkdir -p "$out"
  for r in $(seq 0 $((RANKS - 1))); do
    env CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGDIR" $($env_of "$r") \
      timeout 120 "$PY" "$ROOT/rank_check.py" "$r" "$RANKS" "$out" > "$out/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}" || { failed=1; echo "rank $r failed:"; tail -n 20 "$out/rank$r.log"; }
  done
  "$PY" "$ROOT/compare.py" "$out" "$RANKS"
}

say "machine"
nvidia-smi --query-gpu=index,name,uuid,driver_version,compute_mode --format=csv 2>&1
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}  uid=$(id -u)  ranks=$RANKS"
command -v "$CONTROL" || { VERDICT="no $CONTROL on the PATH"; exit 1; }
echo "\$ $CONTROL -v"; timeout 10 "$CONTROL" -v 2>&1 | head -5
echo "(static SM partitioning needs a daemon reporting version 13010 or later; the H200 lent on 2026-12-02 had 13000)"
"$PY" -c 'import cupy, sys; print("python", sys.version.split()[0], "cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())' 2>&1
GPU=${CUDA_VISIBLE_DEVICES:-0}; GPU=${GPU%%,*}
UUID=$(nvidia-smi -i "$GPU" --query-gpu=uuid --format=csv,noheader 2>/dev/null | tr -d '[:space:]')
echo "GPU $GPU uuid: $UUID"

say "static SM partitioning: daemon in the foreground with -S"
if start_daemon static -f -S || start_daemon static-d -d -S; then
  say "lspart (before)"; LSPART=$(control "$PIPE" lspart); echo "$LSPART"
  if ! grep -q '^GPU-' <<< "$LSPART"; then
    echo "no device row: starting the server first"
    control "$PIPE" "start_server -uid $(id -u)"; sleep 2
    LSPART=$(control "$PIPE" lspart); echo "$LSPART"
  fi
  # the device row: GPU  -  free-chunks  used-chunks  free-SMs  used-SMs  clients
  read -r FREE_CHUNKS FREE_SMS < <(awk '$1 ~ /^GPU-/ && $2 == "-" {print $3, $5; exit}' <<< "$LSPART")
  echo "free chunks: ${FREE_CHUNKS:-?}, free SMs: ${FREE_SMS:-?}"
  CHUNKS=${PROBE_CHUNKS:-$(( ${FREE_CHUNKS:-0} / RANKS ))}
  PARTS=()
  if [ "${CHUNKS:-0}" -ge 1 ]; then
    for r in $(seq 0 $((RANKS - 1))); do
      echo "\$ sm_partition add $UUID $CHUNKS"
      REPLY_TEXT=$(control "$PIPE" "sm_partition add $UUID $CHUNKS"); echo "$REPLY_TEXT"
      PART=$(grep -Eo 'GPU-[0-9A-Fa-f-]+/[^[:space:]]+' <<< "$REPLY_TEXT" | head -1)
      [ -n "$PART" ] && PARTS+=("$PART")
    done
  else
    echo "cannot size the partitions (free chunks '${FREE_CHUNKS:-}' for $RANKS ranks): set PROBE_CHUNKS"
  fi
  say "lspart (after)"; control "$PIPE" lspart
  if [ ${#PARTS[@]} -eq "$RANKS" ]; then
    partition_of() { echo "CUDA_MPS_SM_PARTITION=${PARTS[$1]}"; }
    say "$RANKS ranks at once, each in its own partition of $CHUNKS chunks"
    if run_ranks static partition_of; then VERDICT="static partitioning WORKS: no rank waited for another's SMs"
    else VERDICT="static partitioning ran but some rank waited for SMs (or failed)"; fi
    say "a client without CUDA_MPS_SM_PARTITION under -S (expected to be refused)"
    CUDA_MPS_PIPE_DIRECTORY=$PIPE timeout 60 "$PY" -c \
      'import cupy as cp; print("SMs:", cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]); cp.zeros(1).sum()' 2>&1 | tail -3
  else
    VERDICT="static partitioning unavailable: got ${#PARTS[@]} of $RANKS partitions"
  fi
  echo "\$ lspart while the server lives"; control "$PIPE" lspart
  stop_daemon "$PIPE"
else
  VERDICT="static partitioning unavailable: the daemon would not start with -S"
fi

say "for comparison: thread-percentage mode (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / RANKS)))"
if start_daemon percent -f; then
  share_of() { echo "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / RANKS))"; }
  run_ranks percent share_of
  echo "(the percentage caps each client's SMs; whether it separates them is what this shows)"
  stop_daemon "$PIPE"
fi
[[ $VERDICT == *WORKS* ]]
