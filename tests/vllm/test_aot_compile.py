"""vLLM's AOT compile cache with fxsplit: the second process loads fxsplit's precompiled
graph (vLLM calls its ``finalize_loading``), never compiling a second time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(cache: str) -> dict:
    env = {**os.environ, "VLLM_CACHE_ROOT": cache}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.aot_child", "llama", "v2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_second_process_loads_fxsplits_artifact_instead_of_compiling(tmp_path):
    first = _child(str(tmp_path))
    assert (first["aot_compiles"], first["aot_loaded"], first["graphs"]) == (1, 0, 1)
    second = _child(str(tmp_path))
    assert (second["aot_compiles"], second["aot_loaded"], second["graphs"]) == (0, 1, 1)
    assert second["tokens"] == first["tokens"]
    assert second["replays"] > 0
    # read from vLLM under AOT compile too: only attention eager under v2 (the size inputs
    # keep the rotary captured)
    for run in (first, second):
        assert run["eager_reasons"] == ["preset:engine_attention", "region:attention"], run
