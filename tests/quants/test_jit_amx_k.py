"""Prompts of Q4_K and Q6_K weights with q8_K activations: the numpy reference of llama.cpp's arithmetic
(``q8k_act``) and the AMX tile kernels (``backend/kernels/amx_k.py``) held to it bit for bit.

Error model of the reference: the per-super-block integer sums are exact (int64 in numpy, int32 on the tiles:
at most 256 * 4096 * 128 < 2^31), so against the float64 product of the dequantized activations (``q * d``) and
the decoded weights it differs only by float32 rounding: per super-block two products and an add (three for
the minimums' term), so ``|ref - exact| <= (3 nb + 4) * eps32 * S`` with ``S`` the sum of the magnitudes of the
terms; the kernels do the reference's operations in its order, so they equal it bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen_runtime.quants import QType, codec, q8k_act
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import JIT_KERNELS, JIT_PROMPT_KERNELS, jit_kernel  # noqa: E402
from qwen_runtime.backend.kernels import amx as jit_amx  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels import amx_k as jit_amx_k  # noqa: E402
from qwen_runtime.backend.kernels import int8_k as jit_int8_k  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
SIZES = {QType.Q4_K: 144, QType.Q6_K: 210}


def k_rows(qtype: QType, rows: int, nb: int, seed: int) -> np.ndarray:
    """Random rows of ``qtype``: every quant and scale bit pattern, float16 d (and dmin) of about 1e-3, both
    signs, a few zeros."""
    rng = np.random.default_rng(seed)
    size = SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    scales = (rng.uniform(2e-4, 2e-3, (rows, nb, 2)) * rng.choice([-1, 1], (rows, nb, 2))).astype(np.float16)
    scales[rng.random(scales.shape) < 0.05] = 0
    fields = scales.view(np.uint8).reshape(rows, nb, 4)
    if qtype == QType.Q4_K:
        blocks[:, :, 0:4] = fields
    else:
        blocks[:, :, 208:210] = fields[:, :, 0:2]
    return blocks.reshape(rows, nb * size)


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with an all-zero super-block, a tiny value in another, a negative largest value."""
    x = np.random.default_rng(seed).normal(0, 1, (n, cols)).astype(np.float32)
    if cols >= 2 * 256:
        x[:, 0:256] = 0
        x[:, 5] = 1e-30
        x[:, 300] = -40
    return x


def reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    q, d, bsums = q8k_act.quantize_q8_k(x)
    if qtype == QType.Q4_K:
        return q8k_act.product_q4_k(raw, q, d, bsums)
    return q8k_act.product_q6_k(raw, q, d)


def test_quantize_as_llama_cpp() -> None:
    """llama.cpp's ``quantize_row_q8_K_ref`` written out per value (first value of largest magnitude, ``-127 /
    max``, round half to even, at most 127, ``d = 1 / iscale``, sums per 16)."""
    x = activations(3, 512, seed=1)
    x[1, 256:512] = np.linspace(-2, 2, 256, dtype=np.float32)  # -2 and 2: the first, -2, is max
    q, d, bsums = q8k_act.quantize_q8_k(x)
    for i in range(3):
        for b in range(2):
            block = x[i, 256 * b:256 * b + 256]
            amax, top = np.float32(0), np.float32(0)
            for v in block:
                if abs(v) > amax:
                    amax, top = abs(v), v
            if amax == 0:
                assert d[i, b] == 0 and not q[i, 256 * b:256 * b + 256].any()
                continue
            iscale = np.float32(-127) / top
            expected = [min(127, int(np.rint(iscale * v))) for v in block]
            assert q[i, 256 * b:256 * b + 256].tolist() == expected
            assert d[i, b] == np.float32(1) / iscale
    assert np.array_equal(bsums, q.reshape(3, -1, 16).astype(np.int32).sum(axis=2))
    assert (q[1, 256], q[1, 511], d[1, 1]) == (-127, 127, np.float32(1) / np.float32(127 / 2))  # max: -2, first


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_parts_decode_as_the_codec(qtype: QType) -> None:
    raw = k_rows(qtype, 7, 3, seed=2)
    if qtype == QType.Q4_K:
        q, sc, m, d, dmin = q8k_act.q4_k_parts(raw)
        values = (d[..., None, None] * sc[..., None] * q.reshape(7, 3, 8, 32).astype(np.float32)
                  - dmin[..., None, None] * m[..., None])
    else:
        q, sc, d = q8k_act.q6_k_parts(raw)
        values = d[..., None, None] * sc[..., None] * q.reshape(7, 3, 16, 16).astype(np.float32)
    assert np.array_equal(values.reshape(7, -1), codec(qtype).reference(raw))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_reference_against_float64(qtype: QType) -> None:
    """Within float32 rounding of the float64 product of the dequantized activations and decoded weights."""
    nb = 3
    raw = k_rows(qtype, 21, nb, seed=3)
    x = activations(5, nb * 256, seed=3)
    q, d, _ = q8k_act.quantize_q8_k(x)
    xd = q.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)
    w = codec(qtype).reference(raw).astype(np.float64)
    exact = xd @ w.T
    size = np.abs(xd) @ np.abs(w).T
    ref = reference(qtype, raw, x)
    assert np.all(np.abs(ref - exact) <= (3 * nb + 4) * EPS32 * size)
    assert np.abs(ref - exact).max() > 0  # float32, not float64: the bound is what is tested


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
@pytest.mark.parametrize(("m", "rows", "nb"), [(16, 16, 1), (37, 53, 2), (64, 40, 3), (33, 40, 130)])
def test_amx_product_equals_the_reference(qtype: QType, m: int, rows: int, nb: int) -> None:
    """Bit for bit (partial activation and weight tiles; 130 super-blocks: one 16-row panel per L2 chunk)."""
    if not jit_amx.amx_available():
        pytest.skip("AMX int8 tiles are not available here")
    raw = k_rows(qtype, rows, nb, seed=m + rows)
    x = activations(m, nb * 256, seed=nb)
    out = np.full((m, rows), np.nan, np.float32)
    jit_amx_k.kquant_amx_product(raw, jit_amx_k.q8_k_padded(x), out)
    assert np.array_equal(out, reference(qtype, raw, x))


def test_compiled_quantization_equals_the_reference() -> None:
    """``q8_k_padded`` (compiled) gives :func:`q8k_act.quantize_q8_k`'s q and d, zero padding rows, and the sums
    per 32 of its ``bsums`` (pairs of the sums per 16)."""
    x = activations(37, 3 * 256, seed=4)
    x[2, 256:512] = np.linspace(-2, 2, 256, dtype=np.float32)
    q, d, bsums = q8k_act.quantize_q8_k(x)
    pq, pd, pbs = jit_amx_k.q8_k_padded(x)
    assert pq.shape == (64, 768) and not pq[37:].any() and not pd[37:].any() and not pbs[37:].any()
    assert np.array_equal(pq[:37], q) and np.array_equal(pd[:37], d)
    assert np.array_equal(pbs[:37], bsums.reshape(37, -1, 2).sum(axis=2).astype(np.float32))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_kernel_choice_for_prompts(qtype: QType) -> None:
    """``activations="q8"`` picks the AMX kernel class; a prompt of 16 rows or more (not ``rowwise``) is
    quantized once to q8_K and each tile of weight rows equals the reference's columns bit for bit; fewer rows and
    ``rowwise`` products keep the integer decode kernels' preparation (no q8_K activations)."""
    raw = k_rows(qtype, 48, 2, seed=5)
    kernel = jit_kernel(qtype, raw, activations="q8")
    assert isinstance(kernel, jit_int8_k.Q4_KAmxKernel if qtype == QType.Q4_K else jit_int8_k.Q6_KAmxKernel)
    x = activations(20, 512, seed=5)
    assert not isinstance(kernel.prepare(x[:15]), jit_amx_k.KActivations)
    assert not isinstance(kernel.prepare(x, rowwise=True), jit_amx_k.KActivations)
    if not jit_amx.amx_available():
        assert not isinstance(kernel.prepare(x), jit_amx_k.KActivations)
        return
    xk = kernel.prepare(x)
    assert isinstance(xk, jit_amx_k.KActivations)
    out = np.full((20, 48), np.nan, np.float32)
    for r0, r1 in [(0, 16), (16, 41), (41, 48)]:
        kernel.product(r0, r1, xk, out[:, r0:r1], Scratch())
    assert np.array_equal(out, reference(qtype, raw, x))


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K])
def test_prompt_kernels_are_the_float_kernels_outside_prompts(qtype: QType) -> None:
    """``q8-prompts`` picks a kernel that is the exact float kernel (no integer row product for the decode step)
    with AMX prompts: fewer than 16 rows and ``rowwise`` products give the float kernel's numbers bit for bit; a
    prompt of 16 rows or more is quantized once to q8_K where AMX is available."""
    raw = k_rows(qtype, 48, 2, seed=3)
    kernel, exact = jit_kernel(qtype, raw, "q8-prompts"), jit_kernel(qtype, raw, "float")
    assert isinstance(kernel, type(exact)) and not hasattr(kernel, "q8_row_product")
    x = activations(20, 512, seed=3)
    for rows, rowwise in ((15, False), (20, True)):
        got, want = (np.full((rows, 48), np.nan, np.float32) for _ in range(2))
        xk, xe = kernel.prepare(x[:rows], rowwise), exact.prepare(x[:rows], rowwise)
        kernel.product(0, 48, xk, got, Scratch())
        exact.product(0, 48, xe, want, Scratch())
        assert np.array_equal(got, want)
    assert isinstance(kernel.prepare(x), jit_amx_k.KActivations) == jit_amx.amx_available()


def test_other_types_keep_their_float_kernel() -> None:
    assert set(JIT_PROMPT_KERNELS) == {QType.Q8_0, QType.Q4_K, QType.Q6_K}
    raw = np.zeros((4, 36), np.uint8)  # Q4_0 rows: two blocks of 18 bytes
    assert type(jit_kernel(QType.Q4_0, raw, "q8-prompts")).__name__ == JIT_KERNELS[QType.Q4_0][1]
