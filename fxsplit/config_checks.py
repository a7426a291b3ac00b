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
from fxsplit.facts.ops import op_names
from fxsplit.passes.modules import module_path
from fxsplit.warn import warn_at_caller

# Each pattern option, and the kind of name its patterns match (what a did-you-mean offers).
_PATTERN_OPTIONS = {"splitting_ops": "ops", "module_regions": "modules", "eager_modules": "modules"}


class ConfigChecks:
    """What the graphs compiled so far matched, and the warnings still to judge."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every graph (``torch._dynamo.reset()``); warnings given may be given again."""
        self._matched: set[str] = set()
        self._unmatched: dict[str, tuple[str, ...]] = {}  # pattern -> the options naming it
        self._seen: dict[str, set[str]] = {"ops": set(), "modules": set()}  # names graphs hold
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
        unused = policy.unused_patterns()
        for pattern in unused:
            self._unmatched[pattern] = tuple(
                option for option in _PATTERN_OPTIONS if pattern in _patterns(policy, option)
            )
        if unused:  # what a misspelt pattern may have meant: only then worth a walk
            _names_in(marks.nodes, self._seen)
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

        * a ``splitting_ops`` / ``module_regions`` / ``eager_modules`` pattern no node matched
          (naming its option and the closest op or module name the graphs hold);
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
            (pattern, self._unmatched_message(pattern))
            for pattern in sorted(self._unmatched.keys() - self._matched - self._warned)
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

    def _unmatched_message(self, pattern: str) -> str:
        """Which option's pattern matched nothing, and the closest name the graphs hold."""
        options = self._unmatched[pattern]
        names = set().union(*(self._seen[_PATTERN_OPTIONS[o]] for o in options))
        close = difflib.get_close_matches(
            pattern, sorted({_shaped(pattern, n) for n in names}), n=1
        )
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"fxsplit: {' / '.join(options)} pattern {pattern!r} matched no node of the graphs "
            f"compiled so far{hint}"
        )


def _shaped(pattern: str, name: str) -> str:
    """``name`` with the path components a glob ``pattern`` leaves open as the pattern's
    (``"layers.*.ln"``, ``"layers.0.lin"`` -> ``"layers.*.lin"``), so what a misspelt glob is
    offered is a glob too."""
    parts, theirs = pattern.split("."), name.split(".")
    if len(parts) != len(theirs):
        return name
    return ".".join(p if p in ("*", "**") else n for p, n in zip(parts, theirs, strict=True))


def _patterns(policy, option: str) -> list[str]:
    matcher = getattr(policy, option)
    return matcher.names if option == "splitting_ops" else matcher.patterns


def _names_in(nodes, seen: dict[str, set[str]]) -> None:
    """Add to ``seen`` the names patterns could match in ``nodes``: op names (``"ns::op"`` and
    ``"ns::op.overload"``) and enclosing modules' class names and paths."""
    ops, modules = seen["ops"], seen["modules"]
    for node in nodes:
        names = op_names(node)
        if names is not None:
            base, overload = names
            ops.add(base)
            if overload is not None:
                ops.add(f"{base}.{overload}")
        for dynamo_path, cls in (node.meta.get("nn_module_stack") or {}).values():
            modules.add(module_path(dynamo_path))
            modules.add(cls.rpartition(".")[2] if isinstance(cls, str) else cls.__name__)


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
