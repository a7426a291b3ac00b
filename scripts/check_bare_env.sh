#!/usr/bin/env bash
# The GPU check runs from the source tree on a box with torch 2.11 on Python 3.12 and no network:
# hypothesis, expecttest, transformers, rich, tqdm or graphviz may be missing there. This builds
# such an environment here (a venv on Python 3.12 where this machine has it, else python3;
# torch 2.11 from the registry, a CUDA build that runs on the CPU; pytest and numpy, nothing
# else) and checks, on the CPU, what can run without a GPU:
#   - pytest collects every test module without error;
#   - the compiled-piece, higher-order-op and binding tests pass (or skip where this torch lacks
#     what they need);
#   - the GPU check's scripts start (bench/*.py --help);
#   - bench/decode_latency.py measures tiny sizes under a budget with parts stopped at their
#     time limit (SIGALRM through Dynamo and fxsplit), and still writes its table and JSON;
#   - scripts/gpu_check.sh --dry-run: its time plan and decode_latency.py's add up;
#   - the run time on this torch: the runtime, emulator, output-lifetime, exports, model-state
#     and Hugging Face generate tests, with the test extras installed into a folder beside the
#     venv (the checks above stay bare);
#   - scripts/gpu_check.sh end to end: the CUDA tests skip, tp_nccl_check.py says it skipped,
#     the decode and demo parts skip, the summary table is printed and the exit status is 0.
# The first run downloads torch (about 3 GB, a few minutes); the venv is kept for later runs.
# Usage: bash scripts/check_bare_env.sh   (CI runs it before the test suite)
#   FXSPLIT_BARE_TORCH (default 2.11): the torch release; FXSPLIT_BARE_PYTHON: the interpreter
#   that makes the venv; FXSPLIT_BARE_VENV: its folder; FXSPLIT_TORCH_INDEX: a package index.
set -euo pipefail
cd "$(dirname "$0")/.."
release="${FXSPLIT_BARE_TORCH:-2.11}"
venv="${FXSPLIT_BARE_VENV:-${TMPDIR:-/tmp}/fxsplit-bare-venv-torch$release}"
if [ ! -x "$venv/bin/python" ]; then
    base="${FXSPLIT_BARE_PYTHON:-}"
    if [ -z "$base" ]; then  # Python 3.12 as on the GPU box, where this machine has it
        pyenvs="$(pyenv root 2>/dev/null || echo /nonexistent)/versions"
        for candidate in python3.12 "$pyenvs"/3.12*/bin/python3.12 python3; do
            if "$candidate" -c "" 2>/dev/null; then
                base=$candidate
                break
            fi
        done
    fi
    "$base" -m venv "$venv"
    if ! "$venv/bin/pip" install -q "torch==$release.*" pytest numpy \
        ${FXSPLIT_TORCH_INDEX:+--index-url "$FXSPLIT_TORCH_INDEX"} >"$venv.log" 2>&1; then
        cat "$venv.log" >&2
        rm -rf "$venv"
        exit 1
    fi
fi
py="$venv/bin/python"
export PYTHONPATH="$PWD" PYTHONDONTWRITEBYTECODE=1
"$py" -c "import sys, torch; print('bare env check: Python', sys.version.split()[0], 'torch', \
torch.__version__)"
for lib in hypothesis expecttest transformers rich tqdm graphviz; do
    if "$py" -c "import $lib" 2>/dev/null; then
        echo "bare env check: $lib is installed in $venv; it must not be" >&2
        exit 1
    fi
done
"$py" -m pytest -q -p no:cacheprovider --collect-only tests >/dev/null
# Compiled pieces lean on Inductor's and Dynamo's newest APIs, the aliasing analysis of pieces
# holding higher-order ops on their fake tracing, and a buffer the model rebinds to an output on
# how this torch invalidates held outputs (the model's state too, which a torch without
# storage moves cannot keep across a reset): run their tests on this torch.
"$py" -m pytest -q -p no:cacheprovider tests/test_inductor.py tests/test_piece_cache.py \
    tests/test_precompile.py tests/test_floats.py tests/test_compiled_capture.py tests/test_hops.py \
    tests/test_binding.py tests/test_model_state.py \
    >"$venv.tests.log" 2>&1 || { cat "$venv.tests.log" >&2; exit 1; }
"$py" bench/decode_latency.py --help >/dev/null
"$py" bench/decode.py --help >/dev/null
"$py" bench/compile_time.py --help >/dev/null

scratch="$(mktemp -d "${TMPDIR:-/tmp}/fxsplit-bare-check.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
# 0.1 s a part: eager's steps fit, fxsplit's compile cannot (Dynamo's trace alone takes longer;
# a whole 1-layer part took 0.6-1 s), so its parts stop at the limit and are reported.
"$py" bench/decode_latency.py --device cpu --layers 1 --steps 2 --batches 1 2 \
    --variants eager fxsplit_eager --part-timeout 0.1 --budget 60 --json "$scratch/latency.json" \
    >"$scratch/latency.log" 2>&1 || { cat "$scratch/latency.log" >&2; exit 1; }
for expected in '^ms per decode step' 'fxsplit_eager batch 1: ran over its 0.1 s limit'; do
    if ! grep -q "$expected" "$scratch/latency.log" || [ ! -s "$scratch/latency.json" ]; then
        cat "$scratch/latency.log" >&2
        echo "bare env check: decode_latency.py printed no '$expected' (or no JSON)" >&2
        exit 1
    fi
done

# The run time on torch 2.11, its other end of the supported range: the runtime, emulator,
# output-lifetime, exports, model-state and Hugging Face generate tests, with the test extras
# installed into a folder of their own beside the bare venv (the checks above stay bare).
extras="$venv.extras"
if [ ! -d "$extras" ]; then
    # pyproject's test and goldens extras but pytest (the venv has it) and ruff; no torch
    mapfile -t wanted < <("$py" - <<'PY'
import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
deps = dict.fromkeys(extras["test"] + extras["goldens"])
for dep in deps:
    name = dep.split(">")[0].split("=")[0]
    if name not in ("pytest", "ruff") and not (name == "transformers" and "==" not in dep):
        print(dep)
PY
    )
    if ! "$venv/bin/pip" install -q --target "$extras" "${wanted[@]}" rich tqdm graphviz \
        >"$extras.log" 2>&1; then
        cat "$extras.log" >&2
        rm -rf "$extras"
        exit 1
    fi
fi
# fxsplit's own metadata (its torch_dynamo_backends entry point: backend="fxsplit" as a user who
# installed it names it) from a build of this tree; the source on PYTHONPATH is what runs.
"$venv/bin/pip" install -q --no-deps --target "$scratch/dist" . >"$scratch/dist.log" 2>&1 ||
    { cat "$scratch/dist.log" >&2; exit 1; }
PYTHONPATH="$PWD:$extras:$scratch/dist" "$py" -m pytest -q -p no:cacheprovider tests/test_runtime.py \
    tests/test_emulator.py tests/test_output_lifetime.py tests/test_exports.py \
    tests/test_model_state.py tests/test_hf_generate.py tests/test_runtime_devices.py \
    tests/test_graphs.py tests/test_pool.py tests/test_field_cases.py tests/test_ownership.py \
    tests/test_capture_off.py tests/test_devices.py tests/test_refusals.py tests/test_dedup.py \
    >"$venv.runtime.log" 2>&1 || { cat "$venv.runtime.log" >&2; exit 1; }
echo "bare env check: torch $release's run time: $(tail -n 1 "$venv.runtime.log")"

PYTHON="$py" bash scripts/gpu_check.sh --dry-run >"$scratch/plan.log" ||
    { cat "$scratch/plan.log" >&2; exit 1; }
PYTHON="$py" OUT="$scratch" bash scripts/gpu_check.sh >"$scratch/gpu_check.log" 2>&1 ||
    { cat "$scratch/gpu_check.log" >&2; exit 1; }
for expected in '^tests    exit 0' ' skipped' '^tp nccl  exit 0' '^decode   skipped' '^demo     skipped'; do
    if ! grep -q "$expected" "$scratch/gpu_check/summary.txt"; then
        cat "$scratch/gpu_check.log" >&2
        echo "bare env check: the GPU check's summary lacks '$expected'" >&2
        exit 1
    fi
done
grep -q 'needs a CUDA/ROCm device' "$scratch/gpu_check/tp_nccl.log"
echo "bare env check: passed (collection, the compiled-piece tests, the run time's tests, the scripts start," \
    "decode_latency.py under its time limits, gpu_check.sh's plan adds up and it runs through on CPU)"
