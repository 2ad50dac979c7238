"""The integer-dot kernels of the 1- to 3-bit i-quants and TQ2_0 (``activations="q8"``,
``qwen_runtime/backend/kernels/lattice_int8.py``) against the float64 product of the codec's reference decoding
and the quantized activations.

Error model of a product row: each stored value is ``s * v`` exactly in float32 (the reference's scale times a
small integer), so the float64 reference ``sum_k w_k q_k d_x`` equals the exact ``sum_b s_b d_x (v_b . q_b)``.  The
kernel's integer sums are exact; per sub-block and lane it rounds ``s * d_x`` once and fuses one add, and sums its
lanes in order: ``|got - ref| <= (subs + lanes + 2) * eps32 * sum |w q| d_x`` (first-order ``gamma_m``), ``subs``
the 32-value sub-blocks of a row and ``lanes`` the 16 accumulator lanes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_jit_int8 import assert_decode_step_close_to_the_float_path
from test_jit_kernels import random_blocks

from qwen_runtime.backend.kernels import jit_kernel, kernel_table
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.backend.weights import make_weight
from qwen_runtime.formats.tensors import StoredTensor
from qwen_runtime.quants import QType, codec, q8_act

pytest.importorskip("numba")
from qwen_runtime.backend.kernels.base import GEMV_ROWS  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels.int8 import Int8Kernel  # noqa: E402
from qwen_runtime.backend.kernels.lattice_int8 import (  # noqa: E402
    IQ1_MInt8Kernel,
    IQ1_SInt8Kernel,
    IQ2_SInt8Kernel,
    IQ2_XSInt8Kernel,
    IQ2_XXSInt8Kernel,
    IQ3_SInt8Kernel,
    IQ3_XXSInt8Kernel,
    TQ2_0Int8Kernel,
)

EPS32 = float(np.finfo(np.float32).eps)
KERNELS = {QType.IQ2_XXS: IQ2_XXSInt8Kernel, QType.IQ2_XS: IQ2_XSInt8Kernel, QType.IQ2_S: IQ2_SInt8Kernel,
           QType.IQ3_XXS: IQ3_XXSInt8Kernel, QType.IQ3_S: IQ3_SInt8Kernel, QType.IQ1_S: IQ1_SInt8Kernel,
           QType.IQ1_M: IQ1_MInt8Kernel, QType.TQ2_0: TQ2_0Int8Kernel}
TYPES = sorted(KERNELS, key=lambda q: q.name)
LANES = 16


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with edge blocks: all zero, one tiny value, a constant, values rounding at .5."""
    x = np.random.default_rng(seed).normal(0, 1, (n, cols)).astype(np.float32)
    x[:, 0:32] = 0
    x[:, 32:64] = 0
    x[:, 40] = 1e-30
    x[:, 64:96] = -3.25
    x[:, 128:160] = np.arange(-16, 16) + 0.5
    return x


def run(kernel: Int8Kernel, x: np.ndarray) -> np.ndarray:
    """The integer row kernels on every row of ``x``, whatever their number."""
    out = np.empty((len(x), kernel.raw.shape[0]), np.float32)
    xq, *extra = kernel.prepare(x, rowwise=True)
    kernel._rows(kernel.raw, xq, extra, out)
    return out


def reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the product of the decoded weights and the quantized activations, ``sum |w q| d_x``), both float64."""
    w = codec(qtype).reference(raw).astype(np.float64)  # [R, cols], each s * v exactly
    q, d = q8_act.quantize_activations(x)
    xq = (q.reshape(len(x), -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T


def test_every_type_is_registered() -> None:
    for qtype, kernel in KERNELS.items():
        assert kernel_table()["q8"][qtype] is kernel
        assert isinstance(jit_kernel(qtype, random_blocks(qtype, 2, 256, seed=0), activations="q8"), kernel)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8, GEMV_ROWS])
def test_products_within_the_error_model(qtype: QType, n: int) -> None:
    """Random bytes (every grid index, sign pattern and scale field; 10 % edge scales: zero, subnormal, largest)
    in rows of 3 super-blocks against activations with edge blocks."""
    cols, rows = 3 * 256, 37
    raw = random_blocks(qtype, rows, cols, seed=20 + n)
    x = activations(n, cols, seed=n)
    got = run(KERNELS[qtype](raw), x)
    want, magnitude = reference(qtype, raw, x)
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - want) <= (cols // 32 + LANES + 2) * EPS32 * magnitude)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_equal_alone_and_in_any_batch(qtype: QType) -> None:
    """Row invariance (the server's batch invariance): 1..GEMV_ROWS rows through the row kernels, more through
    ``rowwise``; a product of more rows than ``direct_rows`` is the float kernel's (prompts stay exact)."""
    cols = 2 * 256
    raw = random_blocks(qtype, 29, cols, seed=3)
    x = activations(max(GEMV_ROWS, Int8Kernel.direct_rows) + 5, cols, seed=4)
    kernel = KERNELS[qtype](raw)
    alone = np.concatenate([run(kernel, x[i:i + 1]) for i in range(len(x))])
    for n in range(2, GEMV_ROWS + 1):
        assert np.array_equal(run(kernel, x[:n]), alone[:n])
    ws = Workspace(threads=2, kernels="numba", activations="q8")
    weight = make_weight(StoredTensor("w", qtype, (29, cols), "memory", data=raw), ws)
    assert isinstance(weight.kernel, KERNELS[qtype])
    with ws.rowwise():
        assert np.array_equal(weight.matmul(x), alone)
    assert np.array_equal(weight.matmul(x[:Int8Kernel.direct_rows]), alone[:Int8Kernel.direct_rows])
    exact = make_weight(StoredTensor("w", qtype, (29, cols), "memory", data=raw), Workspace(threads=2, kernels="numba"))
    assert np.array_equal(weight.matmul(x), exact.matmul(x))


@pytest.mark.parametrize("qtype", [QType.IQ2_XXS, QType.IQ3_S, QType.IQ1_M, QType.TQ2_0], ids=lambda q: q.name)
def test_largest_values_do_not_saturate(qtype: QType) -> None:
    """Every activation at ±127 against rows of one repeated block: each pair of products (at most 2 * 62 * 127)
    stays below int16's limit in ``pmaddubsw``, so the result is the reference's within the error model."""
    rng = np.random.default_rng(5)
    raw = np.tile(random_blocks(qtype, 8, 256, seed=6, edges=0), (1, 4))
    x = np.where(rng.random((3, 4 * 256)) < 0.5, -127, 127).astype(np.float32)
    want, magnitude = reference(qtype, raw, x)
    got = run(KERNELS[qtype](raw), x)
    assert np.all(np.abs(got - want) <= (4 * 8 + LANES + 2) * EPS32 * magnitude)
    signs = np.sign(codec(qtype).reference(raw).astype(np.float64))  # activations with the weights' signs
    aligned = np.where(signs == 0, 127, 127 * signs).astype(np.float32)
    want, magnitude = reference(qtype, raw, aligned)
    got = run(KERNELS[qtype](raw), aligned)
    assert np.all(want.diagonal() >= 0)
    assert np.all(np.abs(got - want) <= (4 * 8 + LANES + 2) * EPS32 * magnitude)


@pytest.mark.parametrize("dtype", ["iq2_xxs", "iq3_xxs", "iq1_m", "tq2_0"])
def test_model_decode_step_close_to_the_float_path(tmp_path: Path, dtype: str) -> None:
    """A two-layer Qwen3 whose every matrix is stored in the type, with 8-bit activations: a decode step goes
    through the integer kernels (the compiled step's row products) and stays within the 8-bit activations' error
    (2^-8 of each product's magnitude, through two layers) of the exact step."""
    from hostile_helpers import RawGGUF, wide_qwen3_f32
    from test_lowbit_quants import retyped

    qtype = QType[dtype.upper()]
    stored, _ = retyped(RawGGUF.from_file(wide_qwen3_f32(tmp_path)), qtype, np.random.default_rng(31))
    assert_decode_step_close_to_the_float_path(stored.write(tmp_path / f"{dtype}.gguf"))
