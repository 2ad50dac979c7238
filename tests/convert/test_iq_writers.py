"""The i-quant writers below 4 bits (qwen_convert/iq_encode.py: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S,
IQ1_M) against llama.cpp's quantizer.

* Without llama.cpp: the tables ``iq3xs_init_impl`` / ``iq2xs_init_impl`` build, re-derived by brute force
  (every packed level combination the searches can produce that is off the grid lists the grid points at its
  ``nwant`` smallest squared distances, by distance then index); the bytes do not depend on threads or on which
  rows are encoded together; every value of a gaussian row decodes (gguf-py's dequantizer, independent of ours)
  with its own sign (but at most one per group of 8 for the types with a parity bit) and the row to within half
  of its norm.
* ``peer``: our bytes equal ``ggml_quantize_chunk``'s in llama-cpp-python's ``libggml-base.so`` (the function
  ``llama_model_quantize`` calls) on rows of varied statistics (heavy tails, zeros, constants, subnormal-sized
  values, blocks of very different magnitudes) and on edge rows (sub-blocks of zeros between others, which move
  IQ3_S's later indices; all-negative values; one value per sub-block; tiny sub-blocks beside large ones;
  equal magnitudes, whose ties IQ1's sort resolves as glibc's merge sort), without (IQ2_XXS, IQ2_XS and IQ1_S
  have no unweighted form: refused) and with five kinds of importance weights.
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

IQ_TYPES = (QType.IQ3_XXS, QType.IQ3_S, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.IQ1_M)
IQ1 = (QType.IQ1_S, QType.IQ1_M)
PARITY_SIGNS = (QType.IQ3_XXS, QType.IQ2_XXS, QType.IQ2_XS)  # 7 sign bits per 8 values


def weights(qtype: QType, n: int) -> np.ndarray | None:
    """Ones for a type that cannot be encoded without importance (an unweighted test of the others)."""
    return np.ones(n, np.float32) if qtype in WEIGHTS_REQUIRED else None


TABLES = [(QType.IQ3_XXS, 256, 4), (QType.IQ3_S, 512, 4), (QType.IQ2_XXS, 256, 8), (QType.IQ2_XS, 512, 8),
          (QType.IQ2_S, 1024, 8), (QType.IQ1_S, 2048, 8)]


@pytest.mark.parametrize(("qtype", "size", "width"), TABLES, ids=lambda v: getattr(v, "name", str(v)))
def test_grid_tables_are_llama_cpp_neighbours(qtype: QType, size: int, width: int) -> None:
    grid, kmap, neighbours = grid_tables(qtype)
    bits, nwant, levels = GRIDS[qtype]
    shifts = bits * np.arange(width)
    assert grid.shape == (size, width) and set(np.unique(grid)) <= set(range(1, 2 * levels, 2))
    on_grid = np.flatnonzero(kmap >= 0)
    assert len(on_grid) == size and np.array_equal(np.sort(kmap[on_grid]), np.arange(size))
    for u in on_grid:  # the map inverts the grid
        assert np.array_equal(2 * ((u >> shifts) & ((1 << bits) - 1)) + 1, grid[kmap[u]])
    digits = (np.arange(len(kmap))[:, None] >> shifts) & ((1 << bits) - 1)
    reachable = np.flatnonzero((digits < levels).all(axis=1) & (kmap < 0))  # what the searches can look up
    for u in reachable[::max(1, len(reachable) // 97)]:
        point = 2 * digits[u] + 1
        d2 = ((grid.astype(int) - point) ** 2).sum(axis=1)
        farthest = np.unique(d2)[nwant - 1]  # the nwant nearest distances, ties included
        expected = sorted((int(d), j) for j, d in enumerate(d2) if d <= farthest)
        start = -kmap[u] - 1
        listed = neighbours[start + 1:start + 1 + neighbours[start]]
        assert [j for _, j in expected] == list(listed), u


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_gaussian_rows_keep_signs_and_shape(qtype: QType) -> None:
    """The lattice types store signs apart (IQ1 has none: levels -1, 0, 1 and a shift).  Three levels leave at
    least 0.44 of a gaussian's norm, 0.51 once llama.cpp enlarges the fitted scale by 1.125 (IQ1_S) or 1.1125
    (IQ1_M); the grid's restriction and the x^2 weights of unweighted IQ1_M add to that, hence 0.65."""
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((6, 512)).astype(np.float32)
    decoded = quants.dequantize(encode_rows(x, qtype, weights(qtype, 512)), qtype)
    if qtype not in IQ1:
        wrong_sign = (np.sign(decoded) != np.sign(x)).reshape(-1, 8).sum(axis=1)
        assert wrong_sign.max() <= (1 if qtype in PARITY_SIGNS else 0)
    bound = 0.65 if qtype in IQ1 else 0.5
    assert (np.linalg.norm(decoded - x, axis=1) < bound * np.linalg.norm(x, axis=1)).all()


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bytes_do_not_depend_on_threads_or_neighbour_rows(qtype: QType) -> None:
    rng = np.random.default_rng(3)
    x, importance = varied_rows(rng, 13, 512), varied_importance(rng, 512, 1)
    one = encode_rows(x, qtype, importance, threads=1)
    assert np.array_equal(one, encode_rows(x, qtype, importance, threads=3))
    assert np.array_equal(one[5:9], encode_rows(x[5:9], qtype, importance, threads=1))


@pytest.mark.parametrize("qtype", [QType.IQ2_XXS, QType.IQ2_XS, QType.IQ1_S], ids=lambda q: q.name)
def test_weightless_types_are_refused_unweighted(qtype: QType) -> None:
    with pytest.raises(FormatError, match=f"{qtype.name} needs an importance vector"):
        encode_rows(np.ones((1, 256), np.float32), qtype)


def edge_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [8, n]: every other sub-block of 16 or 32 values zero (IQ3_S then writes its later indices one
    sub-block early, as llama.cpp does), all values negative, one value per 32 (the rest zero), tiny sub-blocks
    (1e-12 .. 1e-38) beside unit ones, equal magnitudes, and (rows longer than 256) a first super-block of zeros."""
    x = rng.standard_normal((8, n))
    x[0] *= np.arange(n) // 16 % 2
    x[1] *= np.arange(n) // 32 % 2
    x[2] *= np.arange(n) // 32 % 3 == 1
    x[3] = -np.abs(x[3])
    x[4] *= np.arange(n) % 32 == 5
    x[5] *= np.repeat(10.0 ** rng.choice([0, -12, -20, -30, -38], n // 32), 32)
    x[6] *= np.repeat(10.0 ** rng.integers(-3, 4, n // 16), 16)
    x[7] = np.sign(x[7]) * 0.5  # every magnitude equal: ties in every comparison
    if n > 256:
        x[:, :256] = 0
    return x.astype(np.float32)


# llama.cpp aborts on the WEIGHTS_REQUIRED types without weights (we refuse: the test above)
CHUNK_CASES = [(q, w) for q in IQ_TYPES for w in (False, True) if w or q not in WEIGHTS_REQUIRED]


@pytest.mark.peer
@pytest.mark.parametrize(("qtype", "weighted"), CHUNK_CASES,
                         ids=[f"{q.name}-{'imatrix' if w else 'plain'}" for q, w in CHUNK_CASES])
def test_bytes_equal_ggml_quantize_chunk(qtype: QType, weighted: bool) -> None:
    lib = _ggml()
    rng = np.random.default_rng([int(qtype), weighted])
    for width in (256, 2048):
        x = np.concatenate([varied_rows(rng, 2 * len(KINDS), width), edge_rows(rng, width)])
        for kind in range(5 if weighted else 1):
            importance = varied_importance(rng, width, kind) if weighted else None
            ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
            assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} width {width} kind {kind}"
