"""The integer-dot kernels with 8-bit activations (``activations="q8"``) against the plain numpy reference of
the same integer arithmetic (``qwen_runtime/quants/q8_act.py``).

Error model of a product row: the int32 block sums are exact; per block, 16 exact int32 pair sums (each below
2^24, so exact in float32) are fused into 16 float32 lanes with the scale ``fl(d_w * d_x)`` (one rounding
for the scale, one per fused add), and the lanes are summed in order: against the float64 value of the exact
block sums, ``|got - ref| <= (nb + 16 + 1) * eps32 * sum |w q| d_w d_x`` (first-order ``gamma_m``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gquants
from runtime_helpers import Converted

from qwen_runtime import load
from qwen_runtime.backend.jit_setup import other_instruction_forms
from qwen_runtime.backend.kernels import jit_kernel
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.backend.weights import make_weight
from qwen_runtime.errors import KernelsError
from qwen_runtime.formats.tensors import StoredTensor
from qwen_runtime.quants import QType, codec, q8_act, q8k_act
from qwen_runtime.quants.iq4 import IQ4_LEVELS

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import lanes as jit_lanes  # noqa: E402
from qwen_runtime.backend.kernels.amx import amx_available  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels.base import F16_TABLE, GEMV_ROWS  # noqa: E402
from qwen_runtime.backend.kernels.int8 import (  # noqa: E402
    Int8Kernel,
    IQ4_NLInt8Kernel,
    IQ4_XSInt8Kernel,
    Q4_0Int8Kernel,
    Q4_1Int8Kernel,
    Q5_0Int8Kernel,
    Q8_0Int8Kernel,
    quantize_rows,
)
from qwen_runtime.backend.kernels.int8_k import (  # noqa: E402
    Q8K,
    Q2_KInt8Kernel,
    Q4_KInt8Kernel,
    Q5_KInt8Kernel,
    Q6_KInt8Kernel,
)
from qwen_runtime.backend.kernels.q8_act import quantize_k  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF], np.uint16)  # zero, -0, subnormal, max


BYTES = {QType.Q8_0: 34, QType.Q4_0: 18, QType.Q5_0: 22, QType.IQ4_NL: 18}
KERNELS = {QType.Q8_0: Q8_0Int8Kernel, QType.Q4_0: Q4_0Int8Kernel, QType.Q5_0: Q5_0Int8Kernel,
           QType.IQ4_NL: IQ4_NLInt8Kernel}
TYPES = list(KERNELS)


def random_blocks(qtype: QType, rows: int, nb: int, seed: int, scales: np.ndarray | None = None) -> np.ndarray:
    """Random rows [rows, nb * bytes per block] (every quant value: ±max, Q8_0's -128), float16 scales of about
    1e-3 with a tenth of edge values, or ``scales`` (float16 bits) when given."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, nb, BYTES[qtype]), dtype=np.uint8)
    if scales is None:
        scales = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        scales = scales.view(np.uint16)
        edge = rng.random(scales.shape) < 0.1
        scales[edge] = rng.choice(EDGE_F16, int(edge.sum()))
    blocks[:, :, :2] = np.broadcast_to(scales, (rows, nb))[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * BYTES[qtype])


def weights_of(qtype: QType, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(integer weights int16 [R, nb * 32], float32 scales [R, nb]) of stored rows, checked against the codec's
    reference decoder (value = scale * weight)."""
    blocks = raw.reshape(len(raw), -1, BYTES[qtype])
    scales = F16_TABLE[blocks[:, :, :2].copy().view(np.uint16)[..., 0]]
    if qtype == QType.Q8_0:
        w = blocks[:, :, 2:].view(np.int8).astype(np.int16)
    else:
        qs = blocks[:, :, -16:].astype(np.int16)
        w = np.concatenate([qs & 15, qs >> 4], axis=2)
        if qtype == QType.Q5_0:
            qh = blocks[:, :, 2:6].copy().view(np.uint32)  # [R, nb, 1]
            w |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        w = IQ4_LEVELS[w].astype(np.int16) if qtype == QType.IQ4_NL else w - (16 if qtype == QType.Q5_0 else 8)
    w = w.reshape(len(raw), -1)
    decoded = codec(qtype).reference(raw).reshape(len(raw), -1, 32)
    assert np.array_equal(decoded, scales[..., None] * w.reshape(decoded.shape).astype(np.float32))
    return w, scales


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with edge blocks: all zero, one tiny value, a constant, ±large, values rounding at .5."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, cols)).astype(np.float32)
    if cols >= 5 * 32:
        x[:, 0:32] = 0
        x[:, 32:64] = 0
        x[:, 40] = 1e-30
        x[:, 64:96] = -3.25
        x[:, 96:128] *= 1e30
        x[:, 128:160] = np.arange(-16, 16) + 0.5
    return x


def run(kernel: Int8Kernel, x: np.ndarray) -> np.ndarray:
    out = np.empty((len(x), kernel.raw.shape[0]), np.float32)
    xq, *extra = kernel.prepare(x, rowwise=True)  # the row kernels, whatever the number of rows
    kernel._rows(kernel.raw, xq, extra, out)
    return out


def test_activations_quantize_as_the_reference() -> None:
    x = activations(7, 12 * 32, seed=0)
    q, d = np.empty(x.shape, np.int8), np.empty((7, 12), np.float32)
    quantize_rows(x, q, d)
    q_ref, d_ref = q8_act.quantize_activations(x)
    assert np.array_equal(q, q_ref) and np.array_equal(d, d_ref)
    assert np.all(q[:, :32] == 0) and np.all(d[:, 0] == 0)  # an all-zero block
    assert np.abs(q).max() == 127 and np.all(np.abs(q).reshape(7, 12, 32).max(axis=2)[:, 1:] == 127)
    blocks = x.reshape(7, 12, 32)
    assert np.all(np.abs(q.reshape(7, 12, 32) * d[..., None] - blocks) <= d[..., None] * (0.5 + 1e-5))


def test_q8_k_activations_quantize_as_the_reference() -> None:
    """The compiled q8_K quantizer of the decode step's forms (``q8_act.quantize_k``): ``q8k_act.quantize_q8_k``'s
    values, scales and sums per 16, with an all-zero super-block, a tie of largest magnitudes of both signs (the
    first one decides the sign of ``d``), huge and tiny values."""
    x = activations(5, 4 * 256, seed=3)
    x[:, 256:512] = 0
    x[:, 512:768] = np.linspace(-1, 1, 256)
    x[:, 520], x[:, 700] = -7.5, 7.5
    x[:, 768:] *= 1e-30
    q, d, bs = quantize_k(x)
    q_ref, d_ref, bs_ref = q8k_act.quantize_q8_k(x)
    assert np.array_equal(q, q_ref) and np.array_equal(d, d_ref) and np.array_equal(bs, bs_ref)
    assert bs.dtype == np.int16 and np.all(d[:, 1] == 0) and np.all(q[:, 256:512] == 0)
    assert np.all(q[:, 520] == -127) and np.all(q[:, 700] == 127) and np.all(d[:, 2] > 0)


def test_infinite_activations_give_ieee_results_not_an_exception() -> None:
    """An infinite activation (a diverging model; once, unwritten buffers in a warm-up pass) quantizes as numpy
    divides, ``d = 1 / (-127 / inf) = -inf``, as the reference does, instead of stopping the step with Python's
    ZeroDivisionError; the other blocks keep the reference's numbers."""
    x = activations(2, 2 * 256, seed=4)
    x[0, 3], x[1, 300] = np.inf, -np.inf
    q, d, _ = quantize_k(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        q_ref, d_ref, _ = q8k_act.quantize_q8_k(x)
    assert d[0, 0] == -np.inf and d[1, 1] == np.inf
    assert np.array_equal(d[0, 1:], d_ref[0, 1:]) and np.array_equal(q[0, 256:], q_ref[0, 256:])
    assert np.array_equal(d[1, :1], d_ref[1, :1]) and np.array_equal(q[1, :256], q_ref[1, :256])
    q8, d8 = np.empty(x.shape, np.int8), np.empty((2, 16), np.float32)
    quantize_rows(x, q8, d8)
    assert d8[0, 0] == np.inf and d8[1, 9] == np.inf


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 2, 5, GEMV_ROWS])
def test_block_sums_are_exact(qtype: QType, n: int) -> None:
    """Scales of 1 and activation blocks whose largest value is 127 (so ``d_x = 1``, ``q = x``): every sum of
    the products is an integer below 2^24, so the kernel's float32 result is the exact int32 sum."""
    rng = np.random.default_rng(n)
    for nb in (1, 3):
        raw = random_blocks(qtype, 37, nb, seed=n, scales=np.uint16(0x3C00))  # 37 rows: not a multiple of any tile
        x = rng.integers(-127, 128, (n, nb * 32)).astype(np.float32)
        x[:, ::32] = rng.choice([-127, 127], (n, nb))
        w, _ = weights_of(qtype, raw)
        q, d = q8_act.quantize_activations(x)
        assert np.array_equal(q, x) and np.all(d == 1)
        expected = q8_act.block_sums(w, q).sum(axis=2)  # [n, 37] int32
        assert np.array_equal(run(KERNELS[qtype](raw), x), expected.astype(np.float32))
    if qtype != QType.Q8_0:
        return
    extreme = random_blocks(qtype, 2, 1, seed=0, scales=np.uint16(0x3C00))
    extreme[0, 2:] = np.uint8(128)  # -128 everywhere
    extreme[1, 2:] = 127
    x = np.full((1, 32), -127, np.float32)
    assert run(Q8_0Int8Kernel(extreme), x).tolist() == [[32 * 128 * 127, -32 * 127 * 127]]


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 3, 8, GEMV_ROWS])
def test_products_within_the_error_model(qtype: QType, n: int) -> None:
    nb, rows = 14, 53
    raw = random_blocks(qtype, rows, nb, seed=10 + n)
    x = activations(n, nb * 32, seed=n)
    w, scales = weights_of(qtype, raw)
    got = run(KERNELS[qtype](raw), x)
    reference = q8_act.product(w, scales, x)
    q, d = q8_act.quantize_activations(x)
    sums = q8_act.block_sums(np.abs(w), np.abs(q))  # sum |w q| per block
    magnitude = np.einsum("nrb,rb,nb->nr", sums.astype(np.float64), np.abs(scales.astype(np.float64)), d)
    assert np.all(np.abs(got - reference) <= (nb + 17) * EPS32 * magnitude)
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_equal_alone_and_in_any_batch(qtype: QType) -> None:
    """Row invariance (the server's batch invariance): 1..GEMV_ROWS rows, and more through ``rowwise``; a product of
    more rows than ``direct_rows`` is the float kernel's (or, on AMX and for Q8_0, Q4_0 and Q5_0 on AVX2's lanes,
    the blockwise reference's)."""
    raw = random_blocks(qtype, 29, 9, seed=3)
    x = activations(max(GEMV_ROWS, Int8Kernel.direct_rows) + 5, 9 * 32, seed=4)
    kernel = KERNELS[qtype](raw)
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(len(x))])
    for n in range(2, GEMV_ROWS + 1):
        assert np.array_equal(run(kernel, x[:n]), alone[:n])
    ws = Workspace(threads=2, kernels="numba", activations="q8")
    weight = make_weight(StoredTensor("w", qtype, (29, 9 * 32), "memory", data=raw), ws, tile_elements=8 * 288)
    assert isinstance(weight.kernel, KERNELS[qtype])
    with ws.rowwise():
        assert np.array_equal(weight.matmul(x), alone)
    assert np.array_equal(weight.matmul(x[:Int8Kernel.direct_rows]), alone[:Int8Kernel.direct_rows])
    exact = make_weight(StoredTensor("w", qtype, (29, 9 * 32), "memory", data=raw),
                        Workspace(threads=2, kernels="numba"), tile_elements=8 * 288)  # the same tiles, float
    many = exact.matmul(x)
    if amx_available() or (qtype in (QType.Q8_0, QType.Q4_0, QType.Q5_0) and jit_lanes.takes_q8_0()):
        w, scales, mins = q8_act.block_weights(qtype, raw)
        q, d = q8_act.quantize_activations(x)
        many = q8_act.product_blockwise(w, scales, q, d, mins, None if mins is None else q8_act.activation_sums(q, d))
    assert np.array_equal(weight.matmul(x), many)


def test_activations_choice_is_checked() -> None:
    with pytest.raises(KernelsError, match="compiled kernels"):
        Workspace(kernels="numpy", activations="q8")
    with pytest.raises(KernelsError, match="activations"):
        Workspace(kernels="numba", activations="int4")
    assert Workspace(kernels="numba").activations == "float"


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1", "q3_k_m", "iq4_xs"])
def test_model_logits_close_to_the_float_path(converted: Converted, dtype: str) -> None:
    """A model with 8-bit activations (q8_0; the tiny fixture's rows are not multiples of 256, so the K and
    IQ4_XS mixes fall back to Q4_0, Q5_0, Q5_1, IQ4_NL and Q8_0, all integer kernels): its logits stay within
    the 8-bit activations' error (2^-8 of each product's magnitude, through a few layers) of the exact path's."""
    assert_decode_step_close_to_the_float_path(converted("qwen2-tiny", "gguf", dtype))


def assert_decode_step_close_to_the_float_path(path: Path) -> None:
    """The model at ``path`` with 8-bit activations against its exact path: after the same 6-token prompt, one
    decode step (integer products) differs, by at most 5 % of the exact logits' largest magnitude."""
    exact, q8 = load(path, kernels="numba"), load(path, kernels="numba", activations="q8")
    assert q8.workspace.activations == "q8"
    ids = np.array([[3, 17, 42, 7, 99, 5]])
    cache_exact, cache_q8 = exact.make_cache(1, 8), q8.make_cache(1, 8)
    exact.forward(ids, cache_exact, last_only=True)
    q8.forward(ids, cache_q8, last_only=True)
    step = np.array([[11]])
    want, got = exact.forward(step, cache_exact), q8.forward(step, cache_q8)  # one decode step: integer products
    assert not np.array_equal(got, want)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


K45_BYTES = {QType.Q4_K: 144, QType.Q5_K: 176}
# Types whose row kernels take q8_K activations here (AVX2 without AVX-512 VNNI: ``int8_k.Q8K``): bit for bit
# ``q8k_act.product``, whose error model against float64 ``test_jit_amx_k.py`` proves.
Q8K_TYPES = (QType.Q4_K, QType.Q6_K) if Q8K else ()


def q8k_reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    return q8k_act.product(qtype, raw, *q8k_act.quantize_q8_k(x))
K45_KERNELS = {QType.Q4_K: Q4_KInt8Kernel, QType.Q5_K: Q5_KInt8Kernel}


def q4_k_parts(raw: np.ndarray, qtype: QType = QType.Q4_K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int16 [R, nb * 256], ds [R, nb * 8], dm [R, nb * 8]) of Q4_K (q 0..15) or Q5_K (0..31: bit ``j`` of
    ``qh`` as bit 4 in sub-block ``j``) rows (gguf's scale unpacking), checked against the codec's reference
    (value = ds * q - dm, rounded as float32)."""
    blocks = raw.reshape(-1, K45_BYTES[qtype])
    sc, m = gquants.Q4_K.get_scale_min(blocks[:, 4:16])
    d, dmin = (F16_TABLE[blocks[:, at:at + 2].copy().view(np.uint16)[:, 0]] for at in (0, 2))
    ds, dm = d[:, None] * sc.astype(np.float32), dmin[:, None] * m.astype(np.float32)  # [blocks, 8]
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(-1, 8, 32).astype(np.int16)
    if qtype == QType.Q5_K:
        qh = blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # [blocks, 8, 32]
        q |= (qh & 1).astype(np.int16) << 4
    decoded = codec(qtype).reference(raw).reshape(-1, 8, 32)
    assert np.array_equal(decoded, ds[..., None] * q.astype(np.float32) - dm[..., None])
    rows = len(raw)
    return q.reshape(rows, -1), ds.reshape(rows, -1), dm.reshape(rows, -1)


def q4_k_rows(rows: int, nb: int, seed: int, unit: bool = False, qtype: QType = QType.Q4_K) -> np.ndarray:
    """Random Q4_K/Q5_K rows; ``unit``: d = 1, dmin = 0 and every 6-bit scale 1 (values = the quants)."""
    size = K45_BYTES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * nb, size), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, (rows * nb, 2)) * rng.choice([-1, 1], (rows * nb, 2))).astype(np.float16)
    d.view(np.uint16)[rng.random(d.shape) < 0.1] = 0
    if unit:
        d[:] = [1, 0]
        blocks[:, 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    blocks[:, :4] = d.view(np.uint8)
    return blocks.reshape(rows, nb * size)


@pytest.mark.parametrize("qtype", list(K45_KERNELS))
@pytest.mark.parametrize("n", [1, 4, GEMV_ROWS])
def test_q4_k_block_sums_are_exact(qtype: QType, n: int) -> None:
    raw = q4_k_rows(23, 2, seed=n, unit=True, qtype=qtype)
    q_w, ds, dm = q4_k_parts(raw, qtype)
    assert np.all(ds == 1) and np.all(dm == 0)
    rng = np.random.default_rng(n)
    x = rng.integers(-127, 128, (n, 512)).astype(np.float32)
    x[:, ::32] = 127
    q, d = q8_act.quantize_activations(x)
    assert np.array_equal(q, x) and np.all(d == 1)
    expected = q8_act.block_sums(q_w, q).sum(axis=2).astype(np.float32)  # below 2^24: exact in float32
    assert np.array_equal(run(K45_KERNELS[qtype](raw), x), expected)


@pytest.mark.parametrize("qtype", list(K45_KERNELS))
@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS])
def test_q4_k_within_the_error_model(qtype: QType, n: int) -> None:
    """``sum_j ds_j d_x[j] (q_j . q_x[j]) - dm_j xsum[j]`` (float64 from exact block sums; ``xsum`` the float32
    sums per 32): the lanes' terms as in the module docstring, plus the minimums' own ``nb * 8`` ordered sums."""
    nb = 3
    raw = q4_k_rows(31, nb, seed=20 + n, qtype=qtype)
    x = activations(n, nb * 256, seed=n)
    q_w, ds, dm = q4_k_parts(raw, qtype)
    q, d = q8_act.quantize_activations(x)
    xsum = x.reshape(n, -1, 32).sum(axis=2, dtype=np.float32)
    sums = q8_act.block_sums(q_w, q).astype(np.float64)  # [n, R, nb * 8]
    reference = np.einsum("nrj,rj,nj->nr", sums, ds.astype(np.float64), d) - xsum.astype(np.float64) @ dm.T
    magnitude = np.einsum("nrj,rj,nj->nr", q8_act.block_sums(q_w, np.abs(q)).astype(np.float64), np.abs(ds), d)
    magnitude += np.abs(xsum.astype(np.float64)) @ np.abs(dm.T)
    kernel = jit_kernel(qtype, raw, activations="q8")  # the registered integer-dot kernel
    assert isinstance(kernel, K45_KERNELS[qtype])
    got = run(kernel, x)
    if qtype in Q8K_TYPES:
        assert np.array_equal(got, q8k_reference(qtype, raw, x))
    else:
        assert np.all(np.abs(got - reference) <= (nb * 8 + 18) * EPS32 * magnitude)
    # rows alone and in every batch size: the same numbers
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(n)])
    for m in range(1, n + 1):
        assert np.array_equal(run(kernel, x[:m]), alone[:m])


def q6_k_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w = q - 32 int16 [R, nb * 256], d * sc float32 [R, nb * 16]) of Q6_K rows, checked against the codec's
    reference (value = (d * sc) * w in float32)."""
    blocks = raw.reshape(-1, 210)
    ql, qh = blocks[:, :128].astype(np.int16), blocks[:, 128:192].astype(np.int16)
    w = np.empty((len(blocks), 256), np.int16)
    for h in range(2):
        for s in range(4):
            low = (ql[:, 64 * h + 32 * (s % 2): 64 * h + 32 * (s % 2) + 32] >> (4 * (s // 2))) & 15
            high = (qh[:, 32 * h: 32 * h + 32] >> (2 * s)) & 3
            w[:, 128 * h + 32 * s: 128 * h + 32 * s + 32] = (low | (high << 4)) - 32
    d = F16_TABLE[blocks[:, 208:210].copy().view(np.uint16)[:, 0]]
    scales = d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [blocks, 16]
    decoded = codec(QType.Q6_K).reference(raw).reshape(-1, 16, 16)
    assert np.array_equal(decoded, scales[..., None] * w.reshape(-1, 16, 16).astype(np.float32))
    return w.reshape(len(raw), -1), scales.reshape(len(raw), -1)


def q6_k_rows(rows: int, nb: int, seed: int, unit: bool = False) -> np.ndarray:
    """Random Q6_K rows; ``unit``: d = 1 and every scale 1 (values = q - 32)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * nb, 210), dtype=np.uint8)
    d = (rng.uniform(1e-4, 1e-3, rows * nb) * rng.choice([-1, 1], rows * nb)).astype(np.float16)
    d.view(np.uint16)[rng.random(d.shape) < 0.1] = 0
    if unit:
        d[:] = 1
        blocks[:, 192:208] = 1
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, nb * 210)


@pytest.mark.parametrize("n", [1, 4, GEMV_ROWS])
def test_q6_k_block_sums_are_exact(n: int) -> None:
    raw = q6_k_rows(19, 2, seed=n, unit=True)
    w, scales = q6_k_parts(raw)
    assert np.all(scales == 1)
    rng = np.random.default_rng(n)
    x = rng.integers(-127, 128, (n, 512)).astype(np.float32)
    x[:, ::32] = -127
    q, d = q8_act.quantize_activations(x)
    assert np.array_equal(q, x) and np.all(d == 1)
    expected = q8_act.block_sums(w, q).sum(axis=2).astype(np.float32)
    assert np.array_equal(run(Q6_KInt8Kernel(raw), x), expected)


@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS])
def test_q6_k_within_the_error_model(n: int) -> None:
    """``sum_j (d sc_j) d_x[j // 2] (w_j . q_x)`` over the 16-value sub-blocks, float64 from exact sums."""
    nb = 3
    raw = q6_k_rows(27, nb, seed=30 + n)
    x = activations(n, nb * 256, seed=n)
    w, scales = q6_k_parts(raw)
    q, d = q8_act.quantize_activations(x)
    halves = np.repeat(d, 2, axis=1).astype(np.float64)  # [n, nb * 16]: each sub-block's activation scale

    def per_16(wi: np.ndarray, qi: np.ndarray) -> np.ndarray:
        return np.einsum("rjk,njk->nrj", wi.reshape(len(wi), -1, 16).astype(np.int64),
                         qi.reshape(len(qi), -1, 16).astype(np.int64)).astype(np.float64)

    reference = np.einsum("nrj,rj,nj->nr", per_16(w, q), scales.astype(np.float64), halves)
    magnitude = np.einsum("nrj,rj,nj->nr", per_16(np.abs(w), np.abs(q)), np.abs(scales.astype(np.float64)), halves)
    got = run(Q6_KInt8Kernel(raw), x)
    if QType.Q6_K in Q8K_TYPES:
        assert np.array_equal(got, q8k_reference(QType.Q6_K, raw, x))
    else:
        assert np.all(np.abs(got - reference) <= (nb * 8 + 18) * EPS32 * magnitude)
    kernel = Q6_KInt8Kernel(raw)
    assert np.array_equal(np.concatenate([run(kernel, x[i:i + 1]) for i in range(n)]), got)


def iq4_xs_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(levels int16 [R, nb * 256], scales d * (ls_j - 32) float32 [R, nb * 8]) of IQ4_XS rows (iq4.py's
    docstring layout), checked against the codec's reference (value = scale * level in float32)."""
    blocks = raw.reshape(-1, 136)
    d = F16_TABLE[blocks[:, :2].copy().view(np.uint16)[:, 0]]
    high = blocks[:, 2:4].copy().view(np.uint16)[:, 0].astype(np.int32)
    j = np.arange(8)
    ls = ((blocks[:, 4 + j // 2].astype(np.int32) >> (4 * (j % 2))) & 15) | (((high[:, None] >> (2 * j)) & 3) << 4)
    scales = d[:, None] * (ls - 32).astype(np.float32)  # [blocks, 8]
    qs = blocks[:, 8:].reshape(-1, 8, 16)
    w = IQ4_LEVELS[np.concatenate([qs & 15, qs >> 4], axis=2)].astype(np.int16)  # [blocks, 8, 32]
    decoded = codec(QType.IQ4_XS).reference(raw).reshape(-1, 8, 32)
    assert np.array_equal(decoded, scales[..., None] * w.astype(np.float32))
    return w.reshape(len(raw), -1), scales.reshape(len(raw), -1)


def iq4_xs_rows(rows: int, nb: int, seed: int, unit: bool = False) -> np.ndarray:
    """Random IQ4_XS rows; ``unit``: d = 1 and every ls_j = 33 (scale 1: values = the levels)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * nb, 136), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, rows * nb) * rng.choice([-1, 1], rows * nb)).astype(np.float16)
    d.view(np.uint16)[rng.random(d.shape) < 0.1] = 0
    if unit:
        d[:] = 1
        blocks[:, 2:4] = 0b10101010  # high bits 2 of every ls: 32 + low nibble 1
        blocks[:, 4:8] = 0x11
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, nb * 136)


@pytest.mark.parametrize("n", [1, 3, 8, GEMV_ROWS])
def test_iq4_xs_exact_sums_error_model_and_rows(n: int) -> None:
    """IQ4_XS: exact block sums at unit scales; the error model of :func:`test_products_within_the_error_model`
    with the sub-block scales; every row the same alone and in any batch."""
    rng = np.random.default_rng(n)
    unit = iq4_xs_rows(21, 2, seed=n, unit=True)
    w, scales = iq4_xs_parts(unit)
    assert np.all(scales == 1)
    x = rng.integers(-127, 128, (n, 512)).astype(np.float32)
    x[:, ::32] = 127
    q, d = q8_act.quantize_activations(x)
    assert np.array_equal(q, x) and np.all(d == 1)
    kernel = jit_kernel(QType.IQ4_XS, unit, activations="q8")
    assert isinstance(kernel, IQ4_XSInt8Kernel)
    assert np.array_equal(run(kernel, x), q8_act.block_sums(w, q).sum(axis=2).astype(np.float32))

    nb = 3
    raw = iq4_xs_rows(27, nb, seed=40 + n)
    x = activations(n, nb * 256, seed=n)
    w, scales = iq4_xs_parts(raw)
    kernel = IQ4_XSInt8Kernel(raw)
    got = run(kernel, x)
    reference = q8_act.product(w, scales, x)
    q, d = q8_act.quantize_activations(x)
    sums = q8_act.block_sums(np.abs(w), np.abs(q))
    magnitude = np.einsum("nrb,rb,nb->nr", sums.astype(np.float64), np.abs(scales.astype(np.float64)), d)
    assert np.all(np.abs(got - reference) <= (nb * 8 + 17) * EPS32 * magnitude)
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(n)])
    for m in range(1, n + 1):
        assert np.array_equal(run(kernel, x[:m]), alone[:m])


@pytest.mark.slow
@pytest.mark.parametrize("form", [pytest.param(form, marks=pytest.mark.cpu(form))
                                  for form in ("avx2", "avx512 without vnni")])
def test_the_other_instruction_forms(form: str) -> None:
    """This file's kernel tests in a process compiling for another CPU (``NUMBA_CPU_FEATURES``; numba keys its
    cache by them): AVX2's two 256-bit ``pmaddwd`` and the generic sums of 4, or AVX-512BW without VNNI (Q8_0's
    sums of 4 from ``pmaddwd`` pairs): the same exact sums, so every assertion holds as it is; with them the compiled
    decode step's row products (``test_jit_kernels.py``), whose forms differ without VNNI, and for AVX2 the float
    kernels' tests, whose small groups of rows convert and scale each block without AVX-512F instead of looking
    the values up (``jit_base.PERMUTE``; AVX-512 without VNNI compiles them as with it)."""
    from llvmlite import binding as llvm

    features = other_instruction_forms(llvm.get_host_cpu_features().flatten())[form]
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    kernels = Path(__file__).parent / "test_jit_kernels.py"
    tests = ["test_q8_row_product_by_address_equals_the_kernel"]
    if form == "avx2":
        tests += ["test_product_within_float32_error_model", "test_each_row_is_the_same_alone_and_in_any_batch",
                  "test_row_product_by_address_equals_the_kernel_bit_for_bit"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                             "-k", "not model_logits", __file__, *[f"{kernels}::{test}" for test in tests]],
                            capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2])  # no model
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


MIN_BYTES = {QType.Q4_1: 20, QType.Q5_1: 24}


def min_parts(qtype: QType, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int16 [R, nb * 32] 0..15 or 0..31, d [R, nb], m [R, nb]) of Q4_1/Q5_1 rows (legacy.py's layout),
    checked against the codec's reference (value = d * q + m in float32)."""
    blocks = raw.reshape(len(raw), -1, MIN_BYTES[qtype])
    d, m = (F16_TABLE[blocks[:, :, at:at + 2].copy().view(np.uint16)[..., 0]] for at in (0, 2))
    qs = blocks[:, :, -16:].astype(np.int16)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)
    if qtype == QType.Q5_1:
        qh = blocks[:, :, 4:8].copy().view(np.uint32)  # [R, nb, 1]
        q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
    decoded = codec(qtype).reference(raw).reshape(q.shape)
    assert np.array_equal(decoded, d[..., None] * q.astype(np.float32) + m[..., None])
    return q.reshape(len(raw), -1), d, m


def min_rows(qtype: QType, rows: int, nb: int, seed: int, unit: bool = False) -> np.ndarray:
    """Random Q4_1/Q5_1 rows; ``unit``: d = 1, m = 0 (values = the quants)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, nb, MIN_BYTES[qtype]), dtype=np.uint8)
    dm = (rng.uniform(1e-3, 1e-2, (rows, nb, 2)) * rng.choice([-1, 1], (rows, nb, 2))).astype(np.float16)
    dm.view(np.uint16)[rng.random(dm.shape) < 0.1] = 0
    if unit:
        dm[:] = [1, 0]
    blocks[:, :, :4] = dm.view(np.uint8).reshape(rows, nb, 4)
    return blocks.reshape(rows, nb * MIN_BYTES[qtype])


@pytest.mark.parametrize("qtype", list(MIN_BYTES))
@pytest.mark.parametrize("n", [1, 3, 8, GEMV_ROWS])
def test_types_with_a_minimum(qtype: QType, n: int) -> None:
    """Q4_1/Q5_1: exact block sums at d = 1, m = 0; ``sum_b d_b d_x[b] (q_b . q_x[b]) + m_b xsum[b]`` within
    the error model (the lanes' terms plus the minimums' ``nb`` ordered sums); rows alone and in any batch."""
    rng = np.random.default_rng(n)
    unit = min_rows(qtype, 19, 3, seed=n, unit=True)
    q_w, d_w, m_w = min_parts(qtype, unit)
    assert np.all(d_w == 1) and np.all(m_w == 0)
    x = rng.integers(-127, 128, (n, 96)).astype(np.float32)
    x[:, ::32] = 127
    q, d = q8_act.quantize_activations(x)
    assert np.array_equal(q, x) and np.all(d == 1)
    kernel = jit_kernel(qtype, unit, activations="q8")
    assert isinstance(kernel, Q4_1Int8Kernel)
    assert np.array_equal(run(kernel, x), q8_act.block_sums(q_w, q).sum(axis=2).astype(np.float32))

    nb = 14
    raw = min_rows(qtype, 41, nb, seed=50 + n)
    x = activations(n, nb * 32, seed=n)
    q_w, d_w, m_w = min_parts(qtype, raw)
    q, d = q8_act.quantize_activations(x)
    xsum = x.reshape(n, nb, 32).sum(axis=2, dtype=np.float32)
    reference = q8_act.product(q_w, d_w, x) + xsum.astype(np.float64) @ m_w.T.astype(np.float64)
    magnitude = np.einsum("nrb,rb,nb->nr", q8_act.block_sums(q_w, np.abs(q)).astype(np.float64),
                          np.abs(d_w.astype(np.float64)), d)
    magnitude += np.abs(xsum.astype(np.float64)) @ np.abs(m_w.T.astype(np.float64))
    kernel = jit_kernel(qtype, raw, activations="q8")
    got = run(kernel, x)
    assert np.all(np.abs(got - reference) <= (2 * nb + 18) * EPS32 * magnitude)
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(n)])
    for m in range(1, n + 1):
        assert np.array_equal(run(kernel, x[:m]), alone[:m])


K23_BYTES = {QType.Q2_K: 84, QType.Q3_K: 110}


def k23_parts(qtype: QType, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w int16 [R, nb * 256], ds [R, nb * 16], dm [R, nb * 16]) of Q2_K (w 0..3) or Q3_K (w -4..3, dm 0) rows
    (kquants.py's layout), checked against the codec's reference (value = ds * w - dm in float32)."""
    blocks = raw.reshape(-1, K23_BYTES[qtype]).astype(np.int32)
    q3 = qtype == QType.Q3_K
    qs = blocks[:, 32:96] if q3 else blocks[:, 16:80]
    w = np.empty((len(blocks), 256), np.int16)
    for h in range(2):
        for s in range(4):
            value = (qs[:, 32 * h: 32 * h + 32] >> (2 * s)) & 3
            if q3:
                value -= 4 * (1 - ((blocks[:, :32] >> (4 * h + s)) & 1))
            w[:, 128 * h + 32 * s: 128 * h + 32 * s + 32] = value
    f16 = raw.reshape(-1, K23_BYTES[qtype])
    j = np.arange(16)
    if q3:
        d = F16_TABLE[f16[:, 108:110].copy().view(np.uint16)[:, 0]]
        sj = ((blocks[:, 96 + j % 8] >> (4 * (j // 8))) & 15) | (((blocks[:, 104 + j % 4] >> (2 * (j // 4))) & 3) << 4)
        ds, dm = d[:, None] * (sj - 32).astype(np.float32), np.zeros((len(blocks), 16), np.float32)
    else:
        d, dmin = (F16_TABLE[f16[:, at:at + 2].copy().view(np.uint16)[:, 0]] for at in (80, 82))
        ds = d[:, None] * (blocks[:, :16] & 15).astype(np.float32)
        dm = dmin[:, None] * (blocks[:, :16] >> 4).astype(np.float32)
    decoded = codec(qtype).reference(raw).reshape(-1, 16, 16)
    assert np.array_equal(decoded, ds[..., None] * w.reshape(-1, 16, 16).astype(np.float32) - dm[..., None])
    rows = len(raw)
    return w.reshape(rows, -1), ds.reshape(rows, -1), dm.reshape(rows, -1)


def k23_rows(qtype: QType, rows: int, nb: int, seed: int, unit: bool = False) -> np.ndarray:
    """Random Q2_K/Q3_K rows; ``unit``: every sub-block scale 1 and no minimum (values = w)."""
    size, rng = K23_BYTES[qtype], np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * nb, size), dtype=np.uint8)
    d = (rng.uniform(1e-3, 1e-2, (rows * nb, 2)) * rng.choice([-1, 1], (rows * nb, 2))).astype(np.float16)
    d.view(np.uint16)[rng.random(d.shape) < 0.1] = 0
    if qtype == QType.Q3_K:
        if unit:
            d[:, 0] = 1
            blocks[:, 96:104], blocks[:, 104:108] = 0x11, 0b10101010  # every 6-bit s_j = 33
        blocks[:, 108:110] = d[:, :1].view(np.uint8)
    else:
        if unit:
            d[:] = [1, 0]
            blocks[:, :16] = 1
        blocks[:, 80:84] = d.view(np.uint8)
    return blocks.reshape(rows, nb * size)


@pytest.mark.parametrize("qtype", list(K23_BYTES))
@pytest.mark.parametrize("n", [1, 3, 8, GEMV_ROWS])
def test_q2_k_q3_k(qtype: QType, n: int) -> None:
    """Exact block sums at unit scales; ``sum_j ds_j d_x[j // 2] (w_j . q_x) - dm_j xsum16[j]`` over the
    16-value sub-blocks within the error model (each lane fuses ``nb * 8`` terms; Q2_K's minimums take 3
    roundings per step, ``nb * 24``); rows alone and in any batch."""
    rng = np.random.default_rng(n)
    unit = k23_rows(qtype, 17, 2, seed=n, unit=True)
    w, ds, dm = k23_parts(qtype, unit)
    assert np.all(ds == 1) and np.all(dm == 0)
    x = rng.integers(-127, 128, (n, 512)).astype(np.float32)
    x[:, ::32] = -127
    q, d = q8_act.quantize_activations(x)
    assert np.array_equal(q, x) and np.all(d == 1)
    kernel = jit_kernel(qtype, unit, activations="q8")
    assert isinstance(kernel, Q2_KInt8Kernel)
    assert np.array_equal(run(kernel, x), q8_act.block_sums(w, q).sum(axis=2).astype(np.float32))

    nb = 3
    raw = k23_rows(qtype, 23, nb, seed=60 + n)
    x = activations(n, nb * 256, seed=n)
    w, ds, dm = k23_parts(qtype, raw)
    q, d = q8_act.quantize_activations(x)
    halves = np.repeat(d, 2, axis=1).astype(np.float64)  # [n, nb * 16]: each sub-block's activation scale
    xsum = x.reshape(n, -1, 16).sum(axis=2, dtype=np.float32).astype(np.float64)

    def per_16(wi: np.ndarray, qi: np.ndarray) -> np.ndarray:
        return np.einsum("rjk,njk->nrj", wi.reshape(len(wi), -1, 16).astype(np.int64),
                         qi.reshape(len(qi), -1, 16).astype(np.int64)).astype(np.float64)

    reference = np.einsum("nrj,rj,nj->nr", per_16(w, q), ds.astype(np.float64), halves) - xsum @ dm.T
    magnitude = np.einsum("nrj,rj,nj->nr", per_16(np.abs(w), np.abs(q)), np.abs(ds.astype(np.float64)), halves)
    magnitude += np.abs(xsum) @ np.abs(dm.T.astype(np.float64))
    kernel = jit_kernel(qtype, raw, activations="q8")
    got = run(kernel, x)
    assert np.all(np.abs(got - reference) <= (nb * 24 + 18) * EPS32 * magnitude)
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(n)])
    for m in range(1, n + 1):
        assert np.array_equal(run(kernel, x[:m]), alone[:m])
