"""The transformers zoo: every causal-LM architecture, tiny, through fxsplit under both runners.

:func:`run` takes one architecture of :func:`fxsplit.models.hf_zoo.architectures`, builds it
tiny (:func:`fxsplit.models.hf_zoo.build`: nothing downloaded), prefills and decodes
:data:`STEPS` tokens with a ``DynamicCache`` eagerly and compiled under runners v1 and v2
(capture emulated, ``input_binding="copy"``; :func:`fxsplit.tools.coverage.check`), and returns
one :class:`Row`: per runner, equal / wrong / crash and the replay share from decode step
:data:`fxsplit.tools.coverage.REPLAYS_FROM` on. :func:`table` and :func:`summary` render rows;
``scripts/hf_zoo.py`` runs the whole zoo, one child process per batch of architectures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fxsplit.tools import coverage

__all__ = ["RUNNERS", "STEPS", "Row", "Runner", "run", "summary", "table"]

RUNNERS = ("v1", "v2")
STEPS = 6
TARGET = 0.9
"""Replay share a decode loop should reach from decode step 4 on."""


@dataclass(frozen=True)
class Runner:
    """One architecture under one runner.

    Attributes:
        status: ``"equal"`` (every step's logits equal the reference bit for bit), ``"wrong"``
            or ``"crash"``.
        reference: ``"eager"`` or ``"dynamo"`` (see :class:`fxsplit.tools.coverage.Result`).
        replays / calls: captured-piece replays and calls from decode step 4 on.
        detail: the largest difference (wrong) or the error (crash), else empty.
    """

    status: str
    reference: str = "eager"
    replays: int = 0
    calls: int = 0
    detail: str = ""

    @property
    def share(self) -> float | None:
        """Replays / calls; None when no captured piece ran."""
        return self.replays / self.calls if self.calls else None


@dataclass(frozen=True)
class Row:
    """One architecture: ``runners`` maps runner name -> :class:`Runner`; empty with a
    ``reason`` when the tiny model cannot be built or fails eagerly (not fxsplit's doing).
    ``attention`` is the implementation the tiny model runs (``"sdpa"`` or ``"eager"``)."""

    architecture: str
    runners: dict[str, Runner]
    reason: str = ""
    attention: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        runners = {k: Runner(**v) for k, v in data["runners"].items()}
        return cls(data["architecture"], runners, data["reason"], data["attention"])

    @property
    def equal(self) -> bool:
        """Ran, and equal to its reference under every runner."""
        return bool(self.runners) and all(r.status == "equal" for r in self.runners.values())

    @property
    def replaying(self) -> bool:
        """Equal, and at least :data:`TARGET` of captured-piece calls replayed under every
        runner (a runner with no captured call does not count as replaying)."""
        return self.equal and all(
            r.share is not None and r.share >= TARGET for r in self.runners.values()
        )


def run(architecture: str, steps: int = STEPS, runners_run: tuple[str, ...] = RUNNERS) -> Row:
    """Run one architecture under ``runners_run`` (see the module docstring); never raises for
    the model's sake."""
    from fxsplit.models import hf_zoo

    runners: dict[str, Runner] = {}
    attention = ""
    for runner in runners_run:
        result = coverage.attempt(architecture, runner, steps=steps, build=hf_zoo.build)
        if result.error and not result.error.startswith("fxsplit:"):
            return Row(architecture, {}, result.error)
        if result.error:
            runners[runner] = Runner("crash", detail=result.error.removeprefix("fxsplit: "))
            continue
        attention = result.attention or attention
        replays, calls = result.replays
        status = "equal" if result.exact else "wrong"
        detail = "" if result.exact else f"{max(result.diffs):.3g}"
        runners[runner] = Runner(status, result.reference, replays, calls, detail)
    return Row(architecture, runners, attention=attention)


def _cell(runner: Runner) -> str:
    if runner.status == "crash":
        return f"crash: {runner.detail}"
    status = runner.status if runner.reference == "eager" else f"{runner.status} (Dynamo's graph)"
    if runner.status == "wrong":
        status += f" ({runner.detail})"
    if runner.share is None:
        return f"{status}, no captured call"
    return f"{status}, {100 * runner.share:.0f} % ({runner.replays}/{runner.calls})"


def table(rows: list[Row]) -> str:
    """Markdown: one row per architecture, a cell per runner (status, replay share)."""
    lines = [
        "| architecture | attention | " + " | ".join(RUNNERS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in RUNNERS) + " |",
    ]
    for row in rows:
        if not row.runners:
            cells = [row.reason.replace("|", "/")] + ["-"] * (len(RUNNERS) - 1)
        else:
            cells = [
                _cell(row.runners[r]).replace("|", "/") if r in row.runners else "-"
                for r in RUNNERS
            ]
        lines.append(f"| `{row.architecture}` | {row.attention or '-'} | {' | '.join(cells)} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """The counts: architectures, how many run tiny, equal, replaying, wrong, crashing."""
    ran = [r for r in rows if r.runners]
    built = sum(1 for r in rows if not r.reason.startswith("cannot build"))
    wrong = sum(1 for r in ran if any(x.status == "wrong" for x in r.runners.values()))
    crash = sum(1 for r in ran if any(x.status == "crash" for x in r.runners.values()))
    return (
        f"{len(rows)} architectures: {built} build tiny, {len(ran)} run eagerly; "
        f"{sum(r.equal for r in ran)} equal under both runners "
        f"({sum(r.replaying for r in ran)} of them replaying >= {100 * TARGET:.0f} % of "
        f"captured-piece calls from decode step {coverage.REPLAYS_FROM} on under both), "
        f"{wrong} wrong, {crash} crash"
    )
