"""The cache of compiled pieces: what its key covers (change an ingredient: a recompile; change
nothing: a hit), a store nothing on disk can crash, private folders, and the ``fxsplit cache``
command. Counters say what happened: ``pieces_compiled`` and ``piece_cache_hits``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit import cache, counters
from fxsplit.passes import inductor, piece_key
from fxsplit.tools import cli
from tests.stack import Stack
from tests.timeouts import scaled

pytestmark = [
    pytest.mark.usefixtures("fresh_capture_state"),
    pytest.mark.skipif(
        not piece_key.keys_for_disk(),
        reason=f"torch {torch.__version__} cannot key pieces for the disk (memory only)",
    ),
]

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
ROOT = Path(__file__).resolve().parent.parent


def _run(root, model=None, **options) -> tuple[dict, list[str]]:
    """Compile ``model`` (``Stack(1)``) with Inductor pieces cached under ``root`` in a fresh
    process state (nothing in memory), run it once against eager; returns the counters and
    the warnings raised."""
    inductor.forget()
    torch._dynamo.reset()
    counters.reset()
    model = model if model is not None else Stack(1)
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(root), **options)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    messages = [str(w.message) for w in caught if "fxsplit" in str(w.message)]
    return counters.snapshot(), messages


def _entries(root) -> list[Path]:
    return sorted((Path(root) / cache.PIECES).glob("*.bin"))


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache folder filled by one run of ``Stack(1)`` (two distinct pieces)."""
    root = tmp_path_factory.mktemp("filled")
    found, _ = _run(root)
    assert found["pieces_compiled"] == 2 and len(_entries(root)) == 2
    return root


def _copy(filled, tmp_path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(filled, root)
    return root


def test_warm_run_loads_every_piece_and_compiles_none(filled, tmp_path):
    found, messages = _run(_copy(filled, tmp_path))
    assert (found["pieces_compiled"], found["piece_cache_hits"], messages) == (0, 2, [])


def test_a_piece_served_from_memory_is_stored_in_this_backends_cache_folder_too(filled, tmp_path):
    """Two backends with their own cache folders in one process: the second finds the pieces in
    memory, and must still leave them in its folder for its next process (it did not: a warm
    start there compiled them again; test_inductor's warm-start test failed after this file)."""
    _run(_copy(filled, tmp_path / "first"))  # the pieces are in memory now
    counters.reset()
    torch._dynamo.reset()
    second = tmp_path / "second"
    model = Stack(1)
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(second))
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(torch.randn(3, 8))
    assert counters.snapshot()["piece_cache_hits"] == 2  # from memory
    found, messages = _run(second)  # a new process's view: nothing in memory
    assert (found["pieces_compiled"], found["piece_cache_hits"], messages) == (0, 2, [])


def test_a_failure_known_in_memory_is_marked_in_this_backends_cache_folder_too(
    tmp_path, monkeypatch
):
    attempts = []

    def failing(*args, **kwargs):
        attempts.append(args)
        raise RuntimeError("no lowering")

    monkeypatch.setattr(torch._inductor, "standalone_compile", failing)
    _run(tmp_path / "first")
    assert len(attempts) == 2
    torch._dynamo.reset()
    model = Stack(1)
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(tmp_path / "second"))
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(torch.randn(3, 8))
    assert len(attempts) == 2  # known in memory
    assert cache.info(tmp_path / "second")["failures"] == 2


# ----------------------------------------------------------------------------- the key


class _Cosine(torch._inductor.custom_graph_pass.CustomGraphPass):
    """A post-grad pass that turns every sin into a cos (what a fusion pass engines register
    could do to numbers), with a uuid it is told."""

    def __init__(self, uuid):
        self._uuid = uuid

    def __call__(self, graph):
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.sin.default):
            node.target = torch.ops.aten.cos.default

    def uuid(self):
        return self._uuid


class _Sine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.sin(self.proj(x))


def _with_pass(root, custom):
    with torch._inductor.config.patch(post_grad_custom_post_pass=custom):
        inductor.forget()
        torch._dynamo.reset()
        counters.reset()
        backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(root))
        model = _Sine()
        x = torch.randn(3, 8)
        with torch.no_grad():
            out = torch.compile(model, backend=backend, dynamic=True)(x)
            torch.testing.assert_close(out, torch.cos(model.proj(x)), **TOLERANCE)
    return counters.snapshot()


def test_a_custom_pass_enters_the_key_through_its_uuid(tmp_path):
    assert _with_pass(tmp_path, _Cosine("a"))["pieces_compiled"] == 1
    assert _with_pass(tmp_path, _Cosine("a"))["piece_cache_hits"] == 1  # nothing changed
    assert _with_pass(tmp_path, _Cosine("b"))["pieces_compiled"] == 1  # its uuid changed
    # the pass removed: its artifact must not be served (it computes cos)
    found, _ = _run(tmp_path, _Sine())
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (1, 0)


def test_a_custom_pass_without_uuid_keeps_its_pieces_off_disk(tmp_path):
    assert _with_pass(tmp_path, _Cosine(None))["pieces_compiled"] == 1
    assert _entries(tmp_path) == []
    assert _with_pass(tmp_path, _Cosine(None))["pieces_compiled"] == 1
    found, _ = _run(tmp_path, _Sine())
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (1, 0)


def test_an_inductor_setting_enters_the_key(tmp_path):
    assert _run(tmp_path)[0]["pieces_compiled"] == 2
    with torch._inductor.config.patch(max_fusion_size=32):
        assert _run(tmp_path)[0]["pieces_compiled"] == 2
        assert _run(tmp_path)[0]["piece_cache_hits"] == 2
    assert _run(tmp_path)[0]["piece_cache_hits"] == 2


def _with_rows_up_to(root, most: int) -> dict:
    """``_Sine`` compiled in a fresh process state with its rows marked dynamic in [2, most]:
    the same graph and code, one assumption of Dynamo's shape environment apart."""
    inductor.forget()
    torch._dynamo.reset()
    counters.reset()
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(root))
    model = _Sine()
    x = torch.randn(8, 8)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=most)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x), **TOLERANCE)
    return counters.snapshot()


def test_the_shape_environments_assumptions_enter_the_key(tmp_path):
    """What Dynamo's shape environment assumes of a size (here its value range) enters the key:
    Inductor may simplify with it, and a standalone artifact loads without shape guards, so an
    artifact compiled for rows <= 16 is never served where rows may reach 64."""
    found = _with_rows_up_to(tmp_path, 16)
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (1, 0)
    found = _with_rows_up_to(tmp_path, 64)
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (1, 0)  # another range
    found = _with_rows_up_to(tmp_path, 16)
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (0, 1)  # nothing changed


def test_fxsplits_version_enters_the_key(filled, tmp_path, monkeypatch):
    monkeypatch.setattr(fxsplit, "__version__", fxsplit.__version__ + "+other")
    assert _run(_copy(filled, tmp_path))[0]["pieces_compiled"] == 2


_LIBRARY = torch.library.Library("fxsplit_piece_cache", "DEF")
_LIBRARY.define("affine(Tensor x) -> Tensor")


class _Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.fxsplit_piece_cache.affine(self.proj(x)).relu()


def test_a_user_ops_python_implementation_enters_the_key(tmp_path):
    """A CompositeImplicitAutograd op is a name in the graph Dynamo hands over; what it
    decomposes to changes with its Python code, between runs of the same program."""
    for scale, compiled, hits in ((2.0, 1, 0), (2.0, 0, 1), (3.0, 1, 0)):
        implementation = torch.library.Library("fxsplit_piece_cache", "IMPL")
        implementation.impl("affine", lambda x, s=scale: x * s + 1, "CompositeImplicitAutograd")
        try:
            found, _ = _run(tmp_path, _Affine())  # compares with eager: numbers of this code
        finally:
            implementation._destroy()
        assert (found["pieces_compiled"], found["piece_cache_hits"]) == (compiled, hits)


_LIBRARY.define("widen(Tensor x) -> Tensor")


class _Widen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.fxsplit_piece_cache.widen(self.proj(x)).relu().sum(1)


def test_a_user_ops_fake_kernel_enters_the_key(tmp_path):
    """The fake kernel decides the shapes a piece is compiled for; the graph names the op
    only. Between two runs the op's width changes with its fake kernel: the second run
    compiles (no stale artifact served, which failed at its first call), a third hits."""
    for width, compiled, hits in ((8, 1, 0), (16, 1, 0), (16, 0, 1)):
        implementation = torch.library.Library("fxsplit_piece_cache", "IMPL")
        implementation.impl("widen", lambda x, w=width: x.repeat(1, w // 8), "CPU")
        implementation.impl("widen", lambda x, w=width: x.new_empty(x.shape[0], w), "Meta")
        try:
            found, _ = _run(tmp_path, _Widen())
        finally:
            implementation._destroy()
        assert (found["pieces_compiled"], found["piece_cache_hits"]) == (compiled, hits)


# --------------------------------------------------------------------- a store that holds


def _foreign(data: bytes) -> bytes:
    return b"not an artifact"


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _corrupt(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def _garbled_header(data: bytes) -> bytes:
    return data.replace(b'"key"', b'"\xff\xfe', 1)


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        (_foreign, "is not an fxsplit cache entry"),
        (_truncated, "is truncated"),
        (_corrupt, "is corrupt (its digest does not match)"),
        (_garbled_header, "has an unreadable header"),
        ("swapped", "holds the entry of another key"),
    ],
    ids=["foreign", "truncated", "corrupt", "garbled_header", "swapped"],
)
def test_a_bad_entry_is_recompiled_with_one_warning_naming_it(filled, tmp_path, fault, problem):
    """Each check of an entry against the key it is loaded for refuses it before Inductor
    reads it (a payload Inductor happens to load could compute other numbers)."""
    root = _copy(filled, tmp_path)
    entries = _entries(root)
    contents = [entry.read_bytes() for entry in entries]
    if fault == "swapped":
        contents.reverse()
    else:
        contents = [fault(data) for data in contents]
    for entry, data in zip(entries, contents, strict=True):
        entry.write_bytes(data)
    found, messages = _run(root)
    assert found["pieces_compiled"] == 2
    assert sorted(m.split()[3] for m in messages) == [str(e) for e in entries]
    assert all(problem in m for m in messages), messages
    assert _run(root)[0]["piece_cache_hits"] == 2  # stored again, whole


def test_failure_markers_are_read_as_bytes(filled, tmp_path):
    root = _copy(filled, tmp_path)
    first, second = _entries(root)
    # a marker that is not one of fxsplit's: ignored with a warning, the entry loads
    (root / cache.PIECES / f"{first.stem}.failed").write_bytes(b"\xff\xfe\x00 not text")
    # one of fxsplit's whose reason is not UTF-8: read, the piece stays generated Python
    reason = "Inductor failed: \xff".encode("latin-1")
    marker = cache._envelope(cache._FAILED_MAGIC, second.stem, reason)
    (root / cache.PIECES / f"{second.stem}.failed").write_bytes(marker)
    found, messages = _run(root)
    assert found["piece_cache_hits"] == 1 and found["pieces_compiled"] == 0
    assert len(messages) == 1 and "is not an fxsplit cache entry" in messages[0]


def test_cache_folders_are_private(tmp_path):
    root = tmp_path / "new" / "cache"
    _run(root)
    for folder in (root, root / cache.PIECES):
        assert folder.stat().st_mode & 0o777 == 0o700
    assert {entry.stat().st_mode & 0o777 for entry in _entries(root)} == {0o600}


def test_a_folder_others_can_write_is_refused_with_one_warning(filled, tmp_path):
    root = _copy(filled, tmp_path)
    (root / cache.PIECES).chmod(0o777)
    found, messages = _run(root)
    assert (found["pieces_compiled"], found["piece_cache_hits"]) == (2, 0)
    assert len(messages) == 1 and str(root / cache.PIECES) in messages[0]
    assert "other users can write it" in messages[0]


def test_an_entry_others_can_write_or_own_is_refused(filled, tmp_path):
    root = _copy(filled, tmp_path)
    first, second = _entries(root)
    first.chmod(0o666)
    owner_changed = os.geteuid() == 0
    if owner_changed:  # as root, give the other entry to nobody
        os.chown(second, 65534, 65534)
    found, messages = _run(root)
    assert found["pieces_compiled"] == 1 + owner_changed
    assert any(str(first) in m and "other users can write it" in m for m in messages)
    if owner_changed:
        assert any(str(second) in m and "owned by user id 65534" in m for m in messages)


_FILL = """
import sys, torch, fxsplit
sys.path.insert(0, {root!r})
from tests.stack import Stack
model = Stack(1)
backend = fxsplit.Backend(compile_pieces="inductor", cache_dir={cache!r})
compiled = torch.compile(model, backend=backend, dynamic=True)
x = torch.randn(3, 8)
with torch.no_grad():
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
print(fxsplit.counters.snapshot()["pieces_compiled"])
"""


def test_two_processes_fill_one_cache_at_once(tmp_path):
    root = tmp_path / "shared"
    script = textwrap.dedent(_FILL.format(root=str(ROOT), cache=str(root)))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=scaled(600))
        assert run.returncode == 0, err.decode()[-2000:]
    found, messages = _run(root)
    assert (found["pieces_compiled"], found["piece_cache_hits"], messages) == (0, 2, [])


# ------------------------------------------------------------------------ fxsplit cache


def test_cache_command_reports_and_clears(filled, tmp_path, capsys):
    root = _copy(filled, tmp_path)
    assert cli.main(["cache", "info", "--cache-dir", str(root)]) == 0
    assert "2 compiled pieces, 0 failure markers" in capsys.readouterr().out
    assert cli.main(["cache", "clear", "--cache-dir", str(root)]) == 0
    assert "deleted 2 compiled pieces and failure markers" in capsys.readouterr().out
    assert cache.info(root) == {"pieces": 0, "failures": 0, "bytes": 0}


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_command_on_the_pieces_folder_names_its_cache_folder(
    filled, tmp_path, capsys, action
):
    root = _copy(filled, tmp_path)
    assert cli.main(["cache", action, "--cache-dir", str(root / "pieces")]) == 1
    assert f"give its cache folder, {root}" in capsys.readouterr().err
    assert cache.info(root)["pieces"] == 2


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_command_on_a_file_or_a_missing_folder_says_so(tmp_path, capsys, action):
    file = tmp_path / "a-file"
    file.write_text("x")
    assert cli.main(["cache", action, "--cache-dir", str(file)]) == 1
    assert f"{file} is a file, not a cache folder" in capsys.readouterr().err
    assert file.read_text() == "x"
    missing = tmp_path / "missing"
    assert cli.main(["cache", action, "--cache-dir", str(missing)]) == 1
    assert f"no cache folder at {missing}" in capsys.readouterr().err
    assert not missing.exists()


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    assert cache.cache_dir() == tmp_path
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "fxsplit"
    assert cache.cache_dir("/elsewhere") == cache.cache_dir("/elsewhere")


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_command_before_anything_was_compiled_says_so_and_succeeds(
    tmp_path, capsys, monkeypatch, action
):
    """Found by a newcomer's walkthrough: on a fresh machine ``fxsplit cache info`` failed with
    "no cache folder". The default folder not existing yet is no error (a missing folder given
    with ``--cache-dir`` still is)."""
    missing = tmp_path / "fresh"
    monkeypatch.setenv(cache.ENV, str(missing))
    assert cli.main(["cache", action]) == 0
    assert "0 compiled pieces" in capsys.readouterr().out
    assert not missing.exists()
