"""fxsplit: split Dynamo graphs for piecewise CUDA/HIP graph capture (demo, dump, diff, cache)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import fxsplit
from fxsplit.tools import factory as factories
from fxsplit.tools.cli_checks import (
    UsageError,
    check_factory,
    check_options,
    check_runner,
    unknown_arguments,
    unknown_command,
)


def _options(text: str | None, runner: str | None) -> dict:
    options = check_options(text)
    from fxsplit.config import Config

    try:  # every value as given, before the two the CLI sets itself replace theirs
        Config.from_options(options)
    except (TypeError, ValueError) as error:
        raise UsageError(f"bad fxsplit options: {error}") from None
    # The CLI writes its own dumps; the backend must not write them again.
    options.pop("dump_dir", None)
    options["capture"] = "off"
    if runner is not None:
        options["runner"] = runner
    return options


@contextlib.contextmanager
def _no_env_dump_dir():
    saved = os.environ.pop("FXSPLIT_DUMP_DIR", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["FXSPLIT_DUMP_DIR"] = saved


def _compile(spec: str, factory, options: dict):
    """Compile a fresh model from ``factory`` with fxsplit (capture off) and run it once.

    Returns:
        ``(name, records)``: the model's class or function name, and ``(split, dynamo graph
        code, example inputs)`` per compiled graph, in compile order.
    """
    import torch

    import fxsplit

    try:
        backend = fxsplit.Backend(**options)
    except (TypeError, ValueError) as error:
        raise UsageError(f"bad fxsplit options: {error}") from None
    codes: list[tuple[str, list]] = []

    def recording(gm, example_inputs, **kwargs):
        try:
            code = gm.print_readable(print_output=False)
        except Exception:  # print_readable varies across torch releases; the code always works
            code = gm.code
        codes.append((code, list(example_inputs)))
        return backend(gm, example_inputs, **kwargs)

    model, args, kwargs = factories.call(spec, factory)
    torch._dynamo.reset()
    with _warnings_at(factory):
        with _no_env_dump_dir(), torch.no_grad():
            torch.compile(model, backend=recording, dynamic=True)(*args, **kwargs)
        backend.checks.warn()  # the call compiled every graph: a pattern that matched nothing
    records = [
        (split, code, inputs)
        for split, (code, inputs) in zip(backend.compiled, codes, strict=False)
    ]
    name = type(model).__name__ if isinstance(model, torch.nn.Module) else None
    return name or getattr(model, "__name__", None), records


def _warnings_at(factory):
    """fxsplit's warnings about the model attributed to the factory in the user's file, not to
    the ``fxsplit`` script that called it; where its source cannot be found, left as they are."""
    import inspect

    from fxsplit.warn import attributed_to

    try:
        filename = inspect.getsourcefile(factory)
        _, lineno = inspect.getsourcelines(factory)
    except (OSError, TypeError):
        filename = None
    if filename is None:
        return contextlib.nullcontext()
    return attributed_to(filename, lineno)


def _console():
    """A rich console; 100 columns when writing to a pipe or file without ``COLUMNS`` set."""
    from rich.console import Console

    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=100)
    return Console()


def _dump(args) -> int:
    from fxsplit.tools.dump import plan_table, sharing_lines, write_dump

    factory = factories.load(args.factory)
    name, records = _compile(args.factory, factory, _options(args.options, args.runner))
    console = _console()
    for split, code, inputs in records:
        console.print(plan_table(split.plan))
        for line in sharing_lines(split.plan):
            console.print(line, highlight=False, soft_wrap=True)
        folder = write_dump(args.out, split, code, example_inputs=inputs, model=name)
        console.print(f"wrote {folder}", highlight=False, soft_wrap=True)
    if not records:
        console.print("no graph was compiled (nothing to dump)")
    return 0


def _diff(args) -> int:
    from fxsplit.tools.diff import diff_splits, print_diff

    runners = args.runner or ["v1", "v2"]
    if len(runners) != 2:
        raise UsageError(
            f"diff takes --runner exactly twice (A and B), or not at all (v1 against v2); got "
            f"{len(runners)}: {', '.join(runners)}"
        )
    factory = factories.load(args.factory)
    compiled = [
        _compile(args.factory, factory, _options(args.options, runner))[1] for runner in runners
    ]
    console = _console()
    moved = 0
    for (a, _, _), (b, _, _) in zip(*compiled, strict=False):
        diff = diff_splits(a, b)
        print_diff(console, diff, nodes=args.nodes)
        moved += len(diff.moved)
    if moved and not args.nodes:
        console.print(
            f"Each of the {moved} moved nodes, with its reasons: add --nodes", highlight=False
        )
    if len(compiled[0]) != len(compiled[1]):
        console.print(
            f"A compiled {len(compiled[0])} graphs, B {len(compiled[1])}: only the first "
            f"{min(map(len, compiled))} are compared",
            highlight=False,
        )
    return 0


def _cache(args) -> int:
    from fxsplit import cache

    root = cache.cache_dir(args.cache_dir)
    if args.cache_dir is None and not root.exists():  # the default folder: nothing compiled yet
        print(f"{root}: no cache folder yet (nothing compiled into it): 0 compiled pieces")
        return 0
    try:
        if args.action == "clear":
            print(f"deleted {cache.clear(root)} compiled pieces and failure markers from {root}")
            return 0
        found = cache.info(root)
    except OSError as error:  # missing, or a file
        print(f"fxsplit cache {args.action}: error: {error}", file=sys.stderr)
        return 1
    print(
        f"{root}: {found['pieces']} compiled pieces, {found['failures']} failure markers, "
        f"{found['bytes'] / 2**20:.1f} MiB"
    )
    return 0


def _demo(args) -> int:
    from fxsplit.models import hf_architectures
    from fxsplit.tools import demo

    if args.model is not None:
        try:
            hf_architectures.tiny_config(args.model)
        except (ValueError, ImportError) as error:
            raise UsageError(str(error)) from None
    try:
        device = demo.check_device(args.device or demo.default_device())
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        return demo.run(args.model, compile_pieces=args.compile_pieces, device=device)
    except ModuleNotFoundError as error:
        if args.model is None:
            raise
        raise UsageError(
            f"{args.model} needs the Python package {error.name!r} (pip install {error.name})"
        ) from None


def _check_before_torch(args) -> None:
    """What ``dump`` and ``diff`` were given, judged before the model's module (and torch) is
    imported: the ``MODULE:FACTORY`` form, ``--options``, the runner names."""
    module, _ = check_factory(args.factory)
    options = check_options(args.options)
    runners = args.runner if isinstance(args.runner, list) else [args.runner]
    for name in [*runners, options.get("runner")]:
        if isinstance(name, str):
            check_runner(name, module)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    # argparse keeps its options only in ``_actions`` (private, and there since Python 2.7)
    return [flag for action in parser._actions for flag in action.option_strings]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fxsplit``; returns the exit status (2: bad command line)."""
    parser = argparse.ArgumentParser(prog="fxsplit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fxsplit {fxsplit.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_help = (
        "compile the reference models under runners v1 and v2 and compare with eager, then "
        "decode with eager and fxsplit side by side (and reduce-overhead on CUDA)"
    )
    demo_parser = commands.add_parser("demo", help=demo_help, description=demo_help)
    demo_parser.add_argument(
        "--compile-pieces",
        choices=("auto", "inductor", "eager"),
        default="auto",
        help="compile captured pieces with Inductor (default auto: on GPUs)",
    )
    demo_parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="instead: DeepSeek-V4 decode tensor-parallel over N CPU processes (gloo, capture "
        "emulated) under v1 and v2, each rank compared with the single-process model",
    )
    demo_parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where to run: cuda (CUDA graphs; the decode table adds reduce-overhead) or cpu "
        "(capture emulated); default: cuda where torch sees a GPU",
    )
    demo_parser.add_argument(
        "--model",
        default=None,
        metavar="ARCHITECTURE",
        help="run one Hugging Face architecture instead (tiny config, prefill + decode), e.g. "
        "Qwen2MoeForCausalLM",
    )
    factory_help = "a module and a function in it that returns (model, example_inputs)"
    options_help = 'fxsplit options as a JSON object, e.g. \'{"splitting_ops": ["aten::topk"]}\''
    dump_help = "plan a model without capturing, print the plan, write one dump folder per graph"
    dump = commands.add_parser("dump", help=dump_help, description=dump_help)
    dump.add_argument("factory", metavar="MODULE:FACTORY", help=factory_help)
    dump.add_argument(
        "--runner", default=None, help="runner name (default: the one in --options, else v1)"
    )
    dump.add_argument("--options", default=None, help=options_help)
    dump.add_argument("--out", default="fxsplit_dump", help="dump root (default: fxsplit_dump)")
    diff_help = "plan a model under two runners and show what moved between eager and captured"
    diff = commands.add_parser("diff", help=diff_help, description=diff_help)
    diff.add_argument("factory", metavar="MODULE:FACTORY", help=factory_help)
    diff.add_argument(
        "--runner",
        action="append",
        help="runner of plan A, then of plan B (give it twice; default: v1, then v2)",
    )
    diff.add_argument("--options", default=None, help=options_help + " (both plans)")
    diff.add_argument(
        "--nodes",
        action="store_true",
        help="also a table of every moved node (its regions, kind and piece under A and B, "
        "the reasons on each side); by default only the pieces and the moves by region",
    )
    # The default since the node table became --nodes; kept so that scripts passing it still run.
    diff.add_argument("--summary", action="store_true", help=argparse.SUPPRESS)
    cache_parser = commands.add_parser(
        "cache",
        # a help line without hyphens: argparse wraps words at them ("--cache-" / "dir")
        help="show or clear the cache of compiled pieces",
        description="show or clear the cache of compiled pieces (folder: --cache-dir, else "
        "$FXSPLIT_CACHE_DIR, else fxsplit under $XDG_CACHE_HOME or ~/.cache)",
    )
    cache_parser.add_argument(
        "action",
        choices=("info", "clear"),
        help="info: count the compiled pieces and failure markers, and their size; clear: "
        "delete them",
    )
    cache_parser.add_argument("--cache-dir", default=None, help="the cache folder")
    topics = list(commands.choices)
    help_parser = commands.add_parser(
        "help", help="this help, or a command's (fxsplit help demo)", description="show help"
    )
    help_parser.add_argument("topic", nargs="?", choices=topics, help="a command")
    words = sys.argv[1:] if argv is None else argv
    named = next((word for word in words if not word.startswith("-")), None)
    if named is not None and named not in commands.choices:
        parser.error(unknown_command(named, list(commands.choices)))  # exits 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = commands.choices[args.command]
        command.error(unknown_arguments(unknown, _flags(parser) + _flags(command)))  # exits 2
    if args.command == "help":
        (commands.choices[args.topic] if args.topic else parser).print_help()
        return 0
    if args.command == "cache":
        return _cache(args)
    if args.command == "demo" and args.tp is not None:
        if args.tp < 1:
            print(f"fxsplit demo: error: --tp {args.tp}: needs N >= 1", file=sys.stderr)
            return 2
        if args.model is not None:
            print(
                f"fxsplit demo: error: --tp runs the DeepSeek-V4 reference model only; drop "
                f"--model {args.model} (or --tp)",
                file=sys.stderr,
            )
            return 2
        if args.device == "cuda":
            print(
                "fxsplit demo: error: --tp runs on CPU processes (gloo); drop --device cuda "
                "(or --tp)",
                file=sys.stderr,
            )
            return 2
        if args.compile_pieces != "auto":
            print(
                f"fxsplit demo: error: --tp runs its pieces as generated Python on CPU "
                f"processes; drop --compile-pieces {args.compile_pieces} (or --tp)",
                file=sys.stderr,
            )
            return 2
        from fxsplit.tools import tp_demo

        return tp_demo.run(args.tp)
    try:
        if args.command in ("dump", "diff"):
            _check_before_torch(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "dump":
            return _dump(args)
        if args.command == "diff":
            return _diff(args)
    except UsageError as error:
        print(f"fxsplit {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
