"""The installed package imports from any folder, even one holding a clone named ``fxsplit``
(which Python would otherwise import as an empty namespace package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_from_a_folder_holding_a_folder_named_fxsplit(tmp_path):
    (tmp_path / "fxsplit").mkdir()  # what `git clone ... fxsplit` leaves in the parent folder
    done = subprocess.run(
        [sys.executable, "-c", "import fxsplit; print(fxsplit.__file__); fxsplit.counters"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.parent == REPO
