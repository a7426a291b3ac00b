"""Inductor's per-process start-up, run beside fxsplit's own work.

Before a process loads or compiles its first Inductor piece, Inductor pays costs that do not
depend on the piece: on the CPU, a check of which vector instruction sets the C++ compiler may
use (:func:`prepare`); everywhere, the import of its compiler (``torch._inductor.compile_fx``:
AOTAutograd, its partitioners, the kernel templates) and ``torch_key()``, the hash of torch's
sources every artifact is checked against (:func:`warm`). Started in background threads, they
run while fxsplit unpickles and splits a graph, or while a precompiled graph's first call runs
its pieces' generated Python; :func:`ready` joins them before the first load or compile,
:func:`warmed` the import before any split's compile.
"""

from __future__ import annotations

import atexit
import threading

import torch

# Inductor's check of the CPU's vector instruction sets, started by prepare().
_ISA_CHECK: threading.Thread | None = None
# The import of Inductor's compiler and torch_key(), started by warm().
_WARM: threading.Thread | None = None


def prepare(device: torch.device | None) -> None:
    """Start Inductor's per-process check of the CPU's vector instruction sets in the
    background, once per process, where pieces compile or load for the CPU (``device`` None).

    Before its first C++ kernel builds or loads, Inductor checks which instruction sets the
    compiler may use: per check, a small build (cached on disk) and a child process that loads
    it, ten checks and about 1 s in all on an x86 CPU with AMX, spent in the children. Started
    before the split (before unpickling, for a precompiled graph), the children run beside the
    split, the piece keys and the import of Inductor's compiler. Checking the sets side by side
    was measured too: on two cores it slows the main thread more than it shortens the check."""
    global _ISA_CHECK
    if device is not None or _ISA_CHECK is not None:
        return
    # what the check imports, imported here: the thread then never waits on the import lock
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

    _ISA_CHECK = threading.Thread(
        target=cpu_vec_isa.valid_vec_isa_list, name="fxsplit-isa-check", daemon=True
    )
    _ISA_CHECK.start()


def warm() -> None:
    """Import Inductor's compiler and compute ``torch_key()`` in the background, once per
    process (a precompiled graph starts it after its split, so that the two share the GIL
    only with the first call). ``torch_key()`` asked for meanwhile is computed twice at worst;
    a compile waits for the thread first (:func:`warmed`)."""
    global _WARM
    if _WARM is not None:
        return
    # What the import registers with threading's exit hooks, which refuse it once the
    # interpreter starts shutting down: imported here, before a process that ends right after
    # loading can start to
    import concurrent.futures.process
    import concurrent.futures.thread  # noqa: F401

    _WARM = threading.Thread(target=_warm, name="fxsplit-inductor-warm", daemon=True)
    _WARM.start()
    # and such a process waits for the import (cut short by the shutdown, it prints a traceback)
    atexit.register(_WARM.join)


def _warm() -> None:
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.codecache import torch_key

    torch_key()


def warmed() -> None:
    """Wait for :func:`warm`'s thread, where one runs: a compile imports much of what it
    imports, and two threads importing modules that import each other can hand one of them a
    partly initialised module."""
    if _WARM is not None:
        _WARM.join()


def ready() -> None:
    """Wait for :func:`warm` and :func:`prepare` (Inductor would run the check again if asked
    while it runs), having imported Inductor's compiler: loading an artifact needs it."""
    warmed()
    import torch._inductor.compile_fx  # noqa: F401

    if _ISA_CHECK is not None:
        _ISA_CHECK.join()
