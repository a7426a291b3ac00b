#!/usr/bin/env bash
# GPU check, run from the source tree on a CUDA machine with only what it has (torch, pytest,
# numpy): no network, no pip install (hypothesis, expecttest, transformers, rich are optional;
# their tests skip). Runs the CUDA-marked tests, the tensor-parallel path on one GPU (NCCL,
# world size 1, collectives captured: scripts/tp_nccl_check.py) and the decode latency
# comparison within about 11 minutes, writes every figure and log under one folder
# ($OUT/gpu_check, or ./gpu_check) and prints one summary table.
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/gpu_check"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.version.cuda or torch.version.hip, \
torch.cuda.get_device_name())" 2>&1 | tee "$out/device.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_cuda.py -rfEs 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
timeout 180 python3 scripts/tp_nccl_check.py 2>&1 | tee "$out/tp_nccl.log"
tp=${PIPESTATUS[0]}
timeout 300 python3 bench/decode_latency.py --device cuda --batches 1 8 32 --steps 50 \
    --part-timeout 90 --json "$out/latency.json" 2>&1 | tee "$out/latency.log"
latency=${PIPESTATUS[0]}
{
    echo "== fxsplit GPU check: $(head -n 1 "$out/device.txt")"
    printf '%-10s %s\n' "tests" "$(tail -n 1 "$out/tests.log") (exit $tests)"
    printf '%-10s %s\n' "tp nccl" "exit $tp"
    grep -E '^v[12]:' "$out/tp_nccl.log"
    printf '%-10s %s\n' "latency" "exit $latency; ms per decode step:"
    sed -n '/^batch/,$p' "$out/latency.log"
} | tee "$out/summary.txt"
exit $(( tests != 0 || tp != 0 || latency != 0 ))
