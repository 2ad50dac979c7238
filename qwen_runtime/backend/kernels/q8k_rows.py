"""Q4_K and Q6_K rows against q8_K activations in AVX2's integer lanes (numba): the decode step's products and
every product of up to ``direct_rows`` activation rows on CPUs without AVX-512 VNNI.

Why a form of its own.  The 8-bit kernels of :mod:`.int8_k` quantize the activations per 32 values, so each
32-value sub-block ends in a conversion to float and a fused add with its own scale product: on AVX2 that float
work per 32 values cost as much as the integer products, and the 3B-shaped Q4_K_M file decoded well below the
memory's rate.  Here the activations are quantized per super-block of 256 (llama.cpp's q8_K,
``quants.q8k_act.quantize_q8_k``), a super-block's sub-block scales are small integers, and so a whole
super-block sums in int32 (``pmaddubsw`` of the unsigned weights and the signed activations, then ``pmaddwd`` by the
sub-block scales, which also adds the pairs), with one float step per super-block and activation row.

The numbers are ``quants.q8k_act.product``'s bit for bit, as are the prompts' (:mod:`.lanes`, :mod:`.amx_k`):
per super-block ``acc = acc + f32(sumi) * (d_w * d_x)`` and for Q4_K ``acc = acc - f32(summ) * (dmin_w * d_x)``,
each operation rounded (the IR carries no fast-math flags, so nothing is fused), the super-blocks in order.  So a
row's result depends neither on the other activation rows nor on how many rows the product has.  The rows go
whole, however long (:func:`.int8_k.q8k_whole_rows`).

* Q4_K: ``sumi = sum_j sc_j (q_j . x_j)`` over its 8 sub-blocks of 32 (``q`` 0..15; pair sums at most
  ``2 * 15 * 127``), ``summ = sum_j m_j (bsum_2j + bsum_2j+1)`` from the activations' sums per 16 (one
  ``pmaddwd`` of the 16 sums by the minimums, each twice).
* Q6_K: ``q`` 0..63 unsigned into ``pmaddubsw`` (pairs at most ``2 * 63 * 127``), the 16 int8 scales per 16 values
  in ``pmaddwd``, and the ``- 32`` as ``32 sum_j sc_j bsum_j`` off the int32 sum.

Activations per row: ``q`` int8 [cols], ``d`` float32 [cols / 256], ``bsums`` int16 [cols / 16]
(:func:`.q8_act.quantize_k_rows`, the forms slots :data:`.q8_act.KQ`, :data:`.q8_act.KD`, :data:`.q8_act.KB`).
"""

from __future__ import annotations

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...quants.kquants import Q4_K, Q6_K
from ...quants.q8k_act import BSUM, QK_K
from .base import F32, FEATURES, I8, I16, I32, I64, V4_I32, V8_I32, V16_I8, V16_I16, V32_I8
from .int8 import _literal

AVAILABLE = "avx2" in FEATURES
binding.initialize_native_asmparser()  # numba does not, and LLVM needs it to emit inline assembly
Q4_K_BYTES, Q6_K_BYTES = Q4_K().type_size, Q6_K().type_size
SUMS = QK_K // BSUM  # activation sums per super-block


def _x86(builder: ir.IRBuilder, name: str, result: ir.Type, argument: ir.Type) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, [argument] * 2), name)


def _at(context, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value, at: ir.Value,
        element: ir.Type) -> ir.Value:
    """``&array[at]`` (flat element index) as a pointer to ``element``."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [at]), element.as_pointer())


def _pick(builder: ir.IRBuilder, v: ir.Value, lanes: list[int], other: ir.Value | None = None) -> ir.Value:
    """The elements ``lanes`` of ``v`` (and of ``other`` after them)."""
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined) if other is None else other,
                                  ir.Constant(ir.VectorType(I32, len(lanes)), lanes))


def _totals(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The sums of the 8 int32 lanes of ``a`` and of ``b``, reduced side by side (exact in any order)."""
    a4 = builder.add(_pick(builder, a, [0, 1, 2, 3]), _pick(builder, a, [4, 5, 6, 7]))
    b4 = builder.add(_pick(builder, b, [0, 1, 2, 3]), _pick(builder, b, [4, 5, 6, 7]))
    both = builder.add(_pick(builder, a4, [0, 2, 4, 6], b4), _pick(builder, a4, [1, 3, 5, 7], b4))
    both = builder.add(_pick(builder, both, [0, 2]), _pick(builder, both, [1, 3]))
    return builder.extract_element(both, I32(0)), builder.extract_element(both, I32(1))


class _Block:
    """A stored super-block (intrinsic arguments ``raw, at``: the stored rows and the flat index of its first
    byte) and the operands of activation row ``g`` of a group (``x, x_at, x_stride, xd, d_at, d_stride, bs, bs_at,
    bs_stride``: its values, scale and sums per 16 at flat indices ``*_at + g * *_stride``)."""

    def __init__(self, context, builder: ir.IRBuilder, ty: tuple, args: list) -> None:
        self.context, self.builder, self.ty, self.args = context, builder, ty, args
        self.base = _at(context, builder, ty[0], args[0], args[1], I8)
        self.pmaddubsw = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", V16_I16, V32_I8)
        self.pmaddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", V8_I32, V16_I16)

    def load(self, offset: int, element: ir.Type) -> ir.Value:
        """``element`` at byte ``offset`` of the block (unaligned)."""
        b = self.builder
        return b.load(b.bitcast(b.gep(self.base, [I64(offset)]), element.as_pointer()), align=1)

    def half(self, offset: int) -> ir.Value:
        """The float16 at byte ``offset`` as float32 (exact; ``vcvtph2ps`` with F16C)."""
        return self.builder.fpext(self.builder.bitcast(self.load(offset, I16), ir.HalfType()), F32)

    def _row(self, k: int, g: int, offset: int, element: ir.Type, align: int) -> ir.Value:
        b, at = self.builder, self.args[k + 1]
        at = b.add(b.add(at, b.mul(self.args[k + 2], I64(g))), I64(offset))
        return b.load(_at(self.context, b, self.ty[k], self.args[k], at, element), align=align)

    def values(self, g: int, offset: int) -> ir.Value:
        """32 int8 activations of row ``g`` from value ``offset`` of the super-block."""
        return self._row(2, g, offset, V32_I8, 1)

    def scale(self, g: int) -> ir.Value:
        return self._row(5, g, 0, F32, 4)

    def sums(self, g: int) -> ir.Value:
        """The super-block's 16 activation sums per 16 values (int16) of row ``g``."""
        return self._row(8, g, 0, V16_I16, 2)

    def products(self, sumi: list, w: ir.Value, offset: int, scale: ir.Value) -> None:
        """``sumi[g] += pmaddwd(pmaddubsw(w, row g's 32 values from ``offset``), scale)`` for every row ``g``:
        32 unsigned weights ``w`` against the activations, the pairs times their sub-block's ``<16 x i16>``
        scales."""
        b = self.builder
        for g, total in enumerate(sumi):
            pairs = b.call(self.pmaddubsw, [w, self.values(g, offset)])
            sumi[g] = b.add(total, b.call(self.pmaddwd, [pairs, scale]))


def _step(builder: ir.IRBuilder, acc: ir.Value, g: int, terms: list) -> None:
    """``acc[g]`` through the reference's float step: for each ``(sign, integer, scale_w, scale_x)`` of ``terms``,
    ``acc = acc +/- f32(integer) * (scale_w * scale_x)``, each operation rounded (no fast-math flags here, and the
    kernels that inline this are compiled without contraction)."""
    at = builder.gep(acc, [I64(g)])
    value = builder.load(at)
    for sign, integer, scale_w, scale_x in terms:
        term = builder.fmul(builder.sitofp(integer, F32), builder.fmul(scale_w, scale_x))
        value = builder.fadd(value, term) if sign > 0 else builder.fsub(value, term)
    builder.store(value, at)


def _super_block(body: callable):  # -> an intrinsic
    """The intrinsic ``(raw, at, x, x_at, x_stride, xd, d_at, d_stride, bs, bs_at, bs_stride, acc, group)`` of a
    stored super-block times ``group`` (a literal) activation rows whose code ``body(builder, block, count, acc)``
    emits (``block`` a :class:`_Block`); its docstring is the body's."""

    @intrinsic
    def kernel(typingctx, raw, at, x, x_at, x_stride, xd, d_at, d_stride, bs, bs_at, bs_stride, acc,
               group):  # noqa: ARG001
        if not _literal(group):
            return None

        def codegen(context, builder, signature, args):
            body(builder, _Block(context, builder, signature.args, args), group.literal_value, args[11])
            return context.get_dummy_value()

        return types.void(raw, at, x, x_at, x_stride, xd, d_at, d_stride, bs, bs_at, bs_stride, acc, group), codegen

    kernel.__doc__ = body.__doc__
    return kernel


def _splats(builder: ir.IRBuilder, scales: ir.Value) -> callable:
    """For ``<8 x i16>`` scales: a function of a list of 16 indices giving the ``<16 x i16>`` of those scales,
    each one ``vpshufb`` of the scales in both 128-bit halves.  The ``vpshufb`` is inline assembly because LLVM
    rewrites a constant byte shuffle into a shift and a broadcast, two instructions where one does."""
    both = builder.bitcast(_pick(builder, scales, list(range(8)) * 2), V32_I8)
    vpshufb = ir.InlineAsm(ir.FunctionType(V32_I8, [V32_I8, V32_I8]), "vpshufb $2, $1, $0", "=x,x,x")

    def pick(lanes: list[int]) -> ir.Value:
        mask = ir.Constant(V32_I8, [2 * j + k for j in lanes for k in (0, 1)])
        return builder.bitcast(builder.call(vpshufb, [both, mask]), V16_I16)

    return pick


def _q4_k_scales(block: _Block) -> ir.Value:
    """The 8 sub-block scales and the 8 minimums (6 bits each) of a Q4_K block as one ``<16 x i16>`` (scales in
    lanes 0..7), unpacked from the 12 bytes at byte 4 (``kquants.get_scale_min_k4``'s layout) in one vector: the
    words ``a0, a1, a2`` give the scales' words ``a0 & 0x3f..`` and ``(a2 & 0x0f..) | ((a0 >> 2) & 0x30..)``, the
    minimums' the same of ``a1`` and ``a2 >> 4``."""
    builder = block.builder
    words = block.load(4, V4_I32)  # a0, a1, a2 and the block's first 4 quant bytes (unused)

    def const(value: int) -> ir.Constant:
        return ir.Constant(V4_I32, [value] * 4)

    low = builder.and_(words, const(0x3F3F3F3F))  # [sc 0..3, min 0..3, ...]
    top = builder.and_(builder.lshr(words, const(2)), const(0x30303030))
    a2 = builder.lshr(_pick(builder, words, [2, 2, 2, 2]), ir.Constant(V4_I32, [0, 4, 0, 4]))
    high = builder.or_(builder.and_(a2, const(0x0F0F0F0F)), top)  # [sc 4..7, min 4..7, ...]
    both = builder.bitcast(_pick(builder, low, [0, 4, 1, 5], high), V16_I8)
    return builder.zext(both, V16_I16)


@_super_block
def q4_k_block(builder: ir.IRBuilder, block: _Block, count: int, acc: ir.Value) -> None:
    """The Q4_K super-block at byte ``at`` of ``raw`` times ``group`` activation rows: row ``g``'s 256 int8 values
    at ``x[x_at + g x_stride]``, its scale ``xd[d_at + g d_stride]``, its 16 sums ``bs[bs_at + g bs_stride]``
    (flat indices), its running float32 sum at ``acc[g]`` (the module docstring's step)."""
    dw, dm = block.half(0), block.half(2)
    scales = _q4_k_scales(block)
    splat = _splats(builder, _pick(builder, scales, list(range(8))))
    fifteen = ir.Constant(V32_I8, [15] * 32)
    sumi = [ir.Constant(V8_I32, [0] * 8)] * count
    for c in range(4):  # 64 values: bytes k hold value 64 c + k (low nibble) and 64 c + 32 + k (high)
        q = block.load(16 + 32 * c, V32_I8)
        halves = (builder.and_(q, fifteen), builder.and_(builder.lshr(q, ir.Constant(V32_I8, [4] * 32)), fifteen))
        for h, w in enumerate(halves):
            block.products(sumi, w, 64 * c + 32 * h, splat([2 * c + h] * 16))
    twice = _pick(builder, scales, [8 + j // 2 for j in range(16)])
    for g in range(count):
        total, summ = _totals(builder, sumi[g], builder.call(block.pmaddwd, [block.sums(g), twice]))
        dx = block.scale(g)
        _step(builder, acc, g, [(1, total, dw, dx), (-1, summ, dm, dx)])


@_super_block
def q6_k_block(builder: ir.IRBuilder, block: _Block, count: int, acc: ir.Value) -> None:
    """The Q6_K super-block at byte ``at`` of ``raw`` times ``group`` activation rows (:func:`q4_k_block`'s
    arguments): ``q`` (0..63) of value ``128*h + 32*j + k`` from bits ``4*(j // 2)`` of ``ql[64*h + 32*(j % 2) +
    k]`` and bits ``2*j`` of ``qh[32*h + k]``; its scales ``sc[16]`` int8 at byte 192, ``d`` at 208."""
    dw = block.half(208)
    scales = builder.sext(block.load(192, V16_I8), V16_I16)
    halves = [_splats(builder, _pick(builder, scales, list(range(8 * h, 8 * h + 8)))) for h in range(2)]

    def bits(v, shift, mask):
        return builder.and_(builder.lshr(v, ir.Constant(V32_I8, [shift] * 32)), ir.Constant(V32_I8, [mask] * 32))

    sumi = [ir.Constant(V8_I32, [0] * 8)] * count
    for h in range(2):
        qh = block.load(128 + 32 * h, V32_I8)
        for j in range(4):
            w = builder.or_(bits(block.load(64 * h + 32 * (j % 2), V32_I8), 4 * (j // 2), 15),
                            builder.shl(bits(qh, 2 * j, 3), ir.Constant(V32_I8, [4] * 32)))
            block.products(sumi, w, 128 * h + 32 * j, halves[h]([2 * j] * 8 + [2 * j + 1] * 8))
    for g in range(count):
        bias = builder.shl(builder.call(block.pmaddwd, [block.sums(g), scales]), ir.Constant(V8_I32, [5] * 8))
        total, _ = _totals(builder, builder.sub(sumi[g], bias), bias)
        _step(builder, acc, g, [(1, total, dw, block.scale(g))])
