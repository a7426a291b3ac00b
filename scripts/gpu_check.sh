#!/usr/bin/env bash
# GPU check, run from the source tree on a CUDA machine with only what it has (torch, pytest,
# numpy): no network, no pip install (hypothesis, expecttest, transformers, rich, tqdm and
# pytest-timeout are used where present; tests needing a missing one skip). Its parts:
#   device   torch's version, the device's name, the optional packages present
#   tests    the CUDA-marked tests, Inductor pieces under real CUDA capture among them
#   tp_nccl  the tensor-parallel path on one GPU (NCCL, world size 1, collectives captured:
#            scripts/tp_nccl_check.py)
#   latency  decode latency, batch 1, 8, 32: eager, fxsplit with Inductor pieces, the whole
#            model in one CUDA graph, fxsplit with eager pieces, reduce-overhead, with the
#            targets (bench/decode_latency.py)
# It writes every figure and log under one folder ($OUT/gpu_check, or ./gpu_check) and prints
# one summary table whatever happens (an EXIT trap; SIGINT or SIGTERM stops the running part the
# way its time limit would, then the summary follows). Compiled pieces go to a fresh cache
# folder, so every part compiles what it runs. Without a CUDA device the parts that need one
# skip: scripts/check_bare_env.sh runs it so on CPU.
#
# Time, in seconds: the whole check fits 8 minutes (480 s) of a lease. Each part runs under
# scripts/timed_part.sh: SIGINT at its limit (pytest then writes its failure summary, the Python
# scripts their tables), SIGKILL 10 s later (the grace) if it still runs.
#   part      limit  grace
#   device       30     10   the first torch import of a fresh machine reads its libraries cold
#   tests       130     10   each test at most 90 s where pytest-timeout is installed
#   tp_nccl      90     10
#   latency     170     10   decode_latency.py --budget 160 counts from its process start and
#                            keeps its last 10 s for the table and JSON: its parts (60 s at
#                            most each) end by 150 s
#   summary      10
#   in all      470 <= 480
# `bash scripts/gpu_check.sh --dry-run` prints this plan from the figures below, checks that it
# adds up, and prints decode_latency.py's own worst-case plan; it needs no GPU.
# Usage: bash scripts/gpu_check.sh [--dry-run]    (PYTHON: the interpreter, default python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
TOTAL=480 GRACE=10 SUMMARY=10 TEST_TIMEOUT=90 LATENCY_BUDGET=160
parts=(device tests tp_nccl latency)
declare -A limit=([device]=30 [tests]=130 [tp_nccl]=90 [latency]=170)
latency=(bench/decode_latency.py --device cuda --batches 1 8 32 --steps 50
    --variants eager fxsplit_inductor cuda_graph fxsplit_eager reduce_overhead
    --part-timeout 60 --budget "$LATENCY_BUDGET")

# plan: prints the time table; fails where it does not add up.
plan() {
    local name sum=$SUMMARY ok=0
    declare -A inside=([tests]="each test at most $TEST_TIMEOUT s where pytest-timeout is installed"
        [latency]="decode_latency.py --budget $LATENCY_BUDGET")
    printf '%-9s %5s %5s\n' part limit grace
    for name in "${parts[@]}"; do
        printf '%-9s %5s %5s%s\n' "$name" "${limit[$name]}" "$GRACE" \
            "${inside[$name]:+  ${inside[$name]}}"
        sum=$((sum + limit[$name] + GRACE))
    done
    printf '%-9s %5s\n' summary "$SUMMARY"
    if [ "$sum" -le "$TOTAL" ]; then
        echo "in all: $sum s <= $TOTAL s: fits"
    else
        echo "in all: $sum s > $TOTAL s: OVER"
        ok=1
    fi
    if [ "$LATENCY_BUDGET" -ge "${limit[latency]}" ]; then
        echo "decode_latency.py's budget ($LATENCY_BUDGET s) leaves no time of its part's limit"
        ok=1
    fi
    if [ "$TEST_TIMEOUT" -gt "${limit[tests]}" ]; then
        echo "the per-test timeout ($TEST_TIMEOUT s) is over the tests' limit"
        ok=1
    fi
    return $ok
}

if [ "${1:-}" = --dry-run ]; then
    plan
    fits=$?
    echo "decode_latency.py, worst case:"
    "$PYTHON" "${latency[@]}" --dry-run || fits=1
    exit $fits
elif [ $# -gt 0 ]; then
    echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2
    exit 2
fi

out="${OUT:-.}/gpu_check"
mkdir -p "$out"
rm -f "$out"/*.status "$out"/*.log "$out/latency.json"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FXSPLIT_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fxsplit-gpu-check-cache.XXXXXX")"
export FXSPLIT_CACHE_DIR

# row NAME LABEL: one line of the summary: the part's exit status and seconds, or why it did
# not run.
row() {
    local status seconds
    if read -r status seconds 2>/dev/null <"$out/$1.status"; then
        printf '%-8s exit %s, %s s\n' "$2" "$status" "$seconds"
    elif [ -s "$out/$1.log" ]; then
        printf '%-8s %s\n' "$2" "$(tail -n 1 "$out/$1.log")"
    else
        printf '%-8s not run\n' "$2"
    fi
}

summary() {
    echo "== fxsplit GPU check: $(head -n 1 "$out/device.log" 2>/dev/null)"
    row device device
    row tests tests
    local closing
    closing=$(grep -sE '^[0-9]+ (passed|failed|skipped|error)|^no tests ran' "$out/tests.log")
    [ -n "$closing" ] && echo "         ${closing##*$'\n'}"
    grep -sE '^(FAILED|ERROR) |^PASSED .*inductor' "$out/tests.log"
    row tp_nccl "tp nccl"
    grep -sE '^v[12]:' "$out/tp_nccl.log"
    row latency latency
    if grep -qs '^ms per decode step' "$out/latency.log"; then
        sed -n '/^ms per decode step/,$p' "$out/latency.log"
    else  # cut short before its table: the parts it measured, one line each
        grep -sE '^  [a-z_]+ batch ' "$out/latency.log"
    fi
    echo "in all: $SECONDS s (plan: at most $TOTAL s)"
}

# finish: the EXIT trap. Prints the summary; the exit status is 1 if a part failed (or the
# signal's, 130 or 143, if the check was stopped).
finish() {
    local rc=$? name status
    trap - EXIT INT TERM
    rm -rf "$FXSPLIT_CACHE_DIR"
    summary | tee "$out/summary.txt"
    for name in "${parts[@]}"; do
        if read -r status _ 2>/dev/null <"$out/$name.status" && [ "$status" != 0 ]; then
            [ "$rc" = 0 ] && rc=1
        fi
    done
    exit "$rc"
}
trap finish EXIT

# part NAME COMMAND...: COMMAND under NAME's limit (scripts/timed_part.sh). In the background
# so that a SIGINT or SIGTERM to this script reaches it at once: it stops as at its limit.
running="" stopped=""
trap 'stopped=130; [ -n "$running" ] && kill -TERM "$running"' INT
trap 'stopped=143; [ -n "$running" ] && kill -TERM "$running"' TERM
part() {
    [ -n "$stopped" ] && exit "$stopped"
    bash scripts/timed_part.sh "$1" "${limit[$1]}" "$GRACE" "$out" "${@:2}" &
    running=$!
    wait "$running"
    while kill -0 "$running" 2>/dev/null; do  # a trapped signal ends wait early
        wait "$running"
    done
    running=""
    [ -n "$stopped" ] && exit "$stopped"
    return 0
}

part device "$PYTHON" -c "
import importlib.util, torch
runtime = (f'CUDA {torch.version.cuda}' if torch.version.cuda else
           f'HIP {torch.version.hip}' if torch.version.hip else 'a CPU build')
device = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA or ROCm device'
print(f'torch {torch.__version__}, {runtime}, {device}')
optional = ('tqdm', 'rich', 'hypothesis', 'expecttest', 'transformers', 'triton', 'pytest_timeout')
print('optional packages present:', *(m for m in optional if importlib.util.find_spec(m)))
"
tests=(-m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_devices.py -rfEsp)
if grep -qs 'optional packages present:.* pytest_timeout' "$out/device.log"; then
    tests+=(--timeout "$TEST_TIMEOUT")
fi
part tests "$PYTHON" "${tests[@]}"
part tp_nccl "$PYTHON" scripts/tp_nccl_check.py
if grep -qs 'no CUDA or ROCm device' "$out/device.log"; then
    echo "skipped (no CUDA or ROCm device)" | tee "$out/latency.log"
else
    part latency "$PYTHON" "${latency[@]}" --json "$out/latency.json"
fi
exit 0
