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

The 4- to 6-bit types share the field-major tile machinery of :mod:`.blocks`.  Other GGML types (IQ1_*, IQ2_*,
IQ3_*, TQ1_0, TQ2_0, MXFP4, ...) are refused by :func:`codec` with a :class:`~qwen_runtime.errors.FormatError`.
Block sizes and bytes per block come from ``gguf.GGML_QUANT_SIZES``.
"""

from __future__ import annotations

import importlib

import numpy as np

from ..errors import FormatError
from ..pool import Scratch
from .base import BLOCK_SUM_ROWS, Codec, QType, TileKernel
from .dense import BF16, F16, F32
from .iq4 import IQ4_NL, IQ4_XS
from .kquants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .legacy import Q4_0, Q4_1, Q5_0, Q5_1
from .q8_0 import Q8_0

CODECS: dict[QType, Codec] = {c.qtype: c for c in (
    F32(), F16(), BF16(), Q8_0(), Q4_0(), Q4_1(), Q5_0(), Q5_1(),
    Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K(), IQ4_NL(), IQ4_XS())}
READ_TYPES = tuple(CODECS)
DENSE_TYPES = (QType.F32, QType.F16, QType.BF16)

# The compiled kernel of each type that has one: (module of this package, class), imported on first use so
# that numba loads only for ``kernels="numba"`` and each family compiles only when a model uses it.
JIT_KERNELS: dict[QType, tuple[str, str]] = {
    QType.Q8_0: ("jit_q8_0", "Q8_0JitKernel"),
    QType.Q2_K: ("jit_kquants", "Q2_KJitKernel"),
    QType.Q3_K: ("jit_kquants", "Q3_KJitKernel"),
    QType.Q4_K: ("jit_kquants", "Q4_KJitKernel"),
    QType.Q5_K: ("jit_kquants", "Q5_KJitKernel"),
    QType.Q6_K: ("jit_kquants", "Q6_KJitKernel"),
    QType.F32: ("jit_dense", "F32JitKernel"),
    QType.F16: ("jit_dense", "F16JitKernel"),
    QType.BF16: ("jit_dense", "BF16JitKernel"),
    QType.Q4_0: ("jit_legacy", "Q4_0JitKernel"),
    QType.Q4_1: ("jit_legacy", "Q4_1JitKernel"),
    QType.Q5_0: ("jit_legacy", "Q5_0JitKernel"),
    QType.Q5_1: ("jit_legacy", "Q5_1JitKernel"),
    QType.IQ4_NL: ("jit_iq4", "IQ4_NLJitKernel"),
    QType.IQ4_XS: ("jit_iq4", "IQ4_XSJitKernel"),
}

# Integer-dot kernels with 8-bit activations (``Workspace.activations == "q8"``; other types keep their float kernel).
JIT_Q8_KERNELS: dict[QType, tuple[str, str]] = {
    QType.Q8_0: ("jit_amx", "Q8_0AmxKernel"),  # prompts on AMX tiles where the CPU has them
    QType.Q4_0: ("jit_int8", "Q4_0Int8Kernel"),
    QType.Q5_0: ("jit_int8", "Q5_0Int8Kernel"),
    QType.Q4_1: ("jit_int8", "Q4_1Int8Kernel"),
    QType.Q5_1: ("jit_int8", "Q5_1Int8Kernel"),
    QType.Q2_K: ("jit_int8_k", "Q2_KInt8Kernel"),
    QType.Q3_K: ("jit_int8_k", "Q3_KInt8Kernel"),
    QType.Q4_K: ("jit_amx_k", "Q4_KAmxKernel"),  # prompts on AMX tiles where the CPU has them
    QType.Q5_K: ("jit_int8_k", "Q5_KInt8Kernel"),
    QType.Q6_K: ("jit_amx_k", "Q6_KAmxKernel"),  # prompts on AMX tiles where the CPU has them
    QType.IQ4_NL: ("jit_int8", "IQ4_NLInt8Kernel"),
    QType.IQ4_XS: ("jit_int8", "IQ4_XSInt8Kernel"),
}

__all__ = ["BLOCK_SUM_ROWS", "CODECS", "Codec", "DENSE_TYPES", "JIT_KERNELS", "JIT_Q8_KERNELS", "READ_TYPES",
           "TileKernel", "codec", "jit_kernel", "stored_nbytes", "stored_shape", "to_float32"]


def codec(qtype: QType | int) -> Codec:
    """The codec of a GGML type; :class:`FormatError` naming the type for one this runtime cannot read."""
    found = CODECS.get(qtype)  # type: ignore[call-overload]
    if found is None:
        name = QType(qtype).name if qtype in QType._value2member_map_ else str(qtype)
        raise FormatError(f"type {name} is not supported (supported: {', '.join(q.name for q in READ_TYPES)})")
    return found


def jit_kernel(qtype: QType, raw: np.ndarray, activations: str = "float") -> TileKernel | None:
    """The compiled tile kernel of a matrix stored as ``raw`` (None for a type without one, and for rows that are
    not one contiguous array, e.g. a Fortran-ordered npy file: the numpy kernels handle any strides); with
    ``activations="q8"`` the integer-dot kernel where the type has one."""
    entry = (JIT_Q8_KERNELS.get(qtype) if activations == "q8" else None) or JIT_KERNELS.get(qtype)
    if entry is None or not np.asarray(raw).flags.c_contiguous:
        return None
    module, name = entry
    return getattr(importlib.import_module(f".{module}", __name__), name)(raw)


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
