"""One engine run with vLLM's AOT compile cache on, in a process of its own (run as
``python -m tests.vllm.aot_child ARCH BACKEND``): prints one JSON line with the tokens,
vLLM's compile counters and fxsplit's counters. ``VLLM_CACHE_ROOT`` names the cache."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_USE_AOT_COMPILE"] = "1"
os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "0"

from vllm.compilation.counter import compilation_counter

from fxsplit import counters
from tests.vllm import engine

run = engine.run(sys.argv[1], sys.argv[2])
print(
    json.dumps(
        {
            "tokens": run.tokens,
            "aot_compiles": compilation_counter.num_aot_compiles,
            "aot_loaded": compilation_counter.num_aot_artifacts_loaded,
            "graphs": counters.snapshot()["graphs"],
            "replays": run.counts["replays"],
        }
    )
)
