"""The ``fxsplit`` console script."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fxsplit``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="fxsplit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="compile the reference models and compare against eager")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fxsplit.tools import demo

        return demo.run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
