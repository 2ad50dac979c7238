"""What the compiled (numba) tile kernels share: the decorator, stack accumulators, the float16 table and the
kernel class that :mod:`qwen_runtime.weights` calls.

Imported only when ``Workspace.kernels == "numba"`` (through :func:`qwen_runtime.quants.jit_kernel`), so the
numpy path never loads numba.  Every kernel is a single-threaded ``nogil`` function with an explicit signature,
compiled when its module is first imported (one module per family of types, so only the types a model uses)
and kept in numba's on-disk cache (``cache=True``; ``NUMBA_CACHE_DIR`` moves it).  The pool's threads call
them and release the GIL, so numba's own thread pool never starts (:mod:`qwen_runtime.pool`).

**Formulation** (measured, and checked in each kernel's assembly: packed ``vfmadd...ps`` and packed
conversions in the block loop).  A product row keeps 32 float32 lanes ``acc[k] += f32(q[k]) * (x[k] * d)``
(per-block scales folded into the activation side) and sums them once at the end; a per-block float
reduction compiles to scalar code.  The lanes live in a stack buffer (:func:`stack_f32`): LLVM then knows
they alias no argument and vectorizes without runtime overlap checks (a heap ``np.empty`` buffer vectorized
only behind such checks and ran 1.3-4x slower).  Only ``contract`` of fastmath is allowed (multiply-add
fused into FMA); sums keep their order, so a row's result is the same whatever the other rows
(:data:`GEMV_ROWS`).  Every row loop calls :func:`prefetch` for the block it starts: the hardware prefetchers
alone left the loops waiting for memory (1.2-2.3x the CPU time per weight, out of cache).

**Start-up** (measured on 2 shared, loaded vCPUs; CPU time, as waiting for a core is not start-up): the
first-ever compile of every module takes about 1.5 minutes of wall time (most in jit_legacy and jit_kquants);
with a warm cache a process reaches its first token about 0.3 s later than with ``kernels="numpy"``:
``import numba`` (0.13 s), numba's target set-up on the first kernel it compiles or loads (0.13 s, without the
SciPy import it would add: :mod:`..jit_setup`), then 2-10 ms per cached function (3 per type; a module loads
all its types).

For more than ``direct_rows`` activation rows (prefill, large batches) a tile is decoded into float32 scratch
by compiled code and multiplied by BLAS; inside ``Workspace.rowwise()`` (serving) every row goes through the
row kernel instead (groups of :data:`GEMV_ROWS`), so a row's numbers never depend on the batch.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import FormatError
from ..jit_setup import prepare_numba
from ..pool import Scratch

prepare_numba()  # before this package's first compile or cache load (which happens at import)

# Activation rows a row kernel multiplies at once, each by the same operations (the accumulators it holds).
GEMV_ROWS = 16
LANES = 32  # float32 accumulators per row (vertical lanes)
ACC_FLOATS = GEMV_ROWS * LANES  # the stack accumulators of a kernel for GEMV_ROWS rows

# float16 bits -> float32, exact (NaN payloads included): 256 KiB, built once per process (~1 ms).
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# Stored rows: read-only (memory-mapped files are), writable arrays convert to these.
U8_2D = types.Array(types.uint8, 2, "C", readonly=True)
I8_2D = types.Array(types.int8, 2, "C", readonly=True)
U16_2D = types.Array(types.uint16, 2, "C", readonly=True)
F32_1D = types.float32[::1]
F32_2D_C = types.float32[:, ::1]
F32_2D = types.float32[:, :]  # output column blocks: any row stride


def compiled(signature: object, contract: bool = True):  # -> a decorator
    """``numba.njit`` as every kernel uses it: explicit signature (compiled at import, one specialisation),
    no GIL, the on-disk cache, and FMA contraction as the only fast-math licence (``contract=False`` for
    decoders, whose ``scale * q - minimum`` must round twice, as the reference does)."""
    return numba.njit(signature, nogil=True, cache=True, fastmath={"contract"} if contract else False)


@intrinsic
def stack_f32(typingctx, size):  # noqa: ARG001 (numba's intrinsic protocol)
    """A float32 buffer of ``size`` (a literal) on the stack, as a pointer for ``numba.carray``."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    count = size.literal_value

    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, context.get_value_type(types.float32), size=count)

    return types.CPointer(types.float32)(size), codegen


@intrinsic
def bits_to_f32(typingctx, bits):  # noqa: ARG001
    """The float32 whose bit pattern is the low 32 bits of the unsigned integer ``bits`` (numba widens uint32
    arithmetic to uint64)."""
    if not isinstance(bits, types.Integer) or bits.signed or bits.bitwidth < 32:
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(bits), codegen


# How far ahead of the block being multiplied the row kernels prefetch the stored rows.  Out of cache the loops
# waited for memory: one row, one thread, ms of CPU per million weights of the 8-bit-activation Q8_0 kernel
# (loaded machine): none 0.157, 512 bytes 0.131, 1024 0.124, 2048 0.098-0.107, 4096 0.098-0.099, 8192 0.107.
PREFETCH_BYTES = 2048


@intrinsic
def prefetch(typingctx, array, at):  # noqa: ARG001
    """Ask for the bytes :data:`PREFETCH_BYTES` after element ``at`` of the C-contiguous ``array`` (a hint: never
    faults, even past the end of the rows)."""
    if not isinstance(array, types.Array) or not isinstance(at, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        byte = ir.IntType(8).as_pointer()
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        start = builder.bitcast(builder.gep(data, [args[1]]), byte)
        ahead = builder.gep(start, [ir.Constant(ir.IntType(64), PREFETCH_BYTES)])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [ahead, i32(0), i32(3), i32(1)])  # read, keep in every cache level, data
        return context.get_dummy_value()

    return types.void(array, at), codegen


class JitKernel:
    """A stored matrix multiplied by compiled kernels (the :class:`~qwen_runtime.quants.TileKernel` interface).

    Subclasses set ``block`` and ``type_size`` and the compiled functions ``gemv`` (any 1..GEMV_ROWS rows),
    ``gemv1`` (one row, optional: the same operations, faster) and ``decode``, called as
    ``gemv(raw, x, *activations, *constants, out)`` and ``decode(raw, *constants, tile)``; they may override
    :meth:`activations` for per-row quantities of ``x`` shared by every weight (per-block sums) and set
    ``constants`` (tables).
    Compiled code runs without bounds checks: every shape it sees is checked here first.
    """

    block: int
    type_size: int
    constants: tuple = ()
    direct_rows = 8  # products of up to this many rows read the blocks directly (measured crossover: 8-16)

    def __init__(self, raw: np.ndarray) -> None:
        raw = np.asarray(raw)
        if raw.ndim != 2 or raw.shape[1] % self.stored_unit():
            raise FormatError(f"{type(self).__name__}: stored rows of shape {raw.shape} do not hold whole blocks")
        if not raw.flags.c_contiguous:
            raise FormatError(f"{type(self).__name__}: stored rows must be contiguous")
        self.raw = self.stored(raw)
        self.in_features = raw.shape[1] // self.stored_unit() * self.block

    def stored_unit(self) -> int:
        """Elements of the stored row array per block (bytes for quantized types, 1 for dense ones)."""
        return self.type_size

    def stored(self, raw: np.ndarray) -> np.ndarray:
        """The stored rows in the dtype the compiled functions take (a view)."""
        return raw.view(np.uint8)

    def activations(self, x: np.ndarray) -> tuple:
        """The extra arguments the compiled functions take after ``x`` (activation-only quantities)."""
        return ()

    def prepare(self, x: np.ndarray) -> tuple:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"activations of shape {x.shape} for a matrix of {self.in_features} columns")
        x = np.ascontiguousarray(x, dtype=np.float32)
        return (x, *self.activations(x))

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T``: up to :attr:`direct_rows` rows straight from the blocks, more rows through a
        decoded float32 tile and BLAS."""
        x, *extra = xk
        if out.shape != (len(x), r1 - r0) or out.dtype != np.float32:
            raise ValueError(f"output of shape {out.shape} for {len(x)} rows and {r1 - r0} columns")
        if len(x) <= self.direct_rows:
            self._rows(self.raw[r0:r1], x, extra, out)
            return
        tile = scratch.array("tile", (r1 - r0, self.in_features))
        self.decode(self.raw[r0:r1], *self.constants, tile)
        np.matmul(x, tile.T, out=out)

    def product_rows(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T`` with every row by the row kernel, whatever the number of rows (groups of
        GEMV_ROWS): for ``Workspace.rowwise``."""
        x, *extra = xk
        if out.shape != (len(x), r1 - r0) or out.dtype != np.float32:
            raise ValueError(f"output of shape {out.shape} for {len(x)} rows and {r1 - r0} columns")
        for i in range(0, len(x), GEMV_ROWS):
            self._rows(self.raw[r0:r1], x[i:i + GEMV_ROWS], [e[i:i + GEMV_ROWS] for e in extra],
                       out[i:i + GEMV_ROWS])

    def _rows(self, raw: np.ndarray, x: np.ndarray, extra: list, out: np.ndarray) -> None:
        gemv = self.gemv1 if len(x) == 1 and hasattr(self, "gemv1") else self.gemv
        gemv(raw, x, *extra, *self.constants, out)
