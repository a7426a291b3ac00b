"""Backend options: one dataclass and one validator for ``options={...}`` and ``Backend(**kw)``."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fxsplit import presets, runners
from fxsplit.presets import Preset
from fxsplit.runners import Runner

CAPTURE_MODES = ("auto", "cuda", "emulate", "off")
COMPILE_MODES = ("auto", "inductor", "eager")
INPUT_BINDINGS = ("copy", "strict", "trust")
ON_CAPTURE_ERROR = ("fallback", "raise")


@dataclass(frozen=True)
class Config:
    """fxsplit options. Every field is a key of ``options={...}`` and of ``fxsplit.Backend(...)``.

    Attributes:
        runner: registered runner name (``"v1"``, ``"v2"``, see :mod:`fxsplit.runners`) or a
            :class:`~fxsplit.runners.Runner`; decides which regions run eagerly.
        eager_regions: region names to run eagerly instead of the runner's own set.
        splitting_ops: op names ``"ns::op"`` or ``"ns::op.overload"`` that always run eagerly.
        module_regions: module class name or qualified module-path glob -> region name.
        eager_modules: module class names or path globs whose nodes always run eagerly.
        presets: built-in region presets (:mod:`fxsplit.presets`: attention ops, rotary
            embeddings, sparse indexers): ``True`` applies them, ``False`` none; a
            :class:`~fxsplit.presets.Preset`, a list of them or a dict ``{name: Preset or
            {"region", "ops", "modules"}}`` extends them (replacing a built-in of the same name).
            Held as ``True``, ``False`` or the tuple of added presets.
        capture: ``"auto"`` (CUDA/HIP graphs when the graph's tensors are on a CUDA device, else
            off), ``"cuda"``, ``"emulate"`` (the CPU capture emulator) or ``"off"``.
        capture_sizes: token counts to capture: the leading dim of the first tensor argument
            of ``forward``, in its signature's order (or of ``size_input``); None captures
            every key seen, up to ``max_captured_keys``.
        size_input: names of the ``forward`` arguments whose leading dim is the token count
            (a str or a list; held as a tuple): the first one present is the one
            ``capture_sizes`` reads, for models whose first tensor argument is not the token
            count; the leading dims of the others are the token count too, so work that follows
            them is never taken for per-step work (vLLM hands ``input_ids`` and ``positions``,
            each with a symbol of its own).
        max_captured_keys: graphs captured per piece when ``capture_sizes`` is None: one per
            capture key, and one per key for each further call of its graph in a step (inside
            another graph's call).
        warmup_runs: uncaptured runs per capture key before it is captured.
        input_binding: what a runner input whose address changed since capture gets: ``"copy"``,
            ``"strict"`` or ``"trust"``; None takes the runner's default ("strict" for runners
            with persistent inputs, else "copy").
        on_capture_error: ``"fallback"`` (run the piece uncaptured, log why) or ``"raise"``.
        verify: re-run each replayed piece uncaptured and compare (slow; for debugging).
        clone_outputs: return clones of the graph outputs instead of the replay's own buffers.
        dump_dir: folder to write a dump of every compiled graph into; defaults to the
            ``FXSPLIT_DUMP_DIR`` environment variable.
        compile_pieces: ``"inductor"`` (compile each distinct captured piece with Inductor),
            ``"eager"`` (run the generated Python) or ``"auto"`` (Inductor where the graph's
            tensors are on a CUDA/HIP device, else eager).
        compile_sizes: token counts (as ``capture_sizes``) that get an Inductor compile of their
            own besides the symbolic one (Inductor can then specialise its kernels).
        cache_dir: folder of the compiled-piece cache; defaults to ``$FXSPLIT_CACHE_DIR``, else
            ``fxsplit`` under the user's cache folder.
        check_ranks: where ``torch.distributed`` is initialised, compare each graph's split
            across the ranks right after splitting and raise on a mismatch
            (:mod:`fxsplit.distributed`); False skips it (single-rank debugging).
    """

    runner: str | Runner = "v1"
    eager_regions: frozenset[str] | None = None
    splitting_ops: tuple[str, ...] = ()
    module_regions: Mapping[str, str] = field(default_factory=dict)
    eager_modules: tuple[str, ...] = ()
    presets: bool | tuple[Preset, ...] = True
    capture: str = "auto"
    capture_sizes: tuple[int, ...] | None = None
    size_input: tuple[str, ...] | None = None
    max_captured_keys: int = 64
    warmup_runs: int = 1
    input_binding: str | None = None
    on_capture_error: str = "fallback"
    verify: bool = False
    clone_outputs: bool = False
    dump_dir: str | None = None
    compile_pieces: str = "auto"
    compile_sizes: tuple[int, ...] = ()
    cache_dir: str | None = None
    check_ranks: bool = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, base: Config | None = None):
        """Validate ``options`` and return a Config (``base`` supplies the keys not given).

        Raises:
            ValueError: an unknown key (the message lists the valid keys) or a bad value (the
                message names the key, the value and what is allowed).
            TypeError: a value of the wrong type, naming the key and the expected type.
        """
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in options if k not in valid)
        if unknown:
            close = [m for k in unknown for m in difflib.get_close_matches(k, valid, n=1)]
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"unknown fxsplit option {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(valid)}{hint}"
            )
        values = {} if base is None else {k: getattr(base, k) for k in valid}
        for key, value in options.items():
            values[key] = _VALIDATORS[key](key, value)
        config = cls(**values)
        runners.get(config.runner)
        return config

    @property
    def runner_policy(self) -> Runner:
        """The :class:`Runner` this config names, with ``eager_regions`` applied."""
        runner = runners.get(self.runner)
        if self.eager_regions is not None:
            runner = dataclasses.replace(runner, eager_regions=self.eager_regions)
        return runner

    @property
    def active_presets(self) -> tuple[Preset, ...]:
        """The presets the mark pass matches (see :func:`fxsplit.presets.resolve`)."""
        return presets.resolve(self.presets)

    @property
    def binding(self) -> str:
        """The effective input binding: ``input_binding`` or the runner's default."""
        if self.input_binding is not None:
            return self.input_binding
        return "strict" if self.runner_policy.persistent_inputs else "copy"

    @property
    def dump_folder(self) -> str | None:
        """``dump_dir``, else the ``FXSPLIT_DUMP_DIR`` environment variable, else None."""
        return self.dump_dir or os.environ.get("FXSPLIT_DUMP_DIR") or None


def _type_error(key: str, value: Any, expected: str) -> TypeError:
    return TypeError(
        f"fxsplit option {key}={value!r} has type {type(value).__name__}; expected {expected}"
    )


def _choice(choices: tuple[str, ...]):
    def check(key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise _type_error(key, value, f"one of {', '.join(map(repr, choices))}")
        if value not in choices:
            close = difflib.get_close_matches(value.strip().lower(), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"fxsplit option {key}={value!r} is not allowed; "
                f"choose one of {', '.join(map(repr, choices))}{hint}"
            )
        return value

    return check


def _optional(check):
    return lambda key, value: None if value is None else check(key, value)


def _strings(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise _type_error(key, value, "a list of strings")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise ValueError(
            f"fxsplit option {key} holds {bad[0]!r}; every entry must be a non-empty str"
        )
    return tuple(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(key, value, "a bool")
    return value


def _positive_int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, value, "an int")
    if value < minimum:
        raise ValueError(f"fxsplit option {key}={value!r} must be >= {minimum}")
    return value


def _runner(key: str, value: Any) -> str | Runner:
    if not isinstance(value, str | Runner):
        raise _type_error(key, value, "a runner name (str) or fxsplit.runners.Runner")
    runners.get(value)
    return value


def _module_regions(key: str, value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise _type_error(key, value, "a dict of module pattern -> region name")
    for pattern, name in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"fxsplit option {key} has key {pattern!r}; keys must be non-empty str"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"fxsplit option {key}[{pattern!r}]={name!r}; region names must be non-empty str"
            )
    return dict(value)


def _splitting_ops(key: str, value: Any) -> tuple[str, ...]:
    from fxsplit.facts.ops import parse_op_name

    names = _strings(key, value)
    for name in names:
        ns, op, overload = parse_op_name(name)
        packet = _registered_op(ns, op)
        if overload is not None and packet is not None and overload not in packet.overloads():
            real = ", ".join(f"{ns}::{op}.{o}" for o in sorted(packet.overloads()))
            raise ValueError(
                f"fxsplit option {key} holds {name!r}, but {ns}::{op} has no overload "
                f"{overload!r}; its overloads: {real} (or {ns}::{op} for all of them)"
            )
    return names


def _registered_op(ns: str, op: str):
    """The op's packet when its namespace is already registered with torch; None otherwise
    (custom ops may be registered after the backend is configured)."""
    import torch

    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _capture_sizes(key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise _type_error(key, value, "a list of positive ints")
    if not value:
        raise ValueError(
            f"fxsplit option {key}=[] would capture nothing; list at least one size, pass None to "
            "capture every size seen, or capture='off'"
        )
    seen: set[int] = set()
    for size in value:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"fxsplit option {key} holds {size!r}; every entry must be an int")
        if size <= 0:
            raise ValueError(
                f"fxsplit option {key} holds {size!r}; every entry must be a positive int "
                "(a token count)"
            )
        if size in seen:
            raise ValueError(f"fxsplit option {key} holds {size!r} twice; sizes must be unique")
        seen.add(size)
    return tuple(value)


def _argument_names(key: str, value: Any) -> tuple[str, ...]:
    """One argument name or a non-empty list of distinct ones, as a tuple."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple):
        raise _type_error(key, value, "an argument name (str) or a list of them")
    if not names:
        raise ValueError(f"fxsplit option {key}=[] names no argument; pass None or a name")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"fxsplit option {key} holds {name!r}; every entry must be an argument name (str)"
            )
        if not name.isidentifier():
            raise ValueError(f"fxsplit option {key} holds {name!r}, not a Python argument name")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"fxsplit option {key} names {repeated[0]!r} twice; names must be unique")
    return tuple(names)


def _folder(key: str, value: Any) -> str:
    if not isinstance(value, str | os.PathLike):
        raise _type_error(key, value, "a folder path")
    return os.fspath(value)


_VALIDATORS = {
    "runner": _runner,
    "eager_regions": _optional(lambda k, v: frozenset(_strings(k, v))),
    "splitting_ops": _splitting_ops,
    "module_regions": _module_regions,
    "eager_modules": _strings,
    "presets": presets.from_option,
    "capture": _choice(CAPTURE_MODES),
    "capture_sizes": _optional(_capture_sizes),
    "size_input": _optional(_argument_names),
    "max_captured_keys": _positive_int,
    "warmup_runs": lambda k, v: _positive_int(k, v, minimum=0),
    "input_binding": _optional(_choice(INPUT_BINDINGS)),
    "on_capture_error": _choice(ON_CAPTURE_ERROR),
    "verify": _bool,
    "clone_outputs": _bool,
    "dump_dir": _optional(_folder),
    "compile_pieces": _choice(COMPILE_MODES),
    "compile_sizes": lambda k, v: (
        () if v is None or (isinstance(v, list | tuple) and not v) else _capture_sizes(k, v)
    ),
    "cache_dir": _optional(_folder),
    "check_ranks": _bool,
}
