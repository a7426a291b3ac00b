#!/usr/bin/env bash
# GPU check, run from the source tree on a CUDA machine with only what it has (torch, pytest,
# numpy, transformers): no network, no pip install. Runs the CUDA-marked tests and the decode
# latency comparison; writes $OUT/gpu_check.json (or ./gpu_check.json) and logs.
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_cuda.py \
    2>&1 | tee "$out/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 240 python3 bench/decode_latency.py --device cuda --batches 1 8 32 --steps 50 \
    --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_latency.log"
latency=${PIPESTATUS[0]}
echo "tests exit $tests, latency exit $latency"
exit $(( tests != 0 || latency != 0 ))
