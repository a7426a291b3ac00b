#!/usr/bin/env bash
# GPU check, run from the source tree on a CUDA machine with only what it has (torch, pytest,
# numpy): no network, no pip install (hypothesis, expecttest, transformers, rich are optional;
# their tests skip). Runs, each part under its own time limit so a hang cannot take the lease:
#   tests    the CUDA-marked tests, Inductor pieces under real CUDA capture among them (170 s)
#   tp nccl  the tensor-parallel path on one GPU (NCCL, world size 1, collectives captured:
#            scripts/tp_nccl_check.py) (110 s)
#   latency  decode latency, batch 1, 8, 32: eager, fxsplit with eager pieces, fxsplit with
#            Inductor pieces, the whole model in one CUDA graph, reduce-overhead, with the
#            targets (bench/decode_latency.py; it starts no part after 190 s) (240 s)
# about 9 minutes in all at worst, writes every figure and log under one folder ($OUT/gpu_check,
# or ./gpu_check) and prints one summary table. Compiled pieces go to a fresh cache folder, so
# every part compiles what it runs.
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/gpu_check"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
FXSPLIT_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/fxsplit-gpu-check-cache.XXXXXX")"
export FXSPLIT_CACHE_DIR
python3 -c "import torch; print(torch.__version__, torch.version.cuda or torch.version.hip, \
torch.cuda.get_device_name())" 2>&1 | tee "$out/device.txt"
python3 -c "import importlib.util as u; print('optional packages present:', *(m for m in \
('tqdm', 'rich', 'hypothesis', 'expecttest', 'transformers', 'triton') if u.find_spec(m)))" \
    2>&1 | tee -a "$out/device.txt"

# part NAME SECONDS COMMAND...: runs COMMAND under a time limit (killed 10 s after it), its
# output in $out/NAME.log; sets status[NAME] and took[NAME].
declare -A status took
part() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    status[$name]=${PIPESTATUS[0]}
    took[$name]=$((SECONDS - start))
    if [ "${status[$name]}" = 124 ] || [ "${status[$name]}" = 137 ]; then
        echo "$name: stopped at its $limit s limit" | tee -a "$out/$name.log"
    fi
}

part tests 170 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_cuda.py -rfEsp
part tp_nccl 110 python3 scripts/tp_nccl_check.py
part latency 240 python3 bench/decode_latency.py --device cuda --batches 1 8 32 --steps 50 \
    --variants eager fxsplit_inductor cuda_graph fxsplit_eager reduce_overhead \
    --part-timeout 60 --budget 190 --json "$out/latency.json"
rm -rf "$FXSPLIT_CACHE_DIR"
{
    echo "== fxsplit GPU check: $(head -n 1 "$out/device.txt")"
    printf '%-8s %s\n' "tests" "$(tail -n 1 "$out/tests.log") (exit ${status[tests]}, \
${took[tests]} s)"
    grep -E '^(PASSED|FAILED|ERROR) .*inductor' "$out/tests.log"
    printf '%-8s %s\n' "tp nccl" "exit ${status[tp_nccl]}, ${took[tp_nccl]} s"
    grep -E '^v[12]:' "$out/tp_nccl.log"
    printf '%-8s %s\n' "latency" "exit ${status[latency]}, ${took[latency]} s"
    if grep -q '^ms per decode step' "$out/latency.log"; then
        sed -n '/^ms per decode step/,$p' "$out/latency.log"
    else  # cut short: the parts it measured, one line each
        grep -E '^  [a-z_]+ batch ' "$out/latency.log"
    fi
} | tee "$out/summary.txt"
exit $(( status[tests] != 0 || status[tp_nccl] != 0 || status[latency] != 0 ))
