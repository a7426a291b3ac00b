#!/usr/bin/env bash
# Install fxsplit with its test tools. Installs the CPU build of torch first when no torch in the
# supported range is present, so pip never resolves a bare "torch" to a multi-GB CUDA build.
# On machines whose pip does not already serve a CPU wheel, set
# FXSPLIT_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
PY
then
    python3 -m pip install -q "torch==2.13.0" ${FXSPLIT_TORCH_INDEX:+--index-url "$FXSPLIT_TORCH_INDEX"}
fi
# compat mode puts the repository root on sys.path (a .pth file): `import fxsplit` then finds
# the package even from a folder holding a clone named fxsplit (a finder-based editable install
# loses to that folder, which imports as an empty namespace package).
python3 -m pip install -q -e ".[test]" --config-settings editable_mode=compat
