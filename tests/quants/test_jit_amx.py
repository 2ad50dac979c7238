"""Prefill products of Q8_0 weights with 8-bit activations: the blockwise float32 reference
(``q8_act.product_blockwise``) and the AMX tile kernel (``quants/jit_amx.py``) held to it.

Error model: the int32 block sums are exact (at most 32 * 128 * 127 < 2^24, so also exact in float32).  The
reference adds the blocks in order, ``acc = acc + f32(s_b) * fl(d_w * d_x)``, three roundings per block; against
the float64 value of the exact sums ``|ref - exact| <= (nb + 2) * eps32 * S`` with ``S = sum_b |s_b| d_w d_x``
(first order).  The decode kernels (``jit_int8``) round partial sums of 4 products per lane (lanes over pairs of
blocks, fused adds, a pairwise sum of 16 lanes), so their bound is ``(nb + 17) * eps32 * A`` with ``A = sum_b
(sum_k |w_k q_k|) |d_w d_x|`` (cancellation inside a block shows: a block whose sum is 13 from products of
~10^4 is off by far more than eps32 of 13), and the two agree within ``(2 nb + 19) * eps32 * A``, not bit for
bit.  The AMX kernel does the reference's operations in its order, so it must equal it bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen_runtime.pool import Scratch
from qwen_runtime.quants import QType, codec, q8_act

pytest.importorskip("numba")
from qwen_runtime.quants.jit_base import GEMV_ROWS  # noqa: E402
from qwen_runtime.quants.jit_int8 import Q8_0Int8Kernel  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def q8_0_rows(rows: int, nb: int, seed: int, scale: np.float16 | None = None) -> np.ndarray:
    """Random Q8_0 rows [rows, nb * 34]: every int8 value (-128 included), float16 scales of about 1e-3 of both
    signs with a few zeros and subnormals, or all ``scale``."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
    if scale is None:
        scales = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        edge = rng.random(scales.shape) < 0.05
        scales[edge] = rng.choice(np.array([0, 1e-7, -6e-8], np.float16), int(edge.sum()))
    else:
        scales = np.full((rows, nb), scale, np.float16)
    blocks[:, :, :2] = scales[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * 34)


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with an all-zero block, a tiny value, a constant block and a large one."""
    x = np.random.default_rng(seed).normal(0, 1, (n, cols)).astype(np.float32)
    if cols >= 4 * 32:
        x[:, 0:32] = 0
        x[:, 32:64] = 0
        x[:, 40] = 1e-30
        x[:, 64:96] = -3.25
        x[:, 96:128] *= 1e20
    return x


def reference(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, scales = q8_act.q8_0_weights(raw)
    q, d = q8_act.quantize_activations(x)
    return q8_act.product_blockwise(w, scales, q, d)


def magnitude(raw: np.ndarray, x: np.ndarray, products: bool = False) -> np.ndarray:
    """``S = sum_b |s_b| |d_w d_x|`` per output, float64 (``products``: ``A``, with ``sum |w q|`` for ``|s_b|``)."""
    w, scales = q8_act.q8_0_weights(raw)
    q, d = q8_act.quantize_activations(x)
    if products:
        sums = q8_act.block_sums(np.abs(w.astype(np.int16)), np.abs(q)).astype(np.float64)
    else:
        sums = np.abs(q8_act.block_sums(w, q)).astype(np.float64)
    return np.einsum("nrb,rb,nb->nr", sums, np.abs(scales.astype(np.float64)), d.astype(np.float64))


def decode_kernel(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The existing q8-activation decode kernels, every row by the integer row kernels (``rowwise``: above
    ``direct_rows`` rows :meth:`product` takes the float kernel)."""
    kernel = Q8_0Int8Kernel(raw)
    out = np.empty((len(x), len(raw)), np.float32)
    kernel.product_rows(0, len(raw), kernel.prepare(x, rowwise=True), out, Scratch())
    return out


def test_weights_of_the_stored_blocks() -> None:
    raw = q8_0_rows(5, 3, seed=0)
    w, scales = q8_act.q8_0_weights(raw)
    decoded = codec(QType.Q8_0).reference(raw)
    assert np.array_equal(decoded, (scales[..., None] * w.reshape(5, 3, 32).astype(np.float32)).reshape(5, -1))


@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS + 5])
def test_reference_against_the_decode_kernel(n: int) -> None:
    """Within float32 summation-order error of the q8 decode kernel, and of the exact float64 sums."""
    nb = 14
    raw = q8_0_rows(45, nb, seed=n)
    x = activations(n, nb * 32, seed=n)
    ref, size = reference(raw, x), magnitude(raw, x)
    w, scales = q8_act.q8_0_weights(raw)
    exact = q8_act.product(w, scales, x)
    assert np.all(np.abs(ref - exact) <= (nb + 2) * EPS32 * size)
    products = magnitude(raw, x, products=True)
    assert np.all(np.abs(decode_kernel(raw, x) - ref) <= (2 * nb + 19) * EPS32 * products)
    assert np.all(np.isfinite(ref))


def test_reference_integer_sums_exact() -> None:
    """Scales of 1 and activation blocks whose largest value is 127 (``q = x``, ``d_x = 1``): the reference is
    the exact int32 sum, and equals the decode kernel's bit for bit."""
    rng = np.random.default_rng(1)
    nb = 3
    raw = q8_0_rows(37, nb, seed=1, scale=np.float16(1))
    x = rng.integers(-127, 128, (GEMV_ROWS, nb * 32)).astype(np.float32)
    x[:, ::32] = 127
    w, _ = q8_act.q8_0_weights(raw)
    expected = (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
    assert np.array_equal(reference(raw, x), expected)
    assert np.array_equal(decode_kernel(raw, x), expected)
