"""Every stored type's decoders against gguf-py's, and every tile kernel against its plain reference.

gguf-py's ``quants.dequantize`` (the well-kept Python twin of ggml's C decoders) is the oracle: each type's
plain :meth:`Codec.reference` and fast :meth:`Codec.decode` must give its float32 results bit for bit (NaN
payloads included) on random blocks, on blocks whose float16 scales take extreme values, and on rows of
several blocks; the tile kernels must equal ``x @ reference.T`` up to float32 rounding, serial or pooled.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from qwen_runtime.backend.pool import Workspace
from qwen_runtime.backend.weights import TiledWeight, make_weight
from qwen_runtime.errors import FormatError
from qwen_runtime.formats.tensors import QType, StoredTensor
from qwen_runtime.quants import CODECS, codec, stored_shape, to_float32
from qwen_runtime.quants.scratch import Scratch

QUANTIZED = [q for q, c in CODECS.items() if c.quantized]
# Byte offsets of the float16 fields (scales, minimums) in one block of each type.
F16_FIELDS = {
    QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
    QType.IQ4_NL: (0,), QType.IQ4_XS: (0,),
}
EXTREME_F16 = np.array([0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-14, 65504.0, -65504.0, 1.0, np.inf, -np.inf, np.nan],
                       np.float16)


def random_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Stored rows ``[rows, cols // block * type_size]``: random bytes with finite float16 fields ~ N(0, scale)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, :, at:at + 2] = rng.normal(0, scale, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype == np.float32
    bad = got.view(np.uint32) != expected.view(np.uint32)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(f"{bad.sum()} values differ, first at {tuple(i)}: {got[tuple(i)]!r} != "
                             f"{expected[tuple(i)]!r}")


def decoders(qtype: QType, raw: np.ndarray) -> dict[str, np.ndarray]:
    c = CODECS[qtype]
    n = raw.shape[1] // c.type_size * c.block_size
    return {"reference": c.reference(raw), "fast": c.decode(raw, np.empty((len(raw), n), np.float32), Scratch())}


def test_every_quantized_type_has_gguf_geometry() -> None:
    for qtype in QUANTIZED:
        c = CODECS[qtype]
        assert (c.block_size, c.type_size) == GGML_QUANT_SIZES[qtype]
        if c.npy_dtype is not None:
            assert c.npy_dtype.itemsize == c.type_size


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_decoders_equal_gguf_bit_for_bit_on_random_bytes(qtype: QType) -> None:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(qtype.value).integers(0, 256, (64, 3 * size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # random float16 fields hold inf and NaN
        expected = quants.dequantize(raw, qtype)
        for got in decoders(qtype, raw).values():
            assert_bits_equal(got, expected)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_decoders_equal_gguf_bit_for_bit_with_extreme_scales(qtype: QType) -> None:
    rng = np.random.default_rng(100 + qtype.value)
    fields = F16_FIELDS[qtype]
    raw = random_blocks(qtype, len(EXTREME_F16) ** len(fields), GGML_QUANT_SIZES[qtype][0], rng)
    grids = np.meshgrid(*[EXTREME_F16] * len(fields), indexing="ij")  # every combination of extreme fields
    for at, values in zip(fields, grids, strict=True):
        raw[:, at:at + 2] = values.reshape(-1, 1).view(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = quants.dequantize(raw, qtype)
        for got in decoders(qtype, raw).values():
            assert_bits_equal(got, expected)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.parametrize("blocks", [5, 8])  # 8: neighbouring blocks are moved in groups of whole words
def test_fast_decoder_equals_reference_on_rows_of_many_blocks(qtype: QType, blocks: int) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 37, blocks * block, np.random.default_rng(200 + qtype.value))
    got = decoders(qtype, raw)
    assert_bits_equal(got["fast"], got["reference"])
    assert_bits_equal(to_float32(qtype, raw, chunk_elements=3 * block), got["reference"])  # chunked: same bits


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("blocks", [3, 4, 8])  # blocks per row: single blocks, groups of 2, 4 or 8
def test_tile_kernel_matches_reference_product(qtype: QType, n: int, blocks: int) -> None:
    rng = np.random.default_rng(300 + n)
    cols = blocks * GGML_QUANT_SIZES[qtype][0]
    w = random_blocks(qtype, 70, cols, rng)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    weight = make_weight(StoredTensor("w", qtype, (70, cols), "mem", data=w), Workspace(threads=1), 16 * cols)
    assert isinstance(weight, TiledWeight)
    ref = x @ weight.to_float32().T
    got = weight.matmul(x)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_array_equal(weight.rows(np.array([69, 0, 5])), weight.to_float32()[[69, 0, 5]])


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q5_1, QType.Q4_K, QType.Q6_K, QType.IQ4_XS], ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 12])
def test_pool_gives_the_serial_result(qtype: QType, n: int) -> None:
    rng = np.random.default_rng(400)
    cols = 512
    w = random_blocks(qtype, 320, cols, rng)  # 10 tiles of 32 rows with 1 thread and with 2
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    tensor = StoredTensor("w", qtype, (320, cols), "mem", data=w)
    serial = make_weight(tensor, Workspace(threads=1), tile_elements=32 * cols)
    pooled = make_weight(tensor, Workspace(threads=2), tile_elements=32 * cols)
    np.testing.assert_array_equal(pooled.matmul(x), serial.matmul(x))


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q5_0, QType.Q4_K, QType.Q6_K], ids=lambda q: q.name)
def test_tiled_weight_keeps_no_float32_copy(qtype: QType) -> None:
    rng = np.random.default_rng(500)
    w = random_blocks(qtype, 2048, 256, rng)
    ws = Workspace()
    weight = make_weight(StoredTensor("w", qtype, (2048, 256), "mem", data=w), ws, tile_elements=4096)
    for n in (1, 20):
        weight.matmul(np.ones((n, 256), np.float32))
    for scratch in ws.scratch:  # one tile of float32 per thread, nothing the size of the matrix
        assert sum(size for name, size in scratch.sizes().items()) * 4 < 8 * 4096 * 4


def test_unsupported_types_are_refused_by_name() -> None:
    for qtype in (GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ3_S, GGMLQuantizationType.TQ1_0,
                  GGMLQuantizationType.MXFP4):
        with pytest.raises(FormatError, match=qtype.name):
            codec(qtype)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_row_length_must_be_a_multiple_of_the_block(qtype: QType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    assert stored_shape(qtype, (3, 2 * block)) == (3, 2 * GGML_QUANT_SIZES[qtype][1])
    with pytest.raises(FormatError, match=f"{qtype.name} needs a row length divisible by {block}"):
        stored_shape(qtype, (3, block + 16))
