"""One engine run with vLLM's AOT compile cache on, in a process of its own (run as
``python -m tests.vllm.aot_child ARCH BACKEND``): prints one JSON line with the tokens,
vLLM's compile counters, fxsplit's counters and the reasons of its eager pieces.
``VLLM_CACHE_ROOT`` names the cache."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_AOT_COMPILE"] = "1"
os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "0"

from vllm.compilation.counter import compilation_counter

from fxsplit import counters
from fxsplit.backend import fxsplit_backend
from tests.vllm import engine

run = engine.run(sys.argv[1], sys.argv[2])
# a loaded graph runs under the process's fxsplit backend object
plans = [*run.backend.plans, *fxsplit_backend.plans]
eager_reasons = sorted({r for plan in plans for piece in plan.eager for r in piece.reasons})
print(
    json.dumps(
        {
            "tokens": run.tokens,
            "aot_compiles": compilation_counter.num_aot_compiles,
            "aot_loaded": compilation_counter.num_aot_artifacts_loaded,
            "graphs": counters.snapshot()["graphs"],
            "replays": run.counts["replays"],
            "eager_reasons": eager_reasons,
        }
    )
)
