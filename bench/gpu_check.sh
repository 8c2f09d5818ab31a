#!/usr/bin/env bash
# The GPU check: what probe does on a machine with one NVIDIA GPU, in at most 8 minutes, as one table
# (check, result, seconds, detail) and one record under bench/results/ (BENCH_RESULTS=DIR: there instead;
# BENCH_RECORD=0: none).
#
#   bash bench/gpu_check.sh            # PYTHON=... picks the interpreter (default: python)
#
# Checks (bench/gpu_check.py holds them; their targets are bench/targets/gpu_job.py):
#   trace            CUDA training traced (PROBE_TORCH_TRACE=1, then trace start): allocator memory columns
#   checkpoint       probe PID checkpoint of CUDA tensors, torch.load'ed back and compared
#   blocked          a rank blocked in torch.cuda.synchronize on a long kernel: list, health, backtrace --native
#   flight_recorder  a 1-rank NCCL group's entries in torch.flight_recorder (TORCH_FR_BUFFER_SIZE)
#   profile          probe PID profile with CUDA activities ("not built yet" while the command is missing)
#   compile          torch.compile (inductor) with the trace: graph breaks as without it
#   step_extras      PROBE_METRICS_PORT: probe_cuda_memory_* of a training job; its cuda_memory alert
# Without a GPU (nvidia-smi lists none; GPU_CHECK_DEVICE=cpu forces it) the checks that make sense on the CPU
# run there (gloo for the Flight Recorder) and the others say "needs a GPU". Exit 0 unless a check failed
# or ran out of time. Each check runs under `timeout` in its own process group, with its own
# PROBE_RUNTIME_DIR under one mktemp directory; every process of a check is killed and reaped when it ends,
# and on exit or interrupt (trap). GPU_CHECK_SCALE=N stretches every bound (slow machines: the test suite).
set -u

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
PY="${PYTHON:-python}"
SCALE="${GPU_CHECK_SCALE:-1}"
STARTED="$(date +%s.%N)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/probe-gpu-check.XXXXXX")"
if [ "${#WORK}" -gt 48 ]; then  # an agent's socket path must fit in 108 bytes: keep the runtime dirs short
    rmdir "$WORK"
    WORK="$(mktemp -d /tmp/probe-gpu-check.XXXXXX)"
fi
CHILD=""

stop_group() {
    # TERM to the check's process group (timeout is its leader), then KILL after 5 s; reap the leader.
    local pid="$1" i
    kill -TERM -- "-$pid" 2>/dev/null
    for i in $(seq 50); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

cleanup() {
    if [ -n "$CHILD" ]; then
        stop_group "$CHILD"
        CHILD=""
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ -n "${GPU_CHECK_DEVICE:-}" ]; then
    DEVICE="$GPU_CHECK_DEVICE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    DEVICE=cuda
else
    DEVICE=cpu
fi

# check name and its bound in seconds on a GPU machine: 7.5 minutes in all, 8 with every KILL's 5 s after TERM.
CHECKS="trace:55 checkpoint:45 blocked:80 flight_recorder:45 profile:60 compile:165 step_extras:30"
RESULTS="$WORK/results.tsv"
: > "$RESULTS"
for entry in $CHECKS; do
    name="${entry%%:*}"
    limit="$(awk -v s="${entry##*:}" -v k="$SCALE" 'BEGIN { v = s * k; printf "%d", (v < 1 ? 1 : v) }')"  # 0: none
    dir="$WORK/$name"
    mkdir -p "$dir/rt"
    chmod 700 "$dir/rt"
    start="$(date +%s.%N)"
    # timeout puts itself and the check in a process group of their own: the whole check is stopped at once.
    PROBE_RUNTIME_DIR="$dir/rt" timeout -k 5 "$limit" "$PY" "$HERE/gpu_check.py" "$name" "$DEVICE" "$dir" \
        > "$dir/out" 2> "$dir/err" &
    CHILD=$!
    wait "$CHILD"
    code=$?
    stop_group "$CHILD"  # what the check left behind, if anything
    CHILD=""
    seconds="$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
    line="$(grep '^RESULT' "$dir/out" | tail -n 1)"
    if [ "$code" = 124 ] || [ "$code" = 137 ]; then
        printf '%s\ttimeout\t%s\tno result within %s s\n' "$name" "$seconds" "$limit" >> "$RESULTS"
    elif [ -z "$line" ]; then
        printf '%s\tFAIL\t%s\texit %s: %s\n' "$name" "$seconds" "$code" \
            "$(tail -c 400 "$dir/err" | tr '\t\n' '  ')" >> "$RESULTS"
    else
        status="$(printf '%s' "$line" | cut -f2)"
        detail="$(printf '%s' "$line" | cut -f3-)"
        printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$seconds" "$detail" >> "$RESULTS"
    fi
done

PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/gpu_check.py" --report "$RESULTS" "$DEVICE" "$STARTED"
