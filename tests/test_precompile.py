"""PyTorch's precompile with fxsplit: ``aot_compile`` a model whose backend is fxsplit, save
it, load it without tracing, and run the same numbers; the compiled pieces travel in the saved
file (nothing compiled on load, even with the piece cache gone)."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit import counters, precompile
from fxsplit.passes import inductor
from tests.stack import Stack

pytestmark = [
    pytest.mark.usefixtures("fresh_capture_state"),
    pytest.mark.skipif(
        not hasattr(torch.compile(abs), "aot_compile"),
        reason=f"torch {torch.__version__} has no aot_compile on compiled functions",
    ),
]

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


class _Scaled(torch.nn.Module):
    """A float argument and constant floats (a norm's eps), a parameter, an eager region."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.RMSNorm(8, eps=1e-5)

    def forward(self, x, scale: float):
        h = self.norm(self.proj(x)) * scale
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return torch.sin(h * scale) + x


def _aot(model, args, tmp_path, **options):
    options = {"compile_pieces": "inductor", "cache_dir": str(tmp_path / "cache"), **options}
    compiled = torch.compile(
        model.forward, backend="fxsplit", fullgraph=True, dynamic=True, options=options
    )
    with torch.no_grad():
        return compiled.aot_compile((args, {}))


def test_a_precompiled_model_loads_without_tracing_or_compiling(tmp_path):
    model = _Scaled()
    x = torch.randn(3, 8)
    path = tmp_path / "model.pt2"
    _aot(model, (x, 0.5), tmp_path, capture="emulate").save_compiled_function(str(path))
    assert counters.snapshot()["pieces_compiled"] == 2
    # a fresh start: nothing in Dynamo's or fxsplit's memory, no piece cache
    torch._dynamo.reset()
    inductor.forget()
    counters.reset()
    torch._dynamo.utils.counters.clear()
    shutil.rmtree(tmp_path / "cache")
    with open(path, "rb") as f:
        loaded = torch.compiler.load_compiled_function(f, f_globals=globals())
    with torch.no_grad():
        for n, scale in [(3, 0.5), (5, 0.7), (5, 0.7), (5, 0.7), (4, 2.0)]:
            x = torch.randn(n, 8)
            torch.testing.assert_close(loaded(model, x, scale), model(x, scale), **TOLERANCE)
    found = counters.snapshot()
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (0, 2)
    assert found["replays"] > 0  # captured, replayed
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing traced
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    assert {r.outcome for r in split.compiled_pieces} == {"bundle"}
    fxsplit.backend.fxsplit_backend.reset()  # Dynamo's reset knows only the backends it ran


def _fresh_load(aot, tmp_path):
    """Save ``aot`` and load it as a fresh process would: nothing in Dynamo's or fxsplit's
    memory, no piece cache."""
    path = tmp_path / "model.pt2"
    aot.save_compiled_function(str(path))
    torch._dynamo.reset()
    inductor.forget()
    counters.reset()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
    with open(path, "rb") as f:
        return torch.compiler.load_compiled_function(f, f_globals=globals())


def test_the_sizes_compiled_on_their_own_load_from_the_file(tmp_path):
    model = Stack(1)
    aot = _aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate", compile_sizes=(4,))
    loaded = _fresh_load(aot, tmp_path)
    with torch.no_grad():
        for n in (4, 3, 4, 4, 4):
            x = torch.randn(n, 8)
            torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    assert counters.snapshot()["pieces_compiled"] == 0
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    pieces = [p.module.forward for p in split.pieces]
    assert any(isinstance(f, inductor.InductorPiece) and set(f.sized) == {4} for f in pieces)
    assert counters.snapshot()["replays"] > 0
    fxsplit.backend.fxsplit_backend.reset()


def test_a_loaded_graph_runs_python_first_and_loads_its_pieces_at_the_second_call(tmp_path):
    """The first call of a precompiled graph runs its pieces' generated Python (eager's
    numbers) while Inductor starts up in the background; the second loads the compiled
    pieces, whose first run is a warm-up: the first capture comes one call later than in a
    traced graph, whatever the timing."""
    model = Stack(1)
    loaded = _fresh_load(_aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate"), tmp_path)
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    compiled = [p.module.forward for p in split.pieces if hasattr(p.module.forward, "pending")]
    assert len(compiled) == 2 and all(f.artifact is None for f in compiled)
    seen = []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            got, expected = loaded(model, x), model(x)
            found = counters.snapshot()
            seen.append((found["piece_cache_hits"], found["captures"], found["replays"]))
            if len(seen) == 1:
                assert torch.equal(got, expected)  # generated Python: eager's numbers
            torch.testing.assert_close(got, expected, **TOLERANCE)
    assert seen == [(0, 0, 0), (2, 0, 0), (2, 2, 0), (2, 2, 2)]
    assert all(f.pending is None and f.artifact is not None for f in compiled)
    assert {r.outcome for r in split.compiled_pieces} == {"bundle"}
    assert counters.snapshot()["pieces_compiled"] == 0
    fxsplit.backend.fxsplit_backend.reset()


def test_a_bundled_piece_that_does_not_load_is_compiled_at_its_second_call(tmp_path, monkeypatch):
    model, x = Stack(1), torch.randn(3, 8)
    loaded = _fresh_load(_aot(model, (x,), tmp_path, capture="emulate"), tmp_path)

    def unreadable(payload, folder=None):
        raise RuntimeError("truncated")

    monkeypatch.setattr(fxsplit.cache, "load_artifact", unreadable)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    assert counters.snapshot()["pieces_compiled"] == 2
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    assert {r.outcome for r in split.compiled_pieces} == {"compiled"}
    fxsplit.backend.fxsplit_backend.reset()


def test_threads_making_their_second_calls_at_once_load_each_piece_once(tmp_path, monkeypatch):
    """Second calls from several threads at once: one loads a distinct piece, the others wait
    for it and run what it loaded (not a load, or a compile, of their own each: Inductor's
    compiles do not run side by side)."""
    model = Stack(1)
    aot = _aot(model, (torch.randn(3, 8),), tmp_path, capture="off")
    loaded = _fresh_load(aot, tmp_path)
    load = fxsplit.cache.load_artifact
    loads = []

    def slow(payload, folder=None):
        loads.append(payload)
        time.sleep(0.3)  # the other threads reach the piece meanwhile
        return load(payload, folder)

    monkeypatch.setattr(fxsplit.cache, "load_artifact", slow)
    with torch.no_grad():
        loaded(model, torch.randn(3, 8))  # every piece's first call: generated Python
    start, failures = threading.Barrier(3), []

    def second_call():
        start.wait()
        try:
            with torch.no_grad():
                x = torch.randn(3, 8)
                torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
        except BaseException as error:  # reported on the main thread
            failures.append(error)

    threads = [threading.Thread(target=second_call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(loads) == 2  # two distinct pieces, each loaded once
    assert counters.snapshot()["piece_cache_hits"] == 2
    fxsplit.backend.fxsplit_backend.reset()


def test_a_load_by_another_thread_during_a_first_call_does_not_count_it_as_a_warm_up(tmp_path):
    """Another thread may load the pieces while a first call runs their generated Python
    (``Backend.capture`` of any backend loads every waiting piece of the process): that call
    ran no compiled code, so it is no warm-up, and the compiled code's first run (Triton's
    first launch compiles on CUDA) never lands inside the next call's capture."""
    from fxsplit.runtime.emulation import emulator

    model = Stack(1)
    loaded = _fresh_load(_aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate"), tmp_path)
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    compiled = [p.module.forward for p in split.pieces if hasattr(p.module.forward, "pending")]
    first_run_captured = []

    def watched(resolve):
        def resolved():
            record, artifact, sized = resolve()
            runs = []

            def run(*args):
                if not runs:
                    graph = getattr(emulator._tls, "active", None)
                    first_run_captured.append(graph is not None and graph._recorder is not None)
                runs.append(1)
                return artifact(*args)

            return record, run, sized

        return resolved

    for piece in compiled:
        piece.pending._resolve = watched(piece.pending._resolve)
    eager = compiled[0].eager

    def then_another_thread_loads(*args):
        out = eager(*args)
        other = threading.Thread(target=inductor.load_deferred)
        other.start()
        other.join()
        return out

    compiled[0].eager = then_another_thread_loads
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    assert first_run_captured == [False, False]
    assert counters.snapshot()["replays"] > 0
    fxsplit.backend.fxsplit_backend.reset()


def test_finalize_loading_loads_the_pieces_before_the_first_call(tmp_path):
    """An engine's finish after loading (vLLM's AOT compile cache calls
    ``compiled_fn.finalize_loading(vllm_config)`` on what it loaded): the pieces load then, so
    the first call runs them compiled."""
    model = Stack(1)
    loaded = _fresh_load(_aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate"), tmp_path)
    loaded._artifacts.compiled_fn.finalize_loading(object())
    assert counters.snapshot()["piece_cache_hits"] == 2
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    compiled = [p.module.forward for p in split.pieces if hasattr(p.module.forward, "pending")]
    assert all(f.pending is None and f.artifact is not None for f in compiled)
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    fxsplit.backend.fxsplit_backend.reset()


def test_capturing_a_loaded_graph_up_front_loads_its_pieces_first(tmp_path):
    model = Stack(1)
    loaded = _fresh_load(_aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate"), tmp_path)
    backend = fxsplit.backend.fxsplit_backend
    backend.capture(functools.partial(loaded, model), {n: (torch.randn(n, 8),) for n in (4, 2)})
    assert counters.snapshot()["piece_cache_hits"] == 2
    assert counters.snapshot()["captures"] == 4  # two pieces at each size
    with torch.no_grad():
        for n in (4, 2):
            x = torch.randn(n, 8)
            torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    assert counters.snapshot()["captures"] == 4 and counters.snapshot()["replays"] == 4
    backend.reset()


@pytest.mark.parametrize("earlier", ["compiled", "loaded"])
def test_pieces_this_process_already_held_are_in_the_file(tmp_path, earlier):
    """A piece compiled, or loaded from another piece cache, before the precompile is served
    from memory: the file holds it all the same."""
    model, x = Stack(1), torch.randn(3, 8)
    other = {"compile_pieces": "inductor", "cache_dir": str(tmp_path / "other")}
    with torch.no_grad():
        torch.compile(model, backend=fxsplit.Backend(**other), dynamic=True)(x)
        if earlier == "loaded":
            torch._dynamo.reset()
            inductor.forget()
            torch.compile(model, backend=fxsplit.Backend(**other), dynamic=True)(x)
    torch._dynamo.reset()
    loaded = _fresh_load(_aot(model, (x,), tmp_path, capture="emulate"), tmp_path)
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    assert {r.outcome for r in split.compiled_pieces} == {"pending"}
    inductor.load_deferred()
    assert counters.snapshot()["pieces_compiled"] == 0
    assert {r.outcome for r in split.compiled_pieces} == {"bundle"}
    with torch.no_grad():
        torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    fxsplit.backend.fxsplit_backend.reset()


def test_pieces_are_in_the_file_where_the_piece_cache_is_not_usable(tmp_path):
    model, x = Stack(1), torch.randn(3, 8)
    (tmp_path / "cache").mkdir(mode=0o777)
    (tmp_path / "cache").chmod(0o777)  # others can write it: fxsplit refuses it
    with pytest.warns(fxsplit.FxsplitRuntimeWarning, match="not using the cache folder"):
        aot = _aot(model, (x,), tmp_path, capture="emulate")
    _fresh_load(aot, tmp_path)
    assert counters.snapshot()["pieces_compiled"] == 0
    fxsplit.backend.fxsplit_backend.reset()


def test_a_piece_inductor_failed_on_stays_python_when_loaded(tmp_path, monkeypatch):
    """What Inductor failed on is not tried again where the file loads (a failure is kept
    in the piece cache for the same reason)."""
    model, x = Stack(1), torch.randn(3, 8)
    attempts = []

    def failing(*args, **kwargs):
        attempts.append(args)
        raise RuntimeError("no lowering")

    monkeypatch.setattr(torch._inductor, "standalone_compile", failing)
    aot = _aot(model, (x,), tmp_path, capture="emulate")
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    reasons = [r.reason for r in split.compiled_pieces]
    assert len(attempts) == 2 and all("no lowering" in r for r in reasons)
    attempts.clear()
    loaded = _fresh_load(aot, tmp_path)
    assert attempts == []
    (split,) = fxsplit.backend.fxsplit_backend.compiled
    assert [r.reason for r in split.compiled_pieces] == reasons
    with torch.no_grad():
        torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    fxsplit.backend.fxsplit_backend.reset()


def test_a_precompiled_model_captures_its_sizes_up_front(tmp_path):
    """Backend.capture marks no input dynamic for a precompiled function (its guards refuse
    a marked tensor: its shapes were settled when it was compiled)."""
    model = Stack(1)
    aot = _aot(model, (torch.randn(3, 8),), tmp_path, capture="emulate", compile_pieces="eager")
    loaded = _fresh_load(aot, tmp_path)
    backend = fxsplit.backend.fxsplit_backend
    backend.capture(functools.partial(loaded, model), {n: (torch.randn(n, 8),) for n in (4, 2)})
    captured = counters.snapshot()["captures"]
    assert captured > 0
    with torch.no_grad():
        for n in (4, 2, 4):
            x = torch.randn(n, 8)
            torch.testing.assert_close(loaded(model, x), model(x), **TOLERANCE)
    assert counters.snapshot()["captures"] == captured and counters.snapshot()["replays"] > 0
    backend.reset()


def test_the_plan_of_a_precompiled_graph_is_the_plan_of_the_traced_one(tmp_path):
    model, x = Stack(2), torch.randn(3, 8)
    backend = fxsplit.Backend(compile_pieces="eager")
    torch.compile(model, backend=backend, dynamic=True)(x)
    traced = backend.plans[0].pieces
    torch._dynamo.reset()
    aot = _aot(model, (x,), tmp_path, compile_pieces="eager")
    assert fxsplit.plans()[-1].pieces == traced
    data = precompile.Precompiled.serialize_compile_artifacts(aot._artifacts.compiled_fn)
    precompile.Precompiled.deserialize_compile_artifacts(data)
    assert fxsplit.plans()[-1].pieces == traced


def test_another_fxsplit_version_is_refused_naming_both(tmp_path, monkeypatch):
    model, x = Stack(1), torch.randn(3, 8)
    aot = _aot(model, (x,), tmp_path, compile_pieces="eager")
    data = precompile.Precompiled.serialize_compile_artifacts(aot._artifacts.compiled_fn)
    monkeypatch.setattr(fxsplit, "__version__", "0.0.0-other")
    with pytest.raises(precompile.PrecompileError, match=r"this is fxsplit 0\.0\.0-other"):
        precompile.Precompiled.deserialize_compile_artifacts(data)
    assert pickle.loads(data)[0] == precompile.FORMAT


def test_a_precompiled_graph_traced_dynamic_splits_as_traced(tmp_path):
    """Under ``dynamic=True`` every argument's size is symbolic and only the carried state's
    count as step sizes; loading (outside any trace) must split as the trace did: the block
    table's width is no step size there."""
    from fxsplit.models import deepseek_v4

    config = deepseek_v4.DeepseekV4Config(num_layers=1)
    model = deepseek_v4.build(config)
    inputs = deepseek_v4.DecodeRunner(config, 4, persistent=True).step(4)
    aot = _aot(model, tuple(inputs), tmp_path, compile_pieces="eager", runner="v2")
    traced = fxsplit.plans()[-1].pieces
    assert not any(r.startswith("dynamic:") for p in traced for r in p.reasons)
    data = precompile.Precompiled.serialize_compile_artifacts(aot._artifacts.compiled_fn)
    precompile.Precompiled.deserialize_compile_artifacts(data)
    assert fxsplit.plans()[-1].pieces == traced


def test_docs_precompile_scripts_save_then_load_in_new_processes(tmp_path):
    """docs/compiled_pieces.md's save.py and load.py, each a fresh process as a user runs them;
    the load finds no piece cache, so its pieces can only come from the saved file."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "compiled_pieces.md").read_text(encoding="utf-8")
    section = page.split("Precompiling the DeepSeek-V4 reference model", 1)[1]
    save, load = (block.split("```", 1)[0] for block in section.split("```python\n")[1:3])
    assert save.startswith("# save.py") and load.startswith("# load.py")
    cache = tmp_path / "cache"
    env = dict(os.environ, FXSPLIT_CACHE_DIR=str(cache), PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", save], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.rmtree(cache)
    done = subprocess.run(
        [sys.executable, "-c", load], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'replays': 4" in done.stdout, done.stdout
    assert "'pieces_compiled': 0, 'piece_cache_hits': 2" in done.stdout, done.stdout
