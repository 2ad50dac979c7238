"""Weight kinds: how to multiply float32 activations by a matrix kept in its stored type.

A :class:`Weight` is a ``[out, in]`` matrix as stored in the model file (memory-mapped, never copied whole):

* :class:`F32Weight` (F32 with the numpy kernels) multiplies straight from the memory map (BLAS reads the mapped
  pages), a block of rows per task.
* :class:`TiledWeight` (every other type, and every type with the compiled kernels) hands ``block_rows`` rows at a
  time to its type's tile kernel (:mod:`.quants`), which decodes them into float32 scratch buffers of the pool
  thread doing it (:mod:`.pool`: a :class:`Workspace` keeps them per thread, shared by every weight of a model)
  and BLAS-multiplies.  No float32 copy of a whole matrix ever exists: anonymous memory stays at one tile per
  thread, plus Q8_0's block scales widened to float32 (2/17 of its stored bytes).

:func:`matmul_many` runs the tiles of projections sharing an input (q/k/v) as one pool run;
:func:`gated_matmul` also applies SwiGLU's activation inside each gate/up task.  Products that the compiled row
kernels read straight from the blocks (decode-sized ones, and every product inside ``Workspace.rowwise``) are
not cut into tiles but into one task per pool thread (:func:`direct_split`; more for matrices above
:data:`DIRECT_TASK_BYTES` per thread, the lm_head, and up to :data:`DIRECT_ROW_TASKS` per thread for products
of several rows): each run then pays its Python and its hand-off a few times per thread (see :mod:`.pool`).

**Row-invariant products.**  BLAS sums a row's product in an order that depends on how many rows there are
and where the row sits among them (GEMV for one row, GEMM kernels unrolled by position for several), so a
row's result changes in its last bits with the batch around it.  Inside :meth:`Workspace.rowwise` every
weight decodes each tile once and multiplies it by one activation row at a time, one matrix-vector product
per row (:class:`~qwen_runtime.quants.base.RowTileKernel` for F32/F16/BF16, whose lone rows keep the plain
kernel's numbers, and Q8_0, whose block scales are applied to the tile first; other types decode the tile
exactly): a server gives a request the same tokens alone or among others.  A GEMV per row costs more than
one GEMM for the batch, less than per-row block sums (docs/performance.md).
``Workspace.rowwise(rows)`` multiplies only the activation rows named (the others come out 0): the padding of a
verify pass whose rows bring fewer draft tokens than the longest costs no product.

**Segmented products.**  Inside ``Workspace.segmented(lengths)`` (several prompts' chunks prefilled in one pass)
each segment's rows get what a product of the segment alone gives (:func:`by_segments`): segments short enough
for the row kernels go through them (row-invariant), longer ones through the tile path, each tile decoded once
and multiplied by each segment in a BLAS call of its own (a BLAS may sum a row differently in a product of more
rows: OpenBLAS did for segments of 33-37 rows).

``rows(ids)`` is the embedding lookup: it decodes only the rows asked for.  A tied ``lm_head`` is the very
same object as the token embedding.  Every kind keeps ``to_float32()`` as the plain reference that the
tests compare the fast paths against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from ..errors import FormatError
from ..formats.tensors import QType, StoredTensor
from ..quants import TileKernel, codec
from ..quants.base import RowTileKernel
from ..quants.scratch import Scratch
from . import ops
from .kernels import jit_kernel, kernel_class
from .memory import MADV_POPULATE_READ, advise
from .pool import Workspace

# Elements per widened tile (4 MiB of float32, in L3): big enough that the few numpy calls per tile, each a GIL
# hand-off between pool threads, are cheap next to the work (smaller tiles decoded Q8_0 slower).
TILE_ELEMENTS = 1 << 20


class Weight:
    """A stored ``[out, in]`` matrix that multiplies float32 activations, one block of rows per pool task."""

    compiled = False  # whether a compiled row kernel multiplies it (row-invariant by construction)

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        if len(tensor.shape) != 2:
            raise FormatError(f"{tensor.path}: tensor {tensor.name!r} should be a matrix, got shape {tensor.shape}")
        self.name = tensor.name
        self.tensor = tensor
        self.ws = ws
        self.out_features, self.in_features = tensor.shape
        self.block_rows = ws.balanced(self.out_features, tile_elements // self.in_features)
        self._blocks: tuple[int, list[tuple[int, int]]] | None = None  # (block_rows, blocks) of the last blocks()

    @property
    def qtype(self) -> QType:
        return self.tensor.qtype

    def blocks(self) -> list[tuple[int, int]]:
        """The row ranges ``[r0, r1)`` multiplied as one task each (about a tile's elements; computed once)."""
        step = self.block_rows
        if self._blocks is None or self._blocks[0] != step:
            self._blocks = (step, [(r0, min(r0 + step, self.out_features)) for r0 in range(0, self.out_features, step)])
        return self._blocks[1]

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
    """Float32 weights used in place: BLAS reads the memory-mapped rows directly.

    With a ``blas_products`` workspace the whole matrix is one BLAS call on BLAS's own threads; on the pool,
    blocks of about a tile: several per matrix, not one per worker, because a pool thread wakes up late (tens
    of microseconds on a VM), and with two blocks the calling thread had claimed both before it woke.
    """

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        super().__init__(tensor, ws, tile_elements)
        self.w = np.asarray(tensor.data)  # [out, in] view of the memory map
        if ws.blas_products:
            self.block_rows = self.out_features

    def block_product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        if self.ws.row_invariant:
            row_products(xk, self.w[r0:r1], out)
        else:
            np.matmul(xk, self.w[r0:r1].T, out=out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.w[ids], dtype=np.float32)


class TiledWeight(Weight):
    """Weights of any stored type (F32 only with the compiled kernels), multiplied ``block_rows`` rows at a time by
    their type's tile kernel.

    The kernel (:meth:`qwen_runtime.quants.Codec.kernel`) owns everything type-specific: the activation
    layout it multiplies (:meth:`prepare`), the decoding of a tile and any per-tile state it keeps.
    """

    def __init__(self, tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> None:
        super().__init__(tensor, ws, tile_elements)
        self.codec = codec(tensor.qtype)
        self.raw = np.asarray(tensor.rows2d())  # [out, stored row length]
        compiled = jit_kernel(tensor.qtype, self.raw, ws.activations) if ws.kernels == "numba" else None
        self.kernel: TileKernel = compiled if compiled is not None else self.codec.kernel(self.raw)
        self.compiled = compiled is not None  # its row kernel is row-invariant by construction

    def prepare(self, x: np.ndarray) -> object:
        if self.compiled:  # told which products follow: :meth:`block_product`'s rowwise ones or not
            return self.kernel.prepare(x, rowwise=self.ws.row_invariant)
        if not self.ws.row_invariant:
            return self.kernel.prepare(x)
        if isinstance(self.kernel, RowTileKernel):
            return [self.kernel.prepare(x[i:i + 1]) for i in range(len(x))]
        return x

    def block_product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        if not self.ws.row_invariant and self.ws.tile_segments is not None:  # by_segments' long segments
            self.kernel.product_segments(r0, r1, xk, out, scratch, self.ws.tile_segments)
        elif not self.ws.row_invariant:
            self.kernel.product(r0, r1, xk, out, scratch)
        elif isinstance(self.kernel, RowTileKernel):  # the compiled kernels too
            self.kernel.product_rows(r0, r1, xk, out, scratch)
        else:  # any other kernel: decode the tile exactly, then one matrix-vector product per row
            raw = self.raw[r0:r1]
            tile = self.codec.decode(raw, scratch.array("rowwise tile", (len(raw), self.in_features)), scratch)
            row_products(xk, tile, out)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((ids.size, self.in_features), np.float32)
        return self.codec.decode(np.ascontiguousarray(self.raw[ids]), out, self.ws.scratch[0])


def row_products(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ w.T`` one activation row at a time (the same matrix-vector product for any number of rows).

    # x [N, in], w [R, in] float32 -> out [N, R]
    """
    for i in range(len(x)):
        np.matmul(x[i:i + 1], w.T, out=out[i:i + 1])


def matmul_many(weights: Sequence[Weight], x: np.ndarray) -> list[np.ndarray]:
    """``[w.matmul(x) for w in weights]``, the tiles of all of them through the pool in one run.

    Fusing projections that share their input (q/k/v, gate/up) balances the pool over every row of them
    and pays its dispatch once.  All weights must share one workspace.  # [N, in] -> [[N, out_i], ...]
    """
    if weights and weights[0].ws.segments is not None:
        return by_segments(weights, x, lambda xs: matmul_many(weights, xs))
    rows = active_rows(weights[0].ws, x) if weights else None
    if rows is not None:  # padded rows: only the active ones are multiplied
        return [scatter_rows(y, rows) for y in _matmul_many(weights, x[rows])]
    return _matmul_many(weights, x)


def _matmul_many(weights: Sequence[Weight], x: np.ndarray) -> list[np.ndarray]:
    """:func:`matmul_many` of every row of ``x``."""
    if weights and weights[0].ws.dry:  # Workspace.dry_run: zeros, the weights unread
        return [np.zeros((x.shape[0], w.out_features), np.float32) for w in weights]
    outputs = [np.empty((x.shape[0], w.out_features), np.float32) for w in weights]  # tasks fill column blocks
    prepared: dict[QType, object] = {}
    if weights and reads_blocks(weights, len(x)):
        parts = [(w, w.prepared(x, prepared), y) for w, y in zip(weights, outputs, strict=True)]
        rows = tuple(w.out_features for w in weights)
        costs = tuple(w.raw.shape[1] * w.raw.itemsize for w in weights)
        weights[0].ws.run([partial(_direct_task, [(w, r0, r1, xk, y[:, r0:r1]) for (w, xk, y), (r0, r1) in
                                                  zip(parts, ranges, strict=True) if r1 > r0])
                           for ranges in direct_split(rows, costs, weights[0].ws.threads, len(x))])
        return outputs
    tasks = [task for w, y in zip(weights, outputs, strict=True) for task in w.tile_tasks(x, y, prepared)]
    if weights:
        weights[0].ws.run(tasks)
    return outputs


# Direct products (compiled row kernels reading the blocks, no scratch tile): the weight bytes up to which a
# product is cut into exactly one task per thread; larger ones (the lm_head) into a multiple of the threads, so
# that a thread that runs slower (descheduled on a busy machine, or a core slower than the other) leaves its share
# to the others.  Products of several activation rows count their work (bytes times rows) the same way, up to
# DIRECT_ROW_TASKS tasks per thread: more cost more Python per product than a slower thread's share.
DIRECT_TASK_BYTES = 8 << 20
DIRECT_ROW_TASKS = 4
# Task boundaries fall on multiples of these rows (every matrix of a model has a multiple of them).
DIRECT_ROW_ALIGN = 32


def reads_blocks(weights: Sequence[Weight], n: int) -> bool:
    """Whether every weight multiplies ``n`` activation rows by its compiled row kernel straight from the
    blocks, any row range at the same cost per row and with no scratch tile (see :func:`direct_split`)."""
    return all(isinstance(w, TiledWeight) and w.compiled and (w.ws.row_invariant or n <= w.kernel.direct_rows)
               for w in weights)


@functools.lru_cache(maxsize=256)
def direct_split(rows: tuple[int, ...], costs: tuple[int, ...], threads: int, activation_rows: int = 1,
                 ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The rows of matrices (``rows[i]`` rows of ``costs[i]`` bytes) multiplied one after the other by
    ``activation_rows`` rows, cut into tasks of about equal bytes: ``threads`` tasks, or a multiple of them above
    :data:`DIRECT_TASK_BYTES` per task, counting the bytes times the activation rows (the row kernels'
    multiply-adds, not their reads, bound products of several rows) up to :data:`DIRECT_ROW_TASKS` per thread; each
    task a row range ``(r0, r1)`` of every matrix (empty ranges where it holds none of its rows).

    A row's result does not depend on the range it is multiplied in, so any cut gives the same numbers."""
    total = sum(r * c for r, c in zip(rows, costs, strict=True))
    per_thread = threads * DIRECT_TASK_BYTES
    by_bytes = -(-total // per_thread)
    by_work = min(DIRECT_ROW_TASKS, -(-total * activation_rows // per_thread))
    tasks = threads * max(1, by_bytes, by_work)
    cuts = [total * k // tasks for k in range(tasks + 1)]  # byte offsets in the matrices end to end
    out: list[list[tuple[int, int]]] = [[] for _ in range(tasks)]
    start = 0  # byte offset of the current matrix
    for r, c in zip(rows, costs, strict=True):
        for k in range(tasks):
            lo, hi = (min(max(cut - start, 0), r * c) for cut in (cuts[k], cuts[k + 1]))
            out[k].append(tuple(r if b == r * c else min(r, aligned_row(b, c)) for b in (lo, hi)))
        start += r * c
    return tuple(map(tuple, out))


def aligned_row(offset: int, row_bytes: int) -> int:
    """The multiple of :data:`DIRECT_ROW_ALIGN` rows nearest to byte ``offset`` in rows of ``row_bytes``."""
    unit = row_bytes * DIRECT_ROW_ALIGN
    return (2 * offset + unit) // (2 * unit) * DIRECT_ROW_ALIGN


def _direct_task(parts: list[tuple[TiledWeight, int, int, object, np.ndarray]], scratch: Scratch) -> None:
    for w, r0, r1, xk, y in parts:
        w.block_product(r0, r1, xk, y, scratch)


def gated_matmul(gate: Weight, up: Weight, x: np.ndarray) -> np.ndarray:
    """``silu(x @ gate.T) * (x @ up.T)`` (SwiGLU), each row block of both products and its activation in one
    task, so the activation runs on every pool thread while the block is still in cache.

    Each weight multiplies its block in its own kind; weights split into different blocks (different tile
    sizes) fall back to :func:`matmul_many`.  # [N, in] -> [N, out]
    """
    if gate.ws.segments is not None:
        return by_segments([gate, up], x, lambda xs: [gated_matmul(gate, up, xs)], [gate.out_features])[0]
    rows = active_rows(gate.ws, x)
    if rows is not None:  # padded rows: only the active ones are multiplied
        return scatter_rows(_gated_matmul(gate, up, x[rows]), rows)
    return _gated_matmul(gate, up, x)


def by_segments(weights: Sequence[Weight], x: np.ndarray, product: Callable[[np.ndarray], list[np.ndarray]],
                widths: Sequence[int] | None = None) -> list[np.ndarray]:
    """``product(x)`` inside ``Workspace.segmented(lengths)``: each segment's rows as a product of that segment
    alone computes them.  Alone, a segment of up to ``direct_rows`` rows goes through the row kernels, whose
    numbers do not depend on the other rows (so all such segments run together, row by row: ``rowwise``); a
    longer one through a decoded tile and BLAS, so all such segments share each decoded tile, each a BLAS call
    of its own (``JitKernel.product_segments``).  Needs compiled kernels
    sharing one ``direct_rows`` and float activations (``Model.prefill_many`` checks).  ``widths``: the
    columns of each array ``product`` returns (default: each weight's output).  # [N, in] -> [[N, out_i], ...]
    """
    ws = weights[0].ws
    lengths, limit = ws.segments, {w.kernel.direct_rows for w in weights if isinstance(w, TiledWeight)}
    if sum(lengths) != len(x) or len(limit) != 1 or not all(isinstance(w, TiledWeight) and w.compiled
                                                            for w in weights):
        raise ValueError(f"segments of {sum(lengths)} rows need compiled kernels of one direct_rows for {len(x)}")
    direct_rows, bounds = limit.pop(), np.cumsum((0, *lengths))
    short = np.zeros(len(x), bool)  # the rows of segments the row kernels take
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        short[start:stop] = stop - start <= direct_rows
    widths = [w.out_features for w in weights] if widths is None else widths
    outputs = [np.empty((len(x), n), np.float32) for n in widths]
    ws.segments = None  # the parts below are plain products
    try:
        if short.any():
            with ws.rowwise():
                for out, y in zip(outputs, product(x[short]), strict=True):
                    out[short] = y
        if not short.all():
            ws.tile_segments = tuple(n for n in lengths if n > direct_rows)
            for out, y in zip(outputs, product(x[~short]), strict=True):
                out[~short] = y
    finally:
        ws.segments, ws.tile_segments = lengths, None
    return outputs


def _gated_matmul(gate: Weight, up: Weight, x: np.ndarray) -> np.ndarray:
    """:func:`gated_matmul` of every row of ``x``."""
    if gate.ws.dry:  # Workspace.dry_run: the activation of zero products, the weights unread
        g = np.zeros((x.shape[0], gate.out_features), np.float32)
        return swiglu(gate.ws)(g, g.copy())
    direct = reads_blocks([gate, up], len(x))
    if gate.blocks() != up.blocks() and not direct:
        g, u = _matmul_many([gate, up], x)
        return swiglu(gate.ws)(g, u)
    out = np.empty((x.shape[0], gate.out_features), np.float32)
    prepared: dict[QType, object] = {}
    xg, xu = gate.prepared(x, prepared), up.prepared(x, prepared)
    blocks = gate.blocks()
    if direct:  # one task per thread, as in _matmul_many
        cost = gate.raw.shape[1] * gate.raw.itemsize + up.raw.shape[1] * up.raw.itemsize
        blocks = [ranges[0] for ranges in direct_split((gate.out_features,), (cost,), gate.ws.threads, len(x))]
    gate.ws.run([partial(_gated_block, gate, up, r0, r1, xg, xu, out[:, r0:r1]) for r0, r1 in blocks if r1 > r0])
    return out


def active_rows(ws: Workspace, x: np.ndarray) -> np.ndarray | None:
    """The rows of ``x`` [N, in] a product multiplies inside ``Workspace.rowwise(rows)`` (None: all of them)."""
    rows = ws.active_rows
    if rows is None or not ws.row_invariant:
        return None
    if rows.shape != (len(x),):
        raise ValueError(f"rowwise(rows) names {rows.shape[0]} activation rows, a product got {len(x)}")
    return None if rows.all() else rows


def scatter_rows(y: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``y`` [n, out], the products of the active ``rows`` (bool [N], n of them True), as [N, out] with 0 elsewhere."""
    out = np.zeros((len(rows), y.shape[1]), np.float32)
    out[rows] = y
    return out


def _gated_block(gate: Weight, up: Weight, r0: int, r1: int, xg: object, xu: object, out: np.ndarray,
                 scratch: Scratch) -> None:
    g = np.empty(out.shape, np.float32)  # [N, R], contiguous whatever the rows: one compiled swiglu for all batches
    gate.block_product(r0, r1, xg, g, scratch)
    u = np.empty(out.shape, np.float32)  # [N, R]
    up.block_product(r0, r1, xu, u, scratch)
    out[...] = swiglu(gate.ws)(g, u)  # into a fresh array: see swiglu


def swiglu(ws: Workspace) -> Callable[..., np.ndarray]:
    """SwiGLU's activation ``silu(gate) * up`` of the workspace's kernels (numba's twin is imported on first use).

    Callers let it write a fresh array: the compiled loop written over ``gate`` itself (``out=gate``) runs scalar,
    because LLVM's vectorized loop is guarded by a check that the output overlaps no input (the same bits, several
    times slower)."""
    if ws.kernels == "numba":
        from .ops_jit import silu_mul

        return silu_mul
    return ops.silu_mul


def make_weight(tensor: StoredTensor, ws: Workspace, tile_elements: int = TILE_ELEMENTS) -> Weight:
    """The weight kind for a stored matrix: F32 with the numpy kernels in place for BLAS, every type with the
    compiled ones by its row kernel (F32 included: so that the compiled decode step runs fp32 models)."""
    if tensor.qtype == QType.F32 and ws.kernels != "numba":
        return F32Weight(tensor, ws, tile_elements)
    return TiledWeight(tensor, ws, tile_elements)


def kept_bytes(qtype: QType, stored_nbytes: int, kernels: str = "numpy") -> int:
    """Anonymous memory the weight of one matrix of ``stored_nbytes`` stored bytes keeps for its life beside
    its memory-mapped rows, with ``kernels`` (``"numpy"``: an upper bound, as the compiled kernels keep nothing
    and fall back to the numpy ones only for types without a compiled kernel)."""
    if qtype == QType.F32 or (kernels == "numba" and kernel_class(qtype) is not None):
        return 0
    return codec(qtype).kept_bytes(stored_nbytes)


def weight_overhead(tensors: Iterable[StoredTensor], kernels: str = "numpy") -> int:
    """What a model's weights add to anonymous memory (the rest lives in the page cache): :func:`kept_bytes` of
    every matrix (Q8_0's block scales widened to float32 by the numpy kernels)."""
    return sum(kept_bytes(t.qtype, t.nbytes, kernels) for t in tensors if len(t.shape) == 2)


def populate(weights: Iterable[Weight]) -> None:
    """Map the stored rows of ``weights`` into the process now (``MADV_POPULATE_READ``, reading them from the file
    where the page cache lacks them), as llama.cpp's loader does: the first prompt does not take the page faults.
    A hint; nothing happens where the kernel lacks it."""
    for w in weights:
        rows = w.raw if isinstance(w, TiledWeight) else getattr(w, "w", None)
        if rows is not None:
            advise(rows.ctypes.data, rows.nbytes, MADV_POPULATE_READ)


def load_vector(tensor: StoredTensor) -> np.ndarray:
    """A small tensor (norm weight, bias) widened once to float32."""
    return np.ascontiguousarray(tensor.to_float32(), dtype=np.float32)
