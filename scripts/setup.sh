#!/usr/bin/env bash
# Install fxsplit with its test tools into the active Python, one line of output per step.
# Installs the CPU build of torch first when no torch in the supported range is present, so pip
# never resolves a bare "torch" to a multi-GB CUDA build. On machines whose pip does not already
# serve a CPU wheel, set FXSPLIT_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
where=$(python3 -c 'import sys; print(sys.prefix)')
if python3 -c 'import sys; sys.exit(sys.prefix != sys.base_prefix)'; then
    echo "setup: no virtual environment is active; installing into $where"
else
    echo "setup: installing into the virtual environment $where"
fi
if found=$(python3 - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit(1)
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
print(torch.__version__)
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)
PY
); then
    echo "setup: 1/2 torch $found is installed already (2.11 to 2.14 work): kept"
else
    echo "setup: 1/2 torch 2.13.0, CPU build${found:+, replacing $found}" \
        "${FXSPLIT_TORCH_INDEX:+from $FXSPLIT_TORCH_INDEX }(the largest download)..."
    python3 -m pip install -q "torch==2.13.0" ${FXSPLIT_TORCH_INDEX:+--index-url "$FXSPLIT_TORCH_INDEX"}
fi
echo "setup: 2/2 fxsplit (editable, this folder), rich, tqdm, graphviz, test tools..."
# compat mode puts the repository root on sys.path (a .pth file): `import fxsplit` then finds
# the package even from a folder holding a clone named fxsplit (a finder-based editable install
# loses to that folder, which imports as an empty namespace package).
python3 -m pip install -q -e ".[test,goldens]" --config-settings editable_mode=compat
echo "setup: done; the fxsplit command: $(command -v fxsplit || echo "$where/bin/fxsplit")"
