#!/usr/bin/env bash
# GPU check, run from the source tree on a CUDA machine with only what it has (torch, pytest,
# numpy, transformers): no network, no pip install (hypothesis, expecttest, rich, tqdm and
# pytest-timeout are used where present; tests needing a missing one skip). Its parts:
#   device   torch's version, the device's name, the optional packages present
#   tests    the shared CUDA/emulator test bodies on CUDA (tests/test_runtime_devices.py),
#            Inductor pieces under real CUDA capture among them
#   decode   bench/decode.py at batch 1: transformers' Llama (hidden 2048, 16 layers, bf16)
#            through generate() with a new StaticCache per call, forward compiled and through
#            CompileConfig, and with a DynamicCache; fxsplit v1/v2 with eager and Inductor pieces
#            beside eager, the bare piecewise floor, Inductor's graph partition and
#            reduce-overhead; tokens against backend="eager", replays and copies counted; then
#            the DeepSeek-V4 model
#   demo     fxsplit demo --device cuda: what a GPU user runs first
#   tp_nccl  the tensor-parallel path on one GPU (NCCL, world size 1, collectives captured:
#            scripts/tp_nccl_check.py)
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
#   device       20     10   the first torch import of a fresh machine reads its libraries cold
#   tests       110     10   each test at most 60 s where pytest-timeout is installed
#   decode      150     10   bench/decode.py --budget 140 counts from its process start and
#                            keeps its last 10 s for the table: its parts (at most 30 s each,
#                            in the order of DECODE_PARTS) end by 130 s
#   demo         70     10
#   tp_nccl      50     10
#   summary      10
#   in all      460 <= 480
# `bash scripts/gpu_check.sh --dry-run` prints this plan from the figures below, checks that it
# adds up, and prints bench/decode.py's own worst-case plan; it needs no GPU.
# Usage: bash scripts/gpu_check.sh [--dry-run]    (PYTHON: the interpreter, default python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
TOTAL=480 GRACE=10 SUMMARY=10 TEST_TIMEOUT=60 DECODE_BUDGET=140
parts=(device tests decode demo tp_nccl)
declare -A limit=([device]=20 [tests]=110 [decode]=150 [demo]=70 [tp_nccl]=50)
DECODE_PARTS=(llama:eager llama:v1_eager llama:floor llama:partition llama:reduce_overhead
    llama:v1_inductor llama_cc:v1_eager llama_dynamic:v1_eager llama:v2_eager
    deepseek:eager deepseek:v2_eager deepseek:v2_inductor deepseek:floor deepseek:reduce_overhead)
decode=(bench/decode.py --device cuda --batches 1 --check --parts "${DECODE_PARTS[@]}"
    --part-timeout 30 --budget "$DECODE_BUDGET")

# plan: prints the time table; fails where it does not add up.
plan() {
    local name sum=$SUMMARY ok=0
    declare -A inside=([tests]="each test at most $TEST_TIMEOUT s where pytest-timeout is installed"
        [decode]="bench/decode.py --budget $DECODE_BUDGET")
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
    if [ "$DECODE_BUDGET" -ge "${limit[decode]}" ]; then
        echo "bench/decode.py's budget ($DECODE_BUDGET s) leaves no time of its part's limit"
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
    echo "bench/decode.py, worst case:"
    "$PYTHON" "${decode[@]}" --dry-run || fits=1
    exit $fits
elif [ $# -gt 0 ]; then
    echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2
    exit 2
fi

out="${OUT:-.}/gpu_check"
mkdir -p "$out"
rm -f "$out"/*.status "$out"/*.log "$out/decode.json"
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
    row decode decode
    if grep -qs ' torch .*layers$' "$out/decode.log"; then
        sed -n '/ torch .*layers$/,$p' "$out/decode.log"
    else  # cut short before its table: the parts it measured, one line each
        grep -sE '^  [a-z_]+:[a-z_0-9]+ batch ' "$out/decode.log"
    fi
    row demo demo
    grep -sE '^ *(DeepSeek-V4|Llama) ' "$out/demo.log" | tail -n 8
    row tp_nccl "tp nccl"
    grep -sE '^v[12]:' "$out/tp_nccl.log"
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
if grep -qs 'no CUDA or ROCm device' "$out/device.log"; then
    echo "skipped (no CUDA or ROCm device)" | tee "$out/decode.log" >"$out/demo.log"
else
    part decode "$PYTHON" "${decode[@]}" --json "$out/decode.json"
    part demo "$PYTHON" -m fxsplit.tools.cli demo --device cuda
fi
part tp_nccl "$PYTHON" scripts/tp_nccl_check.py
exit 0
