"""Weight kinds: how to multiply float32 activations by a matrix kept in its stored type.

A :class:`Weight` is a ``[out, in]`` matrix as stored in the model file (memory-mapped, never copied whole):

* :class:`F32Weight` multiplies straight from the memory map (BLAS reads the mapped pages), a block of rows
  per task.
* :class:`TiledWeight` (BF16, F16, Q8_0) widens ``block_rows`` rows at a time into a float32 scratch buffer
  of the pool thread doing it (:mod:`.pool`: a :class:`Workspace` keeps one per thread, shared by every
  weight of a model) and BLAS-multiplies the tile.  No float32 copy of a whole matrix ever exists: anonymous
  memory stays at one tile per thread, plus Q8_0's block scales widened to float32 (2/17 of the stored bytes).

:func:`matmul_many` runs the tiles of projections sharing an input (q/k/v) as one pool run;
:func:`gated_matmul` also applies SwiGLU's activation inside each gate/up task.

``rows(ids)`` is the embedding lookup: it decodes only the rows asked for.  A tied ``lm_head`` is the very
same object as the token embedding.  Every kind keeps ``to_float32()`` as the plain reference that the
tests compare the fast paths against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from .errors import FormatError
from .ops import silu_mul
from .pool import Scratch, Workspace
from .tensors import Q8_0_BLOCK, Q8_0_BYTES, Q8_0_DTYPE, QType, StoredTensor

# Elements per widened tile (4 MiB of float32, in L3): big enough that the few numpy calls per tile, each a GIL
# hand-off between pool threads, are cheap next to the work (1 MiB tiles decoded Q8_0 a third slower).
TILE_ELEMENTS = 1 << 20
# Activation rows up to which Q8_0 tiles are multiplied per block column (decode, batch decode); above it the
# tile is scaled in place and multiplied once (prefill).
BLOCK_SUM_ROWS = 8

_F16_EXP_MASK = np.uint16(0x7C00)
_F16_ABS_MASK = np.uint16(0x7FFF)
_F16_SIGN_MASK = np.uint16(0x8000)
_F32_EXP_MASK = np.uint32(0x7F800000)
_F16_TO_F32_SCALE = np.float32(2.0**112)  # rebias the fp16 exponent (15) to float32's (127)
_F16_OVERFLOW = np.float32(65536.0)  # only fp16 inf/nan land at or above this after rebiasing
_F32_SIGN_AND_LOW = np.int32(-0x70000001)  # 0x8FFFFFFF: clears bits 28-30 that sign extension filled
_F16_PRESCALE_LIMIT = np.float32(2.0**15)  # |x| * 2**112 stays finite below this


def f16_bits_to_f32(bits: np.ndarray, out: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Exact float16 -> float32 by bit manipulation (numpy's own f16 cast is not vectorised here).

    The 15 magnitude bits shifted left by 13 form a float32 whose exponent is biased by 15 instead of 127;
    multiplying by 2**112 fixes the bias for normal and subnormal values alike.  Inf/NaN (exponent 31)
    come out >= 65536 and get the float32 all-ones exponent; then the sign bit is copied over.
    """
    tmp16, tmp32 = scratch.array("f16 bits", bits.shape, np.uint16), scratch.array("f16 sign", bits.shape, np.uint32)
    out32 = out.view(np.uint32)
    np.bitwise_and(bits, _F16_ABS_MASK, out=tmp16)
    np.left_shift(tmp16, 13, out=out32, dtype=np.uint32)
    np.multiply(out, _F16_TO_F32_SCALE, out=out)
    special = out >= _F16_OVERFLOW
    if special.any():
        np.bitwise_or(out32, _F32_EXP_MASK, out=out32, where=special)
    np.bitwise_and(bits, _F16_SIGN_MASK, out=tmp16)
    np.left_shift(tmp16, 16, out=tmp32, dtype=np.uint32)
    np.bitwise_or(out32, tmp32, out=out32)
    return out


def f16_bits_to_prescaled(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Finite float16 -> float32 divided by 2**112, exactly, in two passes (no multiply).

    Sign-extending the int16 bits to int32 and shifting left by 13 puts the sign at bit 31, the exponent
    (still biased by 15) and mantissa in place, and copies of the sign in bits 28-30, which the mask clears.
    Multiplying the activations by 2**112 instead of the weights gives exactly the same products.  Only
    for tiles without inf/NaN (exponent 31), which would come out finite here.
    """
    out32 = out.view(np.int32)
    np.left_shift(bits.view(np.int16), 13, out=out32, dtype=np.int32)
    np.bitwise_and(out32, _F32_SIGN_AND_LOW, out=out32)
    return out


def q8_0_to_f32(raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode Q8_0 rows ``[R, nb * 34]`` (uint8) into ``out`` float32 ``[R, nb * 32]`` (the reference)."""
    blocks = raw.view(Q8_0_DTYPE)  # [R, nb] of (d: f16, qs: 32 x i8)
    scale = blocks["d"].astype(np.float32)[..., None]  # [R, nb, 1] (1/32 of the elements: a plain cast is fine)
    np.multiply(blocks["qs"], scale, out=out.reshape(*blocks.shape, Q8_0_BLOCK))
    return out


def q8_0_activations(x: np.ndarray) -> np.ndarray:
    """Activations laid out like Q8_0 bytes: ``[N, nb * 32] -> [N, nb, 34]``, zeros where the scale bytes sit."""
    n, width = x.shape
    out = np.zeros((n, width // Q8_0_BLOCK, Q8_0_BYTES), np.float32)
    out[:, :, Q8_0_BYTES - Q8_0_BLOCK:] = x.reshape(n, -1, Q8_0_BLOCK)
    return out


def q8_0_scales(bits: np.ndarray) -> np.ndarray:
    """The float16 block scales (as bits) to float32, exactly; 3 vector passes instead of numpy's scalar cast."""
    bits = np.ascontiguousarray(bits)
    if np.any(np.bitwise_and(bits, _F16_EXP_MASK) == _F16_EXP_MASK):  # inf/NaN scale: a broken tensor
        return bits.view(np.float16).astype(np.float32)
    out = f16_bits_to_prescaled(bits, np.empty(bits.shape, np.float32))
    return np.multiply(out, _F16_TO_F32_SCALE, out=out)


def q8_0_row_scales(raw: np.ndarray) -> np.ndarray:
    """The float32 block scales of Q8_0 rows.  # [R, nb * 34] uint8 -> [R, nb]"""
    rows = raw.shape[0]
    return q8_0_scales(raw.reshape(rows, -1, Q8_0_BYTES)[:, :, :2].view(np.uint16)[..., 0])


def q8_0_product(raw: np.ndarray, scales: np.ndarray, xq: np.ndarray, scratch: Scratch,
                 out: np.ndarray) -> np.ndarray:
    """``out = x @ dequantize(raw).T`` for Q8_0 rows ``raw`` [R, nb * 34], their float32 ``scales`` [nb, R]
    (any strides) and ``xq = q8_0_activations(x)`` [N, nb, 34].

    Every byte of the rows, scales included, is cast to float32 in one contiguous pass (the fast cast; the
    strided 32-of-34 view is several times slower); the scale bytes meet the zeros of ``xq``.  For a few
    activation rows (decode) one batched BLAS call gives the per-block dot products ``[nb, N, R]``, which are
    scaled and summed over the blocks with R innermost; for many rows the tile is scaled in place and
    multiplied once.  Equal to the reference up to float32 rounding (the scale is applied to block sums).
    ``out`` is ``[N, R]`` (a column block of the layer's output, any leading stride).  # -> out
    """
    rows, n, nb = len(raw), xq.shape[0], xq.shape[1]
    tile = scratch.array("tile", (rows, nb, Q8_0_BYTES))
    np.copyto(tile.reshape(raw.shape), raw.view(np.int8), casting="unsafe")
    if n <= BLOCK_SUM_ROWS:
        sums = scratch.array("block sums", (nb, n, rows))
        np.matmul(xq.transpose(1, 0, 2), tile.transpose(1, 2, 0), out=sums)  # [nb, N, 34] @ [nb, 34, R]
        np.multiply(sums, scales[:, None, :], out=sums)
        return np.add.reduce(sums, axis=0, out=out)
    tile *= scales.T[:, :, None]
    return np.matmul(xq.reshape(n, -1), tile.reshape(rows, -1).T, out=out)


def bf16_bits_to_f32(bits: np.ndarray, out: np.ndarray) -> np.ndarray:
    """BF16 is the high half of a float32: shift the 16 bits into place."""
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def balanced_rows(rows: int, max_rows: int, threads: int) -> int:
    """Rows per tile: at most ``max_rows`` (at least 1), in a number of tiles that is a multiple of ``threads``
    when there are enough rows, so the pool's threads get equal work."""
    tiles = -(-rows // max(1, max_rows))
    tiles = min(rows, -(-tiles // threads) * threads)
    return -(-rows // tiles)


class Weight:
    """A stored ``[out, in]`` matrix that multiplies float32 activations, one block of rows per pool task."""

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        if len(tensor.shape) != 2:
            raise FormatError(f"{tensor.path}: tensor {tensor.name!r} should be a matrix, got shape {tensor.shape}")
        self.name = tensor.name
        self.tensor = tensor
        self.ws = ws
        self.out_features, self.in_features = tensor.shape
        self.block_rows = balanced_rows(self.out_features, tile_elements // self.in_features, ws.threads)

    @property
    def qtype(self) -> QType:
        return self.tensor.qtype

    def blocks(self) -> list[tuple[int, int]]:
        """The row ranges ``[r0, r1)`` multiplied as one task each (about a tile's elements)."""
        step = self.block_rows
        return [(r0, min(r0 + step, self.out_features)) for r0 in range(0, self.out_features, step)]

    def prepare(self, x: np.ndarray) -> object:
        """``x`` [N, in] in the layout :meth:`block_product` multiplies (once per call, shared by all blocks)."""
        return x

    def prepared(self, x: np.ndarray, cache: dict[QType, object]) -> object:
        """:meth:`prepare` of ``x``, computed once per stored type in ``cache``."""
        if self.qtype not in cache:
            cache[self.qtype] = self.prepare(x)
        return cache[self.qtype]

    def block_product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T`` for ``xk = prepare(x)``; ``out`` is [N, r1 - r0], any leading stride."""
        raise NotImplementedError

    def tile_tasks(self, x: np.ndarray, y: np.ndarray,
                   prepared: dict[QType, object] | None = None) -> list[Callable[[Scratch], None]]:
        """Independent tasks that together fill ``y`` [N, out] with ``x @ W.T`` (run by the workspace).

        ``prepared`` shares :meth:`prepare`'s result of ``x`` between weights of one type (q/k/v, gate/up).
        """
        xk = self.prepared(x, {} if prepared is None else prepared)
        return [partial(self.block_product, r0, r1, xk, y[:, r0:r1]) for r0, r1 in self.blocks()]

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """``x @ W.T``.  # [N, in] -> [N, out]"""
        return matmul_many([self], x)[0]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of W as float32 (embedding lookup).  # [N] -> [N, in]"""
        raise NotImplementedError

    def to_float32(self) -> np.ndarray:
        """The whole matrix as float32: the reference for tests (allocates ``out * in`` floats)."""
        return self.tensor.to_float32()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.qtype.name}, {list(self.tensor.shape)})"


class F32Weight(Weight):
    """Float32 weights used in place: BLAS reads the memory-mapped rows directly, in blocks of about a tile.

    Several blocks per matrix, not one per worker: a pool thread wakes up late (tens of microseconds on a
    VM), and with two blocks the calling thread had claimed both before it woke, decoding on one core.
    """

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        super().__init__(tensor, ws, tile_elements)
        self.w = np.asarray(tensor.data)  # [out, in] view of the memory map

    def block_product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        np.matmul(xk, self.w[r0:r1].T, out=out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.w[ids], dtype=np.float32)


class TiledWeight(Weight):
    """BF16 / F16 / Q8_0 weights, multiplied ``block_rows`` rows at a time from the workspace's scratch tiles.

    Q8_0 block scales are widened once per tile, on its first use, into a contiguous float32 ``[nb, out]``
    array (2/17 of the stored bytes: widening them on every call cost a fifth of the decode time); F16 tiles
    are checked for inf/NaN once.
    """

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        super().__init__(tensor, ws, tile_elements)
        if tensor.qtype not in (QType.BF16, QType.F16, QType.Q8_0):
            raise FormatError(f"{tensor.path}: tensor {tensor.name!r}: no tiled kernel for {tensor.qtype.name}")
        raw = np.asarray(tensor.rows2d())  # [out, stored row length]
        self.raw = raw.view(np.uint16) if tensor.qtype == QType.F16 else raw  # F16 is widened from its bits
        self._finite: dict[int, bool] = {}  # F16: tile start -> no inf/NaN in it (checked on first use)
        self._scaled: set[int] = set()  # Q8_0: tile starts whose scales are in _scales
        self._scales: np.ndarray | None = None  # Q8_0: [nb, out] float32, filled tile by tile
        if tensor.qtype == QType.Q8_0:
            self._scales = np.empty((self.in_features // Q8_0_BLOCK, self.out_features), np.float32)

    def widen(self, raw_rows: np.ndarray, out: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
        """Decode stored rows ``[R, stored]`` into ``out`` float32 ``[R, in]`` exactly (the reference)."""
        if self.qtype == QType.Q8_0:
            return q8_0_to_f32(raw_rows, out)
        if self.qtype == QType.BF16:
            return bf16_bits_to_f32(raw_rows, out)
        return f16_bits_to_f32(raw_rows, out, scratch or self.ws.scratch[0])

    def prepare(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``x`` in the layout the kernel multiplies: (plain or Q8_0-shaped, F16's prescaled copy or None)."""
        if self.qtype == QType.Q8_0:
            return q8_0_activations(x), None
        if self.qtype == QType.F16 and x.size and np.abs(x).max() < _F16_PRESCALE_LIMIT:
            return x, x * _F16_TO_F32_SCALE
        return x, None

    def block_product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        raw, (x, prescaled) = self.raw[r0:r1], xk
        if self.qtype == QType.Q8_0:
            q8_0_product(raw, self._tile_scales(r0, r1), x, scratch, out)
            return
        tile = scratch.array("tile", raw.shape)
        if prescaled is not None and self._tile_is_finite(r0, raw):
            np.matmul(prescaled, f16_bits_to_prescaled(raw, tile).T, out=out)
        else:
            np.matmul(x, self.widen(raw, tile, scratch).T, out=out)

    def _tile_scales(self, r0: int, r1: int) -> np.ndarray:
        """Q8_0 scales of rows ``r0:r1`` as float32, widened on the tile's first use.  # -> [nb, R]"""
        scales = self._scales[:, r0:r1]
        if r0 not in self._scaled:
            scales[...] = q8_0_row_scales(self.raw[r0:r1]).T
            self._scaled.add(r0)
        return scales

    def _tile_is_finite(self, r0: int, raw: np.ndarray) -> bool:
        if r0 not in self._finite:
            self._finite[r0] = not np.any(np.bitwise_and(raw, _F16_EXP_MASK) == _F16_EXP_MASK)
        return self._finite[r0]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        return self.widen(self.raw[ids], np.empty((ids.size, self.in_features), np.float32))


def matmul_many(weights: Sequence[Weight], x: np.ndarray) -> list[np.ndarray]:
    """``[w.matmul(x) for w in weights]``, the tiles of all of them through the pool in one run.

    Fusing projections that share their input (q/k/v, gate/up) balances the pool over every row of them
    and pays its dispatch once.  All weights must share one workspace.  # [N, in] -> [[N, out_i], ...]
    """
    outputs = [np.empty((x.shape[0], w.out_features), np.float32) for w in weights]  # tasks fill column blocks
    prepared: dict[QType, object] = {}
    tasks = [task for w, y in zip(weights, outputs, strict=True) for task in w.tile_tasks(x, y, prepared)]
    if weights:
        weights[0].ws.run(tasks)
    return outputs


def gated_matmul(gate: Weight, up: Weight, x: np.ndarray) -> np.ndarray:
    """``silu(x @ gate.T) * (x @ up.T)`` (SwiGLU), each row block of both products and its activation in one
    task, so the activation runs on every pool thread while the block is still in cache.

    Each weight multiplies its block in its own kind; weights split into different blocks (different tile
    sizes) fall back to :func:`matmul_many`.  # [N, in] -> [N, out]
    """
    if gate.blocks() != up.blocks():
        g, u = matmul_many([gate, up], x)
        return silu_mul(g, u, out=g)
    out = np.empty((x.shape[0], gate.out_features), np.float32)
    prepared: dict[QType, object] = {}
    xg, xu = gate.prepared(x, prepared), up.prepared(x, prepared)
    gate.ws.run([partial(_gated_block, gate, up, r0, r1, xg, xu, out[:, r0:r1]) for r0, r1 in gate.blocks()])
    return out


def _gated_block(gate: Weight, up: Weight, r0: int, r1: int, xg: object, xu: object, out: np.ndarray,
                 scratch: Scratch) -> None:
    gate.block_product(r0, r1, xg, out, scratch)
    u = np.empty(out.shape, np.float32)  # [N, R]
    up.block_product(r0, r1, xu, u, scratch)
    silu_mul(out, u, out=out)


def make_weight(tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> Weight:
    """The weight kind for a stored matrix."""
    if tensor.qtype == QType.F32:
        return F32Weight(tensor, ws, tile_elements)
    return TiledWeight(tensor, ws, tile_elements)


def load_vector(tensor: StoredTensor) -> np.ndarray:
    """A small tensor (norm weight, bias) widened once to float32."""
    return np.ascontiguousarray(tensor.to_float32(), dtype=np.float32)
