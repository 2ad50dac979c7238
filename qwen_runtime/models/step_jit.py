"""The compiled decode step: every layer of one new token per row in one compiled call per pool thread, with no
Python between the operations, for softmax-attention layers (Qwen2, Qwen2.5, Qwen3, DeepSeek-R1-Distill-Qwen) and
Qwen3.5's gated attention and Gated DeltaNet layers.  Driven by :mod:`.decode_step`.

Why: a decode step of the Python path runs each layer's seven products, its norms and attention as separate calls
from Python.  On Qwen2.5-0.5B (one thread) about 28 % of a step was Python between the products, and with two
threads every product's hand-off to the pool thread waited for the GIL (the helper's task starts in Python, after
the caller has entered its own kernel), so a second core gave 1.25x (Q4_0) and 1.38x (q8_0) where llama.cpp gets
1.8x.

How: worker 0 (the calling thread) runs what lies between the products (the norms, q/k/v's preparation and cache
writes or the conv step, the residual adds, the activations' block sums) and then *posts* the product
(:func:`post`); every worker, itself included, claims chunks of the product's rows with an atomic counter until none
is left (:func:`work_phase`), and worker 0 waits until every chunk is done. The mixer's heads are a phase of their
own, claimed the same way one (row, kv head) pair of attention or (row, value head) pair of the delta rule at a time
(:func:`work_mix`): with worker 0 alone attending, decode at 2,048 cached tokens ran at 0.64x its speed at 128 (run
12). The other workers wait for the next post polling a counter, without the GIL; one that waits longer than its
``ticks`` returns, and worker 0 claims the rest itself. A chunk's rows are multiplied by the type's row kernel,
called by address (:data:`~..backend.kernels.base.ROW_PRODUCT`; with 8-bit activations the integer-dot
:data:`~..backend.kernels.q8_act.Q8_ROW_PRODUCT` on the forms of the input worker 0 quantized once before posting the
product), in groups of :data:`~..backend.kernels.base.GEMV_ROWS` activation rows as ``Workspace.rowwise`` does; every
other
operation is the Python path's own compiled function
(:mod:`..ops_jit`, :mod:`.attention_jit`) on arrays of the same types. A row's result does not depend on the chunk
or group it is computed in, so the step's numbers are the Python path's, bit for bit (tested).

The plan (built once per model by :class:`.decode_step.DecodeStep`), all int64:

* ``layers`` [L]: each layer's kind, :data:`ATTENTION` or :data:`LINEAR` (Gated DeltaNet);
* ``mats`` [L, 8, 6]: per layer and matrix (:data:`IN0` .. :data:`DOWN`; the input projections are q, k, v of
  attention and qkv, z, β, α of Gated DeltaNet), the row product's address, the stored rows' address, rows, bytes
  per row, the width of the activation block sums it takes (0: none), and the slots of the forms table it reads
  with 8-bit activations (0: float activations, a :data:`~..backend.kernels.base.ROW_PRODUCT`; else a
  :data:`~..backend.kernels.q8_act.Q8_ROW_PRODUCT`, the input quantized once per product by worker 0);
* ``vecs`` [L, 7]: the addresses of a layer's vectors: the two norms, then attention's q/k/v biases and q/k norms
  or Gated DeltaNet's conv taps [K, C], dt bias, A, norm and key head of each value head (int64) (0: absent);
* ``chunks`` [C, 3]: (matrix, first row, end row) of each product phase in turn (:data:`PROJ`, :data:`OUT`,
  :data:`GATE_UP`, :data:`DOWN_PROJ`), ``starts`` [2, 5] each layer kind's first chunk of each phase;
* ``caches`` [L, 2]: each layer's cache arrays: keys and values [B, nkv, S, hd] (float32, or float16 where the
  ``FLAGS`` bits :data:`KEY_F16`/:data:`VALUE_F16` say so: the cache types), or conv inputs [B, K-1, C] and delta
  state [B, Hv, dk, dv];
* ``dims``: :data:`BATCH` .. :data:`CONV_DIM`;
* ``offsets``: where each activation buffer starts in ``work`` (:data:`X` .. :data:`GATE`), float32, 64-byte aligned.

Shapes: B rows, H hidden, nh/nkv heads, hd head dim, I intermediate, S cache slots; Gated DeltaNet's Hk/Hv key and
value heads of dk/dv, C conv channels, K conv taps.
"""

from __future__ import annotations

from numba import carray, njit, types

from ..backend.kernels.base import F16_TABLE, GEMV_ROWS, address_as, block_sums, call_product, f32_at, i64_at
from ..backend.kernels.q8_act import call_q8_product, prepare_forms
from ..backend.ops_jit import add_rms_norm_rows, rms_norm_rows, silu_mul_rows
from ..backend.pool_jit import CHANGED, cpu_relax, cycles_per_us, fetch_add, load_fresh, poll, store_fresh
from .attention_jit import attend_pair, prepare_attention, sigmoid_gate
from .gated_delta_jit import conv_step, delta_head

JIT = {"nogil": True, "cache": True, "error_model": "numpy"}
__all__ = ["F16_TABLE", "cycles_per_us", "decode_layers", "sync_size"]  # what .decode_step takes from here

ATTENTION, LINEAR = 0, 1  # layer kinds
IN0, IN1, IN2, IN3, OUT_W, GATE_W, UP, DOWN = range(8)  # the matrices of a layer (``mats``' second axis)
FN, RAW, ROWS, ROW_BYTES, SUMS, FORMS = range(6)  # a matrix's entries
ATTN_NORM, MLP_NORM = 0, 1  # ``vecs``' second axis: both kinds
Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM = 2, 3, 4, 5, 6  # attention
CONV_TAPS, DT_BIAS, SSM_A, SSM_NORM, KEY_HEADS = 2, 3, 4, 5, 6  # Gated DeltaNet
PROJ, OUT, GATE_UP, DOWN_PROJ = range(4)  # product phases of a layer (``starts``' second axis)
MIX = 4  # the phase between PROJ and OUT: the mixer's heads, one (row, head) pair per claim
STAGES = 5  # phases of a layer, in the order they run: PROJ, MIX, OUT, GATE_UP, DOWN_PROJ
ORDER = (PROJ, MIX, OUT, GATE_UP, DOWN_PROJ)
FIRST, LAST = (IN0, OUT_W, GATE_W, DOWN), (IN3, OUT_W, UP, DOWN)  # each phase's matrices (absent ones: no chunks)
(BATCH, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, SLOTS, FLAGS, Q_WIDTH, KEY_HEADS_LIN, KEY_DIM, VALUE_HEADS,
 VALUE_DIM, CONV_TAPS_K, CONV_DIM) = range(15)  # ``dims``
HAS_BIAS, HAS_QK_NORM, KEY_F16, VALUE_F16 = 1, 2, 4, 8  # FLAGS bits (the last two: the KV cache types)
X, Y0, Y1, Y2, Y3, ATT, ATT_OUT, X2, ACT, MLP_OUT, SUMS16, SUMS32, Q_HEADS, HEADS_OUT, GATE = range(15)  # ``offsets``
# (GATE: two per worker)
POSTED = 0  # sync[POSTED]: phases posted so far
LINE = 8  # int64 per cache line: each phase's two counters on a line of their own
CLAIMED, DONE = 0, 1
u16_at = address_as(types.uint16)  # float16 cache arrays, as their bits (:mod:`.attention_jit`)


def sync_size(layers: int) -> int:
    """int64 entries of a step's ``sync`` array (zeroed before each step)."""
    return LINE * (STAGES * layers + 1)


@njit(**JIT)
def post(sync, phase):
    """Worker 0: phase ``phase``'s inputs are ready."""
    store_fresh(sync, POSTED, phase + 1)


@njit(**JIT)
def await_post(sync, phase, ticks, lost):
    """Other workers: wait until ``phase`` is posted; False when that took more than ``ticks`` cycles or the thread
    lost its CPU meanwhile (two polls ``lost`` cycles apart): the pool's own polling loop, on the posted counter."""
    return poll(sync[POSTED:POSTED + 1], phase + 1, True, ticks, lost) == CHANGED


@njit(**JIT)
def await_done(sync, phase, count):
    """Worker 0: wait until the ``count`` units of ``phase`` are done."""
    while load_fresh(sync, LINE * (phase + 1) + DONE) < count:
        cpu_relax()


@njit(**JIT)
def claim(sync, phase, count):
    """The next of the ``count`` units of ``phase`` (product chunks or mixer heads) for this worker, or -1 when
    every one is claimed."""
    c = fetch_add(sync, LINE * (phase + 1) + CLAIMED, 1)
    return c if c < count else -1


@njit(**JIT)
def finish(sync, phase):
    """One more unit of ``phase`` is done (what :func:`await_done` counts)."""
    fetch_add(sync, LINE * (phase + 1) + DONE, 1)


@njit(**JIT)
def rows_of(work, offset, rows, cols):
    """The float32 [rows, cols] buffer at ``offset`` of ``work``."""
    return work[offset:offset + rows * cols].reshape((rows, cols))


@njit(**JIT)
def vector(vecs, layer, which, size):
    """Float32 vector ``which`` of ``layer`` [size]."""
    return carray(f32_at(vecs[layer, which]), (size,))


@njit(**JIT)
def product(mat, r0, r1, x, sums16, sums32, forms, table, out, col):
    """``out[:, col:col + r1 - r0] = x @ W[r0:r1].T`` by the matrix's row product, GEMV_ROWS activation rows per call.

    mat int64 [6] (a ``mats`` entry); x [N, in]; sums16/sums32 the block sums of ``x`` (C-contiguous, used per the
    matrix's width); forms: the forms table of ``x`` (:mod:`..backend.kernels.q8_act`), for a matrix with 8-bit
    activations (its FORMS entry not 0); out [N, ≥ col + r1 - r0]
    """
    n, cols = x.shape
    width = mat[SUMS]
    sums = sums32 if width == 32 else sums16
    sums_cols = cols // width if width else 0
    stride = out.shape[1]
    raw = mat[RAW] + r0 * mat[ROW_BYTES]
    for i in range(0, n, GEMV_ROWS):
        m = min(GEMV_ROWS, n - i)
        at, out_at = sums.ctypes.data + 4 * i * sums_cols, out.ctypes.data + 4 * (i * stride + col)
        if mat[FORMS]:
            call_q8_product(mat[FN], raw, r1 - r0, mat[ROW_BYTES], forms.ctypes.data, i, m, cols, at, sums_cols,
                            table.ctypes.data, out_at, stride)
        else:
            call_product(mat[FN], raw, r1 - r0, mat[ROW_BYTES], x.ctypes.data + 4 * i * cols, m, cols, at, sums_cols,
                         table.ctypes.data, out_at, stride)


@njit(**JIT)
def prepare_inputs(mats, layer, first, last, x, work, offsets, forms):
    """What matrices ``first..last`` of ``layer`` take of ``x`` [N, in] besides ``x``: its block sums ->
    (sums16, sums32), and its forms table with 8-bit activations (``forms``, filled in place)."""
    n, cols = x.shape
    sums16 = rows_of(work, offsets[SUMS16], n, cols // 16)
    sums32 = rows_of(work, offsets[SUMS32], n, cols // 32)
    need16 = need32 = False
    slots = 0
    for m in range(first, last + 1):
        need16 |= mats[layer, m, SUMS] == 16
        need32 |= mats[layer, m, SUMS] == 32
        slots |= mats[layer, m, FORMS]
    if need16:
        block_sums(x, 16, sums16)
    if need32:
        block_sums(x, 32, sums32)
    if slots:
        prepare_forms(x, slots, forms.ctypes.data)
    return sums16, sums32


@njit(**JIT)
def work_phase(worker, phase, step_phase, layer, kind, sync, mats, chunks, starts, x, sums16, sums32, forms, table,
               outs, work, offsets):
    """Claim chunks of product ``phase`` (:data:`PROJ` ...) of ``layer`` (of layer kind ``kind``), the step's phase
    ``step_phase``, until none is left; returns how many this worker did.

    x [N, in] the product's input; outs: the float32 [N, *] outputs (the four input projections, the mixer's
    output projection, the activation, the MLP's output)
    """
    first, count = starts[kind, phase], starts[kind, phase + 1] - starts[kind, phase]
    did = 0
    while True:
        c = claim(sync, step_phase, count)
        if c < 0:
            return did
        m, r0, r1 = chunks[first + c, 0], chunks[first + c, 1], chunks[first + c, 2]
        if phase == GATE_UP:
            n, rows = x.shape[0], r1 - r0
            g = rows_of(work, offsets[GATE + 2 * worker], n, rows)
            u = rows_of(work, offsets[GATE + 2 * worker + 1], n, rows)
            product(mats[layer, GATE_W], r0, r1, x, sums16, sums32, forms, table, g, 0)
            product(mats[layer, UP], r0, r1, x, sums16, sums32, forms, table, u, 0)
            silu_mul_rows(g, u, outs[5][:, r0:r1])
        else:
            product(mats[layer, m], r0, r1, x, sums16, sums32, forms, table,
                    outs[min(m, 4) if phase != DOWN_PROJ else 6], r0)
        finish(sync, step_phase)
        did += 1


@njit(**JIT)
def kv_shape(dims):
    """An attention layer's cached keys' (or values') shape [B, nkv, S, hd]."""
    return (dims[BATCH], dims[KV_HEADS], dims[SLOTS], dims[HEAD_DIM])


@njit(**JIT)
def f32_cache(layer, which, dims, caches):
    """An attention layer's float32 keys (``which`` 0) or values (1) [B, nkv, S, hd]."""
    return carray(f32_at(caches[layer, which]), kv_shape(dims))


@njit(**JIT)
def f16_cache(layer, which, dims, caches):
    """An attention layer's float16 keys (``which`` 0) or values (1) [B, nkv, S, hd], as their bits (uint16)."""
    return carray(u16_at(caches[layer, which]), kv_shape(dims))


@njit(**JIT)
def prepare_cached(q4, k4, v4, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots, layer, dims, caches, q):
    """:func:`.attention_jit.prepare_attention` into ``layer``'s cache arrays of their types (``FLAGS``)."""
    flags = dims[FLAGS]
    if flags & KEY_F16:
        if flags & VALUE_F16:
            prepare_attention(q4, k4, v4, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots,
                              f16_cache(layer, 0, dims, caches), f16_cache(layer, 1, dims, caches), q)
        else:
            prepare_attention(q4, k4, v4, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots,
                              f16_cache(layer, 0, dims, caches), f32_cache(layer, 1, dims, caches), q)
    elif flags & VALUE_F16:
        prepare_attention(q4, k4, v4, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots,
                          f32_cache(layer, 0, dims, caches), f16_cache(layer, 1, dims, caches), q)
    else:
        prepare_attention(q4, k4, v4, bq, bk, bv, q_norm, k_norm, eps, cos, sin, slots,
                          f32_cache(layer, 0, dims, caches), f32_cache(layer, 1, dims, caches), q)


@njit(**JIT)
def attend_cached(q, layer, dims, caches, slots, key_valid, b, kv, heads):
    """:func:`.attention_jit.attend_pair` of row ``b`` and kv head ``kv`` over ``layer``'s cache arrays of their
    types (``FLAGS``)."""
    flags = dims[FLAGS]
    if flags & KEY_F16:
        if flags & VALUE_F16:
            attend_pair(q, f16_cache(layer, 0, dims, caches), f16_cache(layer, 1, dims, caches), slots, key_valid, b,
                        kv, heads)
        else:
            attend_pair(q, f16_cache(layer, 0, dims, caches), f32_cache(layer, 1, dims, caches), slots, key_valid, b,
                        kv, heads)
    elif flags & VALUE_F16:
        attend_pair(q, f32_cache(layer, 0, dims, caches), f16_cache(layer, 1, dims, caches), slots, key_valid, b, kv,
                    heads)
    else:
        attend_pair(q, f32_cache(layer, 0, dims, caches), f32_cache(layer, 1, dims, caches), slots, key_valid, b, kv,
                    heads)


@njit(**JIT)
def delta_state(layer, dims, caches):
    """A Gated DeltaNet layer's recurrent state [B, Hv, dk, dv]."""
    return carray(f32_at(caches[layer, 1]), (dims[BATCH], dims[VALUE_HEADS], dims[KEY_DIM], dims[VALUE_DIM]))


@njit(**JIT)
def prepare_mix(layer, kind, dims, vecs, caches, eps, outs, cos, sin, slots, valid, q):
    """Worker 0, before the mixer's heads: attention's biases or q/k norms, RoPE and cache writes
    (:func:`prepare_cached`, q into ``q`` [B, nh, 1, hd]), or Gated DeltaNet's conv step
    (:func:`.gated_delta_jit.conv_step`, over its projection ``outs[0]``) with the per-operation path's arguments."""
    b, nh, nkv, hd = dims[BATCH], dims[HEADS], dims[KV_HEADS], dims[HEAD_DIM]
    if kind == LINEAR:
        taps, channels = dims[CONV_TAPS_K], dims[CONV_DIM]
        conv = carray(f32_at(caches[layer, 0]), (b, taps - 1, channels))
        conv_step(outs[0].reshape((b, 1, channels)), carray(f32_at(vecs[layer, CONV_TAPS]), (taps, channels)), conv,
                  valid)
        return
    q4 = outs[0].reshape((b, 1, nh, dims[Q_WIDTH] // nh))
    k4, v4 = outs[1].reshape((b, 1, nkv, hd)), outs[2].reshape((b, 1, nkv, hd))
    if dims[FLAGS] & HAS_BIAS:
        prepare_cached(q4, k4, v4, vector(vecs, layer, Q_BIAS, nh * hd), vector(vecs, layer, K_BIAS, nkv * hd),
                       vector(vecs, layer, V_BIAS, nkv * hd), None, None, eps, cos, sin, slots, layer, dims, caches, q)
    elif dims[FLAGS] & HAS_QK_NORM:
        prepare_cached(q4, k4, v4, None, None, None, vector(vecs, layer, Q_NORM, hd), vector(vecs, layer, K_NORM, hd),
                       eps, cos, sin, slots, layer, dims, caches, q)
    else:
        prepare_cached(q4, k4, v4, None, None, None, None, None, eps, cos, sin, slots, layer, dims, caches, q)


@njit(**JIT)
def mix_units(dims, kind):
    """How many (row, head) pairs the mixer's heads phase has: kv heads of attention, value heads of DeltaNet."""
    return dims[BATCH] * (dims[KV_HEADS] if kind == ATTENTION else dims[VALUE_HEADS])


@njit(**JIT)
def work_mix(step_phase, layer, kind, sync, dims, vecs, caches, eps, outs, q, slots, key_valid, valid, heads, att):
    """Claim (row, head) pairs of the mixer's heads until none is left: :func:`attend_cached` into
    ``heads`` [B, nh, 1, hd], or :func:`.gated_delta_jit.delta_head` into ``att``."""
    count = mix_units(dims, kind)
    b = dims[BATCH]
    while True:
        c = claim(sync, step_phase, count)
        if c < 0:
            return
        if kind == ATTENTION:
            attend_cached(q, layer, dims, caches, slots, key_valid, c // dims[KV_HEADS], c % dims[KV_HEADS], heads)
        else:
            hv, dv = dims[VALUE_HEADS], dims[VALUE_DIM]
            delta_head(outs[0].reshape((b, 1, dims[CONV_DIM])), outs[1].reshape((b, 1, hv, dv)),
                       outs[2].reshape((b, 1, hv)), outs[3].reshape((b, 1, hv)),
                       carray(i64_at(vecs[layer, KEY_HEADS]), (hv,)), vector(vecs, layer, SSM_A, hv),
                       vector(vecs, layer, DT_BIAS, hv), vector(vecs, layer, SSM_NORM, dv), eps, valid,
                       delta_state(layer, dims, caches), c // hv, c % hv, att.reshape((b, 1, hv, dv)))
        finish(sync, step_phase)


@njit(**JIT)
def finish_mix(kind, dims, outs, heads, att):
    """Worker 0, after the mixer's heads: attention's heads merged into ``att`` [B, nh·hd], through Qwen3.5's
    sigmoid gate when q carries one (DeltaNet's heads wrote ``att`` themselves)."""
    if kind == LINEAR:
        return
    b, nh, hd = dims[BATCH], dims[HEADS], dims[HEAD_DIM]
    width = dims[Q_WIDTH] // nh  # hd, or 2·hd when each head's gate follows its query
    if width == hd:
        att[:] = heads.reshape((b, nh * hd))
    else:
        sigmoid_gate(heads, outs[0].reshape((b, 1, nh, width)), att)


@njit(**JIT)
def widths(dims, kind):
    """The widths of a layer kind's input projections and of its mixer's output."""
    if kind == ATTENTION:
        kv = dims[KV_HEADS] * dims[HEAD_DIM]
        return dims[Q_WIDTH], kv, kv, 0, dims[HEADS] * dims[HEAD_DIM]
    hv = dims[VALUE_HEADS]
    return dims[CONV_DIM], hv * dims[VALUE_DIM], hv, hv, hv * dims[VALUE_DIM]


@njit(**JIT)
def decode_layers(worker, h, layers, mats, vecs, chunks, starts, caches, dims, eps, cos, sin, slots, key_valid,
                  valid, work, offsets, forms, table, sync, ticks, lost):
    """Every layer of a decode step, as worker ``worker`` (0: the caller, who also runs what lies between products
    and updates ``h`` [B, H] in place; see the module docstring).  Returns the chunks this worker multiplied.

    cos/sin float32 [B, 1, r/2]; slots int64 [B, 1], key_valid bool [B, S] and valid bool [B, 1] (C-contiguous);
    work float32 (the buffers at ``offsets``); forms int64 [SLOTS]: the forms table of every product input with
    8-bit activations (:mod:`..backend.kernels.q8_act`, its slots sized for the widest); table: the float16 table; sync:
    int64 [:func:`sync_size`], zero; ticks: cycles a worker other than 0 waits for a post before it leaves the rest
    to worker 0; lost: a gap this many cycles long between two of a worker's polls means it lost its CPU (the machine
    is busy), and it leaves too.
    """
    b, hidden, inter = dims[BATCH], dims[HIDDEN], dims[INTERMEDIATE]
    x, x2 = rows_of(work, offsets[X], b, hidden), rows_of(work, offsets[X2], b, hidden)
    act = rows_of(work, offsets[ACT], b, inter)
    attn_out, mlp_out = rows_of(work, offsets[ATT_OUT], b, hidden), rows_of(work, offsets[MLP_OUT], b, hidden)
    q = work[offsets[Q_HEADS]:offsets[Q_HEADS] + b * dims[HEADS] * dims[HEAD_DIM]].reshape(
        (b, dims[HEADS], 1, dims[HEAD_DIM]))
    heads = work[offsets[HEADS_OUT]:offsets[HEADS_OUT] + q.size].reshape(q.shape)
    did = 0
    for layer in range(len(layers)):
        kind = layers[layer]
        w0, w1, w2, w3, w_att = widths(dims, kind)
        att = rows_of(work, offsets[ATT], b, w_att)
        outs = (rows_of(work, offsets[Y0], b, w0), rows_of(work, offsets[Y1], b, w1),
                rows_of(work, offsets[Y2], b, w2), rows_of(work, offsets[Y3], b, w3), attn_out, act, mlp_out)
        inputs = (x, att, x2, act)
        for stage in range(STAGES):
            phase, step_phase = ORDER[stage], STAGES * layer + stage
            if worker == 0:
                if phase == PROJ:
                    rms_norm_rows(h, vector(vecs, layer, ATTN_NORM, hidden), eps, x)
                elif phase == MIX:
                    prepare_mix(layer, kind, dims, vecs, caches, eps, outs, cos, sin, slots, valid, q)
                elif phase == OUT:
                    finish_mix(kind, dims, outs, heads, att)
                elif phase == GATE_UP:
                    add_rms_norm_rows(h, attn_out, vector(vecs, layer, MLP_NORM, hidden), eps, h, x2)
                if phase != MIX:
                    sums16, sums32 = prepare_inputs(mats, layer, FIRST[phase], LAST[phase], inputs[phase], work,
                                                    offsets, forms)
                post(sync, step_phase)
            elif not await_post(sync, step_phase, ticks, lost):
                return did
            elif phase != MIX:
                n, cols = inputs[phase].shape
                sums16 = rows_of(work, offsets[SUMS16], n, cols // 16)
                sums32 = rows_of(work, offsets[SUMS32], n, cols // 32)
            if phase == MIX:
                work_mix(step_phase, layer, kind, sync, dims, vecs, caches, eps, outs, q, slots, key_valid, valid,
                         heads, att)
                count = mix_units(dims, kind)
            else:
                did += work_phase(worker, phase, step_phase, layer, kind, sync, mats, chunks, starts, inputs[phase],
                                  sums16, sums32, forms, table, outs, work, offsets)
                count = starts[kind, phase + 1] - starts[kind, phase]
            if worker == 0:
                await_done(sync, step_phase, count)
                if phase == DOWN_PROJ:
                    h += mlp_out
    return did
