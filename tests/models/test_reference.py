"""qwen_runtime.models.reference, the plain float64 forward pass: equal to transformers and to the fast path."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from float_error import check_rows, reference64
from runtime_helpers import Converted, fixture_dir, load_exact, reference

import qwen_runtime.models.reference
from qwen_runtime.formats import open_model_files
from qwen_runtime.models.reference import forward

FAMILIES = ("qwen2-tiny", "deepseek-tiny", "qwen3-tiny", "qwen35-tiny", "qwen35-tiny-gqa", "qwen35-vl-tiny")
# Against transformers: its float64 logits (stored, or live), within max(1e-4, the fixture's float32 error bound)
# (float_error.py). Measured: 1.7e-14 for Qwen2/Qwen3/DeepSeek (both float64); ~1e-6 for Qwen3.5, whose stored
# ssm_a = -exp(A_log) was rounded to float32 by the converter. Against the float32 fast path on one file: the
# same bound of the fixture's prompt_2.


@pytest.mark.parametrize("name", FAMILIES)
def test_equals_the_stored_transformers_logits(name: str) -> None:
    files, ref = open_model_files(fixture_dir(name)), reference(name)
    for i in range(3):
        check_rows(forward(files, ref[f"prompt_{i}"]), ref[f"logits64_{i}"], ref[f"bound_{i}"], f"prompt_{i}")


@pytest.mark.parametrize(("fmt", "dtype"), [("hf", "fp32"), ("npy", "fp32"), ("gguf", "fp32"), ("npy", "q8_0"),
                                           ("gguf", "q8_0")])
@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny-gqa"])
def test_equals_the_fast_path_on_the_same_file(name: str, fmt: str, dtype: str, converted: Converted) -> None:
    """Both read the same stored weights (a GGUF's tiled value heads, q8_0 blocks), so they agree to float32."""
    path = converted(name, fmt, dtype)
    ref = reference(name)
    prompt = ref["prompt_2"]
    check_rows(load_exact(path).logits(prompt[None])[0], forward(open_model_files(path), prompt), ref["bound_2"],
               f"{fmt} {dtype}")


@pytest.mark.oracle
@pytest.mark.parametrize("name", FAMILIES)
def test_equals_live_transformers(name: str) -> None:
    pytest.importorskip("torch")
    files = open_model_files(fixture_dir(name))
    prompt = np.random.default_rng(7).integers(0, files.config.vocab_size, 23)
    want, bound = reference64(fixture_dir(name), prompt[None])
    check_rows(forward(files, prompt), want[0], bound[0], "random prompt")


def test_reads_no_cache_tiles_or_threads() -> None:
    """The plain path stays plain: it uses the readers and the config, none of the fast path's machinery."""
    tree = ast.parse(Path(qwen_runtime.models.reference.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint({"cache", "weights", "pool", "models", "quants", "ops"})
