"""The on-disk cache of compiled pieces, shared by runs and processes.

One file per compiled piece, ``<cache dir>/pieces/<key>.bin``: a magic line, a JSON line
(the key, the payload's length and sha256) and Inductor's standalone artifact
(``torch._inductor.CompiledArtifact.save(format="binary")``). The key is
:func:`fxsplit.passes.piece_key.key` (PyTorch's AOTAutograd cache key plus what it leaves out).
A piece Inductor failed on gets ``<key>.failed`` (magic, key, reason), so later runs do not try
again.

Nothing a cache folder holds can crash a compile: every entry is checked against the key it is
loaded for (magic, key, length, digest) before Inductor reads it, and one that is unreadable,
truncated, foreign or holds another key's piece is deleted and compiled again, with one warning
naming it. Entries are written to a temporary file in the same folder and renamed into place
(atomic on POSIX), so processes filling one cache at once never read a half-written entry.

Entries are code that is loaded and run (pickles), so the folders are created private to the
user (mode 0700), entries 0600, and a folder or entry that another user owns or can write is
refused with one warning naming it: the piece is compiled instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from fxsplit.warn import FxsplitRuntimeWarning, warn_at_caller

log = logging.getLogger("fxsplit")

ENV = "FXSPLIT_CACHE_DIR"
PIECES = "pieces"
_MAGIC = b"fxsplit-piece 1\n"
_FAILED_MAGIC = b"fxsplit-failed 1\n"
# Folders and entries already warned about in this process: one warning each.
_WARNED: set[str] = set()


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


def unsafe(status: os.stat_result) -> str | None:
    """Why a file or folder with this ``lstat`` must not be trusted, or None: owned by another
    user, or writable by the group or others."""
    if status.st_uid != os.geteuid():
        return f"it is owned by user id {status.st_uid}, not this user ({os.geteuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users can write it (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def warn_once(what: str, message: str) -> None:
    """One warning per ``what`` (a path) per process."""
    if what not in _WARNED:
        _WARNED.add(what)
        warn_at_caller(message, FxsplitRuntimeWarning)


def private_folder(folder: Path) -> Path | None:
    """``folder``, created private to the user (mode 0700, parents as needed) where missing;
    None, with one warning naming it, where it is not a folder or not safe (:func:`unsafe`)
    or cannot be created."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = folder.lstat()
    except OSError as error:
        warn_once(str(folder), f"fxsplit: cannot use the cache folder {folder} ({error})")
        return None
    problem = unsafe(status) if stat.S_ISDIR(status.st_mode) else "it is not a folder"
    if problem is not None:
        warn_once(
            str(folder),
            f"fxsplit: not using the cache folder {folder}: {problem}. Its entries are code "
            "that fxsplit would load and run; compiling instead. Make it private to you "
            f"(chmod 700 {folder}) or choose another cache_dir.",
        )
        return None
    return folder


class PieceCache:
    """Compiled pieces on disk under ``root / "pieces"``.

    Args:
        root: the cache folder (:func:`cache_dir`).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.folder = self.root / PIECES
        self._usable: bool | None = None

    def usable(self) -> bool:
        """Whether the folders exist (created if not) and are safe (one warning if not)."""
        if self._usable is None:
            self._usable = bool(private_folder(self.root) and private_folder(self.folder))
        return self._usable

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.bin"

    def load(self, key: str):
        """``(artifact, payload)`` stored under ``key`` (the payload: its binary format), or
        None: missing, or not usable (deleted if it is this user's, with one warning naming
        it; the caller compiles and stores it again)."""
        payload = self.payload(key)
        if payload is None:
            return None
        try:
            return load_artifact(payload, self.folder), payload
        except Exception as error:  # Inductor cannot read it: a miss, never a crash
            _discard(self.path(key), f"could not be loaded ({type(error).__name__}: {error})")
            return None

    def payload(self, key: str) -> bytes | None:
        """Inductor's artifact stored under ``key``, checked against it; None where missing or
        not usable (see :meth:`load`)."""
        path = self.path(key)
        if not self.usable():
            return None
        data = _read_private(path)
        return None if data is None else _open_envelope(data, _MAGIC, key, path)

    def save(self, key: str, payload: bytes) -> bool:
        """Store an artifact's ``payload`` (:func:`payload_of`) under ``key`` atomically;
        False (logged) where the folder is not usable or cannot be written."""
        if not self.usable():
            return False
        try:
            _write(self.path(key), _envelope(_MAGIC, key, payload))
        except OSError as error:
            log.info("fxsplit: piece %s not cached: %s", key[:12], error)
            return False
        return True

    def failure(self, key: str) -> str | None:
        """Why Inductor failed on the piece stored under ``key`` in an earlier run, or None
        (no marker, or one that is not usable: deleted with one warning)."""
        path = self.folder / f"{key}.failed"
        if not path.exists() or not self.usable():
            return None
        data = _read_private(path)
        payload = None if data is None else _open_envelope(data, _FAILED_MAGIC, key, path)
        return None if payload is None else payload.decode("utf-8", errors="replace")

    def save_failure(self, key: str, reason: str) -> None:
        """Remember that Inductor fails on ``key`` (best effort, atomic)."""
        if not self.usable():
            return
        try:
            _write(self.folder / f"{key}.failed", _envelope(_FAILED_MAGIC, key, reason.encode()))
        except OSError as error:
            log.info("fxsplit: failure of piece %s not cached: %s", key[:12], error)


def _envelope(magic: bytes, key: str, payload: bytes) -> bytes:
    header = {"key": key, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return magic + json.dumps(header).encode() + b"\n" + payload


def _open_envelope(data: bytes, magic: bytes, key: str, path: Path) -> bytes | None:
    """The payload of an entry read for ``key``; None (entry discarded) where it is foreign,
    truncated, corrupt or holds another key's piece."""
    problem = None
    end = data.find(b"\n", len(magic))
    if not data.startswith(magic):
        problem = "is not an fxsplit cache entry"
    elif end < 0:
        problem = "is truncated"
    else:
        payload = data[end + 1 :]
        try:
            header = json.loads(data[len(magic) : end])
        except ValueError:  # UnicodeDecodeError included
            header = None
        if not isinstance(header, dict):
            problem = "has an unreadable header"
        elif header.get("key") != key:
            problem = f"holds the entry of another key ({str(header.get('key'))[:12]}...)"
        elif len(payload) != header.get("bytes"):
            problem = f"is truncated ({len(payload)} of {header.get('bytes')} bytes)"
        elif hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            problem = "is corrupt (its digest does not match)"
    if problem is not None:
        _discard(path, problem)
        return None
    return payload


def _read_private(path: Path) -> bytes | None:
    """The bytes of an entry, or None: missing, or not safe to load (one warning)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as error:  # a symbolic link (O_NOFOLLOW), no permission, ...
        warn_once(str(path), f"fxsplit: cached piece {path} cannot be read ({error}); compiling")
        return None
    try:
        status = os.fstat(fd)
        problem = unsafe(status) if stat.S_ISREG(status.st_mode) else "it is not a file"
        if problem is not None:
            warn_once(
                str(path),
                f"fxsplit: not loading cached piece {path}: {problem}; compiling it instead",
            )
            return None
        with os.fdopen(fd, "rb", closefd=False) as stream:
            return stream.read()
    finally:
        os.close(fd)


def _discard(path: Path, problem: str) -> None:
    warn_once(str(path), f"fxsplit: cached piece {path} {problem}; compiling it again")
    try:
        if path.lstat().st_uid == os.geteuid():
            path.unlink()
    except OSError:
        pass


def _write(path: Path, data: bytes) -> None:
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(scratch, path)
    except BaseException:
        os.unlink(scratch)
        raise


def payload_of(artifact, folder: Path | None = None) -> bytes | None:
    """Inductor's ``artifact`` in its binary format (``CompiledArtifact.save`` writes paths: a
    private temporary file in ``folder``, else in the system's temporary folder); None (logged)
    where Inductor cannot save it (a graph its caches bypass, an artifact it loaded)."""
    if hasattr(artifact, "is_saveable") and not artifact.is_saveable():
        log.info("fxsplit: a compiled piece is not saveable by Inductor")
        return None
    try:
        with _scratch(folder, b"") as scratch:
            artifact.save(path=scratch, format="binary")
            return Path(scratch).read_bytes()
    except Exception as error:
        log.info(
            "fxsplit: a compiled piece could not be saved: %s: %s", type(error).__name__, error
        )
        return None


def load_artifact(payload: bytes, folder: Path | None = None):
    """Inductor's artifact from its binary format (``CompiledArtifact.load`` reads paths: a
    private temporary file in ``folder``, else in the system's temporary folder)."""
    from torch._inductor import CompiledArtifact

    with _scratch(folder, payload) as scratch:
        return CompiledArtifact.load(path=scratch, format="binary")


@contextlib.contextmanager
def _scratch(folder: Path | None, payload: bytes) -> Iterator[str]:
    """A private temporary file holding ``payload`` (Inductor loads artifacts from paths)."""
    fd, path = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".inductor")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        yield path
    finally:
        os.unlink(path)


def _folder(root: Path) -> Path:
    """``root``'s pieces folder.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` (or its pieces folder) is not a folder, or ``root`` is
            the pieces folder of a cache folder.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no cache folder at {root} (nothing compiled into it yet)")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is a file, not a cache folder")
    folder = root / PIECES
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a folder of compiled pieces")
    if not folder.exists() and any(p.suffix in (".bin", ".failed") for p in root.iterdir()):
        raise NotADirectoryError(
            f"{root} is the folder of compiled pieces inside a cache folder: give its cache "
            f"folder, {root.parent}"
        )
    return folder


def info(root: Path) -> dict[str, int]:
    """What ``root`` holds: ``{"pieces": n, "failures": n, "bytes": n}``.

    Raises:
        FileNotFoundError / NotADirectoryError: ``root`` is missing or not a folder.
    """
    folder = _folder(root)
    files = [
        p
        for p in (folder.iterdir() if folder.is_dir() else ())
        if p.is_file() and not p.name.startswith(".tmp-")
    ]
    return {
        "pieces": sum(p.suffix == ".bin" for p in files),
        "failures": sum(p.suffix == ".failed" for p in files),
        "bytes": sum(p.stat().st_size for p in files),
    }


def clear(root: Path) -> int:
    """Delete the compiled pieces and failure markers under ``root``; returns how many.

    Raises:
        FileNotFoundError / NotADirectoryError: ``root`` is missing or not a folder.
    """
    folder = _folder(root)
    if not folder.is_dir():
        return 0
    count = 0
    for path in folder.iterdir():
        if path.suffix in (".bin", ".failed", ".inductor") and path.is_file():
            count += path.suffix != ".inductor"
            path.unlink()
    return count
