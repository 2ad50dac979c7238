"""Memory limits: the cache estimate is exact, and over-budget generations fail before allocating."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

import pytest
from hostile_helpers import FIXTURES

from qwen_runtime import generate, load
from qwen_runtime.errors import EXIT_CODES, ResourceLimitError
from qwen_runtime.limits import (
    check_memory,
    default_memory_limit,
    generation_bytes,
    kv_cache_bytes,
    parse_memory_size,
)


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny-gqa"])
@pytest.mark.parametrize(("batch", "max_len"), [(1, 1), (3, 17)])
def test_kv_cache_bytes_matches_the_cache(name: str, batch: int, max_len: int) -> None:
    model = load(FIXTURES / name)
    cache = model.make_cache(batch, max_len)
    assert kv_cache_bytes(model.config, batch, max_len) == cache.nbytes + cache.valid.nbytes


def test_generation_bytes_grows_with_batch_and_length() -> None:
    config = load(FIXTURES / "qwen3-tiny").config
    base = generation_bytes(config, 1, 64, 256)
    assert generation_bytes(config, 2, 64, 256) > base
    assert generation_bytes(config, 1, 128, 256) > base


def test_check_memory() -> None:
    check_memory(10, 10, "x")
    with pytest.raises(ResourceLimitError, match="x needs about 11.0 B, more than the 10.0 B allowed"):
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
