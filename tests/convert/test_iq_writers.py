"""The i-quant writers below 4 bits (qwen_convert/iq_encode.py: IQ3_XXS, IQ2_XXS) against llama.cpp's quantizer.

* Without llama.cpp: the tables ``iq3xs_init_impl`` / ``iq2xs_init_impl`` build, re-derived by brute force
  (every packed level combination off the grid lists the grid points at its two smallest squared distances, by
  distance then index); the bytes do not depend on threads or on which rows are encoded together; every value of a
  gaussian row decodes (gguf-py's dequantizer, independent of ours) with its own sign (but at most one per
  group of 8, the parity bit) and the row to within half of its norm.
* ``peer``: our bytes equal ``ggml_quantize_chunk``'s in llama-cpp-python's ``libggml-base.so`` (the function
  ``llama_model_quantize`` calls) on rows of varied statistics (heavy tails, zeros, constants, subnormal-sized
  values, blocks of very different magnitudes), without (IQ3_XXS; IQ2_XXS has no unweighted form, refused) and
  with five kinds of importance weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from test_kquant_writers import KINDS, _ggml, block_mismatches, ggml_quantize, varied_importance, varied_rows

from qwen_convert.iq_encode import GRIDS, grid_tables
from qwen_convert.policy import WEIGHTS_REQUIRED
from qwen_convert.quantize import encode_rows
from qwen_runtime.errors import FormatError
from qwen_runtime.formats.tensors import QType

IQ_TYPES = (QType.IQ3_XXS, QType.IQ2_XXS)


def weights(qtype: QType, n: int) -> np.ndarray | None:
    """Ones for a type that cannot be encoded without importance (an unweighted test of the others)."""
    return np.ones(n, np.float32) if qtype in WEIGHTS_REQUIRED else None


@pytest.mark.parametrize(("qtype", "width", "levels"), [(QType.IQ3_XXS, 4, 8), (QType.IQ2_XXS, 8, 3)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_grid_tables_are_llama_cpp_neighbours(qtype: QType, width: int, levels: int) -> None:
    grid, kmap, neighbours = grid_tables(qtype)
    bits = GRIDS[qtype][0]
    shifts = bits * np.arange(width)
    assert grid.shape == (256, width) and set(np.unique(grid)) <= set(range(1, 2 * levels, 2))
    on_grid = np.flatnonzero(kmap >= 0)
    assert len(on_grid) == 256 and np.array_equal(np.sort(kmap[on_grid]), np.arange(256))
    for u in on_grid:  # the map inverts the grid
        assert np.array_equal(2 * ((u >> shifts) & ((1 << bits) - 1)) + 1, grid[kmap[u]])
    for u in range(0, len(kmap), len(kmap) // 97):
        if kmap[u] >= 0:
            continue
        point = 2 * ((u >> shifts) & ((1 << bits) - 1)) + 1
        d2 = ((grid.astype(int) - point) ** 2).sum(axis=1)
        expected = sorted((int(d), j) for j, d in enumerate(d2) if d <= sorted(set(d2))[1])
        start = -kmap[u] - 1
        listed = neighbours[start + 1:start + 1 + neighbours[start]]
        assert [j for _, j in expected] == list(listed), u


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_gaussian_rows_keep_signs_and_shape(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 512)).astype(np.float32)
    decoded = quants.dequantize(encode_rows(x, qtype, weights(qtype, 512)), qtype)
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


def test_weightless_types_are_refused_unweighted() -> None:
    with pytest.raises(FormatError, match="IQ2_XXS needs an importance vector"):
        encode_rows(np.ones((1, 256), np.float32), QType.IQ2_XXS)


# llama.cpp aborts on the WEIGHTS_REQUIRED types without weights (we refuse: the test above)
CHUNK_CASES = [(q, w) for q in IQ_TYPES for w in (False, True) if w or q not in WEIGHTS_REQUIRED]


@pytest.mark.peer
@pytest.mark.parametrize(("qtype", "weighted"), CHUNK_CASES,
                         ids=[f"{q.name}-{'imatrix' if w else 'plain'}" for q, w in CHUNK_CASES])
def test_bytes_equal_ggml_quantize_chunk(qtype: QType, weighted: bool) -> None:
    lib = _ggml()
    rng = np.random.default_rng([int(qtype), weighted])
    for width in (256, 2048):
        x = varied_rows(rng, 2 * len(KINDS), width)
        for kind in range(5 if weighted else 1):
            importance = varied_importance(rng, width, kind) if weighted else None
            ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
            assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} width {width} kind {kind}"
