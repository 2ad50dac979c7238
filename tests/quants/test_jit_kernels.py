"""The compiled (numba) tile kernels against each codec's plain reference decoder.

Error model of a product row (``qwen_runtime/backend/kernels/base.py``): each term ``fma(d * q, x, acc)`` multiplies
the exact weight (as the reference decoder stores it) and rounds once, each of the 32 lanes adds its
``L = n / 32`` terms in order and the lanes are summed by a 5-level pairwise tree: ``L + 5`` roundings at most;
K-quant rows longer than CHUNK_COLS do that per chunk and add the ``c`` chunks' sums in order: ``L + 5 + c``.
Types with a minimum (``w = dl * q - ml``) apply it to per-sub-block activation sums separately (numpy's
pairwise float32 sums: at most 7 roundings for 32 values), a fused product-sum per chunk and one running sum
per row, then one subtraction, so ``|w|`` is replaced by ``|dl * q| + |ml|`` there (what the kernel actually
adds).  The bound checked, ``(nb + 32 + 2) * eps32 * sum |x| |w|`` (``nb``: blocks per row, or ``n / 32`` for
F16/BF16; first-order gamma_m), holds that count for the shapes here (512 columns: L = 16; 2304: L = 72, c = 2).
Decoded tiles multiplied by BLAS (more rows than ``direct_rows``) sum up to ``n`` terms per output:
``(n + 2) * eps32``.  ``exact`` is computed in float64 from the reference decoder's float32 weights, which the
compiled decoder reproduces bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import quants
from test_quants import set_iq1_m_scale

from qwen_runtime.backend.jit_setup import cpu_features, import_closure, imported_files, release_compiler_pages
from qwen_runtime.backend.kernels import jit_kernel, kernel_table
from qwen_runtime.backend.pool import Workspace, resolve_kernels
from qwen_runtime.backend.weights import DIRECT_ROW_TASKS, direct_split, gated_matmul, make_weight, matmul_many
from qwen_runtime.formats.tensors import StoredTensor
from qwen_runtime.quants import DENSE_TYPES, QType, codec, q8k_act
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels.base import CHUNK_COLS, F16_TABLE, GEMV_ROWS, TILE_ROWS, sums_of  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels.int8_k import Q8K, WHOLE_COLS  # noqa: E402
from qwen_runtime.backend.kernels.q8_0 import Q8_0JitKernel  # noqa: E402
from qwen_runtime.backend.kernels.q8_act import forms_bytes, prepare_forms  # noqa: E402
from qwen_runtime.backend.ops_jit import silu_mul  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
# Byte offsets of the float16 fields of each block (scales and minimums): set to edge values below.
F16_FIELDS = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
              QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
              QType.Q6_K: (208,), QType.IQ4_NL: (0,), QType.IQ4_XS: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
              QType.IQ2_S: (0,), QType.IQ3_XXS: (0,), QType.IQ3_S: (0,), QType.IQ1_S: (0,), QType.TQ2_0: (64,),
              QType.IQ1_M: ()}  # IQ1_M's d: the top nibbles of its scale words (set below)
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF, 0x1C00, 0x9C00], np.uint16)
EDGE_F32 = np.array([0.0, -0.0, 1e-40, -1e-45, 2.0**23, -(2.0**23)], np.float32)  # ±0, subnormals, BF16's largest
COMPILED = sorted(kernel_table()["float"], key=lambda q: q.name)


def random_blocks(qtype: QType, rows: int, cols: int, seed: int, edges: float = 0.1) -> np.ndarray:
    """Stored rows of random bytes (every quant value, ±max included), float16 fields finite: mostly scales
    of about 1e-3, a fraction ``edges`` of edge values (zero, negative zero, subnormal, largest).  F32/F16/BF16:
    normal(0, 0.05) weights, half that fraction replaced by edge values (BF16's largest: 2**24, so that products
    with the test's largest activations stay finite, as for the quantized types; F32's the same).  Timings need
    ``edges=0``: subnormal arithmetic takes microcode assists, 5-20x slower."""
    rng = np.random.default_rng(seed)
    c = codec(qtype)
    if qtype == QType.F32:
        w = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        picks = rng.random(w.shape) < edges / 2
        w[picks] = rng.choice(EDGE_F32, int(picks.sum()))
        return w
    if not c.quantized:
        bits = rng.normal(0, 0.05, (rows, cols)).astype(np.float32)
        raw = bits.astype(np.float16).view(np.uint16) if qtype == QType.F16 else (bits.view(np.uint32) >> 16)
        raw = raw.astype(np.uint16)
        flat = raw.reshape(-1)
        picks = rng.random(flat.size) < edges / 2
        edges = EDGE_F16 if qtype == QType.F16 else np.array([0, 0x8000, 0x0001, 0x807F, 0x4B00, 0xCB00], np.uint16)
        flat[picks] = rng.choice(edges, int(picks.sum()))
        return raw.view(np.float16) if qtype == QType.F16 else raw
    raw = rng.integers(0, 256, (rows, cols // c.block_size * c.type_size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, c.type_size)
    for at in F16_FIELDS[qtype]:
        scales = np.float16(rng.uniform(2e-4, 2e-3, blocks.shape[:2])) * rng.choice([-1, 1], blocks.shape[:2])
        bits = scales.astype(np.float16).view(np.uint16)
        edge = rng.random(bits.shape) < edges
        bits[edge] = rng.choice(EDGE_F16, int(edge.sum()))
        blocks[:, :, at:at + 2] = bits[..., None].view(np.uint8).reshape(*bits.shape, 2)
    if qtype == QType.IQ1_M:
        set_iq1_m_scale(blocks, np.float16(rng.uniform(2e-4, 2e-3, blocks.shape[:2])))
    return raw


def magnitudes(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """``|w|`` as the kernels add it: ``|dl * q| + |ml|`` for types with a minimum, else ``|w|``.  float64."""
    c = codec(qtype)
    w = c.reference(raw).astype(np.float64)
    if not getattr(c, "has_offset", False):
        return np.abs(w)
    scratch = Scratch()
    fields = c.field_major(raw, scratch)
    _, offset = c.sub_scales(fields, scratch)
    group = c.layout(offset.shape[1])[0]
    natural = offset.reshape(c.n_sub, group, -1, len(raw)).transpose(3, 2, 1, 0).astype(np.float64)
    m = np.repeat(natural, c.sub, axis=3).reshape(len(raw), -1)  # the minimum of each element's sub-block
    scaled = w + m if c.subtracts else w - m  # dl * q
    return np.abs(scaled) + np.abs(m)


def bound(qtype: QType, raw: np.ndarray, x: np.ndarray, direct: bool) -> np.ndarray:
    n = x.shape[1]
    per_lane = n // max(codec(qtype).block_size, 32)  # terms each of the 32 lanes sums
    terms = per_lane + 32 + 2 if direct else n + 2
    return terms * EPS32 * (np.abs(x.astype(np.float64)) @ magnitudes(qtype, raw).T) + 1e-30


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
def test_decode_equals_reference_bit_for_bit(qtype: QType) -> None:
    raw = random_blocks(qtype, 37, 512, seed=1)
    kernel = jit_kernel(qtype, raw)
    tile = kernel.tile(0, 37, Scratch())
    ref = codec(qtype).reference(raw)
    assert np.array_equal(tile.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 7, 16, 40])
def test_product_within_float32_error_model(qtype: QType, n: int) -> None:
    rows, cols = 70, 512
    raw = random_blocks(qtype, rows, cols, seed=2)
    kernel = jit_kernel(qtype, raw)
    x = np.random.default_rng(3).normal(0, 1, (n, cols)).astype(np.float32)
    x[0, :7] = [0.0, -0.0, 1e-40, -1e28, 1e28, 1.0, -1.0]  # zeros, a subnormal, values whose products with
    # the largest weights (65504 * 127) still fit float32
    exact = x.astype(np.float64) @ codec(qtype).reference(raw).astype(np.float64).T
    scratch = Scratch()
    got = np.full((n, rows), np.nan, np.float32)
    for r0, r1 in ((0, 33), (33, 64), (64, 70)):  # tiles not a multiple of anything
        kernel.product(r0, r1, kernel.prepare(x), got[:, r0:r1], scratch)
    assert np.all(np.abs(got - exact) <= bound(qtype, raw, x, n <= kernel.direct_rows))
    rowwise = np.empty_like(got)
    kernel.product_rows(0, rows, kernel.prepare(x, rowwise=True), rowwise, scratch)
    assert np.all(np.abs(rowwise - exact) <= bound(qtype, raw, x, True))


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
def test_each_row_is_the_same_alone_and_in_any_batch(qtype: QType) -> None:
    raw = random_blocks(qtype, 41, 256, seed=4)  # an odd count: the one-row kernel's last row is not in a pair
    kernel = jit_kernel(qtype, raw)
    x = np.random.default_rng(5).normal(0, 1, (max(GEMV_ROWS, kernel.direct_rows) + 3, 256)).astype(np.float32)
    scratch = Scratch()
    alone = np.empty((len(x), 41), np.float32)
    for i in range(len(x)):
        kernel.product(0, 41, kernel.prepare(x[i:i + 1]), alone[i:i + 1], scratch)
    for n in (2, 5, GEMV_ROWS, kernel.direct_rows, len(x)):
        together = np.empty((n, 41), np.float32)
        kernel.product_rows(0, 41, kernel.prepare(x[:n], rowwise=True), together, scratch)
        assert np.array_equal(together, alone[:n])
        if n <= kernel.direct_rows:
            kernel.product(0, 41, kernel.prepare(x[:n]), together, scratch)
            assert np.array_equal(together, alone[:n])


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
def test_rows_longer_than_a_chunk_within_the_error_model_and_the_same_in_any_batch(qtype: QType) -> None:
    """Rows of more than CHUNK_COLS columns (the K-quants sum them chunk by chunk, a partial last chunk here; the
    dense types end with a partial 32): every product within the bound, each row the same bits alone and in a
    batch."""
    cols = CHUNK_COLS + 256 + (5 if qtype in DENSE_TYPES else 0)
    raw = random_blocks(qtype, 21, cols, seed=6)
    kernel = jit_kernel(qtype, raw)
    x = np.random.default_rng(7).normal(0, 1, (GEMV_ROWS + 3, cols)).astype(np.float32)
    exact = x.astype(np.float64) @ codec(qtype).reference(raw).astype(np.float64).T
    scratch = Scratch()
    alone = np.empty((len(x), 21), np.float32)
    for i in range(len(x)):
        kernel.product(0, 21, kernel.prepare(x[i:i + 1]), alone[i:i + 1], scratch)
    assert np.all(np.abs(alone - exact) <= bound(qtype, raw, x, True))
    for n in (2, 3, 9, len(x)):
        together = np.empty((n, 21), np.float32)
        kernel.product_rows(0, 21, kernel.prepare(x[:n], rowwise=True), together, scratch)
        assert np.array_equal(together, alone[:n])


K_QUANTS = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_long_k_quant_rows_are_their_chunks_added_in_order_bit_for_bit(qtype: QType, activations: str) -> None:
    """K-quant rows longer than a chunk (float activations: CHUNK_COLS; 8-bit: WHOLE_COLS) are the float32 sums,
    in order, of the same kernel over each chunk of CHUNK_COLS columns alone (whole rows each), with a partial
    last chunk and a partial last tile of stored rows; one row alone gives the same bits as in a batch.  The
    kernels against q8_K activations (``int8_k.Q8K``) take the rows whole: the whole row's
    ``q8k_act.product``."""
    cols = (CHUNK_COLS if activations == "float" else WHOLE_COLS) + CHUNK_COLS + 512
    rows = TILE_ROWS + 5
    raw = random_blocks(qtype, rows, cols, seed=8)
    x = np.random.default_rng(9).normal(0, 1, (3, cols)).astype(np.float32)
    scratch = Scratch()

    def rowwise(kernel: object, x: np.ndarray) -> np.ndarray:
        out = np.empty((len(x), rows), np.float32)
        kernel.product_rows(0, rows, kernel.prepare(x, rowwise=True), out, scratch)
        return out

    kernel = jit_kernel(qtype, raw, activations=activations)
    if activations == "q8" and Q8K and qtype in (QType.Q4_K, QType.Q6_K):
        expected = q8k_act.product(qtype, raw, *q8k_act.quantize_q8_k(x))
        assert np.array_equal(rowwise(kernel, x), expected)
        assert np.array_equal(rowwise(kernel, x[1:2]), expected[1:2])
        return
    expected = np.zeros((len(x), rows), np.float32)
    for c0 in range(0, cols, CHUNK_COLS):
        c1 = min(c0 + CHUNK_COLS, cols)
        piece = np.ascontiguousarray(raw[:, c0 * raw.shape[1] // cols: c1 * raw.shape[1] // cols])
        part = rowwise(jit_kernel(qtype, piece, activations=activations), x[:, c0:c1])
        expected = part if c0 == 0 else expected + part
    assert np.array_equal(rowwise(kernel, x), expected)
    assert np.array_equal(rowwise(kernel, x[1:2]), expected[1:2])


ROW_PRODUCT = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 11))


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS])
def test_row_product_by_address_equals_the_kernel_bit_for_bit(qtype: QType, n: int) -> None:
    """Each type's ROW_PRODUCT (what the compiled decode step calls by address): rows 5..37 of the matrix written
    into columns of a wider output, the same bits as the kernel's own product, block sums from ``block_sums``."""
    raw = random_blocks(qtype, 40, 512, seed=8)
    kernel = jit_kernel(qtype, raw)
    x, *extra = kernel.prepare(np.random.default_rng(9).normal(0, 1, (n, 512)).astype(np.float32))
    expected = np.empty((n, 32), np.float32)
    kernel.product(5, 37, (x, *extra), expected, Scratch())
    width = kernel.sums_width
    sums = sums_of(x, width) if width else np.empty((n, 0), np.float32)
    stored = kernel.raw.view(np.uint8)
    out = np.full((n, 50), np.nan, np.float32)
    ROW_PRODUCT(kernel.row_product.address)(stored[5:].ctypes.data, 32, stored.shape[1], x.ctypes.data, n, 512,
                                            sums.ctypes.data, sums.shape[1], F16_TABLE.ctypes.data,
                                            out[:, 3:].ctypes.data, out.shape[1])
    assert np.array_equal(out[:, 3:35], expected)
    assert np.isnan(out[:, :3]).all() and np.isnan(out[:, 35:]).all()  # nothing written outside its columns


Q8_ROW_PRODUCT = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 12))


@pytest.mark.parametrize("qtype", sorted(kernel_table()["q8"], key=lambda q: q.name), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS])
def test_q8_row_product_by_address_equals_the_kernel(qtype: QType, n: int) -> None:
    """Each type's Q8_ROW_PRODUCT (the compiled decode step's call with 8-bit activations): the forms table filled
    by ``prepare_forms`` for two more rows than it uses (the product reads rows 2..), rows 5..37 of the matrix into
    columns of a wider output: the same bits as the kernel's own product, which quantizes in numpy."""
    raw = random_blocks(qtype, 40, 512, seed=8)
    kernel = jit_kernel(qtype, raw, "q8")
    x = np.random.default_rng(9).normal(0, 1, (n + 2, 512)).astype(np.float32)
    expected = np.empty((n, 32), np.float32)
    kernel.product_rows(5, 37, kernel.prepare(x[2:], rowwise=True), expected, Scratch())
    buffers = [np.zeros(size + 64, np.uint8) for size in forms_bytes(n + 2, 512)]
    forms = np.array([b.ctypes.data + (-b.ctypes.data % 64) for b in buffers], np.int64)
    prepare_forms(x, kernel.q8_slots, forms.ctypes.data)
    width = kernel.sums_width
    sums = sums_of(x[2:], width) if width else np.empty((n, 0), np.float32)
    stored = kernel.raw.view(np.uint8)
    out = np.full((n, 50), np.nan, np.float32)
    Q8_ROW_PRODUCT(kernel.q8_row_product.address)(stored[5:].ctypes.data, 32, stored.shape[1], forms.ctypes.data, 2,
                                                  n, 512, sums.ctypes.data, sums.shape[1], F16_TABLE.ctypes.data,
                                                  out[:, 3:].ctypes.data, out.shape[1])
    assert np.array_equal(out[:, 3:35], expected)
    assert np.isnan(out[:, :3]).all() and np.isnan(out[:, 35:]).all()


@pytest.mark.parametrize("width", [16, 32])
def test_block_sums_are_numpys_pairwise_sums(width: int) -> None:
    rng = np.random.default_rng(10)
    x = (rng.normal(0, 1, (4, 1024)) * rng.uniform(0.01, 1e4, (4, 1))).astype(np.float32)
    assert np.array_equal(sums_of(x, width), x.reshape(4, -1, width).sum(axis=2, dtype=np.float32))


@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
def test_weights_pick_the_compiled_kernel_and_agree_with_numpy(qtype: QType) -> None:
    raw = random_blocks(qtype, 90, 256, seed=6)
    tensor = StoredTensor("w", qtype, (90, 256), "mem", data=raw)
    compiled = make_weight(tensor, Workspace(threads=2, kernels="numba"), tile_elements=20 * 256)
    plain = make_weight(tensor, Workspace(threads=2, kernels="numpy"), tile_elements=20 * 256)
    assert compiled.compiled and not plain.compiled
    x = np.random.default_rng(7).normal(0, 1, (3, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ codec(qtype).reference(raw).astype(np.float64).T
    limit = bound(qtype, raw, x, True) + bound(qtype, raw, x, False)  # numpy's block sums: within the BLAS bound
    assert np.all(np.abs(compiled.matmul(x) - exact) <= limit)
    assert np.all(np.abs(plain.matmul(x) - exact) <= limit)


@pytest.mark.parametrize("activations", ["float", "q8"])
@pytest.mark.parametrize("qtype", COMPILED, ids=lambda q: q.name)
def test_products_cut_over_threads_equal_one_call_bit_for_bit(qtype: QType, activations: str) -> None:
    """Decode-sized products cut into one task per thread (``weights.direct_split``: q/k/v-like matrices fused
    into one run, row ranges on any boundary) give every row the numbers of one kernel call over the whole
    matrix, with any thread count, plainly, inside ``rowwise()`` and in ``gated_matmul``."""
    shapes = (200, 64, 72)  # rows of three matrices sharing their input, 200 not a multiple of the alignment
    raws = [random_blocks(qtype, rows, 256, seed=10 + i) for i, rows in enumerate((*shapes, 200))]
    rng = np.random.default_rng(11)
    for n in (1, 5):
        x = rng.normal(0, 1, (n, 256)).astype(np.float32)
        whole = []
        for raw in raws:
            kernel = jit_kernel(qtype, raw, activations)
            whole.append(np.empty((n, len(raw)), np.float32))
            kernel.product(0, len(raw), kernel.prepare(x), whole[-1], Scratch())
        for threads in (1, 2, 3):
            ws = Workspace(threads=threads, kernels="numba", activations=activations)
            weights = [make_weight(StoredTensor(f"w{i}", qtype, (len(raw), 256), "mem", data=raw), ws)
                       for i, raw in enumerate(raws)]
            runs: list[int] = []
            run = ws.run
            ws.run = lambda tasks, run=run, runs=runs: (runs.append(len(tasks)), run(tasks))[1]
            for got, expected in zip(matmul_many(weights[:3], x), whole, strict=False):
                assert np.array_equal(got, expected)
            gated = gated_matmul(weights[0], weights[3], x)
            assert np.array_equal(gated, silu_mul(whole[0], whole[3]))
            assert runs == [threads, threads]  # one task per thread, one run per fused product
            with ws.rowwise():
                for got, expected in zip(matmul_many(weights[:3], x), whole, strict=False):
                    assert np.array_equal(got, expected)


def test_products_of_several_rows_are_cut_into_more_tasks_up_to_a_bound() -> None:
    """A direct product's tasks count its work, weight bytes times activation rows: one task per thread for one
    row of a layer matrix, more for several rows, at most DIRECT_ROW_TASKS per thread from the rows; a matrix
    large in bytes alone (an lm_head) is cut by its bytes, whatever its rows.  The cuts cover every row once."""
    mlp, head = ((4864,), (952,)), ((151936,), (952,))
    assert len(direct_split(*mlp, 2, 1)) == 2
    assert len(direct_split(*mlp, 2, 8)) == 2 * 3
    assert len(direct_split(*mlp, 2, 96)) == 2 * DIRECT_ROW_TASKS
    assert len(direct_split(*head, 2, 1)) == len(direct_split(*head, 2, 96)) == 2 * 9
    for (rows, costs), passes in ((mlp, 8), (head, 1)):
        ranges = [task[0] for task in direct_split(rows, costs, 2, passes)]
        assert ranges[0][0] == 0 and ranges[-1][1] == rows[0]
        assert all(a[1] == b[0] < b[1] for a, b in zip(ranges, ranges[1:], strict=False))


def test_compiled_kernels_refuse_shapes_they_were_not_built_for() -> None:
    raw = quants.quantize(np.ones((4, 64), np.float32), QType.Q8_0)
    with pytest.raises(ValueError):
        jit_kernel(QType.Q8_0, np.ascontiguousarray(raw[:, :50]))  # not whole blocks
    assert jit_kernel(QType.Q8_0, np.asfortranarray(raw)) is None  # not contiguous: the numpy kernel instead
    with pytest.raises(ValueError):
        Q8_0JitKernel(np.asfortranarray(raw))
    kernel = jit_kernel(QType.Q8_0, raw)
    with pytest.raises(ValueError):
        kernel.prepare(np.ones((1, 96), np.float32))  # activations of another width
    with pytest.raises(ValueError):
        kernel.product(0, 4, kernel.prepare(np.ones((1, 64), np.float32)), np.empty((1, 3), np.float32), Scratch())


def test_resolve_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QWEN_KERNELS", raising=False)
    assert resolve_kernels() == "numba" and resolve_kernels("auto") == "numba"
    assert resolve_kernels("numpy") == "numpy"
    monkeypatch.setenv("QWEN_KERNELS", "numpy")
    assert resolve_kernels() == "numpy" and resolve_kernels("numba") == "numba"
    monkeypatch.setenv("QWEN_KERNELS", "fast")
    with pytest.raises(ValueError, match="QWEN_KERNELS"):
        resolve_kernels()


def test_numba_thread_pool_never_starts() -> None:
    """The compiled kernels run on the tile pool's threads: numba's own pool (parallel=True) is never launched."""
    from numba.np.ufunc import parallel

    raw = random_blocks(QType.Q8_0, 256, 256, seed=8)
    weight = make_weight(StoredTensor("w", QType.Q8_0, (256, 256), "mem", data=raw),
                         Workspace(threads=2, kernels="numba"), tile_elements=32 * 256)
    for n in (1, 5, 40):
        weight.matmul(np.ones((n, 256), np.float32))
    assert not parallel._is_initialized


@pytest.mark.slow
def test_numba_set_up_without_scipy_linalg() -> None:
    """A process that loads a compiled kernel never imports SciPy's linear algebra (qwen_runtime.backend.jit_setup), and
    numba's BLAS probe reads as it would have, so numba's np.dot still compiles and agrees with numpy."""
    code = ("import sys; import numpy as np, numba; import qwen_runtime.backend.kernels.q8_0\n"
            "from numba.np import arraymath\n"
            "print('scipy.linalg' in sys.modules, arraymath._HAVE_BLAS, 'scipy' in sys.modules)\n"
            "x = np.arange(1, 9, dtype=np.float64)\n"
            "if 'scipy' in sys.modules: print(numba.njit(lambda a: np.dot(a, a))(x) == np.dot(x, x))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False" and out[1] == out[2]
    assert out[3:] == (["True"] if out[2] == "True" else [])


def test_cpu_features_without_the_256_bit_preference_only_with_avx512() -> None:
    """512-bit vectors where the CPU has AVX-512 (qwen_runtime.backend.jit_setup); numba's own choice elsewhere
    (AVX2-only
    CPUs), and a user's NUMBA_CPU_FEATURES is kept (numba keys its cache by the features it compiled for)."""
    assert cpu_features("+avx,+avx2,+avx512f,-avx512vnni") == "+avx,+avx2,+avx512f,-avx512vnni,-prefer-256-bit"
    assert cpu_features("+avx,+avx2,-avx512f,+fma") is None
    assert cpu_features("+neon") is None
    code = ("from qwen_runtime.backend.jit_setup import prepare_numba\nprepare_numba()\n"
            "from numba.core.registry import cpu_target\nprint(cpu_target.target_context.codegen().magic_tuple()[2])\n")
    env = {**os.environ, "NUMBA_CPU_FEATURES": "+avx,+avx2,+fma,+f16c"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "+avx,+avx2,+fma,+f16c"


def test_scipy_imported_first_keeps_our_target_and_cache() -> None:
    """A process that imported SciPy's BLAS bindings before the first kernel (torch, transformers, a user's script)
    still compiles for the same features and files its code where every other process does: the same cache keys,
    so it loads what warm_kernels.py compiled rather than compiling every kernel afresh."""
    from llvmlite import binding as llvm

    code = ("import scipy.linalg.cython_blas\nimport qwen_runtime.backend.kernels.base\n"
            "from numba.core import caching\nfrom numba.core.registry import cpu_target\n"
            "from qwen_runtime.backend.jit_setup import caching_class\n"
            "print(cpu_target.target_context.codegen().magic_tuple()[2])\n"
            "print(caching_class('CacheImpl')._locator_classes[0].__name__)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME")}
    features, locator = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env=env).stdout.split()
    assert features == (cpu_features(llvm.get_host_cpu_features().flatten()) or features)
    assert locator == "KernelSourcesLocator"


def test_cache_stamp_covers_the_modules_a_kernel_imports(tmp_path: Path) -> None:
    """numba stamps a cached function with its own file's hash; ours also covers the package's modules that file
    imports, transitively (jit_setup.KernelSourcesLocator), so an edit of jit_base.py alone recompiles the kernels
    that inline its intrinsics.  Other packages' imports, comments and unrelated modules do not count."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {"__init__.py": "", "base.py": "A = 1\n", "unrelated.py": "B = 2\n", "sub/__init__.py": "",
             "sub/helper.py": "from ..base import A  # the constant\n",
             "sub/jit_k.py": "import numpy as np\nfrom numpy import (\n    float32,  # a comment\n)\n"
                             "from . import helper\nfrom pkg.sub.helper import (A,\n    A)\n"}
    for name, text in files.items():
        (root / name).write_text(text)
    kernel = root / "sub" / "jit_k.py"
    assert sorted(f.name for f in imported_files(kernel, root)) == ["__init__.py", "helper.py", "helper.py"]
    stamps = [import_closure(kernel, root)]
    (root / "unrelated.py").write_text("B = 3\n")
    import_closure.cache_clear()
    stamps.append(import_closure(kernel, root))
    (root / "base.py").write_text("A = 2\n")
    import_closure.cache_clear()
    stamps.append(import_closure(kernel, root))
    assert stamps[0] == stamps[1] != stamps[2]
    stamp = Q8_0JitKernel.gemv._cache._impl._locator.get_source_stamp()
    assert type(Q8_0JitKernel.gemv._cache._impl._locator).__name__ == "KernelSourcesLocator"
    assert stamp[1] == import_closure(Path(Q8_0JitKernel.gemv.py_func.__code__.co_filename))


def test_every_compiled_module_is_filed_by_its_sources() -> None:
    """The compiled functions of the model layer and of the converter's searches are filed as the kernels are, under
    their module's name and the hash of its sources (not under numba's hash of the checkout's path, which made every
    checkout compile the decode step afresh), and stamped with the modules they import."""
    from numba.core import config as numba_config

    from qwen_convert import quant_search
    from qwen_runtime.models import step_jit

    for function, module in ((step_jit.post, "qwen_runtime.models.step_jit"),
                             (quant_search.nearest_int, "qwen_convert.quant_search")):
        locator = function._cache._impl._locator
        stamp = import_closure(Path(function.py_func.__code__.co_filename))
        assert type(locator).__name__ == "KernelSourcesLocator" and locator.get_source_stamp()[1] == stamp
        if numba_config.CACHE_DIR:  # else numba's __pycache__ beside the module
            assert Path(locator.get_cache_path()).name == f"{module}-{stamp[:20]}"


def test_two_checkouts_of_the_same_sources_share_the_numba_cache(tmp_path: Path) -> None:
    """With NUMBA_CACHE_DIR set, a module's compiled code is filed under the hash of its sources, not under the
    checkout's path: a second copy of the package loads what the first compiled (CI clones afresh every run)."""
    code = ("import numpy as np\nfrom qwen_runtime.backend import ops_jit\nops_jit.silu32(np.float32(1))\n"
            "stats = ops_jit.silu32.stats\nprint(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()))")
    source = Path(sys.modules[silu_mul.__module__].__file__).parents[1]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    counts = []
    skipped = shutil.ignore_patterns("__pycache__", "assets")
    for copy in ("a", "b"):
        shutil.copytree(source, tmp_path / copy / "qwen_runtime", ignore=skipped)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**env, "PYTHONPATH": str(tmp_path / copy)}, cwd=tmp_path / copy)
        counts.append(run.stdout.split()[-2:])
    assert counts == [["0", "1"], ["1", "0"]]  # (hits, misses): compiled by the first copy, loaded by the second


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")
def test_compiler_pages_released_and_compiling_still_works() -> None:
    """LLVM's read-only code is advised out (how much leaves memory depends on other processes mapping it too), and
    numba compiles afterwards all the same (the pages fault back in)."""
    import numba

    assert release_compiler_pages() > 0

    @numba.njit
    def twice(x):
        return 2 * x

    assert twice(21) == 42


def test_dry_run_products_are_zeros_and_end_with_the_block() -> None:
    raw = random_blocks(QType.Q8_0, 64, 256, seed=11)
    ws = Workspace(threads=2, kernels="numba")
    w, up = (make_weight(StoredTensor(n, QType.Q8_0, (64, 256), "mem", data=raw), ws) for n in "wu")
    x = np.random.default_rng(12).normal(0, 1, (3, 256)).astype(np.float32)
    with ws.dry_run():
        assert not w.matmul(x).any() and not gated_matmul(w, up, x).any()
    assert not ws.dry and w.matmul(x).any()


def test_a_kernel_compiles_when_a_weight_calls_it() -> None:
    """Importing every kernel module compiles no type's kernel; building a Q8_0 weight's kernel readies exactly the
    functions its class names (one specialisation each), and no other type's: a process holds machine code only for
    the types its models store (numba's cache would otherwise load every kernel of a family)."""
    code = """
import numpy as np
from qwen_runtime.backend.kernels import jit_kernel, kernel_table
from qwen_runtime.backend.kernels.base import Declared, DeclaredCFunc
from qwen_runtime.quants import QType

def readied():
    import sys
    return {name for module, m in list(sys.modules.items()) if module.startswith("qwen_runtime.backend.kernels.")
            for name, f in vars(m).items() if (isinstance(f, Declared) and f.overloads and not f.py_func.__name__
            in ("block_sums", "quantize_rows", "quantize_k_rows", "sums16"))
            or (isinstance(f, DeclaredCFunc) and f._compiled is not None)}

kernel_table()
assert not readied(), readied()
kernel = jit_kernel(QType.Q8_0, np.zeros((4, 2 * 34), np.uint8))
names = {f.py_func.__name__ for f in kernel.compiled_functions()}
assert readied() == names, (readied(), names)
assert all(len(f.signatures) == 1 for f in kernel.compiled_functions() if isinstance(f, Declared))
assert not any("q4_k" in name or "q4_0" in name for name in readied())
print(sorted(names))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "q8_0_gemv" in done.stdout and "q8_0_decode" in done.stdout


def test_a_declared_kernel_keeps_its_one_signature() -> None:
    """A kernel compiled on first use holds its declared signature only, as ``numba.njit(signature)`` does: a call
    with a writable array where a read-only one is declared converts, one of another dtype fails and compiles
    nothing."""
    from qwen_runtime.backend.kernels import q8_0

    kernel = q8_0.q8_0_decode
    raw = np.zeros((2, 34), np.uint8)  # writable: the declared raw is read-only
    tile = np.empty((2, 32), np.float32)
    kernel(raw, F16_TABLE, tile)
    assert len(kernel.signatures) == 1 and not tile.any()
    with pytest.raises(TypeError):
        kernel(raw.astype(np.int16), F16_TABLE, tile)
    assert len(kernel.signatures) == 1
