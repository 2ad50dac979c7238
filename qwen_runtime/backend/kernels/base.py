"""What the compiled (numba) tile kernels share: the decorator, stack accumulators, the float16 table and the
kernel class that :mod:`qwen_runtime.backend.weights` calls.

Imported only when ``Workspace.kernels == "numba"`` (through :func:`qwen_runtime.backend.kernels.kernel_table`), so
the numpy path never loads numba.  Every kernel is a single-threaded ``nogil`` function with an explicit
signature, compiled when a weight that calls it is built (:class:`Declared`: only the types and forms a model
uses) and kept in numba's on-disk cache (``cache=True``; ``NUMBA_CACHE_DIR`` moves it).  The pool's threads call
them and release the GIL, so numba's own thread pool never starts (:mod:`qwen_runtime.backend.pool`).

**Formulation** (measured, and checked in each kernel's assembly: packed ``vfmadd...ps`` on zmm, the
accumulators in registers).  A block's 32 weights are decoded once into float32 with their scale folded in,
``w[k] = d * f32(q[k])``, which is exact for every stored type (an 11-bit float16 significand times integer
scales and quants whose product is at most 2**12 in magnitude: see each kernel); then each activation row
``i`` keeps 32 float32 lanes ``acc[i, k] = fma(w[k], x[i, k], acc[i, k])`` over the blocks in order and sums
them by a fixed pairwise tree (lanes ``k`` and ``k + 16``, then 8, 4, 2, 1: :func:`lanes_sum`); the K-quants do
that per chunk of :data:`CHUNK_COLS` columns and add the chunks' sums in order (:func:`deposit`).  Each term is
rounded once (the fused multiply-add), so a row is at least as accurate as with the scale on the activation
side.  The multi-row kernels run the rows in groups of :data:`GROUP_ROWS`,
4, 2 and 1 (a compile-time count, one specialisation per count: :func:`gemv_groups`), so that a group's
``2 * GROUP_ROWS`` zmm accumulators stay in registers and the decoded block is shared by the group's rows;
the one-row kernel is the group of one, so a row's result is the same bits whatever the other rows
(:data:`GEMV_ROWS` per call).  Activations are copied to a 64-byte aligned buffer when they are not
(:meth:`JitKernel.prepare`): a zmm load across two cache lines costs two.  Only ``contract``
of fastmath is allowed (the products are explicit ``llvm.fma``); sums keep their order.  Every row loop calls
:func:`prefetch` for the block it starts: the hardware prefetchers alone left the loops waiting for memory.
This formulation replaced loops that kept each row's lanes in a stack array (``acc += f32(q) * (x * d)``,
loaded and stored every block), slower for every row count; the A/B figures of each type are in
docs/performance.md.

**Start-up.**  The first-ever compile of every module takes minutes of CPU, once per machine (numba's on-disk
cache keeps the machine code; ``scripts/warm_kernels.py`` compiles all of them ahead on every core).  With a warm
cache a process pays ``import numba``, numba's target set-up on the first kernel it compiles or loads (without
the SciPy import it would add: :mod:`..jit_setup`) and the load of each cached function its weights call (a few per
type and form); docs/performance.md has the figures.

For more than ``direct_rows`` activation rows (prefill, large batches) a tile is decoded into float32 scratch
by compiled code and multiplied by BLAS; inside ``Workspace.rowwise()`` (serving) every row goes through the
row kernel instead (calls of :data:`GEMV_ROWS` rows), so a row's numbers never depend on the batch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import config, types
from numba.core import cgutils, sigutils, typeinfer
from numba.core.registry import CPUDispatcher
from numba.extending import intrinsic

from ...errors import FormatError
from ..jit_setup import prepare_numba

if TYPE_CHECKING:  # annotations only, kept out of the cache stamp of the kernels (jit_setup.import_closure)
    from ...quants.base import QType
    from ...quants.scratch import Scratch

prepare_numba()  # before this package's first compile or cache load (the shared helpers load at import)

# Activation rows a row kernel multiplies at once, each by the same operations (the accumulators it holds).
GEMV_ROWS = 16
LANES = 32  # float32 accumulators per row (vertical lanes)
ACC_FLOATS = GEMV_ROWS * LANES  # the stack accumulators of a kernel for GEMV_ROWS rows
PAIR = 2  # stored rows a one-row kernel of the 32-value types multiplies at once (:func:`gemv1_rows`)
PAIR_FLOATS = PAIR * LANES  # their lanes
TILE_ROWS = 16  # stored rows the groups of a multi-row product take in turn (:func:`gemv_groups`)
# Columns of a K-quant row product's chunk: each activation row's lanes are summed per chunk (:func:`lanes_sum`)
# and the chunks' sums added in order (:func:`deposit`), so that a chunk of activations (8 KiB a row) stays in the
# L1 cache while the tile's rows stream through it.  Over whole rows of 4096 or more columns the K-quant loops
# slowed down (the 7B-shaped model's down projection most), as the row's activations no longer stayed in L1.  The
# 32-value types and the dense ones did not slow down over whole rows and lost when chunked: they pass 0, whole
# rows.  Figures: docs/performance.md.
CHUNK_COLS = 2048
LINE = 64  # bytes of a cache line
ALIGN = 64  # bytes: activations start on a cache line (a zmm load across two lines costs two)

HALF = LANES // 2
# The LLVM IR types of every kernel module's intrinsics, defined once: scalars, and vectors named V<count>_<element>
# (V16_F32: one zmm, half of a row's lanes).
I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V4_I8, V16_I8, V32_I8, V64_I8 = (ir.VectorType(I8, n) for n in (4, 16, 32, 64))
V8_I16, V16_I16, V32_I16 = (ir.VectorType(I16, n) for n in (8, 16, 32))
V4_I32, V8_I32, V16_I32, V32_I32 = (ir.VectorType(I32, n) for n in (4, 8, 16, 32))
V4_I64 = ir.VectorType(I64, 4)
V8_F32, V16_F32 = ir.VectorType(F32, 8), ir.VectorType(F32, HALF)


def _target_features() -> frozenset[str]:
    """The CPU features numba compiles for (its own choice: ``NUMBA_CPU_FEATURES``, else the host's), which
    also key its on-disk cache, so a kernel cached for one CPU is never loaded on another."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


FEATURES = _target_features()
# vpermps: the float row kernels of 4- and 5-bit types look their scaled values up (:func:`look_up`), for groups
# of up to TABLE_ROWS activation rows; larger groups share each decoded block among more rows and convert it
# (tables won for one to three rows and lost at eight: docs/performance.md).
PERMUTE = "avx512f" in FEATURES
TABLE_ROWS = 2
# AVX2 without AVX-512: the integer-dot kernels multiply each block by ``pmaddubsw`` (:func:`.int8._quads8`), and a
# one-row product with 8-bit activations decodes well ahead of the exact float kernels, whose 256-bit FMAs bound
# them below the memory's rate (docs/performance.md); ``activations="auto"`` is then ``"q8"``
# (:func:`auto_activations`).
MADDUBS = "avx2" in FEATURES and "avx512bw" not in FEATURES
# Activation rows whose accumulators a float row kernel keeps in registers at once: 8 with AVX-512 (2 zmm each, 16 of
# the 32), 4 elsewhere (4 ymm each: groups of 8 spilled their lanes on AVX2's 16 registers and ran at half the rate
# of groups of 4, docs/performance.md).
GROUP_ROWS = 8 if "avx512f" in FEATURES else 4
GROUP_FLOATS = GROUP_ROWS * LANES
TILE_FLOATS = GROUP_FLOATS + LANES  # a partial block: its weights and a group's activations (:func:`buffer_fma`)


def auto_activations() -> str:
    """What ``activations="auto"`` means with the compiled kernels on this CPU: ``"q8"`` (every product of a
    quantized type with 8-bit activations, as llama.cpp multiplies) where :data:`MADDUBS`, else ``"q8-prompts"``
    (exact decode; 8-bit prompts on AMX tiles)."""
    return "q8" if MADDUBS else "q8-prompts"


def splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    """``value`` in every element of the LLVM vector type ``vector``."""
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, I32(0))
    zeros = ir.Constant(ir.VectorType(I32, vector.count), [0] * vector.count)
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined), zeros)


def level_table(builder: ir.IRBuilder, d: ir.Value, levels: ir.Value) -> ir.Value:
    """``d * levels[j]`` for a ``<16 x float>`` of 16 integer ``levels``: each value rounded once, exactly as
    ``d * f32(q)`` rounds for a stored ``q`` whose level is ``levels[j]`` (one ``vmulps`` per 16 levels)."""
    return builder.fmul(splat(builder, d, V16_F32), levels)


def levels_of(values: list) -> ir.Constant:
    """16 integer levels as the ``<16 x float>`` constant :func:`level_table` takes."""
    return ir.Constant(V16_F32, [float(v) for v in values])


def nibble_indices(builder: ir.IRBuilder, source: ir.Value) -> list:
    """The 16 bytes at the ``<16 x i8>`` pointer ``source`` zero-extended to int32 (``vpmovzxbd`` from memory): as
    they are, whose low nibbles :func:`look_up` reads, and shifted right by 4 for the high nibbles."""
    quads = builder.zext(builder.load(source, align=1), V16_I32)
    return [quads, builder.lshr(quads, ir.Constant(V16_I32, [4] * HALF))]


def look_up(builder: ir.IRBuilder, index: ir.Value, tables: list, high: ir.Value | None = None) -> ir.Value:
    """``tables[0][index[k] & 15]``, or ``tables[1][...]`` where the ``<16 x i1>`` ``high`` is set, for 16 int32
    indices (their bits above 3 are ignored): ``vpermps``, and a masked second one for a fifth bit (AVX-512F).
    In a row kernel this replaces a block's int-to-float conversion and scaling, two instructions per 16
    weights, by one (the table, :func:`level_table`, is made once per block of 32)."""
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32, V16_I32]),
                                             "llvm.x86.avx512.permvar.sf.512")
    low = builder.call(permute, [tables[0], index])
    return low if high is None else builder.select(high, builder.call(permute, [tables[1], index]), low)

# float16 bits -> float32, exact (NaN payloads included): 256 KiB, built once per process (cheap).
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

# The numba array types of the kernels' signatures, defined once.  Stored rows and prepared activations:
# read-only (memory-mapped files are; writable arrays convert to these).
U8_2D = types.Array(types.uint8, 2, "C", readonly=True)
I8_2D = types.Array(types.int8, 2, "C", readonly=True)
I16_2D = types.Array(types.int16, 2, "C", readonly=True)  # activations widened to int16 (multi-row kernels)
I32_2D = types.Array(types.int32, 2, "C", readonly=True)
U16_2D = types.Array(types.uint16, 2, "C", readonly=True)
F32_2D_RO = types.Array(types.float32, 2, "C", readonly=True)
# Writable: what a kernel fills (quantized activations, sums, tiles).
I8_2D_W = types.int8[:, ::1]
I16_2D_W = types.int16[:, ::1]
I32_2D_W = types.int32[:, ::1]
F32_1D = types.float32[::1]
F32_2D_C = types.float32[:, ::1]
F32_2D = types.float32[:, :]  # output column blocks: any row stride


# IEEE division, as numpy's and llama.cpp's: an infinite activation gives an infinite or NaN result rather than
# Python's ZeroDivisionError (q8_K's ``1 / iscale`` of an infinite maximum is 1 / -0.0).  The compiled decode step
# calls the activations' quantizers; a warm-up pass over unwritten buffers (``Workspace.dry_run``) once met such
# values and stopped a model's load.
ERROR_MODEL = "numpy"


class Declared(CPUDispatcher):
    """A kernel of one declared signature, compiled (or loaded from numba's cache) on first use rather than at
    import: by :meth:`ready` (a weight's kernel readies the functions it calls while the model loads, see
    :meth:`JitKernel.compiled_functions`), by a compiled caller being typed, or by a first call from Python.

    Then, as ``numba.njit(signature)``, it holds exactly that one specialisation: a call whose arguments differ
    (a writable array for a read-only one) converts to it or fails, and never compiles another.  Why lazy: a
    module holds a family's kernels for every type and form, and machine code loaded for the types a model does
    not store is anonymous memory for the whole run (a Q8_0 model imported the K-quant and legacy kernels:
    docs/performance.md)."""

    declared: object = None  # the signature; None for a dispatcher numba rebuilt by pickling (compiles as njit)

    def ready(self) -> Declared:
        """Compile (or load) the declared signature once, then refuse any other."""
        if self.declared is not None and not self.overloads:
            with typeinfer.register_dispatcher(self):
                super().compile(self.declared)
            self.disable_compile()
        return self

    def compile(self, sig: object) -> object:
        self.ready()
        existing = self.overloads.get(tuple(sigutils.normalize_signature(sig)[0]))
        return existing.entry_point if existing is not None else super().compile(sig)

    def get_call_template(self, args: tuple, kws: dict) -> tuple:
        self.ready()
        return super().get_call_template(args, kws)

    def _compile_for_args(self, *args: object, **kws: object) -> object:
        self.ready()
        return self if self.declared is not None else super()._compile_for_args(*args, **kws)


def compiled(signature: object, contract: bool = True, shared: bool = False):  # -> a decorator
    """``numba.njit`` as every kernel uses it: explicit signature (one specialisation, compiled on first use:
    :class:`Declared`), no GIL, the on-disk cache, and FMA contraction as the only fast-math licence
    (``contract=False`` for decoders, whose ``scale * q - minimum`` must round twice, as the reference does).
    ``shared``: compiled at import, for the helpers the kernels of many types call from Python (the activations'
    quantizers and block sums), which no one weight's kernel lists."""

    def declare(function: Callable) -> Declared:
        options = {"nopython": True, "nogil": True, "fastmath": {"contract"} if contract else False,
                   "error_model": ERROR_MODEL}
        kernel = Declared(py_func=function, locals={}, targetoptions=options)
        kernel.enable_caching()
        kernel.declared = signature
        return kernel.ready() if shared else kernel

    return declare


class DeclaredCFunc:
    """A C-callable kernel (``numba.cfunc``) compiled (or loaded from numba's cache) when its address is first
    asked for, as :class:`Declared` for Python's calls; the compiled :class:`numba.core.ccallback.CFunc` answers
    every attribute."""

    def __init__(self, function: Callable, signature: object) -> None:
        self.py_func, self.signature = function, signature
        self.__name__, self.__doc__ = function.__name__, function.__doc__
        self._compiled = None
        self._lock = threading.Lock()

    def ready(self) -> object:
        with self._lock:
            if self._compiled is None:
                self._compiled = numba.cfunc(self.signature, nopython=True, cache=True,
                                             error_model=ERROR_MODEL)(self.py_func)
        return self._compiled

    def __getattr__(self, name: str) -> object:
        return getattr(self.ready(), name)


def declared_cfunc(signature: object):  # -> a decorator
    """:class:`DeclaredCFunc` of ``signature``."""
    return lambda function: DeclaredCFunc(function, signature)


def ready_module(module: ModuleType) -> list[str]:
    """Every declared kernel of ``module`` compiled or loaded now (``scripts/warm_kernels.py``); their names."""
    names = [name for name, value in vars(module).items() if isinstance(value, (Declared, DeclaredCFunc))
             and getattr(value.py_func, "__module__", None) == module.__name__]
    for name in names:
        getattr(module, name).ready()
    return names


@intrinsic
def stack_f32(typingctx, size):  # noqa: ARG001 (numba's intrinsic protocol)
    """A float32 buffer of ``size`` (a literal) on the stack, as a pointer for ``numba.carray``; it starts on a
    64-byte boundary (:data:`ALIGN`), so that :func:`rows_fma` and :func:`lanes_sum` load whole zmm from it."""
    if not isinstance(size, types.IntegerLiteral):
        return None
    count = size.literal_value

    def codegen(context, builder, signature, args):
        buffer = cgutils.alloca_once(builder, context.get_value_type(types.float32), size=count)
        buffer.align = ALIGN
        return buffer

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
# waited for memory without it; 2048 bytes and more were best for the 8-bit-activation Q8_0 kernel, and the VNNI
# K-quant kernels, faster per byte, want it further (4096); the float kernels are the same at 2048 and 4096.  On
# the AVX2-only EPYC (:data:`MADDUBS`) 4096 was slower than 2048 for Q8_0 and Q5_0 rows and than none for Q5_K's.
PREFETCH_BYTES = 2048 if MADDUBS else 4096
# F32 rows (4 bytes a weight, four times Q8_0's) lost at 4096: the fp32 decode step was slower at 4096 than at
# 2048, while the 16-bit and quantized files' steps gained a little.  Figures: docs/performance.md.
F32_PREFETCH_BYTES = 2048
# The q8_K row kernels (AVX2 without VNNI: the AMD EPYC machines here) ask for every cache line of the block, and
# nearer: on those CPUs one request per block at PREFETCH_BYTES left the kernel slower from memory than no request
# at all, while all the block's lines at 2048 made it the fastest.  Figures: docs/performance.md.
Q8K_PREFETCH_BYTES = 2048


def prefetcher(distance: int):  # -> an intrinsic
    """An intrinsic ``(array, at)`` asking for the bytes ``distance`` after element ``at`` of the C-contiguous
    ``array`` (a hint: never faults, even past the end of the rows)."""

    @intrinsic
    def prefetch(typingctx, array, at):  # noqa: ARG001
        if not isinstance(array, types.Array) or not isinstance(at, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            byte = ir.IntType(8).as_pointer()
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            start = builder.bitcast(builder.gep(data, [args[1]]), byte)
            ahead = builder.gep(start, [ir.Constant(ir.IntType(64), distance)])
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            builder.call(fn, [ahead, i32(0), i32(3), i32(1)])  # read, keep in every cache level, data
            return context.get_dummy_value()

        return types.void(array, at), codegen

    return prefetch


prefetch = prefetcher(PREFETCH_BYTES)  # what every row kernel calls for the block it starts
prefetch_at = prefetcher(0)  # the element itself (:func:`fetch_row`)
prefetch_f32 = prefetcher(F32_PREFETCH_BYTES)  # F32 rows' (4 bytes per weight)
prefetch_q8k = prefetcher(Q8K_PREFETCH_BYTES)  # the q8_K row kernels', once per cache line of a block


def rows_fma(context: object, builder: ir.IRBuilder, x_type: types.Array, x: ir.Value, i0: ir.Value, col: ir.Value,
             rows: int, acc: ir.Value, w: list) -> None:
    """LLVM IR of ``acc[i, k] = fma(w[k], x[i0 + i, col + k], acc[i, k])`` for ``i < rows`` and the 32 lanes ``k``:
    ``w`` the block's two ``<16 x float>`` halves, ``x`` a C-contiguous float32 [N, n] array, ``acc`` a float32
    pointer to ``rows * 32`` lanes (a :func:`stack_f32` buffer, 64-byte aligned: LLVM keeps the lanes in registers
    across the block loop, as nothing else can reach them)."""
    array = context.make_array(x_type)(context, builder, x)
    width = builder.extract_value(array.shape, 1)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_F32, [V16_F32] * 3), "llvm.fma.v16f32")
    lanes = builder.bitcast(acc, V16_F32.as_pointer())
    for i in range(rows):
        start = builder.add(builder.mul(builder.add(i0, i0.type(i)), width), col)
        xs = builder.bitcast(builder.gep(array.data, [start]), V16_F32.as_pointer())
        for h in range(2):
            at = builder.gep(lanes, [I32(2 * i + h)])
            term = builder.call(fma, [w[h], builder.load(builder.gep(xs, [I32(h)]), align=4),
                                      builder.load(at, align=ALIGN)])
            builder.store(term, at, align=ALIGN)


@intrinsic
def buffer_fma(typingctx, tile, rows, acc):  # noqa: ARG001
    """``acc[i, k] = fma(tile[0, k], tile[1 + i, k], acc[i, k])`` for ``i < rows`` (a literal): :func:`rows_fma`
    for 32 weights and the rows' 32 activations held in a C-contiguous float32 [1 + rows, 32] ``tile`` (a
    partial block padded with zeros)."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    count = rows.literal_value

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        first = builder.bitcast(data, V16_F32.as_pointer())
        w = [builder.load(builder.gep(first, [I32(h)]), align=4) for h in range(2)]
        i64 = context.get_value_type(types.intp)
        rows_fma(context, builder, signature.args[0], args[0], i64(1), i64(0), count, args[2], w)
        return context.get_dummy_value()

    return types.void(tile, rows, acc), codegen


@intrinsic
def lanes_sum(typingctx, acc, i):  # noqa: ARG001
    """The sum of the 32 lanes of row ``i`` of the accumulators at ``acc`` (a float32 pointer), by a fixed
    pairwise tree: lanes ``k`` and ``k + 16``, then the halves of what is left, down to one."""
    if acc != types.CPointer(types.float32) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        lanes = builder.bitcast(args[0], V16_F32.as_pointer())
        first = builder.mul(args[1], args[1].type(2))
        v = builder.fadd(builder.load(builder.gep(lanes, [first]), align=ALIGN),
                         builder.load(builder.gep(lanes, [builder.add(first, first.type(1))]), align=ALIGN))
        width = HALF
        while width > 1:
            half = ir.VectorType(I32, width // 2)
            v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(half, list(range(width // 2)))),
                             builder.shuffle_vector(v, v, ir.Constant(half, list(range(width // 2, width)))))
            width //= 2
        return builder.extract_element(v, I32(0))

    return types.float32(acc, i), codegen


@intrinsic
def lanes_at(typingctx, acc, i):  # noqa: ARG001
    """The 32 lanes of accumulator row ``i`` at ``acc`` (``acc + 32 * i``, a float32 pointer), where :func:`rows_fma`
    adds the products of a group's second stored row (:func:`pair_rows`)."""
    if acc != types.CPointer(types.float32) or not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.gep(args[0], [builder.mul(args[1], args[1].type(LANES))])

    return types.CPointer(types.float32)(acc, i), codegen


inline = numba.njit(inline="always", cache=True, fastmath={"contract"})  # steps inlined into the kernels


@inline
def zero_lanes(acc, rows):
    """Zero the ``rows * 32`` accumulators at ``acc``."""
    lanes = numba.carray(acc, (rows * LANES,))
    for k in range(rows * LANES):
        lanes[k] = 0


@inline
def deposit(out, i, r, value, c0):
    """``out[i, r] = value`` for a row's first chunk of columns (``c0 == 0``), else ``out[i, r] += value``: what a
    group adds for the chunk ``c0:c1`` (:func:`gemv1_rows`)."""
    if c0 == 0:
        out[i, r] = value
    else:
        out[i, r] += value


# How a group's block step asks for its stored row's bytes ahead (:func:`fetch_block`).
FETCH_NONE, FETCH_ROW, FETCH_PAIR = 0, 1, 2


@inline
def fetch_block(fetch, blocks, o, size, how):
    """Ask for the bytes ahead of the block of ``size`` elements at element ``o`` of the stored row ``blocks``
    (``fetch``: the type's :func:`prefetcher`), as ``how`` says (a constant): FETCH_ROW the row's own stream;
    FETCH_PAIR, for the second row of a pair (:func:`pair_rows`), the stream of both rows' bytes, which a pair
    reads twice as fast as one row (the first row, FETCH_NONE, asks for nothing).  With each row of a pair asking
    for its own bytes ahead, a pair was slower than one row at a time out of cache; with the pair's one stream it
    is faster (docs/performance.md)."""
    if how == FETCH_ROW:
        fetch(blocks, o)
    elif how == FETCH_PAIR:
        fetch(blocks, 2 * o)
        fetch(blocks, 2 * o + size)


@inline
def first_fetch(stored):
    """How the first stored row of a group asks for its bytes (:func:`fetch_block`): alone its own stream, in a pair
    nothing (the second row asks for both)."""
    return FETCH_ROW if stored == 1 else FETCH_NONE


@inline
def pair_rows(raw, r, stored):
    """The stored rows of a group (:func:`gemv1_rows`): row ``r`` and, if ``stored == 2``, row ``r + 1`` (row ``r``
    again when ``r`` is the last row, whose second result is then not deposited: :func:`stored_row`)."""
    return raw[r], raw[min(r + stored - 1, raw.shape[0] - 1)]


@inline
def prefetch_block(blk, size):
    """Ask for the ``size`` bytes of a K-quant block ``blk`` :data:`PREFETCH_BYTES` ahead: every cache line of it
    on CPUs with AVX2 but not AVX-512BW (:data:`MADDUBS`), where one request per block left the loops waiting for
    memory, its first byte elsewhere (as measured on the AVX-512 machines)."""
    for line in range(0, size if MADDUBS else 1, LINE):
        prefetch(blk, line)


@inline
def stored_row(raw, r, s):
    """Whether the ``s``-th stored row of a group starting at row ``r`` is a row of ``raw`` (:func:`pair_rows`)."""
    return r + s < raw.shape[0]


@inline
def fetch_row(raw, r, c0, c1, cols):
    """Ask for the columns ``c0:c1`` of the ``cols`` of stored row ``r`` of ``raw``, one prefetch per cache line (a
    hint: ``r`` may be past the last row)."""
    e0, e1 = c0 * raw.shape[1] // cols, c1 * raw.shape[1] // cols
    base = r * raw.shape[1]
    for e in range(e0, e1, LINE // raw.itemsize):
        prefetch_at(raw, base + e)


@inline
def tile_groups(count, group, raw, t0, t1, x, i0, c0, c1, args, out, acc, fetch):
    """``group(count, 1, raw, r, x, i0, c0, c1, args, out, acc)`` for the stored rows ``t0 <= r < t1``, each first
    asking, if ``fetch``, for the same columns of the row a tile further (:func:`fetch_row`).  The requests go
    between the groups: asked for the whole next tile at once, they stall the loop."""
    for r in range(t0, t1):
        if fetch:
            fetch_row(raw, r + TILE_ROWS, c0, c1, x.shape[1])
        group(count, 1, raw, r, x, i0, c0, c1, args, out, acc)


@inline
def gemv1_rows(group, stored, raw, x, args, out, chunk):
    """``out[0, r] = x[0] @ W[r]`` for every stored row ``r``: ``group(1, stored, raw, r, x, 0, c0, c1, args, out,
    acc)``, the type's block loop for a group of one activation row over the columns ``c0:c1`` of ``stored`` (a
    constant, 1 or :data:`PAIR`) consecutive stored rows from ``r`` (``args``: its activation quantities and
    constants); rows longer than ``chunk`` columns (0: never) one at a time in the order of :func:`gemv_groups` (the
    same chunks, so the same bits).

    The types of blocks of 32 take whole rows by pairs (:func:`pair_rows`), the blocks of the two interleaved, each
    row into its own lanes: one row's lanes take one fused add per block, whose latency (4 cycles) bounded the loop,
    and a pair runs two such chains side by side, its rows' operations (so their bits) unchanged; pairs were
    faster in cache and out of it.  The dense types and the K-quants take one row at a time: F16 reads at memory
    speed either way, and the K-quants' loops are bounded by their operations per block, so pairs gained nothing
    there (docs/performance.md)."""
    cols = x.shape[1]
    acc = stack_f32(PAIR_FLOATS)
    if chunk == 0 or cols <= chunk:
        for r in range(0, raw.shape[0], stored):
            group(1, stored, raw, r, x, 0, 0, cols, args, out, acc)
        return
    for t0 in range(0, raw.shape[0], TILE_ROWS):
        t1 = min(t0 + TILE_ROWS, raw.shape[0])
        for c0 in range(0, cols, chunk):
            tile_groups(1, group, raw, t0, t1, x, 0, c0, min(c0 + chunk, cols), args, out, acc, True)


@inline
def gemv_groups(group, raw, x, args, out, chunk):
    """``out[i, r] = x[i] @ W[r]`` for any number of rows: the rows in groups of GROUP_ROWS, then the rest in
    groups of 4, 2 and 1 (its binary digits), each by ``group(count, 1, raw, r, x, first row, c0, c1, args, out,
    acc)`` with a literal count (its own specialisation, accumulators in registers); a row's operations do not
    depend on its group (nor on whether it was multiplied alone or in a pair of stored rows).  Every count 1-7 as
    its own group ran 7 rows faster but made the first-ever compile of all kernels half as long again.

    The stored rows go by tiles of :data:`TILE_ROWS` and their columns by chunks of ``chunk`` (0: whole rows), each
    group over the tile's chunk, so that a group's activations stay in the L1 cache while the tile's rows (read
    from memory by the first group) come from L2 for the others.  With more than one chunk, each chunk asks for
    the same chunk of the next tile's rows (:func:`fetch_row`), so that the strided reads find their bytes in
    cache, which they do not without it."""
    n, cols = x.shape[0], x.shape[1]
    step = cols if chunk == 0 else chunk
    acc = stack_f32(GROUP_FLOATS)
    for t0 in range(0, raw.shape[0], TILE_ROWS):
        t1 = min(t0 + TILE_ROWS, raw.shape[0])
        for c0 in range(0, cols, step):
            c1 = min(c0 + step, cols)
            fetch = c1 - c0 < cols
            i0 = 0
            while n - i0 >= GROUP_ROWS:
                tile_groups(GROUP_ROWS, group, raw, t0, t1, x, i0, c0, c1, args, out, acc, fetch and i0 == 0)
                i0 += GROUP_ROWS
            if n - i0 >= 4:
                tile_groups(4, group, raw, t0, t1, x, i0, c0, c1, args, out, acc, fetch and i0 == 0)
                i0 += 4
            if n - i0 >= 2:
                tile_groups(2, group, raw, t0, t1, x, i0, c0, c1, args, out, acc, fetch and i0 == 0)
                i0 += 2
            if n - i0 >= 1:
                tile_groups(1, group, raw, t0, t1, x, i0, c0, c1, args, out, acc, fetch and i0 == 0)


# The loops of the types of blocks of 32 values with a float16 scale (Q8_0, the legacy types, IQ4): a block's
# geometry ``geo`` (bytes per block, first byte of its quants, bias subtracted from q, has a minimum) and two
# steps inlined into them, ``locate`` (a block's first byte, scale and minimum) and ``update`` (its products).
SUMS_GEMV = types.void(U8_2D, F32_2D_C, F32_2D_C, F32_1D, F32_2D)
TABLE_DECODE = types.void(U8_2D, F32_1D, F32_2D_C)


@inline
def f16_at(table, blocks, at):
    """The float16 field at byte ``at`` of a stored row, exactly as float32."""
    return table[np.int64(blocks[at]) | (np.int64(blocks[at + 1]) << 8)]


@inline
def block_at(table, blocks, b, geo):
    """(first byte, scale ``d``, minimum ``m`` or 0) of block ``b`` of a stored row; ``geo`` = (bytes per block,
    first byte of qs, bias, has a minimum)."""
    o = b * geo[0]
    return o, f16_at(table, blocks, o), f16_at(table, blocks, o + 2) if geo[3] else np.float32(0)


@inline
def block_step(update, locate, geo, rows, blocks, b, x, i0, sums, table, offset, k, acc, how):
    """Block ``b`` of a stored row times ``rows`` activation rows: the products into the lanes at ``acc``, the
    minimum's into ``offset[k + i]`` (``how``: its :func:`fetch_block`)."""
    o, d, m = locate(table, blocks, b, geo)
    fetch_block(prefetch, blocks, o, geo[0], how)
    if geo[3]:
        for i in range(rows):
            offset[k + i] += m * sums[i0 + i, b]
    update(blocks, o, geo, d, x, i0, b * LANES, rows, acc)


@inline
def group_loop(update, locate, geo, rows, stored, raw, r, x, i0, c0, c1, args, out, acc):
    """``out[i0 + i, r + s] (+)= x[i0 + i, c0:c1] @ W[r + s, c0:c1]`` (:func:`deposit`) for ``i < rows`` (a
    literal) and the ``s < stored`` rows of :func:`pair_rows`, of blocks of 32 values: ``locate`` gives a
    block's byte, scale and minimum, ``update`` adds its products to the group's lanes (held in registers); the
    types with a minimum add ``m * sum(x over the block)`` to one scalar per row (``args``: the block sums [N, nb]
    and the float16 table)."""
    sums, table = args
    offset = numba.carray(stack_f32(GROUP_ROWS), (GROUP_ROWS,))
    for i in range(rows * stored):
        offset[i] = 0
    zero_lanes(acc, rows * stored)
    first, second = pair_rows(raw, r, stored)
    for b in range(c0 // LANES, c1 // LANES):
        block_step(update, locate, geo, rows, first, b, x, i0, sums, table, offset, 0, acc, first_fetch(stored))
        if stored == 2:
            block_step(update, locate, geo, rows, second, b, x, i0, sums, table, offset, rows, lanes_at(acc, rows),
                       FETCH_PAIR)
    for s in range(stored):
        if stored_row(raw, r, s):
            for i in range(rows):
                total = lanes_sum(acc, s * rows + i)
                deposit(out, i0 + i, r + s, total + offset[s * rows + i] if geo[3] else total, c0)


# The C signature of a type's row product (``<type>_rows``), which the compiled decode step calls through its address
# (:mod:`qwen_runtime.models.step_jit`): ``(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out,
# out_stride)``, addresses and sizes as int64: ``out[i, r] = x[i] @ W[r]`` for the ``rows`` stored rows at ``raw``
# and the ``n`` (at most GEMV_ROWS) activation rows at ``x`` [n, cols]; ``sums`` [n, sums_cols] the activations' block
# sums the type takes (:meth:`JitKernel.sums_width`), ``table`` the float16 table, ``out`` rows ``out_stride`` floats
# apart.  One product function per type, each a thin call of the type's ``gemv1``/``gemv``.
ROW_PRODUCT = types.void(*([types.int64] * 11))
row_cfunc = declared_cfunc(ROW_PRODUCT)


def address_as(dtype: types.Type):  # -> an intrinsic
    """An intrinsic taking an int64 address to a pointer to ``dtype`` (for ``numba.carray``)."""
    pointer = types.CPointer(dtype)

    @intrinsic
    def at(typingctx, address):  # noqa: ARG001
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(pointer))

        return pointer(address), codegen

    return at


f32_at, u8_at, i64_at = (address_as(t) for t in (types.float32, types.uint8, types.int64))


@intrinsic
def call_product(typingctx, function, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out,
                 out_stride):  # noqa: ARG001
    """Call the :data:`ROW_PRODUCT` at address ``function`` (a type's ``<type>_rows``.address) with the other
    arguments, every one an int64."""
    operands = (raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)
    if not all(isinstance(a, types.Integer) for a in (function, *operands)):
        return None
    return types.void(function, *operands), call_at


def call_at(context, builder: ir.IRBuilder, signature, args: list):
    """The code of an intrinsic calling the C function at address ``args[0]`` with the other arguments, each taken
    to int64 (:func:`call_product`)."""
    i64 = ir.IntType(64)
    kind = ir.FunctionType(ir.VoidType(), [i64] * (len(args) - 1))
    target = builder.inttoptr(args[0], kind.as_pointer())
    builder.call(target, [context.cast(builder, a, t, types.int64)
                          for a, t in zip(args[1:], signature.args[1:], strict=True)])
    return context.get_dummy_value()


@inline
def product_arrays(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    """The arrays of a :data:`ROW_PRODUCT` call: stored rows uint8 [rows, row_bytes], activations [n, cols], sums
    [n, sums_cols], the float16 table and the output columns [n, rows] (rows ``out_stride`` apart)."""
    return (numba.carray(u8_at(raw), (rows, row_bytes)), numba.carray(f32_at(x), (n, cols)),
            numba.carray(f32_at(sums), (n, sums_cols)), numba.carray(f32_at(table), (F16_TABLE.size,)),
            numba.carray(f32_at(out), (n, out_stride))[:, :rows])


@inline
def sums_product(gemv1, gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride):
    """A :data:`ROW_PRODUCT` of a type whose kernels take ``(raw, x, sums, table, out)`` (raw as uint8)."""
    w, xs, s, t, o = product_arrays(raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride)
    if n == 1:
        gemv1(w, xs, s, t, o)
    else:
        gemv(w, xs, s, t, o)


@inline
def table_product(gemv1, gemv, raw, rows, row_bytes, x, n, cols, sums, sums_cols, table, out, out_stride, dtype):
    """A :data:`ROW_PRODUCT` of a type whose kernels take ``(raw, x, table, out)``, raw viewed as ``dtype``."""
    w, xs, _, t, o = product_arrays(raw, rows, row_bytes, x, n, cols, sums, 0, table, out, out_stride)
    if n == 1:
        gemv1(w.view(dtype), xs, t, o)
    else:
        gemv(w.view(dtype), xs, t, o)


@compiled(types.void(F32_2D_C, types.int64, F32_2D_C), contract=False, shared=True)
def block_sums(x, width, out):
    """``out[i, j] = Σ x[i, j*width : (j+1)*width]``, the activations' block sums of the types with minimums, in
    numpy's pairwise order (eight running sums of every eighth value, then ``((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))``):
    :meth:`JitKernel.activations` and the compiled decode step both take them from here.  # [N, n] -> [N, n/width]"""
    s = np.empty(8, np.float32)
    for i in range(x.shape[0]):
        for j in range(out.shape[1]):
            base = j * width
            for k in range(8):
                s[k] = x[i, base + k]
            for k in range(8, width, 8):
                for m in range(8):
                    s[m] += x[i, base + k + m]
            out[i, j] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


def sums_of(x: np.ndarray, width: int) -> np.ndarray:
    """:func:`block_sums` of ``x`` (C-contiguous float32) in blocks of ``width``.  # [N, n] -> [N, n/width]"""
    out = np.empty((len(x), x.shape[1] // width), np.float32)
    block_sums(x, width, out)
    return out


def aligned(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, C-contiguous) itself when it starts on an :data:`ALIGN`-byte boundary, else a copy that
    does."""
    if x.ctypes.data % ALIGN == 0:
        return x
    buffer = np.empty(x.size + ALIGN // 4, np.float32)
    skip = (-buffer.ctypes.data % ALIGN) // 4
    copy = buffer[skip:skip + x.size].reshape(x.shape)
    copy[...] = x
    return copy


@functools.cache
def _class_functions(cls: type) -> list[Declared | DeclaredCFunc]:
    """The :class:`Declared` and :class:`DeclaredCFunc` attributes of ``cls`` and its bases (static methods
    unwrapped)."""
    found = {}
    for klass in cls.__mro__:
        for value in vars(klass).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, (Declared, DeclaredCFunc)):
                found.setdefault(id(value), value)
    return list(found.values())


class JitKernel:
    """A stored matrix multiplied by compiled kernels (the :class:`~qwen_runtime.quants.TileKernel` interface).

    Subclasses set ``block`` and ``type_size`` and the compiled functions ``gemv`` (any 1..GEMV_ROWS rows),
    ``gemv1`` (one row, optional: the same operations, faster) and ``decode`` (or override :meth:`tile`, as F32
    does), called as ``gemv(raw, x, *activations, *constants, out)`` and ``decode(raw, *constants, tile)``; they
    may override :meth:`activations` for per-row quantities of ``x`` shared by every weight (per-block sums) and
    set ``constants`` (tables).
    Compiled code runs without bounds checks: every shape it sees is checked here first.
    """

    qtype: QType  # the stored type (its key in :func:`..kernel_table`)
    block: int
    type_size: int
    constants: tuple = ()
    # The type's ROW_PRODUCT (a compiled C function, called by address from the compiled decode step; None: the
    # step is not offered) and the width of the activation block sums it takes (0: none; :func:`block_sums`).
    row_product: object = None
    sums_width = 0
    # Products of up to this many rows read the blocks directly, more decode a tile for BLAS: the row kernels win up
    # to 32 rows, and BLAS wins at 64 for the K-quants (docs/performance.md).
    direct_rows = 32

    def __init__(self, raw: np.ndarray) -> None:
        raw = np.asarray(raw)
        if raw.ndim != 2 or raw.shape[1] % self.stored_unit():
            raise FormatError(f"{type(self).__name__}: stored rows of shape {raw.shape} do not hold whole blocks")
        if not raw.flags.c_contiguous:
            raise FormatError(f"{type(self).__name__}: stored rows must be contiguous")
        self.raw = self.stored(raw)
        self.in_features = raw.shape[1] // self.stored_unit() * self.block
        for function in self.compiled_functions():
            function.ready()

    def compiled_functions(self) -> list[Declared | DeclaredCFunc]:
        """The compiled functions this kernel calls, readied when it is built (while the model loads, so that a
        generation compiles nothing): every one its class names (``gemv``, ``decode``, the row products...)."""
        return _class_functions(type(self))

    def stored_unit(self) -> int:
        """Elements of the stored row array per block (bytes for quantized types, 1 for dense ones)."""
        return self.type_size

    def stored(self, raw: np.ndarray) -> np.ndarray:
        """The stored rows in the dtype the compiled functions take (a view)."""
        return raw.view(np.uint8)

    def activations(self, x: np.ndarray) -> tuple:
        """The extra arguments the compiled functions take after ``x`` (activation-only quantities)."""
        return ()

    def prepare(self, x: np.ndarray, rowwise: bool = False) -> tuple:
        """``x`` [N, in] and its :meth:`activations`, for :meth:`product` (``rowwise``: for :meth:`product_rows`;
        the same here, not for every subclass)."""
        x = self.checked(x)
        if len(x) <= self.direct_rows:  # the row kernels' loads (BLAS takes the tile path's rows as they are)
            x = aligned(x)
        return (x, *self.activations(x))

    def checked(self, x: np.ndarray) -> np.ndarray:
        """``x`` [N, in] as C-contiguous float32, after checking its width."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"activations of shape {x.shape} for a matrix of {self.in_features} columns")
        return np.ascontiguousarray(x, dtype=np.float32)

    def product(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T``: up to :attr:`direct_rows` rows straight from the blocks, more rows through a
        decoded float32 tile and BLAS."""
        x, *extra = xk
        if out.shape != (len(x), r1 - r0) or out.dtype != np.float32:
            raise ValueError(f"output of shape {out.shape} for {len(x)} rows and {r1 - r0} columns")
        if len(x) <= self.direct_rows:
            self._rows(self.raw[r0:r1], x, extra, out)
            return
        np.matmul(x, self.tile(r0, r1, scratch).T, out=out)

    @property
    def segments_exact(self) -> bool:
        """Whether :meth:`product_segments` gives each segment of more than :attr:`direct_rows` rows the numbers of
        :meth:`product` of that segment alone (the float kernels: both decode the tile and call BLAS)."""
        return True

    def product_segments(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch,
                         lengths: tuple[int, ...]) -> None:
        """:meth:`product` of consecutive segments of ``lengths`` rows, each longer than :attr:`direct_rows`: the tile
        is decoded once, and each segment is its own BLAS call, so its numbers are those of :meth:`product` of the
        segment alone (BLAS may sum a row in another order in a product of more rows)."""
        x = xk[0]
        if out.shape != (len(x), r1 - r0) or sum(lengths) != len(x) or min(lengths) <= self.direct_rows:
            raise ValueError(f"segments {lengths} of more than {self.direct_rows} rows for {len(x)} rows")
        tile = self.tile(r0, r1, scratch)
        start = 0
        for n in lengths:
            np.matmul(x[start:start + n], tile.T, out=out[start:start + n])
            start += n

    def tile(self, r0: int, r1: int, scratch: Scratch) -> np.ndarray:
        """Stored rows ``r0:r1`` as float32 [r1 - r0, in] for BLAS: decoded into the thread's scratch tile."""
        tile = scratch.array("tile", (r1 - r0, self.in_features))
        self.decode(self.raw[r0:r1], *self.constants, tile)
        return tile

    def product_rows(self, r0: int, r1: int, xk: object, out: np.ndarray, scratch: Scratch) -> None:
        """``out = x @ W[r0:r1].T`` with every row by the row kernel, whatever the number of rows (groups of
        GEMV_ROWS): for ``Workspace.rowwise``, ``xk`` from :meth:`prepare` with ``rowwise=True``."""
        x, *extra = xk
        if out.shape != (len(x), r1 - r0) or out.dtype != np.float32:
            raise ValueError(f"output of shape {out.shape} for {len(x)} rows and {r1 - r0} columns")
        for i in range(0, len(x), GEMV_ROWS):
            self._rows(self.raw[r0:r1], x[i:i + GEMV_ROWS], [e[i:i + GEMV_ROWS] for e in extra],
                       out[i:i + GEMV_ROWS])

    def _rows(self, raw: np.ndarray, x: np.ndarray, extra: list, out: np.ndarray) -> None:
        gemv = self.gemv1 if len(x) == 1 and hasattr(self, "gemv1") else self.gemv
        gemv(raw, x, *extra, *self.constants, out)


class BlockSumsKernel(JitKernel):
    """A type of blocks of 32 values with float16 scales (:func:`group_loop`): ``gemv(raw, x, sums, table, out)``,
    ``decode(raw, table, tile)``; ``sums`` [N, nb] the activations' block sums of the types with a minimum, [N, 0]
    for the others."""

    block = LANES
    constants = (F16_TABLE,)

    def activations(self, x: np.ndarray) -> tuple:
        """Each block's sum of ``x`` [N, nb] for the types with a minimum (``sums_width``; [N, 0] otherwise): one
        float32 sum per row and block, whatever the other rows."""
        if not self.sums_width:
            return (np.empty((len(x), 0), np.float32),)
        return (sums_of(x, self.sums_width),)
