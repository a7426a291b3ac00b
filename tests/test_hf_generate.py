"""transformers' ``generate()`` through fxsplit: ``CompileConfig`` (transformers compiles
``forward`` itself, with a compileable cache) replays, with fxsplit's options given either way
the README shows; compiling the model object compiles nothing ``generate`` runs."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxsplit
from fxsplit import counters
from fxsplit.models import hf_architectures
from tests.timeouts import scaled

if not hf_architectures.available():
    pytest.skip("needs transformers >= 5.8.1", allow_module_level=True)

from transformers import CompileConfig, StaticCache

pytestmark = pytest.mark.usefixtures("fresh_capture_state")

ROOT = Path(__file__).resolve().parent.parent

ARCHITECTURE = "LlamaForCausalLM"
OPTIONS = {"runner": "v2", "capture": "emulate", "input_binding": "copy"}
GENERATE = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model_and_tokens():
    model = hf_architectures.build(ARCHITECTURE)
    prompt = hf_architectures.token_ids(model, 0)[0]
    with torch.no_grad():
        want = model.generate(prompt, cache=_cache(model), **GENERATE)
    return model, prompt, want


def _cache(model) -> StaticCache:
    return StaticCache(config=model.config, max_cache_len=32)


def test_a_backend_deep_copies_to_itself():
    """transformers deep-copies its CompileConfig, backend included, before compiling."""
    backend = fxsplit.Backend(capture="emulate")
    assert copy.deepcopy(backend) is backend
    assert copy.deepcopy({"backend": backend})["backend"] is backend


@pytest.mark.parametrize("way", ["backend object, default mode", "string backend, mode=None"])
def test_generate_compiles_forward_through_compile_config_and_replays(model_and_tokens, way):
    model, prompt, want = model_and_tokens
    model = copy.deepcopy(model)
    backend = fxsplit.Backend(**OPTIONS)
    if way.startswith("backend object"):  # CompileConfig's mode="reduce-overhead" is accepted
        config = CompileConfig(backend=backend)
    else:  # torch refuses options beside a mode
        config = CompileConfig(backend="fxsplit", mode=None, options=OPTIONS)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    model.generation_config.compile_config = config
    with torch.no_grad():
        got = model.generate(prompt, cache=_cache(model), **GENERATE)
    assert torch.equal(got, want)
    snapshot = counters.snapshot()
    assert snapshot["graphs"] >= 1 and snapshot["replays"] > 0, snapshot
    plans = backend.plans if way.startswith("backend object") else fxsplit.plans()
    assert plans and all(p.runner == "v2" for p in plans)


def test_compiling_the_model_object_leaves_generate_uncompiled(model_and_tokens):
    """``generate`` calls the module's own ``forward``, not the compiled wrapper's."""
    model, prompt, want = model_and_tokens
    backend = fxsplit.Backend(**OPTIONS)
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    with torch.no_grad():
        got = compiled.generate(prompt, cache=_cache(model), **GENERATE)
    assert torch.equal(got, want)
    assert backend.plans == [] and counters.snapshot()["graphs"] == 0


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_static_cache_made_in_the_compiled_prefill_is_right_on_every_generate(
    model_and_tokens, runner
):
    """``forward`` compiled (the README's way 1) with a new StaticCache per ``generate()``: the
    cache's tensors are made lazily inside the compiled prefill, so once the prefill is captured
    they are outputs of its graph, stored on the cache object by Dynamo. On torch 2.11 (no
    storage moves) they were handed out over pool memory and poisoned at the first decode step:
    the second ``generate()`` raised (first seen on an H200)."""
    model, prompt, want = model_and_tokens
    model = copy.deepcopy(model)
    backend = fxsplit.Backend(**{**OPTIONS, "runner": runner})
    model.forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        for call in range(3):
            got = model.generate(prompt, cache=_cache(model), **GENERATE)
            assert torch.equal(got, want), call
    assert counters.snapshot()["replays"] > 0


def test_readme_generate_script_says_each_way_matched_eager_and_replayed():
    """The README's ``generate()`` script, run as a user would (a fresh process): its output
    shows that it worked, one line per way (it printed only the counters summed over both)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Hugging Face transformers", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["way 1", "way 2"], done.stdout
    for line in lines:
        said = re.fullmatch(r"way \d: tokens as eager: True; captures (\d+), replays (\d+)", line)
        assert said and int(said.group(2)) > 0, line
    prose = " ".join(section.split())
    assert all(f"`{line}`" in prose for line in lines), (lines, "the README quotes other lines")


@pytest.mark.parametrize("initialised", ["lazily, in the compiled prefill", "before the call"])
def test_a_new_static_cache_per_generate_is_neither_copied_nor_recaptured_under_v1(
    model_and_tokens, initialised
):
    """transformers makes a new StaticCache per ``generate()``. Under v1 the cache writes and
    every op from the cache to attention run eagerly with attention (``cache:<what>``), so no
    captured piece reads or writes the cache: nothing of it is copied in or written back, and a
    new cache captures nothing new (before: the whole cache copied in and back every step when
    made lazily; every piece touching it recaptured on every call when initialised before)."""
    model, prompt, want = model_and_tokens
    model = copy.deepcopy(model)
    backend = fxsplit.Backend(capture="emulate", input_binding="copy", runner="v1")
    model.forward = torch.compile(model.forward, backend=backend)
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads

    def cache() -> StaticCache:
        made = _cache(model)
        if initialised == "before the call":
            made.early_initialization(1, heads, dim, torch.float32, torch.device("cpu"))
        return made

    with torch.no_grad():
        for call in range(4):
            counters.reset()
            got = model.generate(prompt, cache=cache(), **GENERATE)
            assert torch.equal(got, want), call
            if call >= 2:
                snapshot = counters.snapshot()
                assert snapshot["captures"] == 0 and snapshot["recaptures"] == 0, (call, snapshot)
                assert snapshot["replays"] > 0
    copied = {
        name
        for runtime in backend.runtimes
        for piece in runtime.pieces
        for name in piece.stats.copies_by_input
    }
    assert not [name for name in copied if "cache_layers" in name], copied
    decode = backend.plans[-1]
    assert any(r.startswith("cache:cache.layers[0].keys") for p in decode.eager for r in p.reasons)
