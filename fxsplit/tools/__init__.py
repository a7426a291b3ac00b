"""Command-line tools: ``fxsplit demo`` and friends."""
