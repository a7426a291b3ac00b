"""Compiled pieces: Inductor (C++ on this CPU), once per distinct piece, cached across runs."""

from __future__ import annotations

import json

import pytest
import torch

import fxsplit
from fxsplit import counters
from fxsplit.passes import inductor, inductor_startup, piece_key
from tests.stack import Stack
from tests.timeouts import scaled

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}  # fp32: Inductor fuses and reorders reductions


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """One cache folder for the module: Inductor compiles each distinct piece once per run."""
    return tmp_path_factory.mktemp("fxsplit_cache")


def _run(model, cache_root, sizes=(3, 5, 3, 5, 3), **options):
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(cache_root), **options)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    return backend


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_compiled_pieces_equal_eager_and_layers_share_one_compile(cache_root, capture):
    backend = _run(Stack(), cache_root, capture=capture)
    records = backend.compiled[0].compiled_pieces
    assert [r.pieces for r in records] == [("piece_0",), ("piece_2", "piece_4"), ("piece_6",)]
    assert all(r.outcome in ("compiled", "disk", "memory") for r in records)
    snapshot = counters.snapshot()
    assert snapshot["pieces_compiled"] + snapshot["piece_cache_hits"] == 3
    if capture == "emulate":
        assert snapshot["replays"] > 0
    pieces = [p.module for p in backend.compiled[0].pieces]
    assert isinstance(pieces[2].forward, inductor.InductorPiece)
    assert pieces[2].forward.artifact is pieces[4].forward.artifact
    assert not isinstance(pieces[1].forward, inductor.InductorPiece)  # eager pieces stay


def test_plans_do_not_depend_on_compilation(cache_root):
    compiled = _run(Stack(), cache_root, sizes=(3,)).plans[0].format()
    torch._dynamo.reset()  # forgets the backend's plans
    plain = fxsplit.Backend(compile_pieces="eager")
    torch.compile(Stack(), backend=plain, dynamic=True)(torch.randn(3, 8))
    assert compiled == plain.plans[0].format()
    assert plain.compiled[0].compiled_pieces is None


@pytest.mark.skipif(
    not piece_key.keys_for_disk(),
    reason=f"torch {torch.__version__} cannot key pieces for the disk (memory only)",
)
def test_warm_start_compiles_nothing(cache_root):
    _run(Stack(), cache_root, sizes=(3,))  # fills the cache folder (or finds it filled)
    inductor.forget()
    torch._dynamo.reset()
    counters.reset()
    backend = _run(Stack(), cache_root, sizes=(3, 5))
    assert counters.snapshot()["pieces_compiled"] == 0
    assert counters.snapshot()["piece_cache_hits"] == 3
    assert {r.outcome for r in backend.compiled[0].compiled_pieces} == {"disk"}


@torch.library.custom_op("fxsplit_inductortest::write_rows", mutates_args=("cache",))
def _write_rows(cache: torch.Tensor, rows: torch.Tensor) -> None:
    cache[: rows.shape[0]].copy_(rows)


@_write_rows.register_fake
def _(cache, rows):
    return None


class Cached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, kv):
        h = self.proj(x) * 2
        _write_rows(kv, h)
        with fxsplit.region(fxsplit.ATTENTION):
            a = (kv[: x.shape[0]] @ h.t()).softmax(-1)
        return a @ h + kv.sum(0)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_mutating_custom_op_writes_back_from_a_compiled_piece(cache_root, runner):
    model = Cached()
    backend = fxsplit.Backend(
        runner=runner, capture="emulate", compile_pieces="inductor", cache_dir=str(cache_root)
    )
    compiled = torch.compile(model, backend=backend, dynamic=True)
    kv, kv_ref = torch.zeros(8, 8), torch.zeros(8, 8)
    torch._dynamo.mark_static_address(kv)
    x = torch.empty(3, 8)  # a persistent input buffer, as runner v2 hands
    with torch.no_grad():
        for step in range(4):
            x.copy_(torch.randn(3, 8) + step)
            torch.testing.assert_close(compiled(x, kv), model(x, kv_ref), **TOLERANCE)
            torch.testing.assert_close(kv, kv_ref, **TOLERANCE)
    assert counters.snapshot()["replays"] > 0
    assert any(r.outcome != "eager" for r in backend.compiled[0].compiled_pieces)


def test_random_pieces_stay_generated_python(cache_root):
    """Inductor's generator draws other numbers than eager's: a piece that draws random numbers
    keeps its generated Python, so under the same seed every call, captured and replayed, gives
    eager's numbers bit for bit (the numbers drawn reach the output)."""

    def f(x):
        return torch.rand_like(x) + x.sin()

    backend = fxsplit.Backend(
        capture="emulate", eager_regions=[], compile_pieces="inductor", cache_dir=str(cache_root)
    )
    compiled = torch.compile(f, backend=backend)
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(4)
            torch.manual_seed(step)
            want = f(x)
            torch.manual_seed(step)
            assert torch.equal(compiled(x), want), step
    (record,) = backend.compiled[0].compiled_pieces
    assert (record.outcome, record.reason) == (
        "eager",
        "it draws random numbers (Inductor's generator gives other numbers than eager)",
    )
    assert counters.snapshot()["replays"] == 2


def test_auto_compiles_only_on_gpus():
    assert inductor.resolve("auto", None) == "eager"
    assert inductor.resolve("auto", torch.device("cuda", 0)) == "inductor"
    assert inductor.resolve("inductor", None) == "inductor"


def test_bad_compile_pieces_value_is_rejected():
    with pytest.raises(ValueError, match=r"compile_pieces='triton'.*'inductor'"):
        fxsplit.Backend(compile_pieces="triton")


def _counting(fn, calls: list, label: str):
    def run(*args):
        calls.append(label)
        return fn(*args)

    return run


def _count_artifact_calls(forward: inductor.InductorPiece) -> list[str]:
    """Make ``forward``'s artifacts record each call: ``"symbolic"`` or the size compiled for."""
    calls: list[str] = []
    forward.artifact = _counting(forward.artifact, calls, "symbolic")
    forward.sized = {n: _counting(a, calls, str(n)) for n, a in forward.sized.items()}
    return calls


def test_compile_sizes_get_their_own_compile_used_on_calls_of_that_size(cache_root):
    model = Stack(2)
    backend = fxsplit.Backend(
        compile_pieces="inductor", compile_sizes=[4], cache_dir=str(cache_root), capture="emulate"
    )
    compiled = torch.compile(model, backend=backend, dynamic=True)
    sizes = (3, 4, 3, 4, 4, 5)  # after the first: warm-up, capture and replays of 4 and 3
    with torch.no_grad():
        x = torch.randn(sizes[0], 8)
        torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)  # compiles
        pieces = [p.module for p in backend.compiled[0].pieces]
        sized = [p.forward for p in pieces if isinstance(p.forward, inductor.InductorPiece)]
        assert sized and all(set(f.sized) == {4} for f in sized)
        assert all(f.sized[4] is not f.artifact for f in sized)
        calls = [_count_artifact_calls(f) for f in sized]
        for n in sizes[1:]:
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    assert counters.snapshot()["replays"] > 0
    expected = ["4" if n == 4 else "symbolic" for n in sizes[1:]]  # replays call them too
    assert calls == [expected] * len(sized)


def test_bad_compile_sizes_are_rejected():
    with pytest.raises(ValueError, match="compile_sizes holds -1"):
        fxsplit.Backend(compile_sizes=[-1])
    assert fxsplit.Backend(compile_sizes=[]).config.compile_sizes == ()


def test_dump_lists_compiled_pieces_and_their_code(cache_root, tmp_path):
    pytest.importorskip("graphviz")  # a dump draws the split
    inductor.forget()  # compiled in this process, so Inductor's code is at hand
    _run(Stack(), cache_root, sizes=(3,), dump_dir=str(tmp_path))
    (folder,) = tmp_path.iterdir()
    records = json.loads((folder / "compiled.json").read_text())
    assert [r["pieces"] for r in records] == [["piece_0"], ["piece_2", "piece_4"], ["piece_6"]]
    assert "same code: piece_1 = piece_3 = piece_5" in (folder / "plan.txt").read_text()
    report = (folder / "report.html").read_text()
    assert "Compiled pieces" in report and "piece_2 = piece_4" in report
    for record in records:
        if record["outcome"] == "compiled" and record["code_file"]:
            assert (folder / record["code_file"]).read_text()


# --------------------------------------------------------------------------- regressions


def test_compile_sizes_never_freeze_another_host_value(cache_root):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, n):
            return self.proj(x) * n + n

    model = Scaled()
    backend = fxsplit.Backend(
        compile_pieces="inductor",
        compile_sizes=[4],
        cache_dir=str(cache_root),
        capture="off",
        eager_regions=[],  # the model has none
    )
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for batch, n in [(3, 2), (4, 3), (4, 5), (5, 2), (4, 11)]:
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x, n), model(x, n), **TOLERANCE)
    (forward,) = (
        p.forward
        for p in (each.module for each in backend.compiled[0].pieces)
        if isinstance(p.forward, inductor.InductorPiece)
    )
    assert not forward.sized  # the piece reads n besides the token count: symbolic only


def _scaler(c):
    @torch._dynamo.allow_in_graph
    def scale(x):
        return x * c

    return scale


class _ClosureLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scale = _scaler(c)

    def forward(self, x):
        return torch.sin(self.scale(self.proj(x)))


def test_functions_of_one_name_but_other_objects_never_share_an_artifact(cache_root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ClosureLayer(2.0), _ClosureLayer(3.0))
    backend = fxsplit.Backend(
        compile_pieces="inductor",
        splitting_ops=["aten::sin"],
        cache_dir=str(cache_root),
        capture="off",
    )
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for batch in (3, 4):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    records = backend.compiled[0].compiled_pieces
    assert [(r.pieces, r.outcome) for r in records] == [
        (("piece_0",), "compiled"),
        (("piece_2",), "compiled"),
    ]
    pieces = [p.module for p in backend.compiled[0].pieces]
    assert pieces[0].forward.artifact is not pieces[2].forward.artifact


def test_an_artifact_compiled_under_autocast_is_not_reused_without_it(cache_root):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(cache_root), capture="off")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(4, 64)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert compiled(x).dtype == torch.bfloat16
        out = compiled(x)
    assert out.dtype == torch.float32
    records = [r for split in backend.compiled for r in split.compiled_pieces]
    assert len(records) == 2 and all(r.outcome in ("compiled", "disk", "memory") for r in records)
    assert records[0].key != records[1].key
    torch.testing.assert_close(out, model(x), **TOLERANCE)


class _Halves(torch.nn.Module):
    """Both halves of a split, and a slice of what they split, leave the first piece (read by
    an eager region): outputs that share storage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, n):
        h = self.proj(x) * n
        a, b = h.split([3, 5], dim=-1)
        r = h[1:]
        with fxsplit.region(fxsplit.ATTENTION):
            y = a.sum(-1, keepdim=True) * b + r.mean()
        return torch.sin(y) * n


@pytest.mark.parametrize("capture", ["emulate", "off"])
def test_outputs_viewing_one_another_compile_with_their_views_as_python(cache_root, capture):
    model = _Halves()
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(cache_root), capture=capture)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for batch, n in [(2, 2), (3, 3), (3, 3), (2, 3), (3, 3)]:
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x, n), model(x, n), **TOLERANCE)
    first = backend.compiled[0].compiled_pieces[0]
    assert first.outcome != "eager", first.reason
    assert backend.plans[0].pieces[0].outputs == ("a", "b", "r")
    if capture == "emulate":
        assert counters.snapshot()["replays"] > 0


class _Sliced(torch.nn.Module):
    """``h`` and its view ``r`` leave the first piece; an eager op writes through ``r``, and
    the next piece reads ``h``. With ``inside``, the first piece reads ``r`` too."""

    def __init__(self, inside: bool):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.inside = inside

    def forward(self, x, n):
        h = self.proj(x) * n
        r = h[1:]
        t = r * 2 if self.inside else h
        r.add_(1.0)  # eager (a splitting op)
        return torch.sin(h) * n + t.sum()


@pytest.mark.parametrize("inside", [False, True])
def test_a_write_through_an_output_view_reaches_its_base(cache_root, inside):
    """The view tail makes ``r`` a view of the compiled ``h``, so the write reaches ``h``; a
    view the piece itself reads is no tail: its outputs share storage, it stays Python."""
    model = _Sliced(inside)
    backend = fxsplit.Backend(
        compile_pieces="inductor",
        splitting_ops=["aten::add_"],
        cache_dir=str(cache_root),
        capture="emulate",
    )
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for batch, n in [(2, 2), (2, 3), (3, 3), (3, 3), (3, 3)]:
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x, n), model(x, n), **TOLERANCE)
    assert counters.snapshot()["replays"] > 0
    first = backend.compiled[0].compiled_pieces[0]
    if inside:
        assert first.outcome == "eager" and "share storage" in first.reason
    else:
        assert first.outcome != "eager", first.reason


def test_a_piece_reading_a_tensor_before_its_layout_changes_in_place_stays_python(cache_root):
    """Dynamo's fake tensor changes with an in-place layout change (``as_strided_``), so a
    piece that reads the tensor before it holds the later layout as its example: compiled,
    Inductor's own stride check raised at the first call. Such a piece keeps its generated
    Python, the pieces that do not touch the tensor stay compiled, and every call replays
    eager's numbers."""

    def f(x):
        h = x * 2 + 1  # captured (piece_0)
        k = x * 0.5
        k.t_()  # eager: a boundary between h's piece and the next
        g = h.sin() * 3 + k.t()  # captured (piece_2): reads h row-major
        h.as_strided_((3, 5), (1, 3))  # eager: h read column-major from here on
        return (h + g).cos(), x.relu() * 2

    backend = fxsplit.Backend(
        capture="emulate", eager_regions=[], compile_pieces="inductor", cache_dir=str(cache_root)
    )
    compiled = torch.compile(f, backend=backend, dynamic=False)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 5)
            for got, want in zip(compiled(x), f(x), strict=True):
                torch.testing.assert_close(got, want, **TOLERANCE)
    records = backend.compiled[0].compiled_pieces
    relaid = [r for r in records if "layout changes in place" in (r.reason or "")]
    assert relaid and all(r.outcome == "eager" for r in relaid), [
        (r.outcome, r.reason) for r in records
    ]
    assert any(r.outcome != "eager" for r in records), [(r.outcome, r.reason) for r in records]
    assert counters.snapshot()["replays"] > 0


# ------------------------------------------------------------------------------- floats


class _Scaled(torch.nn.Module):
    """A float argument (``scale``) next to floats constant for the frame (the norm's
    ``eps``, ``self.shift``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.RMSNorm(8, eps=1e-5)
        self.shift = 0.25

    def forward(self, x, scale: float):
        h = self.norm(self.proj(x)) * scale + self.shift
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return torch.sin(h * scale)


def _compile_spy(monkeypatch) -> list:
    calls = []
    original = inductor.compile_pieces

    def spy(split, *args, **kwargs):
        calls.append(split.plan.graph_id)
        return original(split, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_pieces", spy)
    return calls


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_float_argument_keeps_its_pieces_compiled_across_values(cache_root, monkeypatch, dynamic):
    calls = _compile_spy(monkeypatch)
    model = _Scaled()
    backend = fxsplit.Backend(
        compile_pieces="inductor", capture="emulate", cache_dir=str(cache_root)
    )
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    x = torch.randn(4, 8)
    # a host float is a capture key part: every value a capture of its own, which the replay
    # watch says, with the fix
    advice = "scale .*changed every time.* pass the float as a 0-dim tensor"
    with torch.no_grad(), pytest.warns(fxsplit.FxsplitRuntimeWarning, match=advice):
        for i in range(20):
            scale = 0.5 + 0.1 * i
            torch.testing.assert_close(compiled(x, scale), model(x, scale), **TOLERANCE)
    # dynamic=None: one graph for the first value, one with the float symbolic; each traced
    # once (constant floats need no retrace), its pieces all compiled
    graphs = 2 if dynamic is None else 1
    assert len(calls) == len(backend.compiled) == graphs
    assert counters.snapshot()["uncaptured_runs"] == 40  # each value a capture key of its own
    for split in backend.compiled:
        assert {r.outcome for r in split.compiled_pieces} <= {"compiled", "memory", "disk"}
    last = backend.compiled[-1].pieces[0].module.forward
    assert isinstance(last, inductor.InductorPiece) and last.inputs.floats


def test_a_constant_float_is_baked_in_and_guarded(cache_root, monkeypatch):
    calls = _compile_spy(monkeypatch)
    model = _Scaled()
    backend = fxsplit.Backend(compile_pieces="inductor", capture="off", cache_dir=str(cache_root))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, 0.5), model(x, 0.5), **TOLERANCE)
        model.shift = 2.0  # fails the guard on the baked-in value: a new graph
        torch.testing.assert_close(compiled(x, 0.5), model(x, 0.5), **TOLERANCE)
    assert len(calls) == len(backend.compiled) == 2


class _Clamped(torch.nn.Module):
    """A float argument used where AOTAutograd cannot turn it into tensor arithmetic (a
    clamp bound)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, limit: float):
        h = torch.clamp(self.proj(x), max=limit)
        with fxsplit.region(fxsplit.ATTENTION):
            h = h.softmax(-1)
        return torch.sin(h)


def test_a_float_argument_inductor_cannot_take_leaves_its_piece_python(cache_root):
    model = _Clamped()
    backend = fxsplit.Backend(compile_pieces="inductor", capture="off", cache_dir=str(cache_root))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for limit in (0.1, 0.2, 0.3):
            torch.testing.assert_close(compiled(x, limit), model(x, limit), **TOLERANCE)
    assert len(backend.compiled) == 1
    first, last = backend.compiled[0].compiled_pieces
    assert first.outcome == "eager" and "float argument L['limit'] reaches" in first.reason
    assert last.outcome in ("compiled", "memory", "disk")


def _isa_checks_cleared():
    """Forget Inductor's answers about the CPU's instruction sets (cached per process)."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    classes = [cpu_vec_isa.VecISA]
    for cls in classes:
        classes += cls.__subclasses__()
        for method in vars(cls).values():
            if hasattr(method, "cache_clear"):
                method.cache_clear()


def test_the_background_isa_check_asks_what_inductor_asks_once_each(monkeypatch):
    from torch._inductor import cpu_vec_isa

    builds = []
    check_build = cpu_vec_isa.VecISA.check_build

    def counted(self, code):
        builds.append((str(self), code))
        return check_build(self, code)

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", counted)
    _isa_checks_cleared()
    alone = list(map(str, cpu_vec_isa.valid_vec_isa_list()))
    asked, builds[:] = sorted(builds), []
    _isa_checks_cleared()
    monkeypatch.setattr(inductor_startup, "_ISA_CHECK", None)
    inductor_startup.prepare(torch.device("cuda"))  # GPU pieces build no CPU kernels
    assert inductor_startup._ISA_CHECK is None
    inductor_startup.prepare(None)
    inductor_startup.ready()
    assert not inductor_startup._ISA_CHECK.is_alive()
    assert list(map(str, cpu_vec_isa.valid_vec_isa_list())) == alone
    assert sorted(builds) == asked


def test_inductor_warms_up_once_in_the_background(monkeypatch):
    import sys

    monkeypatch.setattr(inductor_startup, "_WARM", None)
    inductor_startup.warm()
    thread = inductor_startup._WARM
    inductor_startup.warm()
    assert inductor_startup._WARM is thread
    inductor_startup.warmed()
    assert not thread.is_alive() and "torch._inductor.compile_fx" in sys.modules


def test_a_process_ending_while_inductor_warms_up_ends_cleanly():
    """A process that exits right after loading a precompiled graph (its background import of
    Inductor still running) prints no traceback from that thread."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from fxsplit.passes import inductor_startup\n"
        "inductor_startup.warm()\n"
        "sys.exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


class _TwoBases(torch.nn.Module):
    """Two values each split in halves at the end of the first piece, the halves read by an
    eager region: the compiled graph returns both bases, ``g`` then ``h``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.gate = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        g = self.gate(x)
        h = self.up(x)
        a, b = g.split([3, 5], dim=-1)
        c, d = h.split([3, 5], dim=-1)
        with fxsplit.region(fxsplit.ATTENTION):
            y = a.sum(-1, keepdim=True) * b + c.sum(-1, keepdim=True) * d
        return torch.sin(y)


class _Reversed(set):
    """A set iterated in the reverse of the graph order: what hashing by address may give."""

    def __init__(self, nodes, order):
        super().__init__(nodes)
        self._order = [n for n in reversed(order) if n in nodes]

    def __iter__(self):
        return iter(self._order)


def test_the_bases_a_view_tail_reads_are_returned_in_graph_order(cache_root, monkeypatch):
    """The compiled graph's outputs (and so its cache key) never follow a set's order, which
    changes between processes: a warm start compiled a DeepSeek-V4 piece again."""
    from fxsplit.passes import piece_graph

    view_tail = piece_graph._view_tail
    monkeypatch.setattr(piece_graph, "_view_tail", lambda nodes: _Reversed(view_tail(nodes), nodes))
    built = []
    build = piece_graph.build
    monkeypatch.setattr(
        piece_graph, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1]
    )
    model = _TwoBases()
    backend = fxsplit.Backend(compile_pieces="inductor", cache_dir=str(cache_root), capture="off")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(compiled(x), model(x), **TOLERANCE)
    first = built[0].graph_module.graph
    (output,) = [n for n in first.nodes if n.op == "output"]
    order = {n: i for i, n in enumerate(first.nodes)}
    returned = [order[n] for n in output.args[0]]
    assert returned == sorted(returned), first.python_code("self").src
