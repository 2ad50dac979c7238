"""The i-quant writers below 4 bits (qwen_convert/iq_encode.py: IQ3_XXS) against llama.cpp's quantizer.

* Without llama.cpp: the tables ``iq3xs_init_impl`` builds, re-derived by brute force (every packed level
  combination off the grid lists the grid points at its two smallest squared distances, by distance then
  index); the bytes do not depend on threads or on which rows are encoded together; every value of a
  gaussian row decodes (gguf-py's dequantizer, independent of ours) with its own sign (but at most one per
  group of 8, the parity bit) and the row to within half of its norm.
* ``peer``: our bytes equal ``ggml_quantize_chunk``'s in llama-cpp-python's ``libggml-base.so`` (the function
  ``llama_model_quantize`` calls) on rows of varied statistics (heavy tails, zeros, constants, subnormal-sized
  values, blocks of very different magnitudes), without and with five kinds of importance weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from test_kquant_writers import KINDS, _ggml, block_mismatches, ggml_quantize, varied_importance, varied_rows

from qwen_convert.iq_encode import iq3_tables
from qwen_convert.quantize import encode_rows
from qwen_runtime.tensors import QType

IQ_TYPES = (QType.IQ3_XXS,)


def test_iq3_tables_are_llama_cpp_neighbours() -> None:
    grid, kmap, neighbours = iq3_tables()
    assert grid.shape == (256, 4) and set(np.unique(grid)) <= set(range(1, 16, 2))
    on_grid = np.flatnonzero(kmap >= 0)
    assert len(on_grid) == 256 and np.array_equal(np.sort(kmap[on_grid]), np.arange(256))
    for u in on_grid:  # the map inverts the grid
        assert np.array_equal(2 * ((u >> (3 * np.arange(4))) & 7) + 1, grid[kmap[u]])
    for u in range(0, 4096, 37):
        if kmap[u] >= 0:
            continue
        point = 2 * ((u >> (3 * np.arange(4))) & 7) + 1
        d2 = ((grid.astype(int) - point) ** 2).sum(axis=1)
        expected = sorted((int(d), j) for j, d in enumerate(d2) if d <= sorted(set(d2))[1])
        start = -kmap[u] - 1
        listed = neighbours[start + 1:start + 1 + neighbours[start]]
        assert [j for _, j in expected] == list(listed), u


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_gaussian_rows_keep_signs_and_shape(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 512)).astype(np.float32)
    decoded = quants.dequantize(encode_rows(x, qtype), qtype)
    wrong_sign = (np.sign(decoded) != np.sign(x)).reshape(-1, 8).sum(axis=1)
    assert wrong_sign.max() <= 1
    assert (np.linalg.norm(decoded - x, axis=1) < 0.5 * np.linalg.norm(x, axis=1)).all()


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bytes_do_not_depend_on_threads_or_neighbour_rows(qtype: QType) -> None:
    rng = np.random.default_rng(3)
    x, importance = varied_rows(rng, 13, 512), varied_importance(rng, 512, 1)
    one = encode_rows(x, qtype, importance, threads=1)
    assert np.array_equal(one, encode_rows(x, qtype, importance, threads=3))
    assert np.array_equal(one[5:9], encode_rows(x[5:9], qtype, importance, threads=1))


@pytest.mark.peer
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bytes_equal_ggml_quantize_chunk(qtype: QType, weighted: bool) -> None:
    lib = _ggml()
    rng = np.random.default_rng([int(qtype), weighted])
    for width in (256, 2048):
        x = varied_rows(rng, 2 * len(KINDS), width)
        for kind in range(5 if weighted else 1):
            importance = varied_importance(rng, width, kind) if weighted else None
            ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
            assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} width {width} kind {kind}"
