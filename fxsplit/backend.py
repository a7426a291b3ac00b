"""The torch.compile backend: ``backend="fxsplit"`` and :class:`Backend` objects."""

from __future__ import annotations

import gc
import logging
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule

from fxsplit.config import Config
from fxsplit.passes import Split, split
from fxsplit.passes.mark import Policy
from fxsplit.plan import SplitPlan

log = logging.getLogger("fxsplit")


class Backend:
    """A torch.compile backend object; ``torch.compile(model, backend=fxsplit.Backend(**options))``.

    Takes the same keys as ``torch.compile(..., backend="fxsplit", options={...})`` (see
    :class:`fxsplit.config.Config`) and validates them here. Keeps its own plans, compiled graphs
    and memory pools; ``torch._dynamo.reset()`` calls :meth:`reset`.

    Attributes:
        config: the validated options.
        plans: one :class:`~fxsplit.plan.SplitPlan` per graph compiled since the last reset, in
            compile order (a recompile appends one).
        compiled: the matching :class:`fxsplit.passes.Split` results (stitched module, pieces,
            marks), for inspection and dumps.

    Raises:
        ValueError / TypeError: bad options (see :meth:`fxsplit.config.Config.from_options`).
    """

    def __init__(self, **options):
        self.config = Config.from_options(options)
        self.plans: list[SplitPlan] = []
        self.compiled: list[Split] = []
        self._count = 0
        self._lock = threading.Lock()
        self._matched: set[str] = set()
        self._warned: set[str] = set()

    def __call__(
        self,
        gm: GraphModule,
        example_inputs: Sequence[object],
        *,
        options: dict | None = None,
        mode: str | None = None,
        **kwargs,
    ) -> Callable:
        """Split ``gm`` and return the callable Dynamo runs in its place.

        Raises:
            ValueError: ``mode`` other than "default", or a bad option.
            TypeError: an unknown keyword from torch, or an option of the wrong type.
        """
        if kwargs:
            raise TypeError(
                f"fxsplit backend got unexpected keyword(s) {sorted(kwargs)}; it takes options=..."
            )
        if mode not in (None, "default"):
            raise ValueError(
                f"fxsplit does not take torch.compile(mode={mode!r}); leave mode unset and pass "
                "fxsplit's own settings as options={...}"
            )
        config = Config.from_options(options, base=self.config) if options else self.config
        with self._lock:
            graph_id = f"graph_{self._count}"
            self._count += 1
        runner = config.runner_policy
        policy = Policy.build(
            runner, config.splitting_ops, config.module_regions, config.eager_modules
        )
        # The split allocates many small objects while a large graph is alive; cyclic GC passes
        # over that graph would dominate its cost.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            result = split(
                gm,
                policy,
                graph_id=graph_id,
                runner=runner.name,
                grad_at_entry=torch.is_grad_enabled(),
            )
        finally:
            if gc_was_enabled:
                gc.enable()
        self._warn_unmatched(policy)
        plan = result.plan
        self.plans.append(plan)
        log.info(
            "%s: %d nodes -> %d pieces (%d captured, %d eager) in %.1f ms",
            graph_id,
            plan.num_nodes,
            len(plan.pieces),
            len(plan.captured),
            len(plan.eager),
            plan.split_seconds * 1e3,
        )
        self.compiled.append(result)
        return result.materialised.stitched.forward

    def _warn_unmatched(self, policy: Policy) -> None:
        matched = policy.splitting_ops.used | policy.module_regions.used
        self._matched |= matched | policy.eager_modules.used
        for pattern in policy.unused_patterns():
            if pattern not in self._matched and pattern not in self._warned:
                self._warned.add(pattern)
                warnings.warn(
                    f"fxsplit: {pattern!r} (splitting_ops / module_regions / eager_modules) "
                    "matched no node of the compiled graph",
                    UserWarning,
                    stacklevel=2,
                )

    def reset(self) -> None:
        """Forget every plan and compiled graph and free their memory; safe to call repeatedly."""
        self.plans.clear()
        self.compiled.clear()
        self._count = 0
        self._matched.clear()
        self._warned.clear()


# The per-process object behind backend="fxsplit" (registered by the torch_dynamo_backends entry
# point, never by register_backend: both would fail with "duplicate name").
fxsplit_backend = Backend()


def plans() -> list[SplitPlan]:
    """Plans of every graph the string backend ``"fxsplit"`` compiled since the last reset."""
    return list(fxsplit_backend.plans)
