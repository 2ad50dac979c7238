"""This machine's int8 multiply-add peak and the integer prefill kernels' rate against the float path (issue #46).

    python scripts/int8_peak.py [--repeat 3] [--rows 512]

1. Peak, one thread: AMX ``tdpbssd`` (16 x 64 by 64 x 16 int8 tiles, four independent accumulators) and AVX-512
   VNNI ``vpdpbusd`` (eight independent zmm accumulators), operands in registers, where the CPU has them; with
   AVX2, ``pmaddubsw`` + ``pmaddwd`` + ``paddd`` on 32 int8 values in the lanes GEMM's inner-loop shape (4
   activation vectors and 2 weight vectors and their scales loaded per step from an L1-resident window, 8
   independent accumulators), and float32 FMA (8 independent ymm accumulators), the float path's ceiling.
2. ``x @ W.T`` for Q8_0, Q4_K and Q6_K weights (``--types``) of the Qwen2.5-0.5B MLP shape (4864 x 896) and
   the Qwen2.5-3B one (11008 x 2048), for the K-quants their down projections (896 x 4864, 2048 x 11008),
   ``--rows`` activation rows: the integer kernels (AMX: :mod:`qwen_runtime.backend.kernels.amx`, q8_0
   activations, and :mod:`qwen_runtime.backend.kernels.amx_k`, q8_K; else AVX2's lanes,
   :mod:`qwen_runtime.backend.kernels.lanes`, the same activations; quantized once, timed with the quantization) against
   the float prefill path for the same product (each tile of about 2^20 weights decoded to float32 by the
   compiled decoder, then SGEMM), on one thread and on two (columns split in two halves; the float path's tiles
   shared by two threads, BLAS on one thread each).  Paired: integer and float timed in turn.

Prints T int8 multiply-adds per second (for the float path: T float multiply-adds), the fraction of the measured
int8 peak on the threads used, and the integer / float ratio; the fastest of ``--repeat`` runs.  For stable
numbers run it alone; ``--peak-only`` prints the peaks and one JSON line (what ``scripts/bench.py`` reads).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numba
import numpy as np
import threadpoolctl
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from qwen_runtime.backend.kernels import amx as jit_amx
from qwen_runtime.backend.kernels import amx_k as jit_amx_k
from qwen_runtime.backend.kernels import lanes
from qwen_runtime.backend.kernels.amx import dpbssd, ldtilecfg, tileload, tilerelease, tilestore, tilezero
from qwen_runtime.backend.kernels.base import FEATURES
from qwen_runtime.backend.kernels.kquants import Q4_KJitKernel, Q6_KJitKernel
from qwen_runtime.backend.kernels.lanes import I64, V8_F32, V8_I32, V16_I16, V32_I8
from qwen_runtime.backend.kernels.q8_0 import Q8_0JitKernel
from qwen_runtime.quants.scratch import Scratch

SHAPES = {"Qwen2.5-0.5B MLP 4864 x 896": (4864, 896), "Qwen2.5-3B MLP 11008 x 2048": (11008, 2048)}
# K-quant rows are whole super-blocks of 256: 896 is not, so their shapes are the MLPs' down projections.
K_SHAPES = {"Qwen2.5-0.5B down 896 x 4864": (896, 4864), "Qwen2.5-3B down 2048 x 11008": (2048, 11008)}
V16_I32 = ir.VectorType(ir.IntType(32), 16)
VNNI_ACCUMULATORS = 8
AVX2_X, AVX2_W = lanes.ROWS, lanes.GROUPS  # activation and weight vectors per step of the AVX2 peak: the lanes' tile
WINDOW = 2048  # bytes each stream of the AVX2 peak cycles through (L1-resident)


@numba.njit(nogil=True)
def amx_spin(cfg, a, b, c, n):
    """``4 n`` tdpbssd of 16 x 64 by 64 x 16 int8 tiles already loaded, into four accumulators."""
    ldtilecfg(cfg.ctypes.data)
    tilezero(4)
    tilezero(5)
    tilezero(6)
    tilezero(7)
    tileload(0, a.ctypes.data, 64)
    tileload(2, b.ctypes.data, 64)
    for _ in range(n):
        dpbssd(4, 0, 2)
        dpbssd(5, 0, 2)
        dpbssd(6, 0, 2)
        dpbssd(7, 0, 2)
    tilestore(4, c.ctypes.data, 64)
    tilerelease()


def amx_peak_config() -> np.ndarray:
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:48].view(np.uint16)[:8] = 64
    cfg[48:56] = 16
    return cfg


@intrinsic
def vnni_rounds(typingctx, acc, a, b, rounds):  # noqa: ARG001
    """``rounds`` (a literal) times eight independent ``vpdpbusd`` zmm on the accumulators at ``acc`` (int32
    [8 * 16]), operands ``a`` and ``b`` (int32 [16] each), loaded once and stored back once."""
    if not isinstance(rounds, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        def pointer(i, at):
            data = context.make_array(signature.args[i])(context, builder, args[i]).data
            return builder.bitcast(builder.gep(data, [ir.Constant(ir.IntType(64), at)]), V16_I32.as_pointer())

        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16_I32, [V16_I32] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        x, y = builder.load(pointer(1, 0), align=4), builder.load(pointer(2, 0), align=4)
        accs = [builder.load(pointer(0, 16 * k), align=4) for k in range(VNNI_ACCUMULATORS)]
        for _ in range(signature.args[3].literal_value):
            accs = [builder.call(fn, [v, x, y]) for v in accs]
        for k, v in enumerate(accs):
            builder.store(v, pointer(0, 16 * k), align=4)
        return context.get_dummy_value()

    return types.void(acc, a, b, rounds), codegen


@numba.njit(nogil=True)
def vnni_spin(acc, a, b, n):
    for _ in range(n):
        vnni_rounds(acc, a, b, 64)


def _counted_loop(builder: ir.IRBuilder, n: ir.Value, accumulators: list[ir.Constant], body: Callable) -> list:
    """A loop of ``n`` steps carrying ``accumulators`` (phis); ``body(i, values)`` returns the next values.  The
    accumulators' last values are returned."""
    entry = builder.block
    loop, after = builder.append_basic_block("loop"), builder.append_basic_block("after")
    builder.branch(loop)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    i.add_incoming(I64(0), entry)
    phis = []
    for start in accumulators:
        phi = builder.phi(start.type)
        phi.add_incoming(start, entry)
        phis.append(phi)
    values = body(i, phis)
    for phi, value in zip(phis, values, strict=True):
        phi.add_incoming(value, loop)
    following = builder.add(i, I64(1))
    i.add_incoming(following, loop)
    builder.cbranch(builder.icmp_signed("<", following, n), loop, after)
    builder.position_at_end(after)
    return values


def _store_sum(context, builder: ir.IRBuilder, out_type: types.Array, out: ir.Value, values: list,
               add: Callable) -> None:
    """The sum of the loop's last ``values`` stored to the array ``out`` (so nothing is optimised away)."""
    total = values[0]
    for v in values[1:]:
        total = add(total, v)
    target = context.make_array(out_type)(context, builder, out).data
    builder.store(total, builder.bitcast(target, total.type.as_pointer()), align=4)


@intrinsic
def avx2_spin(typingctx, n, window, out):  # noqa: ARG001
    """``n`` steps of the lanes GEMM's inner loop: per step 2 weight vectors and their scales and 4 activation
    vectors loaded from ``window`` (int8, 8 streams of :data:`WINDOW` bytes), 8 ``pmaddubsw`` + ``pmaddwd`` into 8
    independent int32 accumulators (their sum stored to ``out``, int32 [8], so nothing is optimised away)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        module = builder.module
        maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(V16_I16, [V32_I8] * 2),
                                                 "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8_I32, [V16_I16] * 2),
                                                "llvm.x86.avx2.pmadd.wd")

        def step(i, accs):
            at = builder.mul(builder.and_(i, I64(WINDOW // 32 - 1)), I64(32))

            def load(stream, vector):
                pointer = builder.gep(data, [builder.add(at, I64(stream * WINDOW))])
                return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=1)

            w = [load(c, V32_I8) for c in range(AVX2_W)]
            scales = [load(AVX2_W + c, V16_I16) for c in range(AVX2_W)]
            out = []
            for r in range(AVX2_X):
                x = load(2 * AVX2_W + r, V32_I8)
                for c in range(AVX2_W):
                    pairs = builder.call(maddubs, [w[c], x])
                    out.append(builder.add(accs[r * AVX2_W + c], builder.call(maddwd, [pairs, scales[c]])))
            return out

        zero = ir.Constant(V8_I32, [0] * 8)
        values = _counted_loop(builder, args[0], [zero] * (AVX2_X * AVX2_W), step)
        _store_sum(context, builder, signature.args[2], args[2], values, builder.add)
        return context.get_dummy_value()

    return types.void(n, window, out), codegen


@intrinsic
def fma_spin(typingctx, n, seed, out):  # noqa: ARG001
    """``n`` steps of 8 independent float32 ``fma`` chains on ymm registers (their sum stored to ``out``)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8_F32, [V8_F32] * 3), "llvm.fma.v8f32")
        a, b = (builder.load(builder.bitcast(builder.gep(data, [I64(8 * k)]), V8_F32.as_pointer()), align=4)
                for k in range(2))
        values = _counted_loop(builder, args[0], [ir.Constant(V8_F32, [float(k)] * 8) for k in range(8)],
                               lambda i, accs: [builder.call(fma, [a, b, v]) for v in accs])
        _store_sum(context, builder, signature.args[2], args[2], values, builder.fadd)
        return context.get_dummy_value()

    return types.void(n, seed, out), codegen


@numba.njit(nogil=True)
def avx2_peak_run(n, window, out):
    avx2_spin(n, window, out)


@numba.njit(nogil=True)
def fma_peak_run(n, seed, out):
    fma_spin(n, seed, out)


def best(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def paired(repeat: int, a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float]:
    """The fastest of ``repeat`` runs of ``a`` and of ``b``, timed in turn (a loaded machine slows both alike)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for run, into in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            run()
            into.append(time.perf_counter() - t0)
    return min(times[0]), min(times[1])


def q8_0_rows(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    nb = cols // 32
    blocks = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
    scales = rng.uniform(2e-4, 2e-3, (rows, nb)).astype(np.float16)
    blocks[:, :, :2] = scales[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * 34)


def k_rows(size: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K (``size`` 144) or Q6_K (210) rows with float16 d (and dmin) of about 1e-3."""
    nb = cols // 256
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    scales = rng.uniform(2e-4, 2e-3, (rows, nb, 2)).astype(np.float16).view(np.uint8).reshape(rows, nb, 4)
    if size == 144:
        blocks[:, :, 0:4] = scales
    else:
        blocks[:, :, 208:210] = scales[:, :, 0:2]
    return blocks.reshape(rows, nb * size)


TYPES = {"q8_0": (q8_0_rows, Q8_0JitKernel), "q4_k": (partial(k_rows, 144), Q4_KJitKernel),
         "q6_k": (partial(k_rows, 210), Q6_KJitKernel)}


def int8_product(kind: str, raw: np.ndarray, x: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None,
                 amx: bool) -> None:
    """Quantize once, then the AMX kernel (``amx``) or AVX2's lanes on one thread or on two column halves
    (multiples of 32 rows)."""
    if kind == "q8_0" and amx:
        q, d = jit_amx.quantized_padded(x)

        def run(part: tuple[int, int]) -> None:
            jit_amx.q8_0_amx_product(raw[part[0]:part[1]], q, d, out[:, part[0]:part[1]])
    elif kind == "q8_0":
        q, d = jit_amx.quantized_padded(x)
        prepared = lanes.q8_0_lane_activations(q, d, len(x), x.shape[1])

        def run(part: tuple[int, int]) -> None:
            lanes.q8_0_lanes_product(raw[part[0]:part[1]], prepared, out[:, part[0]:part[1]])
    elif amx:
        xk = jit_amx_k.q8_k_padded(x)

        def run(part: tuple[int, int]) -> None:
            jit_amx_k.kquant_amx_product(raw[part[0]:part[1]], xk, out[:, part[0]:part[1]])
    else:
        per, dtype = lanes.LANE_SUMS[raw.shape[1] // (x.shape[1] // lanes.QK_K)]
        q, d, sums = jit_amx_k.q8_k_padded(x, per)
        prepared = lanes.lane_activations(q, d, sums.astype(dtype), len(x))

        def run(part: tuple[int, int]) -> None:
            lanes.kquant_lanes_product(raw[part[0]:part[1]], prepared, out[:, part[0]:part[1]])
    if pool is None:
        run((0, len(raw)))
        return
    half = -(-len(raw) // 64) * 32
    list(pool.map(run, [(0, half), (half, len(raw))]))


def float_product(kernel: Q8_0JitKernel | Q4_KJitKernel | Q6_KJitKernel, x: np.ndarray, out: np.ndarray,
                  pool: ThreadPoolExecutor | None, scratches: list[Scratch]) -> None:
    """Today's prefill path: tiles of about 2^20 weights decoded to float32, each multiplied by SGEMM."""
    rows = len(kernel.raw)
    step = max(1, (1 << 20) // kernel.in_features)
    xk = kernel.prepare(x)
    tiles = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
    if pool is None:
        for r0, r1 in tiles:
            kernel.product(r0, r1, xk, out[:, r0:r1], scratches[0])
        return
    halves = [tiles[: len(tiles) // 2], tiles[len(tiles) // 2:]]

    def run(i: int) -> None:
        for r0, r1 in halves[i]:
            kernel.product(r0, r1, xk, out[:, r0:r1], scratches[i])

    list(pool.map(run, range(2)))


def peaks(repeat: int, rng: np.random.Generator) -> dict[str, float | str]:
    """This machine's one-thread peaks, printed as measured: T int8 multiply-adds/s of its widest integer form
    (``int8_form``: AMX, else AVX-512 VNNI, else the AVX2 lanes' inner loop) and T float multiply-adds/s of float32
    FMA on ymm registers."""
    found: dict[str, float | str] = {}
    if jit_amx.amx_available():
        cfg, c = amx_peak_config(), np.zeros((16, 16), np.int32)
        a, b = (rng.integers(-128, 128, (16, 64), dtype=np.int8) for _ in range(2))
        amx_spin(cfg, a, b, c, 10)
        n = 500_000
        found["int8"] = 4 * n * 16 * 16 * 64 / best(repeat, lambda: amx_spin(cfg, a, b, c, n)) / 1e12
        found["int8_form"] = "amx"
        print(f"AMX tdpbssd, tiles in registers, one thread: {found['int8']:.2f} T int8 multiply-adds/s")
    else:
        print("AMX: not available here (CPU, compiler target or kernel permission)")
    if "avx512vnni" in FEATURES:
        acc = np.zeros(16 * VNNI_ACCUMULATORS, np.int32)
        a, b = (rng.integers(0, 1 << 30, 16).astype(np.int32) for _ in range(2))
        vnni_spin(acc, a, b, 10)
        n = 20_000
        rate = n * 64 * VNNI_ACCUMULATORS * 64 / best(repeat, lambda: vnni_spin(acc, a, b, n)) / 1e12
        print(f"AVX-512 VNNI vpdpbusd, registers, one thread: {rate:.2f} T int8 multiply-adds/s")
        found.setdefault("int8_form", "vnni")
        found.setdefault("int8", rate)
    if "avx2" in FEATURES and "fma" in FEATURES:
        window = rng.integers(0, 64, (2 * AVX2_W + AVX2_X) * WINDOW).astype(np.int8)
        seed, out8, outf = rng.random(16).astype(np.float32), np.zeros(8, np.int32), np.zeros(8, np.float32)
        avx2_peak_run(10, window, out8)
        fma_peak_run(10, seed, outf)
        n = 10_000_000
        rate = n * AVX2_X * AVX2_W * 32 / best(repeat, lambda: avx2_peak_run(n, window, out8)) / 1e12
        found["float"] = n * 8 * 8 / best(repeat, lambda: fma_peak_run(n, seed, outf)) / 1e12
        print(f"AVX2 pmaddubsw + pmaddwd, the lanes GEMM's inner loop from L1, one thread: {rate:.3f} T int8 "
              f"multiply-adds/s")
        print(f"float32 FMA, 8 ymm chains, one thread: {found['float']:.3f} T float multiply-adds/s")
        if "int8" not in found:
            found["int8"], found["int8_form"] = rate, "avx2"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=512, help="activation rows (prompt tokens)")
    parser.add_argument("--types", default="q8_0,q4_k,q6_k", help="weight types, comma-separated")
    parser.add_argument("--peak-only", action="store_true",
                        help="only the peaks, then one JSON line (what scripts/bench.py reads)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    threadpoolctl.threadpool_limits(1)  # BLAS on the calling thread: the runtime's pool threads each run it so
    found = peaks(args.repeat, rng)
    if args.peak_only:
        print(json.dumps(found))
        return
    amx, peak = found.get("int8_form") == "amx", found.get("int8", float("nan"))
    if not (amx or lanes.takes(lanes.Q4_K_BYTES)):
        return
    kinds = args.types.split(",")
    print(f"\nweights x {args.rows} activation rows (8-bit activations on {'AMX' if amx else 'AVX2 lanes'}; float: "
          "decoded tiles + SGEMM)")
    print(f"{'type':5} {'shape':30} {'threads':>7} {'int8 ms':>8} {'T MAC/s':>8} {'of peak':>8} {'float ms':>9}"
          f" {'T MAC/s':>8} {'int8/float':>10}")
    scratches = [Scratch(), Scratch()]
    with ThreadPoolExecutor(2) as two:
        for kind in kinds:
            make, float_kernel = TYPES[kind]
            for name, (rows, cols) in (SHAPES if kind == "q8_0" else K_SHAPES).items():
                raw = make(rows, cols, rng)
                x = rng.normal(0, 1, (args.rows, cols)).astype(np.float32)
                out = np.empty((args.rows, rows), np.float32)
                kernel = float_kernel(raw)
                int8_product(kind, raw[:64], x, out[:, :64], None, amx)
                float_product(float_kernel(raw[:64]), x, out[:, :64], None, scratches)
                macs = args.rows * rows * cols
                for pool in (None, two):
                    t_int8, t_float = paired(args.repeat, partial(int8_product, kind, raw, x, out, pool, amx),
                                             partial(float_product, kernel, x, out, pool, scratches))
                    threads = 1 if pool is None else 2
                    print(f"{kind:5} {name:30} {threads:>7} {t_int8 * 1e3:8.1f} {macs / t_int8 / 1e12:8.3f} "
                          f"{macs / t_int8 / 1e12 / peak / threads:8.1%} {t_float * 1e3:9.1f} "
                          f"{macs / t_float / 1e12:8.3f} {t_float / t_int8:10.2f}")


if __name__ == "__main__":
    main()
