"""Skip markers for tests that need what a later torch than 2.11 has."""

from __future__ import annotations

import pytest
import torch

from fxsplit.runtime.memory.output_lifetime import can_swap

# torch 2.11 lacks UntypedStorage._swap_data_ptr_: the emulator invalidates a held output as CUDA
# does (a read raises) and an output handed back in becomes unreadable after the step
# (docs/reliability.md, "Torch versions"), so a test that reads either afterwards cannot run there.
needs_swap = pytest.mark.skipif(
    not can_swap(),
    reason=f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_: held and "
    "handed-back outputs are invalidated (reads raise) instead of keeping their values",
)

# Some golden plans and the coverage table (docs/coverage.md) are torch 2.13's Dynamo graphs;
# torch 2.11's Dynamo traces other ones for them (other op counts, another representative of
# equal dynamic sizes, so another split of a decode step's graph).
_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
needs_golden_torch = pytest.mark.skipif(
    _RELEASE < (2, 13),
    reason=f"recorded with torch 2.13's Dynamo graphs; torch {torch.__version__} traces others",
)
