"""Configuration mistakes, judged over every graph a model's first call compiles.

A graph break splits one model call into several graphs, compiled one after another: a
``splitting_ops`` pattern, a region name or the regions a runner wants may appear only in a later
graph. So nothing is judged per graph: :class:`ConfigChecks` gathers what each graph showed and
:meth:`ConfigChecks.warn` judges when a compiled graph runs a second time (the model's second
call: the first has compiled all its graphs) or at the end of :func:`fxsplit.explain`.
"""

from __future__ import annotations

import difflib

from fxsplit import runners
from fxsplit.warn import warn_at_caller


class ConfigChecks:
    """What the graphs compiled so far matched, and the warnings still to judge."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every graph (``torch._dynamo.reset()``); warnings given may be given again."""
        self._matched: set[str] = set()
        self._unmatched: set[str] = set()
        self._regions_seen: set[str] = set()
        self._configured_regions: set[str] = set()
        self._eager_seen = False
        self._no_region: str | None = None
        self._warned: set[str] = set()

    def note(self, policy, config, plan, marks) -> None:
        """Record one compiled graph: the patterns its policy matched, the regions its nodes
        carry, whether any piece is eager."""
        self._matched |= policy.splitting_ops.used | policy.module_regions.used
        self._matched |= policy.eager_modules.used
        self._unmatched |= set(policy.unused_patterns())
        self._regions_seen.update(r for names in marks.regions.values() for r in names)
        self._configured_regions |= set(config.eager_regions or ())
        self._configured_regions |= set(config.module_regions.values())
        self._eager_seen |= bool(plan.eager)
        runner = config.runner_policy
        if runner.eager_regions and self._no_region is None:
            self._no_region = (
                f"runner {runner.name!r} (eager: {', '.join(sorted(runner.eager_regions))})"
            )

    @property
    def pending(self) -> bool:
        """True when :meth:`warn` would warn if called now."""
        return bool(self._due())

    def warn(self) -> None:
        """Warn once per mistake the graphs compiled so far show:

        * a ``splitting_ops`` / ``module_regions`` / ``eager_modules`` pattern no node matched;
        * a region name (``eager_regions``, a ``module_regions`` value, a ``fxsplit.region``
          in model code) no runner knows, close to one that is known (``"attenion"``);
        * a runner that wants regions eager where no node is in any region and nothing is eager
          (attention, if any, is then captured with everything else).
        """
        for key, message in self._due():
            self._warned.add(key)
            warn_at_caller(message)

    def _due(self) -> list[tuple[str, str]]:
        due = [
            (
                pattern,
                f"fxsplit: {pattern!r} (splitting_ops / module_regions / eager_modules) "
                "matched no node of the graphs compiled so far",
            )
            for pattern in sorted(self._unmatched - self._matched - self._warned)
        ]
        known = {r for name in runners.names() for r in runners.get(name).eager_regions}
        # A misspelt name marks nodes too (fxsplit.region("atention"), a module_regions value):
        # it is judged against the names runners know, whether nodes carry it or not.
        named = self._configured_regions | self._regions_seen
        for name in sorted(named - known):
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.8)
            if close and f"region:{name}" not in self._warned:
                due.append(
                    (
                        f"region:{name}",
                        f"fxsplit: no runner knows region {name!r}, so no runner runs it "
                        f"eagerly; did you mean {' or '.join(map(repr, close))}?",
                    )
                )
        if (
            self._no_region
            and not self._regions_seen
            and not self._eager_seen
            and "no-region" not in self._warned
        ):
            due.append(
                (
                    "no-region",
                    "fxsplit: no node of the graphs compiled so far is in any region, so "
                    f"{self._no_region} runs nothing eagerly and any attention is captured; "
                    "mark it with fxsplit.region(...), module_regions={'<AttentionClass>': "
                    "'attention'} or splitting_ops=['ns::op'] (eager_regions=[] says a model "
                    "has no regions on purpose)",
                )
            )
        return due


class WarnOnSecondCall:
    """A compiled graph that calls ``on_second`` once, when it runs the second time."""

    __slots__ = ("calls", "fn", "on_second")

    def __init__(self, fn, on_second) -> None:
        self.fn = fn
        self.on_second = on_second
        self.calls = 0

    def __call__(self, *args):
        if self.calls < 2:
            self.calls += 1
            if self.calls == 2:
                self.on_second()
        return self.fn(*args)
