"""Compiled (numba) twin of :func:`.attention.attend` for a prefill: tiles of query rows over blocks of cached
slots with an online softmax, so that a long prompt never holds a ``T x S`` score matrix.  The reference is the
numpy path of :func:`.attention.attend` (``_attend_tile``: the same online softmax, on BLAS).

Shapes: B batch, T new tokens, nh/nkv query/kv heads, g = nh / nkv, hd head dim, S cache slots.

**Tiles.**  A pool task (:func:`attend_tile`) takes one batch row, one kv head and up to :data:`TILE_ROWS` / g new
tokens; its *rows* are the (token, query head) pairs of that kv head, ``r = (t - t0)·g + h``, so every cached key
and value it decodes serves all the query heads that read it (GQA).  The rows are cut into strips of :data:`STRIP`,
one float32 lane per row, and the scaled queries are held transposed per strip (``qt [J, hd, STRIP]``).  The task
walks the blocks of :data:`BLOCK` slots from slot 0 up to its last token's own slot; per block it decodes the keys
(``kb [BLOCK, hd]``) and the values transposed (``vt [hd, BLOCK]``) once, then for each strip whose rows see any
of the block (the strips a block lies wholly after are skipped: the tiles above the diagonal) it computes the scores
``st [BLOCK, STRIP]`` (slots by rows), masks them when the block reaches past a row's own slot or holds padding, and
folds them into the strip's running maximum ``top``, sum ``weight`` and output ``ot [J, hd, STRIP]`` (transposed),
rescaled by exp(old top - new top) (:func:`fold_block`).  The output is ``ot / weight``.  What a task holds is
O(tile) and nothing grows with the cache (:func:`scratch_shapes`).  The tasks that see the most slots go first.

**Products.**  Both products keep :data:`KEYS` x 2 vectors of :data:`LANES` float32 accumulators in registers
(:func:`lanes_fma`: ``acc[m, k] = fma(b[m0 + m, j], a[i, k], acc[m, k])``, one key or value element broadcast
against a strip's lanes): the scores with ``a = qt``, ``b = kb``, summed over i = 0 .. hd - 1 in order
(:func:`strip_scores`); the outputs with ``a = st`` (the weights), ``b = vt``, summed over the block's slots in order
onto the rescaled output (:func:`strip_values`).

**Exactness and invariance.**  Every row is one lane, every lane runs the same operations in the same order, and
the blocks are aligned on slot 0 whatever the tile: a row's numbers depend only on its own query, its own slot and
the slots it sees, not on the tile, the strip or the other rows, so a prompt's attention is the same bits whether
its tokens come in one pass or in chunks, alone or beside other rows.  A block a row sees nothing of leaves its sums
exactly as they were (exp32(0) is exactly 1, its weights exactly 0).  **Error model** (u = 2^-24): each score is a
sum of hd products, each rounded once (fma), within (hd + 1)·u·Σ|q·k| of the exact score; each weight carries
exp32's 2 ulp and, per block after it, a rescale factor's 2 ulp and rounding; the output is a sum of S weighted
values, each rounded once, divided by the sum of the weights: within (S + 3·S/BLOCK + 4)·u·Σ p|v| of the exact sum
over the same weights.  Masked slots get a weight of exactly 0, as in the reference.  The numpy path rounds the
scores and sums in BLAS's order and its blocks differ, so the two paths agree within the sum of both bounds.

**Cache types** as :mod:`.attention_jit` reads them (:func:`~.attention_jit.widen_row`): every sum runs in float32
on exactly the values the numpy path decodes.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..backend.kernels.base import FEATURES, stack_f32
from ..backend.ops_jit import F32, JIT, ONE, ZERO, exp32
from ..backend.pool import Workspace
from ..quants.scratch import Scratch
from .attention_jit import MASKED, widen_row

LANES = 16 if "avx512f" in FEATURES else 8  # float32 per vector register (zmm; ymm with AVX2)
STRIP = 2 * LANES  # query rows of a strip: two vectors of lanes
KEYS = 6 if LANES == 16 else 4  # keys (scores) or value dims (outputs) a product step takes at once
BLOCK = 128  # cache slots decoded at once (shared by the tile's strips; 64 ran slower)
TILE_ROWS = 512  # query rows of a task, at most: each decoded block serves this many rows (256 ran slower)
ACC_FLOATS = KEYS * STRIP  # a product step's accumulators (:func:`lanes_fma`)
ROW_FLOATS = 3 * STRIP  # a strip's running values in a block (:func:`fold_block`)


VECTOR = ir.VectorType(ir.FloatType(), LANES)
I32 = ir.IntType(32)


def _is_matrix(x: types.Type) -> bool:
    """A C-contiguous float32 2-D array (what the intrinsics below address by row and column)."""
    return isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 and x.layout == "C"


def _address(context, builder: ir.IRBuilder, kind: types.Array, array: ir.Value, row: ir.Value,
             col: ir.Value) -> ir.Value:
    """A pointer to element ``[row, col]`` of a C-contiguous float32 2-D array."""
    arr = context.make_array(kind)(context, builder, array)
    width = builder.extract_value(arr.shape, 1)
    return builder.gep(arr.data, [builder.add(builder.mul(row, width), col)])


def _lanes(builder: ir.IRBuilder, pointer: ir.Value, h: int) -> ir.Value:
    """Vector ``h`` of the lanes at a float32 ``pointer``."""
    return builder.gep(builder.bitcast(pointer, VECTOR.as_pointer()), [I32(h)])


@intrinsic
def lanes_fma(typingctx, acc, a, i, b, m0, j, count):  # noqa: ARG001 (numba's intrinsic protocol)
    """``acc[m, k] = fma(b[m0 + m, j], a[i, k], acc[m, k])`` for m < ``count`` (a literal) and the :data:`STRIP`
    lanes k: ``a`` [·, STRIP] and ``b`` C-contiguous float32 2-D arrays, ``acc`` a float32 pointer to ``count x
    STRIP`` lanes (a ``stack_f32`` buffer, which LLVM keeps in registers across the caller's loop)."""
    if not isinstance(count, types.IntegerLiteral) or not (_is_matrix(a) and _is_matrix(b)):
        return None
    rows = count.literal_value

    def codegen(context, builder, signature, args):
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VECTOR, [VECTOR] * 3),
                                             f"llvm.fma.v{LANES}f32")
        start = _address(context, builder, signature.args[1], args[1], args[2], args[2].type(0))
        halves = [builder.load(_lanes(builder, start, h), align=4) for h in range(2)]
        for m in range(rows):
            row = builder.add(args[4], args[4].type(m))
            scalar = builder.load(_address(context, builder, signature.args[3], args[3], row, args[5]))
            one = builder.insert_element(ir.Constant(VECTOR, ir.Undefined), scalar, I32(0))
            splat = builder.shuffle_vector(one, ir.Constant(VECTOR, ir.Undefined),
                                           ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))
            for h in range(2):
                at = _lanes(builder, args[0], 2 * m + h)
                builder.store(builder.call(fma, [splat, halves[h], builder.load(at, align=4)]), at, align=4)
        return context.get_dummy_value()

    return types.void(acc, a, i, b, m0, j, count), codegen


def _mover(store: bool):  # -> an intrinsic
    """An intrinsic ``(acc, x, m0, count)`` moving ``count x STRIP`` lanes between ``acc`` (a float32 pointer) and
    ``x[m0 + m, k]`` (a C-contiguous float32 [·, STRIP] array): into ``x`` when ``store``, else out of it."""

    @intrinsic
    def move(typingctx, acc, x, m0, count):  # noqa: ARG001
        if not isinstance(count, types.IntegerLiteral) or not _is_matrix(x):
            return None

        def codegen(context, builder, signature, args):
            for m in range(count.literal_value):
                row = builder.add(args[2], args[2].type(m))
                start = _address(context, builder, signature.args[1], args[1], row, row.type(0))
                for h in range(2):
                    source, target = _lanes(builder, args[0], 2 * m + h), _lanes(builder, start, h)
                    if not store:
                        source, target = target, source
                    builder.store(builder.load(source, align=4), target, align=4)
            return context.get_dummy_value()

        return types.void(acc, x, m0, count), codegen

    return move


load_lanes = _mover(store=False)  # acc[m, k] = x[m0 + m, k]
store_lanes = _mover(store=True)  # x[m0 + m, k] = acc[m, k]


@intrinsic
def data_pointer(typingctx, array):  # noqa: ARG001
    """The address of ``array``'s first element, as a pointer to its dtype (for ``numba.carray``)."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        return context.make_array(signature.args[0])(context, builder, args[0]).data

    return types.CPointer(array.dtype)(array), codegen


@njit(**JIT)
def borrowed(array: np.ndarray) -> np.ndarray:
    """A C-contiguous ``array`` as an array of the same memory that holds no reference to it: its row views cost no
    reference count (two atomic operations and calls each, which made decoding a block's f16 or q8_0 rows about twice
    as slow).  Only while ``array`` itself is alive (the caller's argument)."""
    return carray(data_pointer(array), array.shape)


@njit(**JIT)
def zero_lanes(buffer: object) -> None:
    """The :data:`ACC_FLOATS` accumulators at ``buffer`` set to 0."""
    acc = carray(buffer, (ACC_FLOATS,))
    for k in range(ACC_FLOATS):
        acc[k] = ZERO


@njit(**JIT)
def strip_scores(qt: np.ndarray, kb: np.ndarray, n: int, st: np.ndarray) -> None:
    """st[s, k] ← Σ_i kb[s, i]·qt[i, k] (fma in i order) for the slots s < n (in steps of :data:`KEYS`; kb's rows
    past n are zeros) and a strip's lanes k.  # [hd, STRIP], [BLOCK + KEYS, hd] -> [BLOCK + KEYS, STRIP]"""
    hd = kb.shape[1]
    acc = stack_f32(ACC_FLOATS)
    for s0 in range(0, n, KEYS):
        zero_lanes(acc)
        for i in range(hd):
            lanes_fma(acc, qt, i, kb, s0, i, KEYS)
        store_lanes(acc, st, s0, KEYS)


@njit(**JIT)
def strip_values(st: np.ndarray, vt: np.ndarray, n: int, ot: np.ndarray) -> None:
    """ot[i, k] += Σ_s st[s, k]·vt[i, s] (fma in slot order) for the slots s < n and every dim i (rows of vt past
    hd are zeros).  # [BLOCK + KEYS, STRIP], [hd', BLOCK] -> [hd', STRIP] (hd' = hd rounded up to :data:`KEYS`)"""
    acc = stack_f32(ACC_FLOATS)
    for i0 in range(0, ot.shape[0], KEYS):
        load_lanes(acc, ot, i0, KEYS)
        for s in range(n):
            lanes_fma(acc, st, s, vt, i0, s, KEYS)
        store_lanes(acc, ot, i0, KEYS)


@njit(**JIT)
def prepare_queries(q: np.ndarray, slots: np.ndarray, h0: int, group: int, t0: int, t1: int, qt: np.ndarray,
                    own: np.ndarray) -> None:
    """qt[j, i, k] ← q[h0 + h, t, i] / sqrt(hd) and own[j, k] ← slots[t] for the tile's rows r = j·STRIP + k =
    (t - t0)·g + h (the g query heads of one kv head); the padding rows of the last strip get zeros and the last
    row's slot, so they add no block and no mask.  # [nh, T, hd], int [T] -> [strips, hd, STRIP], int [strips, STRIP]"""
    hd = q.shape[2]
    scale = F32(1.0 / np.sqrt(hd))  # as the reference scales q
    rows = (t1 - t0) * group
    for r in range(qt.shape[0] * STRIP):
        j, k = r // STRIP, r % STRIP
        if r < rows:
            t, h = t0 + r // group, r % group
            own[j, k] = slots[t]
            for i in range(hd):
                qt[j, i, k] = q[h0 + h, t, i] * scale
        else:
            own[j, k] = slots[t1 - 1]
            for i in range(hd):
                qt[j, i, k] = ZERO


@njit(**JIT)
def widen_keys(rows: np.ndarray, s0: int, n: int, kb: np.ndarray) -> None:
    """kb[s] ← slot s0 + s's key as float32 for s < n, then zero rows up to a multiple of :data:`KEYS` (what
    :func:`strip_scores` reads).  # [S, hd / block] cache type -> [BLOCK + KEYS, hd]"""
    hd = kb.shape[1]
    for s in range(n):
        k = widen_row(rows[s0 + s], kb[s])  # decoded into kb[s], or the float32 row itself
        for i in range(hd):
            kb[s, i] = k[i]
    for s in range(n, -(-n // KEYS) * KEYS):
        for i in range(hd):
            kb[s, i] = ZERO


@njit(**JIT)
def widen_values(rows: np.ndarray, s0: int, n: int, tmp: np.ndarray, vt: np.ndarray) -> None:
    """vt[i, s] ← slot s0 + s's value i as float32 for s < n (transposed: :func:`strip_values` broadcasts it).
    # [S, hd / block] cache type, [hd] scratch -> [hd', BLOCK]"""
    for s in range(n):
        v = widen_row(rows[s0 + s], tmp)
        for i in range(tmp.shape[0]):
            vt[i, s] = v[i]


@njit(**JIT)
def fold_block(st: np.ndarray, n: int, s0: int, own: np.ndarray, valid: np.ndarray, masked: bool,
               top: np.ndarray, weight: np.ndarray, ot: np.ndarray) -> None:
    """One block's scores of a strip into its running softmax: the hidden slots masked (when ``masked``), each
    row's new maximum, the scores replaced by their weights exp(score - top) (masked ones exactly 0), the running
    sum and output rescaled by exp(old top - top) and the block's weights added to the sum (in slot order).
    st [BLOCK + KEYS, STRIP]; own int [STRIP]; valid bool [S]; top/weight [STRIP]; ot [hd', STRIP]

    The per-row values live on the stack (:func:`~..backend.kernels.base.stack_f32`) so that LLVM knows they share
    no memory with the scores and vectorises the loops over the strip's lanes.  The loops run over the constant
    :data:`STRIP`: LLVM then takes a whole slot per iteration, where a run-time count made it enter a vector loop of
    two iterations, with alias checks and its constants reloaded, once per slot (docs/performance.md).
    """
    if masked:  # a slot is seen by the rows up to whose own slot it comes, if real (a row always sees its own)
        for s in range(n):
            slot, real = s0 + s, valid[s0 + s]
            for k in range(STRIP):
                if not (slot <= own[k] and (real or slot == own[k])):
                    st[s, k] = MASKED
    rows = carray(stack_f32(ROW_FLOATS), (3, STRIP))
    best, alpha, sums = rows[0], rows[1], rows[2]
    for k in range(STRIP):
        best[k] = top[k]
        sums[k] = ZERO
    for s in range(n):
        for k in range(STRIP):
            best[k] = max(best[k], st[s, k])
    for k in range(STRIP):
        alpha[k] = ZERO if top[k] == MASKED else exp32(top[k] - best[k])  # exactly 1 when the top stays
        top[k] = best[k]
    for s in range(n):
        for k in range(STRIP):
            p = ZERO if st[s, k] == MASKED else exp32(st[s, k] - best[k])
            st[s, k] = p
            sums[k] += p
    moved = False
    for k in range(STRIP):
        weight[k] = weight[k] * alpha[k] + sums[k]
        moved |= alpha[k] != ONE
    if moved:  # (most blocks of a long context leave every row's maximum where it was)
        for i in range(ot.shape[0]):
            for k in range(STRIP):
                ot[i, k] *= alpha[k]


@njit(**JIT)
def attend_tile(q: np.ndarray, keys: np.ndarray, values: np.ndarray, slots: np.ndarray, valid: np.ndarray,
                h0: int, group: int, t0: int, t1: int, qt: np.ndarray, ot: np.ndarray, kb: np.ndarray,
                vt: np.ndarray, st: np.ndarray, row: np.ndarray, sums: np.ndarray, own: np.ndarray,
                out: np.ndarray) -> None:
    """Attention of new tokens ``t0:t1`` of one batch row by the query heads ``h0 .. h0 + group - 1`` of one kv head
    (see the module docstring).

    q [nh, T, hd] (unscaled); keys/values [≥S, hd / block] (the kv head's cache rows, any cache type; only slots up
    to the last token's own are read); slots int [T]: each new token's slot; valid bool [≥S]: which slots hold real
    tokens.  Scratch (C-contiguous float32 unless said, J strips): qt [J, hd, STRIP], ot [J, hd', STRIP], kb
    [BLOCK + KEYS, hd], vt [hd', BLOCK], st [BLOCK + KEYS, STRIP], row [hd], sums [2, J, STRIP] (top, weight),
    own int [J, STRIP]; hd' = hd rounded up to :data:`KEYS`.  out [nh, T, hd]: the tile's rows
    written.
    """
    hd, strips = q.shape[2], qt.shape[0]
    keys, values, kb, vt, row = borrowed(keys), borrowed(values), borrowed(kb), borrowed(vt), borrowed(row)
    qt, ot, sums, own = borrowed(qt), borrowed(ot), borrowed(sums), borrowed(own)  # (their views: each strip's)
    prepare_queries(q, slots, h0, group, t0, t1, qt, own)
    top, weight = sums[0], sums[1]
    top[:] = MASKED
    weight[:] = ZERO
    ot[:] = ZERO
    vt[:] = ZERO  # rows past hd stay 0
    last = own[strips - 1, STRIP - 1]
    for s0 in range(0, last + 1, BLOCK):
        n = min(BLOCK, last + 1 - s0)
        widen_keys(keys, s0, n, kb)
        widen_values(values, s0, n, row, vt)
        real = True
        for s in range(s0, s0 + n):
            real &= valid[s]
        for j in range(strips):
            if s0 > own[j, STRIP - 1]:
                continue  # above the diagonal: the strip's rows see none of the block
            strip_scores(qt[j], kb, n, st)
            masked = not real or s0 + n - 1 > own[j, 0]
            fold_block(st, n, s0, own[j], valid, masked, top[j], weight[j], ot[j])
            strip_values(st, vt, n, ot[j])
    for r in range((t1 - t0) * group):
        j, k = r // STRIP, r % STRIP
        t, h = t0 + r // group, r % group
        inverse = ONE / weight[j, k]
        for i in range(hd):
            out[h0 + h, t, i] = ot[j, i, k] * inverse


def tile_tokens(group: int, tokens: int) -> int:
    """New tokens of a task: its rows (tokens x the g query heads of a kv head) up to :data:`TILE_ROWS`, the
    ``tokens`` of a pass cut into tiles of equal size (a chunk of 256 tokens of a group of 7: 4 tiles of 64, not 73,
    73, 73 and 37), so the pool's threads get equal work."""
    most = max(1, TILE_ROWS // group)
    return -(-tokens // -(-tokens // most))


def scratch_shapes(rows: int, hd: int) -> list[tuple[int, ...]]:
    """The float32 scratch of a task of ``rows`` query rows (:func:`attend_tile`'s qt, ot, kb, vt, st, row, sums),
    all O(tile): none grows with the cache."""
    strips, dims = -(-rows // STRIP), -(-hd // KEYS) * KEYS
    return [(strips, hd, STRIP), (strips, dims, STRIP), (BLOCK + KEYS, hd), (dims, BLOCK), (BLOCK + KEYS, STRIP),
            (hd,), (2, strips, STRIP)]


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, query_slots: np.ndarray, key_valid: np.ndarray,
           ws: Workspace) -> np.ndarray:
    """Twin of :func:`.attention.attend` for a prefill (slots from :meth:`BatchState.slots`): one pool task per
    (batch row, kv head, tile of new tokens), the tiles that see the most slots first.

    q [B, nh, T, hd]; keys/values [B, nkv, ≥S, hd / block] in their cache types -> [B, nh, T, hd]
    """
    b, heads, t, _ = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = np.ascontiguousarray(q, np.float32)
    # One layout whatever the batch (a ragged batch's slots come as a strided view): a new layout is a new
    # specialisation of attend_tile, compiled inside a prompt rather than while the model loads.
    query_slots = np.ascontiguousarray(query_slots, np.int64)
    key_valid = np.ascontiguousarray(key_valid, np.bool_)
    out = np.empty(q.shape, np.float32)
    k, v = (x.view(np.uint16) if x.dtype == np.float16 else x for x in (keys, values))  # .attention.kernel_view
    step = tile_tokens(group, t)
    ws.run([partial(_task, q[row], k[row, kv], v[row, kv], query_slots[row], key_valid[row], kv * group, group, t0,
                    min(t0 + step, t), out[row])
            for t0 in reversed(range(0, t, step)) for row in range(b) for kv in range(kv_heads)])
    return out


def _task(q: np.ndarray, keys: np.ndarray, values: np.ndarray, slots: np.ndarray, valid: np.ndarray, h0: int,
          group: int, t0: int, t1: int, out: np.ndarray, scratch: Scratch) -> None:
    """:func:`attend_tile` with its thread's scratch (a pool task)."""
    tiles = scratch.arrays("attention tile", scratch_shapes((t1 - t0) * group, q.shape[2]))
    own = scratch.array("attention slots", tiles[0].shape[0] * STRIP, np.int64).reshape(-1, STRIP)
    attend_tile(q, keys, values, slots, valid, h0, group, t0, t1, *tiles, own, out)
