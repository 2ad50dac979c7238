"""The 1- to 3-bit i-quants, the ternary types and MXFP4: tables against llama.cpp's, edge blocks against gguf-py.

test_quants.py runs every type's decoders and tile kernels on random blocks; here each type's special blocks
(all zero, every index field at its maximum, every sign pattern, every value of every byte) decode bit for bit as
gguf-py's ``dequantize``, and the grids, the sign table and the FP4 levels equal llama.cpp's ``ggml-common.h``
(parsed from the vendored source when it is on this machine).  No block of these types can hold an out-of-range
index: each grid has exactly ``2**bits`` points for its ``bits``-wide index field (checked below), TQ1_0 decodes
every byte to digits 0..2, and every TQ2_0 and MXFP4 bit pattern is a level; a damaged file can only be short,
which the GGUF reader refuses naming the tensor (tests/formats/test_hostile_gguf.py).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from hostile_helpers import RawGGUF, wide_qwen3_f32
from test_quants import assert_bits_equal, decoders, set_iq1_m_scale

import qwen_runtime
from qwen_convert.cli import inspect_main
from qwen_runtime.formats.tensors import QType
from qwen_runtime.quants import grids

LOW_BIT = (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S, QType.IQ1_S, QType.IQ1_M,
           QType.TQ1_0, QType.TQ2_0, QType.MXFP4)
D_AT = {QType.IQ2_XXS: 0, QType.IQ2_XS: 0, QType.IQ2_S: 0, QType.IQ3_XXS: 0, QType.IQ3_S: 0, QType.IQ1_S: 0,
        QType.TQ1_0: 52, QType.TQ2_0: 64}  # the float16 d of each type that has one in place
HEADER = Path.home() / ".cache/qwen-numpy/llama.cpp-0.3.36/src/ggml/src/ggml-common.h"


def with_scale(qtype: QType, blocks: np.ndarray, d: float = 0.5) -> np.ndarray:
    """``blocks`` [n, type_size] with their scale set to ``d`` (MXFP4: E8M0 127, 2**-1), all else kept."""
    blocks = blocks.copy()
    if qtype in D_AT:
        blocks[:, D_AT[qtype]:D_AT[qtype] + 2] = np.array([d], np.float16).view(np.uint8)
    elif qtype == QType.IQ1_M:
        set_iq1_m_scale(blocks, np.full(len(blocks), d, np.float16))
    else:
        blocks[:, 0] = 127
    return blocks


def assert_as_gguf(qtype: QType, blocks: np.ndarray) -> None:
    expected = quants.dequantize(blocks, qtype)
    for got in decoders(qtype, blocks).values():
        assert_bits_equal(got, expected)


def test_grid_sizes_match_their_index_fields() -> None:
    # (grid, bits of the index field that selects a point) per the layouts in qwen_runtime.quants.lattice
    for grid, bits, width in ((grids.GRID_IQ2_XXS, 8, 8), (grids.GRID_IQ2_XS, 9, 8), (grids.GRID_IQ2_S, 10, 8),
                              (grids.GRID_IQ3_XXS, 8, 4), (grids.GRID_IQ3_S, 9, 4), (grids.GRID_IQ1, 11, 8)):
        assert grid.shape == (1 << bits, width) and grid.dtype == np.int8
    assert grids.SIGNS_EVEN.shape == (128,) and grids.MXFP4_LEVELS.shape == (16,)


def _header_tables() -> dict[str, np.ndarray]:
    text = HEADER.read_text()
    tables = {}
    for ctype, name, body in re.findall(r"GGML_TABLE_BEGIN\((\w+), (\w+), \w+\)(.*?)GGML_TABLE_END", text, re.S):
        dtype = {"uint64_t": np.uint64, "uint32_t": np.uint32, "uint8_t": np.uint8, "int8_t": np.int8}.get(ctype)
        if dtype is not None:
            tables[name] = np.array([int(v, 0) for v in re.findall(r"-?0x[0-9a-fA-F]+|-?\d+", body)], dtype)
    return tables


@pytest.mark.skipif(not HEADER.exists(), reason="llama.cpp's vendored source is not on this machine")
def test_tables_equal_llama_cpp() -> None:
    tables = _header_tables()
    for name, ours in (("iq2xxs_grid", grids.GRID_IQ2_XXS), ("iq2xs_grid", grids.GRID_IQ2_XS),
                       ("iq2s_grid", grids.GRID_IQ2_S), ("iq3xxs_grid", grids.GRID_IQ3_XXS),
                       ("iq3s_grid", grids.GRID_IQ3_S), ("iq1s_grid", grids.GRID_IQ1)):
        np.testing.assert_array_equal(grids.words(ours), tables[name], err_msg=name)  # point k: byte k of a word
    np.testing.assert_array_equal(grids.SIGNS_EVEN, tables["ksigns_iq2xs"])
    np.testing.assert_array_equal(grids.MXFP4_LEVELS, tables["kvalues_fp4"])


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda q: q.name)
def test_all_zero_and_all_ones_blocks(qtype: QType) -> None:
    size = GGML_QUANT_SIZES[qtype][1]
    zero, ones = np.zeros((1, size), np.uint8), np.full((1, size), 255, np.uint8)
    blocks = np.concatenate([zero, with_scale(qtype, zero), with_scale(qtype, ones)])  # ones: every index at max
    assert_as_gguf(qtype, blocks)
    assert not np.any(decoders(qtype, zero)["fast"])  # a zero scale (IQ1_M, TQ: d; MXFP4's 2**-128 times
    # level 0) gives zeros


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda q: q.name)
def test_every_value_of_every_byte(qtype: QType) -> None:
    size = GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(600 + qtype.value)
    base = with_scale(qtype, rng.integers(0, 256, (1, size), dtype=np.uint8))
    blocks = np.repeat(base, 256 * size, axis=0).reshape(size, 256, size)
    blocks[np.arange(size), :, np.arange(size)] = np.arange(256, dtype=np.uint8)  # byte p takes every value
    blocks = blocks.reshape(-1, size)
    with np.errstate(invalid="ignore", over="ignore"):  # the bytes of d make inf/NaN scales: test_quants' job
        keep = np.isfinite(quants.dequantize(blocks, qtype)).all(axis=1)
    assert keep.mean() > 0.95
    assert_as_gguf(qtype, blocks[keep])


def _sign_blocks(qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """Blocks where every sign field takes each of its values (rows of the result)."""
    size = GGML_QUANT_SIZES[qtype][1]
    if qtype in (QType.IQ2_S, QType.IQ3_S):  # whole sign bytes
        blocks = np.repeat(rng.integers(0, 256, (1, size), dtype=np.uint8), 256, axis=0)
        at = {QType.IQ2_S: 34, QType.IQ3_S: 74}[qtype]
        blocks[:, at:at + 32] = np.arange(256, dtype=np.uint8)[:, None]
        return blocks
    s = np.arange(128, dtype=np.uint32)
    blocks = np.repeat(rng.integers(0, 256, (1, size), dtype=np.uint8), 128, axis=0)
    if qtype == QType.IQ2_XS:  # qs: 9-bit grid index | 7-bit sign index << 9
        qs = blocks[:, 2:66].copy().view("<u2")
        blocks[:, 2:66] = ((qs & 511) | (s[:, None] << 9).astype(np.uint16)).view(np.uint8)
        return blocks
    at = {QType.IQ2_XXS: None, QType.IQ3_XXS: 66}[qtype]
    aux = (s | s << 7 | s << 14 | s << 21 | np.uint32(5) << 28).astype("<u4")  # four 7-bit sign indices, ls 5
    if at is None:  # IQ2_XXS: each group of 8 bytes is 4 grid indices and its aux word
        view = blocks[:, 2:66].reshape(-1, 8, 8)
        view[:, :, 4:8] = aux[:, None, None].view(np.uint8).reshape(-1, 1, 4)
    else:
        blocks[:, at:at + 32] = np.repeat(aux[:, None], 8, axis=1).view(np.uint8)
    return blocks


@pytest.mark.parametrize("qtype", (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S),
                         ids=lambda q: q.name)
def test_every_sign_pattern(qtype: QType) -> None:
    blocks = with_scale(qtype, _sign_blocks(qtype, np.random.default_rng(700 + qtype.value)))
    assert_as_gguf(qtype, blocks)
    negative = np.signbit(decoders(qtype, blocks)["fast"]).reshape(-1, 8)  # grid values are > 0, d > 0
    patterns = np.unique(negative, axis=0)
    if qtype in (QType.IQ2_S, QType.IQ3_S):
        assert len(patterns) == 256
    else:  # 7 stored bits: the 128 patterns with an even number of minus signs
        assert len(patterns) == 128 and np.all(patterns.sum(axis=1) % 2 == 0)


@pytest.mark.parametrize("qtype", (QType.IQ1_S, QType.IQ1_M), ids=lambda q: q.name)
def test_iq1_delta_signs(qtype: QType) -> None:
    rng = np.random.default_rng(800)
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = with_scale(qtype, np.repeat(rng.integers(0, 256, (1, size), dtype=np.uint8), 2, axis=0))
    if qtype == QType.IQ1_S:  # bit 15 of each qh word
        qh = blocks[:, 34:50].copy().view("<u2")
        blocks[:, 34:50] = np.where(np.arange(2)[:, None] == 0, qh & 0x7FFF, qh | 0x8000).view(np.uint8)
    else:  # bit 3 of each nibble of qh
        blocks[:, 32:48] = np.where(np.arange(2)[:, None] == 0, blocks[:, 32:48] & 0x77, blocks[:, 32:48] | 0x88)
    assert_as_gguf(qtype, blocks)
    plus, minus = decoders(qtype, blocks)["fast"]  # the same points and scales, delta +1/8 and -1/8
    assert np.all(plus > minus)  # d > 0: every value moved down by a quarter of its sub-block scale


# -- a model stored in each type ----------------------------------------------------------------------------------

PROMPT = [1, 5, 17, 40, 99, 200, 300, 478, 2, 3]


def model_blocks(qtype: QType, rows: int, cols: int, rng: np.random.Generator, rms: float = 0.05) -> np.ndarray:
    """Random valid blocks [rows, stored row] whose values have about ``rms`` (one scale for the whole matrix:
    a power of two for MXFP4's E8M0)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = with_scale(qtype, rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8), 1.0)
    unit = float(np.sqrt(np.mean(quants.dequantize(blocks, qtype) ** 2)))
    scale = 2.0 ** np.round(np.log2(rms / unit))
    blocks = with_scale(qtype, blocks, scale) if qtype != QType.MXFP4 else with_e8m0(blocks, scale)
    return blocks.reshape(rows, -1)


def with_e8m0(blocks: np.ndarray, d: float) -> np.ndarray:
    """MXFP4 ``blocks`` with every scale ``d`` times the unit scale of :func:`with_scale` (0.5: E8M0 127)."""
    blocks = blocks.copy()
    blocks[:, 0] = 127 + int(np.log2(d))
    return blocks


def retyped(raw: RawGGUF, qtype: QType, rng: np.random.Generator) -> tuple[RawGGUF, RawGGUF]:
    """(``raw`` with every matrix stored as ``qtype`` in random valid blocks, its float32 twin holding gguf-py's
    dequantization of the same blocks)."""
    stored, twin = copy.deepcopy(raw), copy.deepcopy(raw)
    stored.infos, twin.infos, stored.data, twin.data = [], [], b"", b""
    for name, dims, dtype, offset in raw.infos:
        blob = raw.data[offset:offset + 4 * int(np.prod(dims))]
        quantized = float_blob = blob
        if len(dims) == 2:
            blocks = model_blocks(qtype, dims[1], dims[0], rng)
            quantized, float_blob = blocks.tobytes(), quants.dequantize(blocks, qtype).tobytes()
        for target, data, kind in ((stored, quantized, qtype if len(dims) == 2 else dtype), (twin, float_blob, dtype)):
            target.data += b"\0" * (-len(target.data) % raw.alignment)
            target.infos.append((name, dims, int(kind), len(target.data)))
            target.data += data
    return stored, twin


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> RawGGUF:
    return RawGGUF.from_file(wide_qwen3_f32(tmp_path_factory.mktemp("low-bit")))


@pytest.mark.parametrize("qtype", LOW_BIT, ids=lambda q: q.name)
def test_a_model_stored_in_the_type_runs_as_its_float_twin(wide_model: RawGGUF, tmp_path: Path, qtype: QType,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``load()`` runs a Qwen3 whose every matrix (embedding included) is stored as ``qtype``, with the numpy
    kernels: its logits are those of the float32 model holding gguf-py's decoding of the same blocks, and
    qwen-inspect names the type of every matrix."""
    stored, twin = retyped(wide_model, qtype, np.random.default_rng(900 + qtype.value))
    path, twin_path = stored.write(tmp_path / "model.gguf"), twin.write(tmp_path / "twin.gguf")
    got = qwen_runtime.load(path, kernels="numpy").logits([PROMPT])[0]
    expected = qwen_runtime.load(twin_path, kernels="numpy").logits([PROMPT])[0]
    assert np.abs(expected).max() > 1e-3  # the weights do reach the logits
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert inspect_main([str(path), "--json"]) == 0
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    matrices = [t for t in tensors if len(t["shape"]) == 2]
    assert len(matrices) == 15 and {t["type"] for t in matrices} == {qtype.name}
