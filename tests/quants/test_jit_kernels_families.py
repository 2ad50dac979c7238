"""The compiled kernels of F32, F16, BF16, the legacy types (Q4_0, Q4_1, Q5_0, Q5_1) and IQ4 (IQ4_NL, IQ4_XS)
against each codec's plain reference decoder.

Error model of a product row (``jit_legacy``, ``jit_iq4``, ``jit_dense``), with ``exact`` the float64 product
of the reference decoder's float32 weights and ``eps`` float32's:

- a term ``fma(w, x, acc)`` multiplies the weight ``w = s * q`` (``s`` the block or sub-block scale; 1 for dense
  types), which the kernel forms exactly, as the reference stores it, and rounds once (the fused add); each of
  the 32 lanes adds its ``L`` terms in order (L = n / 32 blocks, or chunks of 32 columns plus the tail), the
  lanes are summed by a 5-level pairwise tree and, for the types with a minimum, the minimums' sum is added (1):
  a term meets at most ``L + 6`` roundings, so ``|got - exact| <= (L + 6) * eps * sum |x| |w|`` (first order;
  gamma_k);
- Q4_1 and Q5_1 (``w = d * q + m``) apply ``m`` to block sums of ``x`` (at most 31 additions each, one fused
  add per block into the minimum's accumulator, then the final add: at most ``31 + L + 1`` roundings), and
  their reference rounds ``d * q + m`` once more: ``|w|`` becomes ``|d q| + |m|`` and the count ``L + 34``;
- decoded tiles (more rows than ``direct_rows``) are bit-exact, then BLAS sums ``n`` products in some order:
  ``(n + 2) * eps``.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen_runtime.backend.kernels import jit_kernel, kernel_table
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.backend.weights import make_weight
from qwen_runtime.errors import FormatError
from qwen_runtime.formats.tensors import StoredTensor
from qwen_runtime.quants import QType, codec
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels.base import GEMV_ROWS  # noqa: E402 (numba is needed from here on)

EPS32 = float(np.finfo(np.float32).eps)
TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.IQ4_XS)
MINIMUM = {QType.Q4_1: 2, QType.Q5_1: 2}  # byte of each block's float16 minimum
# float16 edge values for scales and minimums: zeros of both signs, subnormals, the largest, a small normal.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF, 0x1C00, 0x9C00], np.uint16)
EDGE_BF16 = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x5F7F, 0xDF7F], np.uint16)  # ±0, subnormals, ±1.8e19
EDGE_F32 = np.array([0.0, -0.0, 1e-40, -1e-45, 1.8e19, -1.8e19], np.float32)  # the same for F32


def test_every_type_of_this_file_is_registered() -> None:
    assert set(TYPES) <= set(kernel_table()["float"])


def test_the_kernel_table_holds_each_family_once() -> None:
    """Each family module lists its kernels once (``KERNELS``), so the table holds every kernel class under its own
    type (no family's list overwrote another's), and each reads the bytes of that type's blocks."""
    from qwen_runtime.backend.kernels import (
        amx,
        amx_blocks,
        amx_k,
        dense,
        int8,
        int8_k,
        iq4,
        kquants,
        lattice,
        lattice_int8,
        legacy,
        q8_0,
    )

    families = {"float": (dense, q8_0, legacy, kquants, iq4, lattice), "q8": (int8, int8_k, lattice_int8),
                "q8-prompts": (amx, amx_blocks, amx_k)}
    table = kernel_table()
    for form, modules in families.items():
        listed = [kernel for module in modules for kernel in module.KERNELS]
        assert len(table[form]) == len(listed) and set(table[form].values()) == set(listed), form
        for qtype, kernel in table[form].items():
            assert kernel.qtype == qtype
            if qtype not in (QType.F32, QType.F16, QType.BF16):
                assert kernel.type_size == codec(qtype).type_size, (form, qtype)
    assert len(table["float"]) == 23 and set(table["q8-prompts"]) <= set(table["q8"]) <= set(table["float"])


def columns(qtype: QType) -> int:
    """A row length of several blocks (IQ4_XS: 256 per block); dense rows not a multiple of 32."""
    return {QType.F32: 301, QType.F16: 301, QType.BF16: 301, QType.IQ4_XS: 768}.get(qtype, 320)


def random_rows(qtype: QType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Stored rows: random bytes (every quant value), float16 scales and minimums mostly ~1e-3 with 15% edge
    values, a block of all-zero and one of all-one quant bytes in every row (±max quants); dense weights
    normal with 5% edge values."""
    rng = np.random.default_rng(seed)
    c = codec(qtype)
    if not c.quantized:
        w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        if qtype == QType.F32:
            picks = rng.random(w.shape) < 0.05
            w[picks] = rng.choice(EDGE_F32, int(picks.sum()))
            return w
        bits = w.astype(np.float16).view(np.uint16) if qtype == QType.F16 else (w.view(np.uint32) >> 16)
        bits = bits.astype(np.uint16)
        picks = rng.random(bits.shape) < 0.05
        bits[picks] = rng.choice(EDGE_F16 if qtype == QType.F16 else EDGE_BF16, int(picks.sum()))
        return bits.view(np.float16) if qtype == QType.F16 else bits
    raw = rng.integers(0, 256, (rows, cols // c.block_size * c.type_size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, c.type_size)
    blocks[:, 0, 2:] = 0
    blocks[:, 1, 2:] = 255
    for at in (0, *([MINIMUM[qtype]] if qtype in MINIMUM else ())):
        scale = np.float16(rng.uniform(2e-4, 2e-3, blocks.shape[:2])) * rng.choice([-1, 1], blocks.shape[:2])
        bits = scale.astype(np.float16).view(np.uint16)
        edge = rng.random(bits.shape) < 0.15
        bits[edge] = rng.choice(EDGE_F16, int(edge.sum()))
        blocks[:, :, at:at + 2] = bits[..., None].view(np.uint8)
    if qtype in MINIMUM:
        blocks[:, 1, 2:4] = 0  # keep the largest values finite where both d and m are the largest
    return raw


def magnitudes(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """``|w|`` as the kernel adds it, float64: ``|d q| + |m|`` for the types with a minimum, else ``|w|``."""
    w = codec(qtype).reference(raw).astype(np.float64)
    if qtype not in MINIMUM:
        return np.abs(w)
    blocks = raw.reshape(len(raw), -1, codec(qtype).type_size)
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [R, nb]
    m = np.repeat(m, 32, axis=1)
    return np.abs(w - m) + np.abs(m)


def bound(qtype: QType, raw: np.ndarray, x: np.ndarray, direct: bool) -> np.ndarray:
    n = x.shape[1]
    terms = (-(-n // 32) + (34 if qtype in MINIMUM else 6)) if direct else n + 2
    return terms * EPS32 * (np.abs(x.astype(np.float64)) @ magnitudes(qtype, raw).T) + 1e-37


def activations(rows: int, cols: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 1, (rows, cols)).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 1e-40, -1e10, 1.0, -1.0]  # zeros, a subnormal, a large value
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decode_equals_reference_bit_for_bit(qtype: QType) -> None:
    raw = random_rows(qtype, 37, columns(qtype), seed=1)
    kernel = jit_kernel(qtype, raw)
    tile = kernel.tile(0, 37, Scratch())
    assert np.array_equal(tile.view(np.uint32), codec(qtype).reference(raw).view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 7, 16, 40])
def test_product_within_float32_error_model(qtype: QType, n: int) -> None:
    rows, cols = 70, columns(qtype)
    raw = random_rows(qtype, rows, cols, seed=2)
    kernel = jit_kernel(qtype, raw)
    x = activations(n, cols, seed=3)
    exact = x.astype(np.float64) @ codec(qtype).reference(raw).astype(np.float64).T
    scratch = Scratch()
    got = np.full((n, rows), np.nan, np.float32)
    for r0, r1 in ((0, 33), (33, 64), (64, 70)):  # tiles not a multiple of anything
        kernel.product(r0, r1, kernel.prepare(x), got[:, r0:r1], scratch)
    assert np.all(np.abs(got - exact) <= bound(qtype, raw, x, n <= kernel.direct_rows))
    rowwise = np.full((n, rows), np.nan, np.float32)
    kernel.product_rows(0, rows, kernel.prepare(x, rowwise=True), rowwise, scratch)
    assert np.all(np.abs(rowwise - exact) <= bound(qtype, raw, x, True))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_row_is_the_same_alone_and_in_any_batch(qtype: QType) -> None:
    cols = columns(qtype)
    raw = random_rows(qtype, 40, cols, seed=4)
    kernel = jit_kernel(qtype, raw)
    x = activations(max(GEMV_ROWS, kernel.direct_rows) + 3, cols, seed=5)
    scratch = Scratch()
    alone = np.empty((len(x), 40), np.float32)
    for i in range(len(x)):
        kernel.product(0, 40, kernel.prepare(x[i:i + 1]), alone[i:i + 1], scratch)
    for n in (2, 5, kernel.direct_rows, GEMV_ROWS, len(x)):
        together = np.empty((n, 40), np.float32)
        kernel.product_rows(0, 40, kernel.prepare(x[:n], rowwise=True), together, scratch)
        assert np.array_equal(together.view(np.uint32), alone[:n].view(np.uint32))
        if n <= kernel.direct_rows:
            kernel.product(0, 40, kernel.prepare(x[:n]), together, scratch)
            assert np.array_equal(together.view(np.uint32), alone[:n].view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_weights_pick_the_compiled_kernel_and_agree_with_numpy(qtype: QType) -> None:
    cols = columns(qtype)
    raw = random_rows(qtype, 90, cols, seed=6)
    tensor = StoredTensor("w", qtype, (90, cols), "mem", data=raw)
    compiled = make_weight(tensor, Workspace(threads=2, kernels="numba"), tile_elements=20 * cols)
    plain = make_weight(tensor, Workspace(threads=2, kernels="numpy"), tile_elements=20 * cols)
    assert compiled.compiled and not plain.compiled
    x = activations(3, cols, seed=7)
    exact = x.astype(np.float64) @ codec(qtype).reference(raw).astype(np.float64).T
    assert np.all(np.abs(compiled.matmul(x) - exact) <= bound(qtype, raw, x, True))
    assert np.all(np.abs(plain.matmul(x) - exact) <= bound(qtype, raw, x, False))


@pytest.mark.parametrize("qtype", [QType.F16, QType.Q5_1, QType.IQ4_XS], ids=lambda q: q.name)
def test_compiled_kernels_refuse_shapes_they_were_not_built_for(qtype: QType) -> None:
    cols = columns(qtype)
    raw = random_rows(qtype, 4, cols, seed=8)
    if codec(qtype).quantized:
        with pytest.raises(FormatError):
            jit_kernel(qtype, np.ascontiguousarray(raw[:, :-1]))  # not whole blocks
    strided = raw[:, ::2] if not codec(qtype).quantized else np.asfortranarray(raw)
    assert jit_kernel(qtype, strided) is None  # not one contiguous array: the numpy kernel instead
    with pytest.raises(FormatError):
        type(jit_kernel(qtype, raw))(strided)
    kernel = jit_kernel(qtype, raw)
    with pytest.raises(ValueError):
        kernel.prepare(np.ones((1, cols + 32), np.float32))  # activations of another width
    with pytest.raises(ValueError):
        kernel.product(0, 4, kernel.prepare(np.ones((1, cols), np.float32)), np.empty((1, 3), np.float32), Scratch())


def test_iq4_levels_without_pshufb_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable level lookup (a select chain, for CPUs other than x86) decodes as the reference."""
    import numba

    from qwen_runtime.backend.kernels import legacy as jit_legacy
    from qwen_runtime.backend.kernels.base import F16_TABLE

    monkeypatch.setattr(jit_legacy, "X86", False)  # read when a function using the intrinsic is compiled

    @numba.njit(cache=False)
    def decode(raw, table, tile):  # IQ4_NL: 18-byte blocks, qs from byte 2
        for r in range(raw.shape[0]):
            for b in range(tile.shape[1] // 32):
                d = table[np.int64(raw[r, 18 * b]) | (np.int64(raw[r, 18 * b + 1]) << 8)]
                jit_legacy.levels_decode(raw[r], 18 * b + 2, None, 0, d, np.float32(-0.0),
                                         tile[r, 32 * b: 32 * b + 32])

    raw = random_rows(QType.IQ4_NL, 9, 128, seed=9)
    tile = np.empty((9, 128), np.float32)
    decode(raw, F16_TABLE, tile)
    assert np.array_equal(tile.view(np.uint32), codec(QType.IQ4_NL).reference(raw).view(np.uint32))
