#!/usr/bin/env bash
# The GPU check runs from the source tree on a box with only torch, pytest and numpy (no
# network, no hypothesis, expecttest, transformers, rich, tqdm or graphviz). This builds such an
# environment here (a fresh venv, the CPU torch wheel) and checks that pytest collects every test
# module without error, that the CUDA tests skip cleanly, and that the GPU check's scripts start.
# Usage: bash scripts/check_bare_env.sh   (CI runs it before the test suite)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FXSPLIT_BARE_VENV:-${TMPDIR:-/tmp}/fxsplit-bare-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    if ! "$venv/bin/pip" install -q "torch==2.13.0" pytest numpy \
        ${FXSPLIT_TORCH_INDEX:+--index-url "$FXSPLIT_TORCH_INDEX"} >"$venv.log" 2>&1; then
        cat "$venv.log" >&2
        exit 1
    fi
fi
py="$venv/bin/python"
export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1
for lib in hypothesis expecttest transformers rich tqdm graphviz; do
    if "$py" -c "import $lib" 2>/dev/null; then
        echo "bare env check: $lib is installed in $venv; it must not be" >&2
        exit 1
    fi
done
"$py" -m pytest -q -p no:cacheprovider --collect-only tests >/dev/null
"$py" -m pytest -q -p no:cacheprovider -m cuda tests/test_runtime_cuda.py -rs | tail -1
"$py" bench/decode_latency.py --help >/dev/null
"$py" bench/compile_time.py --help >/dev/null
"$py" scripts/tp_nccl_check.py | grep -q skipped  # no GPU here: it must say so and exit 0
echo "bare env check: passed (collection, CUDA tests skip, the GPU check's scripts start)"
