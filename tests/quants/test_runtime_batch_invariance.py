"""Row-invariant products and ragged attention: a row's numbers do not depend on the batch around it.

BLAS does not promise that (GEMV for one row, GEMM kernels unrolled by position for several), so plain
products differ in the last bits with the batch; inside ``Workspace.rowwise()`` they must not.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from runtime_helpers import KERNELS
from test_runtime_weights import stored

from qwen_runtime.backend.cache import BatchState
from qwen_runtime.backend.weights import Workspace, gated_matmul, make_weight, matmul_many
from qwen_runtime.formats.tensors import QType, StoredTensor
from qwen_runtime.models.attention import attend


def stored_any(qtype: QType, w: np.ndarray) -> StoredTensor:
    if qtype in (QType.F32, QType.F16, QType.BF16, QType.Q8_0):
        return stored(qtype, w)
    return StoredTensor("w", qtype, w.shape, "mem", data=quants.quantize(w, qtype))


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0])
@pytest.mark.parametrize("n", [2, 9, 16])
def test_rowwise_products_equal_each_row_alone(qtype: QType, n: int) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (200, 128)).astype(np.float32)
    x = rng.normal(0, 1, (n, 128)).astype(np.float32)
    ws = Workspace(threads=2)
    weight, up = (make_weight(stored_any(qtype, m), ws, tile_elements=50 * 128) for m in (w, w[::-1].copy()))
    with ws.rowwise():
        alone = np.concatenate([weight.matmul(x[i:i + 1]) for i in range(n)])
        gated_alone = np.concatenate([gated_matmul(weight, up, x[i:i + 1]) for i in range(n)])
        together = weight.matmul(x)
        fused = matmul_many([weight, up], x)[0]
        gated = gated_matmul(weight, up, x)
    assert np.array_equal(together, alone) and np.array_equal(fused, alone)
    assert np.array_equal(gated, gated_alone)
    assert not ws.row_invariant  # the mode ends with the block
    reference = x @ weight.to_float32().T
    np.testing.assert_allclose(together, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(weight.matmul(x), reference, rtol=1e-5, atol=1e-5)
    if qtype in (QType.F32, QType.F16, QType.BF16):
        assert np.array_equal(alone[:1], weight.matmul(x[:1]))  # a lone row: the numbers of the plain kernel

@pytest.mark.parametrize("kernels", KERNELS)
def test_ragged_attention_equals_each_row_alone(kernels: str) -> None:
    """Rows holding 3, 11 and 7 tokens attend over exactly their own slots, as if each were alone."""
    if kernels == "numba":
        pytest.importorskip("numba")
    ws = Workspace(threads=1, kernels=kernels)
    rng = np.random.default_rng(2)
    lengths, t, heads, kv, hd, cap = np.array([3, 11, 7]), 2, 4, 2, 16, 20
    q = rng.normal(size=(3, heads, t, hd)).astype(np.float32)
    keys = rng.normal(size=(3, kv, cap, hd)).astype(np.float32)
    values = rng.normal(size=(3, kv, cap, hd)).astype(np.float32)
    valid = np.ones((3, t), bool)
    state = BatchState(lengths[:, None] + np.arange(t), valid, 0, valid, lengths)
    got = attend(q, keys, values, state, ws)
    for b, length in enumerate(lengths.tolist()):
        end = length + t
        alone = BatchState(state.positions[b:b + 1], valid[b:b + 1], length, np.ones((1, end), bool))
        expected = attend(q[b:b + 1], keys[b:b + 1, :, :end], values[b:b + 1, :, :end], alone, ws)
        assert np.array_equal(got[b:b + 1], expected)
    keys[0, :, 5:] = np.nan  # slots past a row's tokens are never read
    assert np.isfinite(attend(q, keys, values, state, ws)[0]).all()
