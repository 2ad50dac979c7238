"""Weight kernels against the plain reference ``to_float32() @ x.T``, and exact fp16/bf16 widening."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from qwen_runtime.tensors import QType, StoredTensor
from qwen_runtime.weights import F32Weight, TiledWeight, Workspace, f16_bits_to_f32, make_weight


def stored(qtype: QType, w: np.ndarray) -> StoredTensor:
    if qtype == QType.F32:
        data = w.astype(np.float32)
    elif qtype == QType.F16:
        data = w.astype(np.float16)
    elif qtype == QType.BF16:
        data = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0)
    return StoredTensor("w", qtype, w.shape, "mem", data=data)


def test_f16_widening_is_exact_for_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    out = np.empty(bits.shape, np.float32)
    f16_bits_to_f32(bits, out, Workspace(bits.size))
    expected = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])  # incl. -0, subnormals, inf


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0])
@pytest.mark.parametrize("n", [1, 5])
def test_matmul_matches_reference(qtype: QType, n: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (100, 96)).astype(np.float32)
    x = rng.normal(0, 1, (n, 96)).astype(np.float32)
    # 13 rows per tile: several tiles plus a ragged last one
    weight = make_weight(stored(qtype, w), Workspace(13 * 96), tile_elements=13 * 96)
    assert isinstance(weight, F32Weight if qtype == QType.F32 else TiledWeight)
    ref = x @ weight.to_float32().T
    got = weight.matmul(x)
    assert got.shape == (n, 100) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0])
def test_rows_decode_only_requested_rows_exactly(qtype: QType) -> None:
    w = np.random.default_rng(1).normal(0, 0.05, (50, 64)).astype(np.float32)
    weight = make_weight(stored(qtype, w), Workspace())
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(weight.rows(ids), weight.to_float32()[ids])


def test_tiled_weight_keeps_no_float32_copy() -> None:
    w = np.random.default_rng(2).normal(0, 0.05, (4096, 64)).astype(np.float32)
    ws = Workspace(1024)
    weight = make_weight(stored(QType.Q8_0, w), ws, tile_elements=1024)
    weight.matmul(np.ones((1, 64), np.float32))
    assert ws.f32.size == 1024  # the only float32 scratch is one tile
