"""The serving engine without HTTP: ragged slot rows with row-invariant decoding give every row the logits it
would get alone, bit for bit, in every family and stored type; rows move and copy without changing them."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir, use_kernels

import qwen_runtime
from qwen_runtime.models import Model

SlotCache = pytest.importorskip("qwen_serve.slots", reason="qwen_serve needs the serve extra").SlotCache


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    return Converted(tmp_path_factory.mktemp("serve-converted"))


def decode_logits(model: Model, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Prefill each prompt in a row of its own, then decode all rows together greedily.  # -> [steps, B, V]"""
    slots = SlotCache(model, len(prompts), 64)
    tokens = []
    for i, prompt in enumerate(prompts):
        slots.reset(i)
        logits = model.forward(np.asarray([prompt]), slots.rows(i, i + 1), last_only=True)
        tokens.append(int(np.argmax(logits[0])))
    out = []
    ws = model.lm_head.ws
    for _ in range(steps):
        with ws.rowwise():
            logits = model.forward(np.asarray(tokens)[:, None], slots.rows(0, len(prompts)), last_only=True)
        out.append(logits)
        tokens = np.argmax(logits, axis=1).tolist()
    return np.stack(out)


@pytest.mark.parametrize(("family", "fmt", "dtype", "kernels"), [
    ("qwen3-tiny", "hf", "fp32", "numpy"), ("qwen2-tiny", "gguf", "q8_0", "numpy"),
    ("qwen35-tiny", "hf", "fp32", "numpy"), ("qwen35-tiny-gqa", "gguf", "q8_0", "numpy"),
    ("qwen3-tiny", "gguf", "fp16", "numpy"), ("qwen2-tiny", "gguf", "q8_0", "numba"),
    ("qwen35-tiny-gqa", "gguf", "q8_0", "numba"),
])
def test_a_row_decodes_the_same_alone_and_among_others(converted: Converted, family: str, fmt: str,
                                                       dtype: str, kernels: str) -> None:
    model = use_kernels(qwen_runtime.load(converted.get(family, fmt, dtype)), kernels)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, int(rng.integers(2, 30))).tolist() for _ in range(9)]
    together = decode_logits(model, prompts, 6)
    for i in (0, 4, 8):
        alone = decode_logits(model, [prompts[i]], 6)
        assert np.array_equal(together[:, i], alone[:, 0]), f"row {i} differs"
    # a row's result matches the plain (slot-aligned) generation loop up to float32 rounding
    [result] = qwen_runtime.generate(model, [prompts[0]], max_new_tokens=7)
    assert np.argmax(together[:, 0], axis=1).tolist() == result.token_ids[1:]


def test_moved_and_copied_rows_continue_unchanged() -> None:
    model = qwen_runtime.load(fixture_dir("qwen35-tiny"))
    slots = SlotCache(model, 4, 32)
    ids = np.asarray([[5, 9, 200, 31]])
    slots.reset(2)
    model.forward(ids, slots.rows(2, 3), last_only=True)
    slots.copy(2, 0)
    slots.move(2, 1)
    assert slots.lengths.tolist() == [4, 4, 0, 0]
    with model.lm_head.ws.rowwise():
        logits = model.forward(np.asarray([[7], [7]]), slots.rows(0, 2), last_only=True)
    reference = model.logits(np.asarray([[5, 9, 200, 31, 7]]))[0, -1]
    assert np.array_equal(logits[0], logits[1])
    np.testing.assert_allclose(logits[0], reference, atol=1e-4)
    with pytest.raises(ValueError, match="overflow"):
        model.forward(np.zeros((2, 30), np.int64), slots.rows(0, 2))
