"""qwen_runtime.reference, the plain float64 forward pass: equal to transformers and to the fast path."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir, reference

import qwen_runtime.reference
from qwen_runtime import load
from qwen_runtime.formats import open_model_files
from qwen_runtime.reference import forward

FAMILIES = ("qwen2-tiny", "deepseek-tiny", "qwen3-tiny", "qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny")
TOL = 1e-4  # float64 here against float32 transformers or the float32 fast path (measured <= 4e-5)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    return Converted(tmp_path_factory.mktemp("converted"))


@pytest.mark.parametrize("name", FAMILIES)
def test_equals_the_stored_transformers_logits(name: str) -> None:
    files, ref = open_model_files(fixture_dir(name)), reference(name)
    for i in range(3):
        np.testing.assert_allclose(forward(files, ref[f"prompt_{i}"]), ref[f"logits_{i}"], atol=TOL, rtol=0)


@pytest.mark.parametrize(("fmt", "dtype"), [("hf", "fp32"), ("npy", "fp32"), ("gguf", "fp32"), ("npy", "q8_0"),
                                           ("gguf", "q8_0")])
@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny-gqa"])
def test_equals_the_fast_path_on_the_same_file(name: str, fmt: str, dtype: str, converted: Converted) -> None:
    """Both read the same stored weights (a GGUF's tiled value heads, q8_0 blocks), so they agree to float32."""
    path = converted.get(name, fmt, dtype)
    prompt = reference(name)["prompt_2"]
    np.testing.assert_allclose(forward(open_model_files(path), prompt), load(path).logits(prompt[None])[0],
                               atol=TOL, rtol=0)


@pytest.mark.oracle
@pytest.mark.parametrize("name", FAMILIES)
def test_equals_live_transformers(name: str) -> None:
    pytest.importorskip("torch")
    from hf_oracle import hf_logits

    files = open_model_files(fixture_dir(name))
    prompt = np.random.default_rng(7).integers(0, files.config.vocab_size, 23)
    np.testing.assert_allclose(forward(files, prompt), hf_logits(fixture_dir(name), prompt[None])[0], atol=TOL, rtol=0)


def test_reads_no_cache_tiles_or_threads() -> None:
    """The plain path stays plain: it uses the readers and the config, none of the fast path's machinery."""
    tree = ast.parse(Path(qwen_runtime.reference.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint({"cache", "weights", "pool", "models", "quants", "ops"})
