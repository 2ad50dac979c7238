"""Which GGML type each canonical tensor is stored as, per output dtype (docs/qwen-architectures.md §4.6).

The rules are llama.cpp's ``prepare_tensors``: F32 for tensors of at most one dimension, for names ending
in ``_norm.weight``, for names not ending in ``.weight`` (``ssm_a``, biases) and for ``ssm_conv1d``;
every other tensor (embedding and output included) gets the output type.  A quantized tensor (q8_0, q4_0,
q4_1, q5_0, q5_1) whose row length is not a multiple of the block size falls back to F16, with a logged note.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from gguf import MODEL_TENSOR, TENSOR_NAMES, LlamaFileType

from qwen_runtime.errors import QwenError
from qwen_runtime.quants import codec
from qwen_runtime.tensors import QType, stored_nbytes

logger = logging.getLogger(__name__)

# Output dtype name (the CLI's --dtype) -> (GGML type of the big matrices, general.file_type).
DTYPES: dict[str, tuple[QType, LlamaFileType]] = {
    "fp32": (QType.F32, LlamaFileType.ALL_F32),
    "fp16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (QType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q5_0": (QType.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q5_1": (QType.Q5_1, LlamaFileType.MOSTLY_Q5_1),
}
# Tensor kinds llama.cpp always keeps in F32 whatever their shape (the ones Qwen models have).
F32_KINDS = frozenset(TENSOR_NAMES[kind] for kind in (MODEL_TENSOR.SSM_CONV1D,))
_LAYER = re.compile(r"^blk\.\d+\.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an output file: canonical name, logical numpy shape and stored GGML type."""

    name: str
    shape: tuple[int, ...]
    qtype: QType

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.qtype, self.shape)


def check_dtype(dtype: str) -> str:
    """``dtype`` if it names an output dtype, else :class:`QwenError` listing the choices."""
    if dtype not in DTYPES:
        raise QwenError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return dtype


def tensor_kind(name: str) -> str:
    """The name without its layer number and suffix, as in ``gguf.TENSOR_NAMES`` (``blk.{bid}.ssm_conv1d``)."""
    base = _LAYER.sub("blk.{bid}.", name)
    return base.rsplit(".", 1)[0] if base.endswith((".weight", ".bias")) else base


def tensor_qtype(name: str, shape: tuple[int, ...], dtype: str) -> QType:
    """The GGML type a canonical tensor is stored as for output ``dtype`` (a key of :data:`DTYPES`)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return QType.F32
    if tensor_kind(name) in F32_KINDS:
        return QType.F32
    qtype = DTYPES[check_dtype(dtype)][0]
    block = codec(qtype).block_size
    if shape[-1] % block:
        logger.info("%s: row length %d is not a multiple of %d, stored as F16 instead of %s",
                    name, shape[-1], block, qtype.name)
        return QType.F16
    return qtype


def _order_key(name: str) -> tuple[int, int, str]:
    """token_embd first, then the blocks by layer number, then output_norm / output."""
    match = _LAYER.match(name)
    if match:
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith(TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]) else 2, 0, name)


def plan_outputs(shapes: dict[str, tuple[int, ...]], dtype: str) -> list[TensorSpec]:
    """Output specs for tensors ``{name: shape}``, in file order (embedding, layers 0..L-1, head)."""
    return [TensorSpec(name, shapes[name], tensor_qtype(name, shapes[name], dtype))
            for name in sorted(shapes, key=_order_key)]


def file_type(dtype: str) -> LlamaFileType:
    """``general.file_type`` for an output dtype."""
    return DTYPES[check_dtype(dtype)][1]

