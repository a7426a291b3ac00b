"""Where fxsplit's warnings point: the file and source line each one names."""

from __future__ import annotations

import linecache
import os

import fxsplit


def warned_at(records) -> list[tuple[str, str]]:
    """``(file name, stripped source line)`` of each fxsplit warning in ``records`` (a
    ``pytest.warns`` or ``warnings.catch_warnings(record=True)`` list), in order."""
    return [
        (os.path.basename(w.filename), linecache.getline(w.filename, w.lineno).strip())
        for w in records
        if issubclass(w.category, fxsplit.FxsplitWarning)
    ]
