"""Streaming conversion of a stored tensor to its output type, a few rows at a time.

Each chunk is widened to float32 (``[rows, n]``) and encoded to the output type's stored layout
(``[rows, row bytes]``), so memory scales with the chunk, never with the tensor.  The Q8_0 kernel gives
exactly the bytes of ``gguf.quants.quantize`` (llama.cpp's reference) with fewer temporaries; Q4_0, Q4_1, Q5_0
and Q5_1 are ``gguf.quants.quantize`` itself, which gives the bytes of llama.cpp's quantizer
(tests/convert/: test_convert_quantize.py and test_quant_writers.py check both), and so are TQ1_0 and TQ2_0
(test_ternary_writers.py).  The K-quants, IQ4 types and lattice i-quants are :mod:`qwen_convert.kquant_encode`,
:mod:`qwen_convert.iq4_encode` and :mod:`qwen_convert.iq_encode` (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S),
llama.cpp's searches re-done in float32 (tests/convert/test_kquant_writers.py, test_iq_writers.py).
"""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
from gguf import quants

from qwen_runtime.backend.compile_events import listen
from qwen_runtime.backend.pool import default_threads
from qwen_runtime.errors import FormatError
from qwen_runtime.formats.tensors import Q8_0_BLOCK, Q8_0_BYTES, QType, StoredTensor, stored_shape, to_float32

CHUNK_ELEMENTS = 1 << 20  # float32 elements widened at once (4 MiB)
GGUF_QUANTIZED = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)  # encoded by gguf.quants
# The ternary types: gguf.quants gives llama.cpp's bytes (quantize_row_tq*_0_ref), which takes no importance.
TERNARY = (QType.TQ1_0, QType.TQ2_0)
# The K-quants, IQ4 and the lattice i-quants: llama.cpp's searches, compiled with numba (imported on first use).
SEARCHED = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS, QType.IQ3_XXS,
            QType.IQ3_S, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ1_S, QType.IQ1_M)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round in place to the nearest integer, halves away from zero (C ``roundf``); ``x`` is float32.

    ``x - trunc(x)`` is exact, so ``trunc(2 * frac)`` is exactly the carry (0 or ±1), as in gguf's ``np_roundf``.
    """
    whole = np.trunc(x)
    np.subtract(x, whole, out=x)
    np.multiply(x, 2, out=x)
    np.trunc(x, out=x)
    np.add(x, whole, out=x)
    return x


def quantize_q8_0(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q8_0-encode float32 ``[rows, n]`` (n divisible by 32) to bytes ``[rows, n // 32 * 34]``."""
    rows, n = x.shape
    blocks = x.reshape(-1, Q8_0_BLOCK)  # [n_blocks, 32]
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)  # [n_blocks, 1]
    inverse = np.zeros_like(scale)
    np.divide(np.float32(1), scale, out=inverse, where=scale != 0)
    values = round_half_away(blocks * inverse)
    if out is None:
        out = np.empty((rows, n // Q8_0_BLOCK * Q8_0_BYTES), np.uint8)
    packed = out.reshape(-1, Q8_0_BYTES)
    packed[:, :2] = scale.astype(np.float16).view(np.uint8)
    packed[:, 2:] = values.astype(np.int8).view(np.uint8)
    return out


def encode_rows(x: np.ndarray, qtype: QType, importance: np.ndarray | None = None,
                threads: int | None = None) -> np.ndarray:
    """Float32 ``[rows, n]`` -> the stored layout of ``qtype`` for those rows.

    ``importance`` is the tensor's per-column importance ``[n]`` (an importance matrix entry, llama.cpp's
    ``quant_weights``): the K-quants, IQ4, the lattice i-quants and Q4_0..Q5_1 are then encoded as
    ``llama-quantize --imatrix`` does; Q8_0, TQ1_0, TQ2_0 and the dense types ignore it, as llama.cpp does.
    These searched encodings split the rows over ``threads`` threads (default:
    :func:`~qwen_runtime.backend.pool.default_threads`); the bytes do not depend on it.
    """
    if qtype in SEARCHED or (importance is not None and qtype in GGUF_QUANTIZED):
        return encode_searched(x, qtype, importance, threads)
    if qtype == QType.F32:
        return x
    if qtype == QType.F16:
        return x.astype(np.float16)
    if qtype == QType.Q8_0:
        return quantize_q8_0(x)
    if qtype in TERNARY:
        with np.errstate(all="ignore"):  # 1/amax overflows for blocks of subnormals, in llama.cpp too
            return quants.quantize(x, qtype)
    if qtype in GGUF_QUANTIZED:
        return quants.quantize(x, qtype)
    raise FormatError(f"cannot write tensors of type {qtype.name}")


def encode_searched(x: np.ndarray, qtype: QType, importance: np.ndarray | None, threads: int | None) -> np.ndarray:
    """A K-quant, IQ4, lattice i-quant or importance-weighted Q4_0..Q5_1 encoding of float32 ``[rows, n]``,
    its rows split into up to ``threads`` parts encoded at once (the compiled searches release the GIL; blocks
    never span rows, so the parts are independent)."""
    listen()  # a command then says when numba compiles the searches (their first use on a machine)
    from . import iq4_encode, iq_encode, kquant_encode, legacy_encode

    stored_shape(qtype, x.shape)  # refuses a row length that is not a multiple of the block
    if importance is not None and np.shape(importance) != x.shape[-1:]:
        raise FormatError(f"importance has shape {np.shape(importance)}, the rows have {x.shape[-1]} columns")
    if qtype in GGUF_QUANTIZED:
        def encoder(rows: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
            return legacy_encode.quantize_weighted(rows, qtype, weights)
    else:
        encoder = {**kquant_encode.ENCODERS, **iq4_encode.ENCODERS, **iq_encode.ENCODERS}[qtype]
    parts = max(1, min(len(x), default_threads() if threads is None else threads))

    def encode(rows: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # inf/NaN intermediates of all-tiny blocks are part of llama.cpp's path
            return encoder(rows, importance)

    if parts == 1:
        return encode(x)
    bounds = np.linspace(0, len(x), parts + 1).astype(int)
    with ThreadPoolExecutor(parts) as pool:
        return np.concatenate(list(pool.map(encode, [x[a:b] for a, b in itertools.pairwise(bounds)])))


def rows_per_chunk(row_length: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(row_length, 1))


def stream_rows(tensor: StoredTensor, qtype: QType, importance: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """The tensor converted to ``qtype`` as C-contiguous chunks of whole rows (``[rows, row bytes]``), with
    the per-column ``importance`` ``[n]`` when given (see :func:`encode_rows`).

    Concatenated, the chunks are the bytes of the tensor stored as ``qtype``.  A chunk may reuse the
    previous chunk's buffer: consume it (write, hash) before asking for the next one.
    """
    stored_shape(qtype, tensor.shape)  # refuses a row length that is not a multiple of the block
    source = tensor.rows2d()  # one memory map for the whole tensor: [rows, stored row length]
    width = tensor.shape[-1] if tensor.shape else 1
    step = rows_per_chunk(width)
    if tensor.qtype == qtype:
        for start in range(0, len(source), step):
            yield np.ascontiguousarray(source[start:start + step])
        return
    buffer = np.empty((min(step, len(source)), width), np.float32)
    for start in range(0, len(source), step):
        rows = source[start:start + step]
        yield encode_rows(to_float32(tensor.qtype, rows, buffer[: len(rows)]), qtype, importance)
        release_pages(source)


def release_pages(view: np.ndarray) -> None:
    """Drop the pages of a read-only memory map from this process's RSS (the page cache keeps them).

    Without this every page read stays mapped until the tensor's map is closed, so peak RSS grows with the
    largest tensor (the embedding: 0.27-0.5 GB of bf16).  Pages touched again are faulted back in.
    """
    mapping = getattr(view, "_mmap", None)  # set on np.memmap and views of one
    if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)


def write_chunks(f: BinaryIO, chunks: Iterable[np.ndarray], digest) -> int:  # digest: hashlib hash object
    """Write encoded chunks to ``f``, feeding them to ``digest``; return the bytes written."""
    written = 0
    for chunk in chunks:
        f.write(chunk.data)
        digest.update(chunk.data)
        written += chunk.nbytes
    return written
