"""Prefill products of the 32-value block types other than Q8_0 (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) with 8-bit
activations on AMX tiles: Q8_0's kernel (:func:`.amx.block_amx`), each block decoded to its 32 int8 values when a
panel is repacked (:func:`.amx.repack_blocks`, from the type's :class:`.amx.BlockGeometry`).

llama.cpp multiplies these types against q8_0 activations (Q4_0, Q5_0, IQ4_NL: ``(d_w * d_x) * sum(w q)`` per
block) or q8_1 (Q4_1, Q5_1: ``+ m_w * s`` with ``s = d_x * sum(q)``; ``ggml``'s ``type_traits_cpu`` ``vec_dot_type``),
whose numbers :func:`.q8_act.product_blockwise` gives (with :func:`.q8_act.activation_sums`); the kernel does its
operations in its order, so it equals it bit for bit.  Every integer fits a signed byte (Q4_0 -8..7, Q5_0
-16..15, Q4_1 0..15, Q5_1 0..31, IQ4_NL's levels -127..113), so one ``tdpbssd`` per block and tile, as Q8_0.
A module of its own so that models without these types do not load their float kernels.
"""

from __future__ import annotations

import numpy as np

from ...quants.base import QType
from ...quants.iq4 import IQ4_NL
from ...quants.legacy import Q4_0, Q4_1, Q5_0, Q5_1
from . import lanes
from .amx import (
    LEVELS,
    NIBBLES,
    AmxActivations,
    AmxPrompts,
    BlockGeometry,
    blocks_amx_product,
    quantized_padded,
    scaled_sums,
)
from .base import Declared
from .iq4 import IQ4_NLJitKernel
from .legacy import Q4_0JitKernel, Q4_1JitKernel, Q5_0JitKernel, Q5_1JitKernel


def _legacy(codec: Q4_0 | Q4_1 | Q5_0 | Q5_1) -> BlockGeometry:
    """A legacy type's geometry from its codec (``d`` first, ``m`` after it)."""
    return BlockGeometry(codec.type_size, codec.qs_at, -1 if codec.qh_at is None else codec.qh_at, codec.bias,
                         2 if codec.has_offset else -1, NIBBLES)


GEOMETRY: dict[QType, BlockGeometry] = {
    **{c.qtype: _legacy(c) for c in (Q4_0(), Q4_1(), Q5_0(), Q5_1())},
    QType.IQ4_NL: BlockGeometry(IQ4_NL().type_size, 2, -1, 0, -1, LEVELS),  # d, then qs[16] as Q4_0's
}


def padded_with_sums(x: np.ndarray, mins: bool) -> AmxActivations:
    """:func:`.amx.quantized_padded` of ``x`` [M, K] and, for types with minimums (``mins``), the activations'
    :func:`.amx.scaled_sums` (else ``d`` in their place, never read): the prepared activations of a prompt."""
    q, d = quantized_padded(x)
    s = d
    if mins:
        s = np.empty_like(d)
        scaled_sums(q, d, s)
    prepared = AmxActivations((q, d, s))
    prepared.rows = len(x)
    return prepared


class BlockAmxPrompts(AmxPrompts):
    """Prompts of a 32-value block type through :func:`.amx.blocks_amx_product` (``qtype``'s :data:`GEOMETRY`), or
    for Q4_0 and Q5_0 through AVX2's lanes (:func:`.lanes.nibble_lanes_product`, the same numbers) where
    :func:`.lanes.takes_q8_0`."""

    prepared_type = AmxActivations
    qtype: QType

    def quantize(self, x: np.ndarray) -> AmxActivations:
        return padded_with_sums(x, GEOMETRY[self.qtype].m_at >= 0)

    def amx_product(self, raw: np.ndarray, xk: AmxActivations, out: np.ndarray) -> None:
        blocks_amx_product(GEOMETRY[self.qtype], raw, *xk, out)

    def lane_quantize(self, x: np.ndarray) -> lanes.LaneActivations | None:
        if self.lane_kernel() is None:
            return None
        q, d = quantized_padded(x)
        return lanes.nibble_lane_activations(q, d, len(x), self.in_features)

    def lane_product(self, raw: np.ndarray, xk: lanes.LaneActivations, out: np.ndarray) -> None:
        lanes.nibble_lanes_product(raw, xk, out)

    def lane_kernel(self) -> Declared | None:
        return lanes.prompt_kernel(self.type_size) if self.qtype in (QType.Q4_0, QType.Q5_0) else None


class Q4_0AmxPrompts(BlockAmxPrompts):
    qtype = QType.Q4_0


class Q4_1AmxPrompts(BlockAmxPrompts):
    qtype = QType.Q4_1


class Q5_0AmxPrompts(BlockAmxPrompts):
    qtype = QType.Q5_0


class Q5_1AmxPrompts(BlockAmxPrompts):
    qtype = QType.Q5_1


class IQ4_NLAmxPrompts(BlockAmxPrompts):
    qtype = QType.IQ4_NL


class Q4_0AmxPromptKernel(Q4_0AmxPrompts, Q4_0JitKernel):
    """Q4_0 with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q4_1AmxPromptKernel(Q4_1AmxPrompts, Q4_1JitKernel):
    """Q4_1 with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q5_0AmxPromptKernel(Q5_0AmxPrompts, Q5_0JitKernel):
    """Q5_0 with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class Q5_1AmxPromptKernel(Q5_1AmxPrompts, Q5_1JitKernel):
    """Q5_1 with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


class IQ4_NLAmxPromptKernel(IQ4_NLAmxPrompts, IQ4_NLJitKernel):
    """IQ4_NL with 8-bit activations in prompts on AMX tiles only (``activations="q8-prompts"``), else exact."""


# This family's AMX prompt kernels (:func:`.kernel_table`).
KERNELS = (Q4_0AmxPromptKernel, Q4_1AmxPromptKernel, Q5_0AmxPromptKernel, Q5_1AmxPromptKernel, IQ4_NLAmxPromptKernel)
