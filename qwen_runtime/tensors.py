"""Stored tensors: the bytes a file holds for one weight, and how to widen them to float32.

A :class:`StoredTensor` is what every reader hands out: a canonical (GGUF-vocabulary) name, the GGML type of
the stored bytes, the logical numpy shape (``[out, in]`` for a matrix) and a zero-copy view of the bytes.
Layouts of :attr:`StoredTensor.data` by type:

* F32 / F16: ``float32`` / ``float16`` array of the logical shape.
* BF16: ``uint16`` array of the logical shape (numpy has no bfloat16).
* Q8_0: ``uint8`` array ``[*shape[:-1], shape[-1] // 32 * 34]``: GGML blocks of an fp16 scale then 32 int8.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import FormatError

QType = GGMLQuantizationType
Q8_0_BLOCK, Q8_0_BYTES = GGML_QUANT_SIZES[QType.Q8_0]  # values per block, bytes per block
# The numpy view of one Q8_0 block, used for .npy files so npy and GGUF hold the same bytes.
Q8_0_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_0_BLOCK,))])
assert Q8_0_DTYPE.itemsize == Q8_0_BYTES

# numpy dtype of the array view for each unquantized type.
DENSE_DTYPES: dict[QType, np.dtype] = {
    QType.F32: np.dtype("<f4"),
    QType.F16: np.dtype("<f2"),
    QType.BF16: np.dtype("<u2"),
}
SUPPORTED_QTYPES = (*DENSE_DTYPES, QType.Q8_0)


def stored_shape(qtype: QType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the array view that holds a tensor of logical ``shape`` stored as ``qtype``."""
    if qtype in DENSE_DTYPES:
        return shape
    if qtype == QType.Q8_0:
        if not shape or shape[-1] % Q8_0_BLOCK:
            raise FormatError(f"Q8_0 needs a row length divisible by {Q8_0_BLOCK}, got shape {shape}")
        return (*shape[:-1], shape[-1] // Q8_0_BLOCK * Q8_0_BYTES)
    raise FormatError(f"unsupported tensor type {qtype!r}")


def stored_nbytes(qtype: QType, shape: tuple[int, ...]) -> int:
    """Bytes needed to store a tensor of logical ``shape`` as ``qtype``."""
    itemsize = DENSE_DTYPES[qtype].itemsize if qtype in DENSE_DTYPES else 1
    return int(np.prod(stored_shape(qtype, shape), dtype=np.int64)) * itemsize


def bf16_to_f32(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bits (``uint16``) to float32 by placing them in the high half of each word."""
    out = np.empty(raw.shape, np.float32) if out is None else out
    np.left_shift(raw, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def dequantize_q8_0(raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Decode Q8_0 bytes ``[..., nb * 34]`` to float32 ``[..., nb * 32]``."""
    lead = raw.shape[:-1]
    blocks = np.ascontiguousarray(raw).reshape(-1, Q8_0_BYTES)  # [n_blocks, 34]
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    qs = blocks[:, 2:].view(np.int8)  # [n_blocks, 32]
    if out is None:
        out = np.empty((*lead, raw.shape[-1] // Q8_0_BYTES * Q8_0_BLOCK), np.float32)
    np.multiply(qs, scale, out=out.reshape(-1, Q8_0_BLOCK))
    return out


def to_float32(qtype: QType, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen a stored view of any supported type to float32 (``out`` reused when given)."""
    if qtype == QType.Q8_0:
        return dequantize_q8_0(raw, out)
    if qtype == QType.BF16:
        return bf16_to_f32(raw, out)
    if qtype in (QType.F32, QType.F16):
        if out is None:
            return np.asarray(raw, dtype=np.float32)
        np.copyto(out, raw, casting="same_kind")
        return out
    raise FormatError(f"unsupported tensor type {qtype!r}")


class StoredTensor:
    """One tensor as stored in a file: type, logical shape and a lazily produced array view."""

    def __init__(self, name: str, qtype: QType, shape: tuple[int, ...], path: str | Path,
                 data: np.ndarray | None = None, loader: Callable[[], np.ndarray] | None = None,
                 transform: str = "") -> None:
        if (data is None) == (loader is None):
            raise ValueError("give exactly one of data and loader")
        self.name = name
        self.qtype = QType(qtype)
        self.shape = tuple(int(s) for s in shape)
        self.path = str(path)
        self.transform = transform  # what was done to the source tensor, e.g. "A_log -> -exp(A_log)"
        self._data = data
        self._loader = loader

    def __repr__(self) -> str:
        return f"StoredTensor({self.name!r}, {self.qtype.name}, {self.shape}, {self.path!r})"

    @property
    def data(self) -> np.ndarray:
        """The stored bytes as an array (see the module docstring for the layout per type)."""
        return self._data if self._data is not None else self._loader()  # type: ignore[misc]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.qtype, self.shape)

    @property
    def n_rows(self) -> int:
        """Rows of the tensor viewed as 2-D ``[rows, shape[-1]]``."""
        return self.n_elements // self.shape[-1] if self.shape else 1

    def rows2d(self) -> np.ndarray:
        """The stored view reshaped to ``[rows, stored row length]``."""
        data = self.data
        return data.reshape(self.n_rows, -1) if self.shape else data.reshape(1, 1)

    def dequantize_rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Float32 ``[stop - start, shape[-1]]`` for rows ``start:stop`` of the 2-D view."""
        return to_float32(self.qtype, self.rows2d()[start:stop], out)

    def to_float32(self) -> np.ndarray:
        """The whole tensor as float32 (a copy unless it is stored as F32): only for small tensors."""
        return to_float32(self.qtype, self.data).reshape(self.shape)
