"""Stored tensors: the bytes a file holds for one weight, and how to widen them to float32.

A :class:`StoredTensor` is what every reader hands out: a canonical (GGUF-vocabulary) name, the GGML type of
the stored bytes, the logical numpy shape (``[out, in]`` for a matrix) and a zero-copy view of the bytes.
Layouts of :attr:`StoredTensor.data` by type:

* F32 / F16: ``float32`` / ``float16`` array of the logical shape.
* BF16: ``uint16`` array of the logical shape (numpy has no bfloat16).
* quantized types (Q8_0, Q4_0, ..., Q6_K, IQ4_XS): ``uint8`` array ``[*shape[:-1], shape[-1] // block * type
  size]``, the GGML blocks of each row.

How each type is decoded lives in :mod:`qwen_runtime.quants` (one codec per type); the names below are
that package's, kept here for the readers and writers that deal in stored tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..quants import CODECS, DENSE_TYPES, READ_TYPES, QType, codec, stored_nbytes, stored_shape, to_float32
from ..quants.q8_0 import Q8_0_BLOCK, Q8_0_BYTES

__all__ = ["DENSE_DTYPES", "Q8_0_BLOCK", "Q8_0_BYTES", "Q8_0_DTYPE", "QType", "SUPPORTED_QTYPES", "StoredTensor",
           "stored_nbytes", "stored_shape", "stored_view", "to_float32"]

# The numpy view of one Q8_0 block, used for .npy files so npy and GGUF hold the same bytes.
Q8_0_DTYPE = CODECS[QType.Q8_0].npy_dtype
# numpy dtype of the array view for each unquantized type.
DENSE_DTYPES: dict[QType, np.dtype] = {q: CODECS[q].npy_dtype for q in DENSE_TYPES}
SUPPORTED_QTYPES = READ_TYPES


def stored_view(qtype: QType, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The array view (layout above) of a tensor's raw bytes ``raw`` (uint8, exactly its stored size)."""
    if qtype in DENSE_DTYPES:
        return raw.view(DENSE_DTYPES[qtype]).reshape(shape)
    return raw.reshape(codec(qtype).stored_shape(shape))


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

    def to_float32(self) -> np.ndarray:
        """The whole tensor as float32 (a copy unless it is stored as F32): only for small tensors."""
        return to_float32(self.qtype, self.data).reshape(self.shape)
