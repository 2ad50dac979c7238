"""The compiled decode step of the softmax-attention models: every layer of one new token per row in one compiled
call per pool thread, with no Python between the operations.  Driven by :mod:`.decode_step`.

Why: a decode step of the Python path runs each layer's seven products, its norms and attention as separate calls
from Python.  On Qwen2.5-0.5B (one thread) about 28 % of a step was Python between the products, and with two
threads every product's hand-off to the pool thread waited for the GIL (the helper's task starts in Python, after
the caller has entered its own kernel), so a second core gave 1.25x (Q4_0) and 1.38x (q8_0) where llama.cpp gets
1.8x.

How: worker 0 (the calling thread) runs what lies between the products (the norms, attention with its cache
writes, the residual adds, the activations' block sums) and then *posts* the product (:func:`post`); every worker,
itself included, claims chunks of the product's rows with an atomic counter until none is left (:func:`work_phase`),
and worker 0 waits until every chunk is done.  The other workers wait for the next post polling a counter, without
the GIL; one that waits longer than its ``ticks`` returns, and worker 0 claims the rest itself.  A chunk's rows are
multiplied by the type's row kernel, called by address (:data:`~..quants.jit_base.ROW_PRODUCT`), in groups of
:data:`~..quants.jit_base.GEMV_ROWS` activation rows as ``Workspace.rowwise`` does; every other operation is the
Python path's own compiled function (:mod:`..ops_jit`, :mod:`.attention_jit`) on arrays of the same types.  A row's
result does not depend on the chunk or group it is computed in, so the step's numbers are the Python path's, bit
for bit (tested).

The plan (built once per model by :class:`.decode_step.DecodeStep`), all int64:

* ``mats`` [L, 7, 5]: per layer and matrix (:data:`Q` .. :data:`DOWN`), the row product's address, the stored
  rows' address, rows, bytes per row, and the width of the activation block sums it takes (0: none);
* ``vecs`` [L, 7]: the addresses of the float32 vectors :data:`ATTN_NORM` .. :data:`K_NORM` (0: absent);
* ``chunks`` [C, 3]: (matrix, first row, end row) of each product kind in turn (:data:`QKV`, :data:`OUT`,
  :data:`GATE_UP`, :data:`DOWN_PROJ`), ``starts`` [5] each kind's first chunk;
* ``kv`` [L, 2]: each layer's cache keys and values, float32 [B, nkv, S, hd];
* ``dims``: :data:`BATCH` .. :data:`FLAGS`;
* ``offsets``: where each activation buffer starts in ``work`` (:data:`X` .. :data:`GATE`), float32, 64-byte aligned.

Shapes: B rows, H hidden, nh/nkv heads, hd head dim, I intermediate, S cache slots.
"""

from __future__ import annotations

from numba import carray, njit

from ..ops_jit import add_rms_norm_rows, rms_norm_rows, silu_mul_rows
from ..pool_jit import cpu_relax, cycles, cycles_per_us, fetch_add, load_fresh, store_fresh
from ..quants.jit_base import F16_TABLE, GEMV_ROWS, block_sums, call_product, f32_at
from .attention_jit import attention_step

JIT = {"nogil": True, "cache": True, "error_model": "numpy"}
__all__ = ["F16_TABLE", "cycles_per_us", "decode_layers", "sync_size"]  # what .decode_step takes from here

Q, K, V, OUT_W, GATE_W, UP, DOWN = range(7)  # the matrices of a layer (``mats``' second axis)
FN, RAW, ROWS, ROW_BYTES, SUMS = range(5)  # a matrix's entries
ATTN_NORM, MLP_NORM, Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM = range(7)  # ``vecs``' second axis
QKV, OUT, GATE_UP, DOWN_PROJ = range(4)  # product kinds (phases of a layer)
FIRST, LAST = (Q, OUT_W, GATE_W, DOWN), (V, OUT_W, UP, DOWN)  # each kind's matrices
BATCH, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, SLOTS, FLAGS = range(8)  # ``dims``
HAS_BIAS, HAS_QK_NORM = 1, 2  # FLAGS bits
X, YQ, YK, YV, ATT, ATT_OUT, X2, ACT, MLP_OUT, SUMS16, SUMS32, GATE = range(12)  # ``offsets`` (GATE: per worker)
POSTED = 0  # sync[POSTED]: phases posted so far
LINE = 8  # int64 per cache line: each phase's two counters on a line of their own
CLAIMED, DONE = 0, 1


def sync_size(layers: int) -> int:
    """int64 entries of a step's ``sync`` array (zeroed before each step)."""
    return LINE * (4 * layers + 1)


@njit(**JIT)
def post(sync, phase):
    """Worker 0: phase ``phase``'s inputs are ready."""
    store_fresh(sync, POSTED, phase + 1)


@njit(**JIT)
def await_post(sync, phase, ticks, lost):
    """Other workers: wait until ``phase`` is posted; False when that took more than ``ticks`` cycles or the thread
    lost its CPU meanwhile (two polls ``lost`` cycles apart)."""
    now = start = cycles()
    while load_fresh(sync, POSTED) <= phase:
        cpu_relax()
        before, now = now, cycles()
        if now - start > ticks or now - before > lost:
            return False
    return True


@njit(**JIT)
def await_done(sync, phase, count):
    """Worker 0: wait until the ``count`` chunks of ``phase`` are done."""
    while load_fresh(sync, LINE * (phase + 1) + DONE) < count:
        cpu_relax()


@njit(**JIT)
def rows_of(work, offset, rows, cols):
    """The float32 [rows, cols] buffer at ``offset`` of ``work``."""
    return work[offset:offset + rows * cols].reshape((rows, cols))


@njit(**JIT)
def vector(vecs, layer, which, size):
    """Float32 vector ``which`` of ``layer`` [size]."""
    return carray(f32_at(vecs[layer, which]), (size,))


@njit(**JIT)
def product(mat, r0, r1, x, sums16, sums32, table, out, col):
    """``out[:, col:col + r1 - r0] = x @ W[r0:r1].T`` by the matrix's row product, GEMV_ROWS activation rows per call.

    mat int64 [5] (a ``mats`` entry); x [N, in]; sums16/sums32 the block sums of ``x`` (C-contiguous, used per the
    matrix's width); out [N, ≥ col + r1 - r0]
    """
    n, cols = x.shape
    width = mat[SUMS]
    sums = sums32 if width == 32 else sums16
    sums_cols = cols // width if width else 0
    stride = out.shape[1]
    for i in range(0, n, GEMV_ROWS):
        m = min(GEMV_ROWS, n - i)
        call_product(mat[FN], mat[RAW] + r0 * mat[ROW_BYTES], r1 - r0, mat[ROW_BYTES], x.ctypes.data + 4 * i * cols,
                     m, cols, sums.ctypes.data + 4 * i * sums_cols, sums_cols, table.ctypes.data,
                     out.ctypes.data + 4 * (i * stride + col), stride)


@njit(**JIT)
def prepare_sums(mats, layer, first, last, x, work, offsets):
    """The block sums of ``x`` [N, in] that matrices ``first..last`` of ``layer`` take -> (sums16, sums32)."""
    n, cols = x.shape
    sums16 = rows_of(work, offsets[SUMS16], n, cols // 16)
    sums32 = rows_of(work, offsets[SUMS32], n, cols // 32)
    need16 = need32 = False
    for m in range(first, last + 1):
        need16 |= mats[layer, m, SUMS] == 16
        need32 |= mats[layer, m, SUMS] == 32
    if need16:
        block_sums(x, 16, sums16)
    if need32:
        block_sums(x, 32, sums32)
    return sums16, sums32


@njit(**JIT)
def work_phase(worker, kind, layer, phase, sync, mats, chunks, starts, x, sums16, sums32, table, outs, work, offsets,
               lost):
    """Claim chunks of product ``kind`` of ``layer`` until none is left; returns how many this worker did, negated
    when a worker other than 0 lost its CPU during its last chunk (a chunk taking more than ``lost`` cycles).

    x [N, in] the product's input; outs: the float32 [N, *] outputs (q, k, v, attention out, activation, MLP out)
    """
    first, count = starts[kind], starts[kind + 1] - starts[kind]
    claims, done = LINE * (phase + 1) + CLAIMED, LINE * (phase + 1) + DONE
    did = 0
    while True:
        c = fetch_add(sync, claims, 1)
        if c >= count:
            return did
        began = cycles()
        m, r0, r1 = chunks[first + c, 0], chunks[first + c, 1], chunks[first + c, 2]
        if kind == QKV:
            product(mats[layer, m], r0, r1, x, sums16, sums32, table, outs[m], r0)
        elif kind == OUT:
            product(mats[layer, m], r0, r1, x, sums16, sums32, table, outs[3], r0)
        elif kind == GATE_UP:
            n, rows = x.shape[0], r1 - r0
            g = rows_of(work, offsets[GATE + 2 * worker], n, rows)
            u = rows_of(work, offsets[GATE + 2 * worker + 1], n, rows)
            product(mats[layer, GATE_W], r0, r1, x, sums16, sums32, table, g, 0)
            product(mats[layer, UP], r0, r1, x, sums16, sums32, table, u, 0)
            silu_mul_rows(g, u, outs[4][:, r0:r1])
        else:
            product(mats[layer, m], r0, r1, x, sums16, sums32, table, outs[5], r0)
        fetch_add(sync, done, 1)
        did += 1
        if worker and cycles() - began > lost:
            return -did  # preempted during the chunk: leave the rest of the step to worker 0


@njit(**JIT)
def attention(layer, dims, vecs, kv, eps, yq, yk, yv, cos, sin, slots, key_valid):
    """Biases or q/k norms, RoPE, the cache writes and attention of one layer (:func:`.attention_jit.attention_step`
    with the Python path's arguments).  -> [B, nh, 1, hd]"""
    b, nh, nkv, hd, s = dims[BATCH], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM], dims[SLOTS]
    keys = carray(f32_at(kv[layer, 0]), (b, nkv, s, hd))
    values = carray(f32_at(kv[layer, 1]), (b, nkv, s, hd))
    q4, k4, v4 = yq.reshape((b, 1, nh, hd)), yk.reshape((b, 1, nkv, hd)), yv.reshape((b, 1, nkv, hd))
    if dims[FLAGS] & HAS_BIAS:
        return attention_step(q4, k4, v4, vector(vecs, layer, Q_BIAS, nh * hd), vector(vecs, layer, K_BIAS, nkv * hd),
                              vector(vecs, layer, V_BIAS, nkv * hd), None, None, eps, cos, sin, slots, key_valid,
                              keys, values)
    if dims[FLAGS] & HAS_QK_NORM:
        return attention_step(q4, k4, v4, None, None, None, vector(vecs, layer, Q_NORM, hd),
                              vector(vecs, layer, K_NORM, hd), eps, cos, sin, slots, key_valid, keys, values)
    return attention_step(q4, k4, v4, None, None, None, None, None, eps, cos, sin, slots, key_valid, keys, values)


@njit(**JIT)
def decode_layers(worker, h, mats, vecs, chunks, starts, kv, dims, eps, cos, sin, slots, key_valid, work, offsets,
                  table, sync, ticks, lost):
    """Every layer of a decode step, as worker ``worker`` (0: the caller, who also runs what lies between products
    and updates ``h`` [B, H] in place; see the module docstring).  Returns the chunks this worker multiplied.

    cos/sin float32 [B, 1, r/2]; slots int64 [B, 1] and key_valid bool [B, S] (C-contiguous); work float32 (the
    buffers at ``offsets``); table: the float16 table; sync: int64 [:func:`sync_size`], zero; ticks: cycles a
    worker other than 0 waits for a post before it leaves the rest to worker 0; lost: a gap in a worker's polls or
    chunk this many cycles long means it lost its CPU (the machine is busy), and it leaves too.
    """
    b, hidden, nh, nkv, hd, inter = (dims[BATCH], dims[HIDDEN], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM],
                                     dims[INTERMEDIATE])
    x, x2 = rows_of(work, offsets[X], b, hidden), rows_of(work, offsets[X2], b, hidden)
    att, act = rows_of(work, offsets[ATT], b, nh * hd), rows_of(work, offsets[ACT], b, inter)
    outs = (rows_of(work, offsets[YQ], b, nh * hd), rows_of(work, offsets[YK], b, nkv * hd),
            rows_of(work, offsets[YV], b, nkv * hd), rows_of(work, offsets[ATT_OUT], b, hidden), act,
            rows_of(work, offsets[MLP_OUT], b, hidden))
    inputs = (x, att, x2, act)
    did = 0
    for layer in range(mats.shape[0]):
        for kind in range(4):
            phase = 4 * layer + kind
            if worker == 0:
                if kind == QKV:
                    rms_norm_rows(h, vector(vecs, layer, ATTN_NORM, hidden), eps, x)
                elif kind == OUT:
                    o = attention(layer, dims, vecs, kv, eps, outs[0], outs[1], outs[2], cos, sin, slots, key_valid)
                    att[:] = o.reshape((b, nh * hd))
                elif kind == GATE_UP:
                    add_rms_norm_rows(h, outs[3], vector(vecs, layer, MLP_NORM, hidden), eps, h, x2)
                sums16, sums32 = prepare_sums(mats, layer, FIRST[kind], LAST[kind], inputs[kind], work, offsets)
                post(sync, phase)
            elif not await_post(sync, phase, ticks, lost):
                return did
            else:
                n, cols = inputs[kind].shape
                sums16 = rows_of(work, offsets[SUMS16], n, cols // 16)
                sums32 = rows_of(work, offsets[SUMS32], n, cols // 32)
            done = work_phase(worker, kind, layer, phase, sync, mats, chunks, starts, inputs[kind], sums16, sums32,
                              table, outs, work, offsets, lost)
            did += abs(done)
            if done < 0:
                return did
            if worker == 0:
                await_done(sync, phase, starts[kind + 1] - starts[kind])
                if kind == DOWN_PROJ:
                    h += outs[5]
    return did
