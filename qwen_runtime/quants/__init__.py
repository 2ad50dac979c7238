"""Stored tensor types, one module per family, each with a plain reference decoder beside its fast kernel.

===========================  =========================================================================
module                       types
===========================  =========================================================================
:mod:`.dense`                F32, F16, BF16
:mod:`.q8_0`                 Q8_0 (its own kernel: the scale bytes ride along in the contiguous cast)
:mod:`.legacy`               Q4_0, Q4_1, Q5_0, Q5_1
:mod:`.kquants`              Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
:mod:`.iq4`                  IQ4_NL, IQ4_XS
===========================  =========================================================================

The compiled twins of these kernels live in :mod:`qwen_runtime.backend.kernels`.  The 4- to 6-bit types share the
field-major tile machinery of :mod:`.blocks`.  Other GGML types (IQ1_*, IQ2_*,
IQ3_*, TQ1_0, TQ2_0, MXFP4, ...) are refused by :func:`codec` with a :class:`~qwen_runtime.errors.FormatError`.
Block sizes and bytes per block come from ``gguf.GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from .base import BLOCK_SUM_ROWS, Codec, QType, TileKernel
from .dense import BF16, F16, F32
from .iq4 import IQ4_NL, IQ4_XS
from .kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1
from .q8_0 import Q8_0
from .scratch import Scratch

CODECS: dict[QType, Codec] = {c.qtype: c for c in (
    F32(), F16(), BF16(), Q8_0(), Q4_0(), Q4_1(), Q5_0(), Q5_1(),
    Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K(), IQ4_NL(), IQ4_XS())}
READ_TYPES = tuple(CODECS)
DENSE_TYPES = (QType.F32, QType.F16, QType.BF16)

__all__ = ["BLOCK_SUM_ROWS", "CODECS", "Codec", "DENSE_TYPES", "READ_TYPES", "TileKernel", "codec",
           "stored_nbytes", "stored_shape", "to_float32"]


def codec(qtype: QType | int) -> Codec:
    """The codec of a GGML type; :class:`FormatError` naming the type for one this runtime cannot read."""
    found = CODECS.get(qtype)  # type: ignore[call-overload]
    if found is None:
        name = QType(qtype).name if qtype in QType._value2member_map_ else str(qtype)
        raise FormatError(f"type {name} is not supported (supported: {', '.join(q.name for q in READ_TYPES)})")
    return found


def stored_shape(qtype: QType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the array view that holds a tensor of logical ``shape`` stored as ``qtype``."""
    return codec(qtype).stored_shape(shape)


def stored_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes needed to store a tensor of logical ``shape`` as ``qtype``."""
    return codec(qtype).stored_nbytes(shape)


def to_float32(qtype: QType, raw: np.ndarray, out: np.ndarray | None = None,
               chunk_elements: int = 1 << 20) -> np.ndarray:
    """Decode a stored view ``[..., stored row]`` of any readable type to float32 ``[..., n]`` (fast, exact),
    about ``chunk_elements`` at a time (``out`` reused when given; F32 without ``out`` is not copied)."""
    c = codec(qtype)
    if qtype == QType.F32 and out is None:
        return np.asarray(raw, dtype=np.float32)
    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim else raw.reshape(1, 1)
    n = rows.shape[1] // c.type_size * c.block_size if c.quantized else rows.shape[1]
    result = np.empty((len(rows), n), np.float32) if out is None else out.reshape(len(rows), n)
    scratch, step = Scratch(), max(1, chunk_elements // max(n, 1))
    for r0 in range(0, len(rows), step):
        c.decode(np.ascontiguousarray(rows[r0:r0 + step]), result[r0:r0 + step], scratch)
    return result.reshape(*raw.shape[:-1], n) if raw.ndim else result.reshape(())
