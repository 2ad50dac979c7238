"""Several sequences' chunks prefilled in one pass (``Model.prefill_many``): each row is bit for bit its own pass.

The server prefills the prompts that join between two decode steps together; a request's tokens must not depend
on the prompts beside it, so every chunk's logits and cache must be exactly those of ``forward`` on it alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir, use_kernels

import qwen_runtime
from qwen_runtime.models import Model

pytest.importorskip("numba")

# rows of the row kernels (5, 9), of BLAS (33, 35, 70: longer than direct_rows; OpenBLAS sums rows of 33-37 row
# products otherwise than in larger ones), and one token (the compiled step)
LENGTHS = (33, 5, 70, 1, 35, 9)


def check_alone_and_together(model: Model) -> None:
    """The logits of chunks prefilled together equal each chunk's alone, at the start of a sequence and after an
    earlier chunk; so do the next one-token steps (the caches hold the same numbers)."""
    assert model.segments_exact
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    firsts = [rng.integers(0, vocab, n).tolist() for n in LENGTHS]
    seconds = [rng.integers(0, vocab, n).tolist() for n in reversed(LENGTHS)]
    alone = [model.make_cache(1, 200) for _ in LENGTHS]
    together = [model.make_cache(1, 200) for _ in LENGTHS]
    for chunks in (firsts, seconds):
        expected = np.stack([model.forward(np.asarray([c]), cache, last_only=True)[0]
                             for c, cache in zip(chunks, alone, strict=True)])
        np.testing.assert_array_equal(model.prefill_many(chunks, together), expected)
    step = np.asarray([[3]])
    for a, t in zip(alone, together, strict=True):
        np.testing.assert_array_equal(model.forward(step, t, last_only=True), model.forward(step, a, last_only=True))


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_chunks_together_equal_chunks_alone(family: str) -> None:
    check_alone_and_together(use_kernels(qwen_runtime.load(fixture_dir(family), kernels="numba"), "numba"))


def test_q8_0_chunks_together_equal_chunks_alone(converted: Converted) -> None:
    check_alone_and_together(qwen_runtime.load(converted("qwen3-tiny", "gguf", "q8_0"), kernels="numba"))


def test_q8_activation_chunks_together_equal_chunks_alone(converted: Converted) -> None:
    """With 8-bit activations the chunks run together where every product of more rows than the integer kernels
    take is the float kernel's tile and BLAS (AVX2 without AVX-512: both take up to 32 rows); elsewhere (AMX
    prompt tiles, or integer kernels of fewer rows than the float ones) each chunk runs alone.  Either way a
    chunk's logits and cache are its own pass's."""
    from qwen_runtime.backend.kernels.amx import amx_available
    from qwen_runtime.backend.kernels.base import MADDUBS

    model = qwen_runtime.load(converted("qwen3-tiny", "gguf", "q8_0"), kernels="numba", activations="q8")
    assert model.segments_exact == (MADDUBS and not amx_available())
    if model.segments_exact:
        check_alone_and_together(model)
        return
    alone = [model.make_cache(1, 200) for _ in LENGTHS]
    together = [model.make_cache(1, 200) for _ in LENGTHS]
    chunks = [np.random.default_rng(1).integers(0, model.config.vocab_size, n).tolist() for n in LENGTHS]
    expected = np.stack([model.forward(np.asarray([c]), cache, last_only=True)[0]
                         for c, cache in zip(chunks, alone, strict=True)])
    np.testing.assert_array_equal(model.prefill_many(chunks, together), expected)


def test_without_exact_segments_each_chunk_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy kernels cannot segment their products: every chunk is a forward pass of its own."""
    model = qwen_runtime.load(fixture_dir("qwen3-tiny"), kernels="numpy")
    assert not model.segments_exact
    passes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward",
                        lambda ids, cache, **kw: passes.append(ids.shape) or forward(ids, cache, **kw))
    model.prefill_many([[1, 2, 3], [4, 5]], [model.make_cache(1, 8), model.make_cache(1, 8)])
    assert passes == [(1, 3), (1, 2)]
