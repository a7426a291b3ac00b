"""The on-disk cache of compiled pieces, shared by runs and processes.

One file per compiled piece: ``<cache dir>/pieces/<key>.bin``, Inductor's standalone artifact
(``torch._inductor.CompiledArtifact.save(format="binary")``). The key hashes the piece's
canonical code and input layouts (:func:`key`) with everything that changes what Inductor would
emit: the torch and fxsplit versions, Inductor's configuration and the device kind. Entries are
written to a temporary file in the same folder and renamed into place (atomic on POSIX), so a
process never reads a half-written entry; one that fails to load is deleted and recompiled with
one warning. A piece Inductor failed on gets ``<key>.failed`` holding the reason, so later runs
do not try again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

log = logging.getLogger("fxsplit")

ENV = "FXSPLIT_CACHE_DIR"


def cache_dir(option: str | None = None) -> Path:
    """The cache folder: ``option`` (the ``cache_dir`` option), else ``$FXSPLIT_CACHE_DIR``,
    else ``fxsplit`` under the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    if option:
        return Path(option)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxsplit"


def device_kind(device: torch.device | None) -> str:
    """``"cpu"``, ``"cuda-sm90"`` (compute capability) or ``"hip-gfx942"`` (arch name)."""
    if device is None or device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return f"hip-{props.gcnArchName}"
    return f"cuda-sm{props.major}{props.minor}"


def key(code: str, layouts: object, device: str) -> str:
    """The cache key of a piece: sha256 of its canonical code and input layouts, the device
    kind, the global state a compile bakes in (autocast, default dtype, grad mode,
    deterministic algorithms, ...: Dynamo's own global-state guard), the torch and fxsplit
    versions and Inductor's configuration."""
    import torch._inductor.config as inductor_config

    from fxsplit import __version__

    config = inductor_config.save_config_portable()
    versions = (torch.__version__, __version__)
    state = global_state()
    parts = (code, repr(layouts), device, state, *versions, repr(sorted(config.items())))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def global_state() -> str:
    """The global state Dynamo guards on, as its ``GlobalStateGuard`` serialises it, less the
    thread count (a run-time setting, not one a compile depends on)."""
    import json

    state = json.loads(torch._C._dynamo.guards.GlobalStateGuard().__getstate__())
    state.pop("num_threads", None)
    return json.dumps(state, sort_keys=True)


class PieceCache:
    """Compiled pieces on disk under ``root / "pieces"``."""

    def __init__(self, root: Path) -> None:
        self.folder = Path(root) / "pieces"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def load(self, key: str):
        """The artifact stored under ``key``, or None (missing, or unreadable: then deleted with
        one warning, so the caller recompiles and stores it again)."""
        from torch._inductor import CompiledArtifact

        path = self.path(key)
        if not path.exists():
            return None
        try:
            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as error:  # any failure to load is a miss, never a crash
            warn_at_caller(
                f"fxsplit: cached piece {path} could not be loaded ({type(error).__name__}: "
                f"{error}); compiling it again",
                FxsplitRuntimeWarning,
            )
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, artifact) -> bool:
        """Store ``artifact`` under ``key`` atomically; False (logged) when Inductor cannot save
        it (a graph its caches bypass) or the folder is not writable."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if hasattr(artifact, "is_saveable") and not artifact.is_saveable():
                log.info("fxsplit: piece %s is not saveable by Inductor; not cached", key[:12])
                return False
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".bin")
            os.close(fd)
            try:
                artifact.save(path=tmp, format="binary")
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as error:
            log.info("fxsplit: piece %s not cached: %s: %s", key[:12], type(error).__name__, error)
            return False
        return True

    def failure(self, key: str) -> str | None:
        """Why Inductor failed on the piece stored under ``key`` in an earlier run, or None."""
        try:
            return (self.folder / f"{key}.failed").read_text(encoding="utf-8")
        except OSError:
            return None

    def save_failure(self, key: str, reason: str) -> None:
        """Remember that Inductor fails on ``key`` (best effort, atomic)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".failed")
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(reason)
            os.replace(tmp, self.folder / f"{key}.failed")
        except OSError as error:
            log.info("fxsplit: failure of piece %s not cached: %s", key[:12], error)


def info(root: Path) -> tuple[int, int]:
    """(entries, bytes) of the compiled pieces under ``root``."""
    folder = Path(root) / "pieces"
    if not folder.is_dir():
        return 0, 0
    files = [p for p in folder.glob("*.bin") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def clear(root: Path) -> int:
    """Delete every compiled piece under ``root``; returns how many were deleted."""
    count, _ = info(root)
    shutil.rmtree(Path(root) / "pieces", ignore_errors=True)
    return count
