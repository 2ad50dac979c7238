"""Memory limits: the cache and weight estimates are exact, and over-budget generations fail before allocating."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest
from hostile_helpers import FIXTURES
from runtime_helpers import Converted

from qwen_runtime import Model, generate, load, stream
from qwen_runtime import cli as cli_module
from qwen_runtime.backend.cache import KVCache
from qwen_runtime.backend.limits import (
    activation_bytes,
    check_memory,
    default_memory_limit,
    format_bytes,
    parse_memory_size,
)
from qwen_runtime.backend.weights import TiledWeight, weight_overhead
from qwen_runtime.errors import EXIT_CODES, ResourceLimitError
from qwen_runtime.formats.tensors import QType
from qwen_runtime.generation.generate import GenerationConfig
from qwen_runtime.quants.q8_0 import Q8_0Kernel


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny-gqa"])
@pytest.mark.parametrize(("batch", "max_len"), [(1, 1), (3, 17)])
def test_cache_bytes_matches_the_cache(name: str, batch: int, max_len: int) -> None:
    """What the mixers report is what their caches hold, layer by layer and for the whole cache."""
    model = load(FIXTURES / name)
    cache = model.make_cache(batch, max_len)
    assert model.cache_bytes(batch, max_len) == cache.nbytes
    for blk, layer in zip(model.blocks, cache.layers, strict=True):
        assert blk.mixer.cache_size.nbytes(batch, max_len) == layer.nbytes


def test_activation_bytes_grow_with_batch_and_length() -> None:
    config = load(FIXTURES / "qwen3-tiny").config
    base = activation_bytes(config, 1, 64, 256)
    assert activation_bytes(config, 2, 64, 256) > base
    assert activation_bytes(config, 1, 128, 256) > base


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_weight_overhead_is_what_the_weights_keep(converted: Converted, kernels: str) -> None:
    """The numpy Q8_0 kernel keeps its block scales as float32 (4 bytes per 34-byte block); the compiled one
    keeps nothing."""
    model = load(converted("qwen3-tiny", "gguf", "q8_0"), kernels=kernels)
    parts = [model, *model.blocks, *(b.mixer for b in model.blocks), *(b.mlp for b in model.blocks)]
    weights = {id(w): w for part in parts for w in vars(part).values() if isinstance(w, TiledWeight)}
    kept = sum(w.kernel._scales.nbytes for w in weights.values() if isinstance(w.kernel, Q8_0Kernel))
    q8_0 = sum(t.nbytes for t in model.files.tensors.values() if t.qtype == QType.Q8_0)
    expected = q8_0 * 4 // 34 if kernels == "numpy" else 0
    assert weight_overhead(model.files.tensors.values(), kernels) == kept == expected


def test_format_bytes_uses_binary_units() -> None:
    assert [format_bytes(n) for n in (512, 1536, 3 << 29, 5 << 40)] == ["512 B", "1.5 KiB", "1.5 GiB", "5.0 TiB"]
    assert parse_memory_size(format_bytes(3 << 29).replace(" ", "")) == 3 << 29


def test_check_memory() -> None:
    check_memory(10, 10, "x")
    with pytest.raises(ResourceLimitError, match="x needs about 11 B, more than the 10 B allowed"):
        check_memory(11, 10, "x")
    assert default_memory_limit() > 0


@pytest.mark.parametrize(("text", "value"), [("512", 512), ("4K", 4096), ("1.5G", 3 << 29), ("2gib", 2 << 30),
                                             ("3 MB", 3 << 20)])
def test_parse_memory_size(text: str, value: int) -> None:
    assert parse_memory_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "0", "1X", "1e9"])
def test_parse_memory_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(text)


def test_over_budget_generation_fails_before_allocating() -> None:
    model = load(FIXTURES / "qwen3-tiny")
    tracemalloc.start()
    try:
        with pytest.raises(ResourceLimitError, match="generating 64 rows of up to 1003 tokens"):
            generate(model, [[1, 2, 3]] * 64, max_new_tokens=1000, max_memory=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_make_cache_refuses_an_absurd_context() -> None:
    model = load(FIXTURES / "qwen3-tiny")
    with pytest.raises(ResourceLimitError, match="a cache of 1000 rows x 1000000 tokens"):
        model.make_cache(1000, 1_000_000)


def test_cli_max_memory_exit_code() -> None:
    proc = subprocess.run([sys.executable, "-m", "qwen_runtime.cli", str(FIXTURES / "qwen3-tiny"), "-p", "hi",
                           "--max-new-tokens", "4", "--max-memory", "1K"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == EXIT_CODES[ResourceLimitError]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than the 1.0 KiB allowed" in lines[0]


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen35-tiny-gqa"])
def test_the_memory_plan_is_what_a_generation_allocates(name: str) -> None:
    """Issue 44: the plan a generation checks and ``--stats`` prints is the cache ``make_cache`` makes, the
    activation estimate and the mapped bytes of the stored tensors."""
    model = load(FIXTURES / name)
    gen = stream(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, prefill_chunk=8)
    assert (gen.plan.rows, gen.plan.tokens) == (2, 7)
    assert gen.plan.cache == model.make_cache(2, 7).nbytes
    assert gen.plan.activations == activation_bytes(model.config, 2, 7, 8)
    assert gen.plan.weights == sum(t.data.nbytes for t in model.files.tensors.values())
    assert gen.plan.cache_types == model.cache_types


def test_a_context_over_the_limit_is_refused_before_any_cache_is_made(monkeypatch, capsys) -> None:
    """Issue 44: ``--ctx`` filled by ``--max-new-tokens`` beyond ``--max-memory`` exits 6 with one line naming
    the cache at that context, the activations, the limit and what to lower; no cache is ever allocated."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cache was allocated")

    model = load(FIXTURES / "qwen3-tiny")  # loading warms up on a one-token cache: refused from here on
    monkeypatch.setattr(cli_module, "load", lambda *args, **kwargs: model)
    monkeypatch.setattr(Model, "make_cache", refuse)
    monkeypatch.setattr(KVCache, "__init__", refuse)
    code = cli_module.main([str(FIXTURES / "qwen3-tiny"), "-p", "hi", "--ctx", "4096", "--max-new-tokens", "4095",
                            "--max-memory", "1M"])  # "hi" is one token: a full context, and no note
    assert code == EXIT_CODES[ResourceLimitError] == 6
    lines = capsys.readouterr().err.strip().splitlines()
    cache, activations = model.cache_bytes(1, 4096), activation_bytes(model.config, 1, 4096,
                                                                       GenerationConfig.prefill_chunk)
    assert lines == [f"qwen-run: error: generating 1 rows of up to 4096 tokens needs about "
                     f"{format_bytes(cache + activations)} (kv cache {format_bytes(cache)} at 4096 tokens x 1 rows "
                     f"+ activations {format_bytes(activations)}), more than the 1.0 MiB allowed (--max-memory); "
                     f"lower --ctx, --max-new-tokens or --max-batch, or use -ctk/-ctv f16"]


def test_stats_print_the_memory_plan(capsys) -> None:
    """Issue 44: ``qwen-run --stats`` prints weights, the cache at the context and the activations."""
    assert cli_module.main([str(FIXTURES / "qwen3-tiny"), "-p", "hi", "--max-new-tokens", "3", "--stats",
                            "-ctk", "f16"]) == 0
    model = load(FIXTURES / "qwen3-tiny", cache_type_k="f16")
    plan_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memory plan:")]
    assert len(plan_lines) == 1
    tokens = int(plan_lines[0].split(" at ")[1].split()[0])
    weights = sum(t.nbytes for t in model.files.tensors.values())
    activations = activation_bytes(model.config, 1, tokens, GenerationConfig.prefill_chunk)
    assert plan_lines[0] == (f"memory plan: weights {format_bytes(weights)} (mapped), kv cache "
                             f"{format_bytes(model.cache_bytes(1, tokens))} at {tokens} tokens x 1 rows "
                             f"(f16 keys, f32 values), activations {format_bytes(activations)}")
