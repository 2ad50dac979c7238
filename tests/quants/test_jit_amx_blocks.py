"""Prompts of the 32-value block types other than Q8_0 (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) with 8-bit activations:
the blockwise float32 reference (``q8_act.product_blockwise``, llama.cpp's q8_0 / q8_1 arithmetic) and the AMX
tile kernel (``backend/kernels/amx_blocks.py`` through ``amx.block_amx``) held to it bit for bit.

Error model of the reference against the float64 product of the integer parts: the block sums ``s_b`` are exact
(int32); a block's term ``f32(s_b) * fl(d_w d_x)`` rounds twice, the minimums' ``m_w * fl(d_x f32(sum q))`` twice
and their sum once, then the add to ``acc`` once: ``|ref - exact| <= (nb + 3) * eps32 * S`` with ``S = sum_b
|s_b d_w d_x| + |m_w d_x sum q|`` (first order).  The codec decodes ``d * w (+ m)`` rounded once or twice per
value, so the float64 product of its values is within ``2 eps32 sum |x_d| (|d w| + |m|)`` of the integer parts'.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import Converted

from qwen_runtime import load
from qwen_runtime.quants import QType, codec, q8_act
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import amx as jit_amx  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels import amx_blocks as jit_amx_blocks  # noqa: E402
from qwen_runtime.backend.kernels import jit_kernel, kernel_table  # noqa: E402
from qwen_runtime.backend.kernels.lattice_int8 import GridKernel  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.IQ4_NL)
MINIMUM = {QType.Q4_1, QType.Q5_1}  # a float16 minimum at bytes 2-3
# float16 edge values for scales and minimums: zeros of both signs, subnormals, the largest of both signs.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF], np.uint16)


def block_rows(qtype: QType, rows: int, nb: int, seed: int, unit: bool = False) -> np.ndarray:
    """Random rows of ``qtype``: every quant bit pattern, float16 scales (and minimums) of about 1e-3 of both signs,
    5 % float16 edge values; ``unit``: every scale 1 and minimum 0 (values = the integers)."""
    rng = np.random.default_rng(seed)
    size = codec(qtype).type_size
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for at in (0, 2) if qtype in MINIMUM else (0,):
        scale = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        edge = rng.random(scale.shape) < 0.05
        scale.view(np.uint16)[edge] = rng.choice(EDGE_F16, int(edge.sum()))
        if unit:
            scale[:] = 1 if at == 0 else 0
        blocks[:, :, at:at + 2] = scale[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * size)


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with an all-zero block, a tiny value, a constant block and a large one."""
    x = np.random.default_rng(seed).normal(0, 1, (n, cols)).astype(np.float32)
    if cols >= 4 * 32:
        x[:, 0:32] = 0
        x[:, 32:64] = 0
        x[:, 40] = 1e-30
        x[:, 64:96] = -3.25
        x[:, 96:128] *= 1e20
    return x


def reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, scales, mins = q8_act.block_weights(qtype, raw)
    q, d = q8_act.quantize_activations(x)
    s = q8_act.activation_sums(q, d) if mins is not None else None
    return q8_act.product_blockwise(w, scales, q, d, mins, s)


def amx_product(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = np.full((len(x), len(raw)), np.nan, np.float32)
    xk = jit_amx_blocks.padded_with_sums(x, qtype in MINIMUM)
    jit_amx.blocks_amx_product(jit_amx_blocks.GEOMETRY[qtype], raw, *xk, out)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_weights_decode_as_the_codec(qtype: QType) -> None:
    """``d * w (+ m)`` in float32, the codec reference's operations, gives its values bit for bit."""
    raw = block_rows(qtype, 5, 3, seed=0)
    w, scales, mins = q8_act.block_weights(qtype, raw)
    assert (mins is not None) == (qtype in MINIMUM)
    values = scales[..., None] * w.reshape(5, 3, 32).astype(np.float32)
    if mins is not None:
        values = values + mins[..., None]
    assert np.array_equal(values.reshape(5, -1), codec(qtype).reference(raw))


def test_activation_sums_as_llama_cpp() -> None:
    """llama.cpp's q8_1 ``s``: the scale times the block's integer sum (float32 here, float16 there)."""
    x = activations(3, 128, seed=1)
    q, d = q8_act.quantize_activations(x)
    s = q8_act.activation_sums(q, d)
    for i in range(3):
        for b in range(4):
            assert s[i, b] == d[i, b] * np.float32(int(q[i, 32 * b:32 * b + 32].astype(np.int64).sum()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_against_float64(qtype: QType) -> None:
    """Within ``(nb + 3) eps32 S`` of the float64 product of the integer parts, and that within the codec's
    rounding of the float64 product of its decoded values (module docstring)."""
    nb = 14
    raw = block_rows(qtype, 45, nb, seed=2)
    x = activations(7, nb * 32, seed=2)
    w, scales, mins = q8_act.block_weights(qtype, raw)
    q, d = q8_act.quantize_activations(x)
    sums = q8_act.block_sums(w, q).astype(np.float64)  # [N, R, nb]
    terms = sums * scales.astype(np.float64)[None] * d.astype(np.float64)[:, None]
    size = np.abs(terms)
    if mins is not None:
        qsum = q.reshape(7, nb, 32).astype(np.float64).sum(axis=2)  # [N, nb]
        min_terms = mins.astype(np.float64)[None] * (d.astype(np.float64) * qsum)[:, None]
        terms, size = terms + min_terms, size + np.abs(min_terms)
    exact, size = terms.sum(axis=2), size.sum(axis=2)
    ref = reference(qtype, raw, x)
    assert np.all(np.isfinite(ref))
    assert np.all(np.abs(ref - exact) <= (nb + 3) * EPS32 * size)
    assert np.abs(ref - exact).max() > 0  # float32, not float64: the bound is what is tested
    xd = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    parts = np.abs(np.repeat(scales.astype(np.float64), 32, axis=1) * w)
    if mins is not None:
        parts += np.abs(np.repeat(mins.astype(np.float64), 32, axis=1))
    decoded = xd @ codec(qtype).reference(raw).astype(np.float64).T
    assert np.all(np.abs(decoded - exact) <= 2 * EPS32 * (np.abs(xd) @ parts.T))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "rows", "nb"), [(16, 16, 1), (37, 53, 14), (32, 64, 3), (50, 33, 7), (96, 40, 28),
                                             (33, 150, 301)])
@pytest.mark.cpu("amx")
def test_amx_product_equals_the_reference(qtype: QType, m: int, rows: int, nb: int) -> None:
    """Bit for bit (partial row tiles: M and R not multiples of 16 or 32; nb not a multiple of the float step's
    group of blocks; 301 blocks: the 32-row panels in more than one L2 chunk, the last one partial)."""
    raw = block_rows(qtype, rows, nb, seed=m + rows)
    x = activations(m, nb * 32, seed=nb)
    assert np.array_equal(amx_product(qtype, raw, x), reference(qtype, raw, x))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.cpu("amx")
def test_amx_integer_sums_exact(qtype: QType) -> None:
    """Scales of 1, minimums 0 and ``q = x`` (``d_x = 1``): the exact integer products, extreme values included."""
    rng = np.random.default_rng(3)
    raw = block_rows(qtype, 35, 4, seed=3, unit=True)
    x = rng.integers(-127, 128, (19, 4 * 32)).astype(np.float32)
    x[:, ::32] = 127
    x[0] = -127
    w, _, _ = q8_act.block_weights(qtype, raw)
    expected = (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)  # below 2^24: exact in float32
    assert np.array_equal(amx_product(qtype, raw, x), expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_choice_for_prompts(qtype: QType) -> None:
    """``q8`` picks the AMX kernel class over the integer decode kernel, ``q8-prompts`` the float kernel with AMX
    prompts; a prompt of 16 rows or more (not ``rowwise``) is quantized once and each tile of weight rows equals
    the reference's columns bit for bit; fewer rows and ``rowwise`` products keep the other kernel's numbers (the
    float kernel's bit for bit)."""
    raw = block_rows(qtype, 70, 8, seed=5)
    x = activations(20, 256, seed=5)
    kernel = jit_kernel(qtype, raw, activations="q8")
    assert type(kernel) is kernel_table()["q8"][qtype] and type(kernel).__name__ == f"{qtype.name}AmxKernel"
    prompts, exact = jit_kernel(qtype, raw, "q8-prompts"), jit_kernel(qtype, raw, "float")
    assert isinstance(prompts, type(exact)) and not hasattr(prompts, "q8_row_product")
    for rows, rowwise in ((15, False), (20, True)):
        assert not isinstance(kernel.prepare(x[:rows], rowwise), jit_amx.AmxActivations)
        got, want = (np.full((rows, 70), np.nan, np.float32) for _ in range(2))
        prompts.product(0, 70, prompts.prepare(x[:rows], rowwise), got, Scratch())
        exact.product(0, 70, exact.prepare(x[:rows], rowwise), want, Scratch())
        assert np.array_equal(got, want)
    for chosen in (kernel, prompts):
        xk = chosen.prepare(x)
        assert isinstance(xk, jit_amx.AmxActivations) == jit_amx.amx_available()
        if jit_amx.amx_available():
            out = np.full((20, 70), np.nan, np.float32)
            for r0, r1 in [(0, 32), (32, 45), (45, 70)]:
                chosen.product(r0, r1, xk, out[:, r0:r1], Scratch())
            assert np.array_equal(out, reference(qtype, raw, x))


def test_float_kernels_where_amx_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX (or its permission) a prompt takes the float kernel: no tile instruction is reached."""
    monkeypatch.setattr(jit_amx, "amx_available", lambda: False)
    raw, x = block_rows(QType.Q4_1, 40, 4, seed=6), activations(20, 128, seed=6)
    prompts, exact = jit_kernel(QType.Q4_1, raw, "q8-prompts"), jit_kernel(QType.Q4_1, raw, "float")
    got, want = (np.full((20, 40), np.nan, np.float32) for _ in range(2))
    prompts.product(0, 40, prompts.prepare(x), got, Scratch())
    exact.product(0, 40, exact.prepare(x), want, Scratch())
    assert np.array_equal(got, want)


def test_the_tables() -> None:
    """Every type with an AMX prompt kernel has an integer-dot kernel too; the i-quants below IQ4 and TQ2_0 have
    integer-dot kernels without AMX prompts, and q8-prompts keeps their float kernel."""
    table = kernel_table()
    assert set(table["q8-prompts"]) <= set(table["q8"]) <= set(table["float"])
    lattice = set(table["q8"]) - set(table["q8-prompts"])
    assert all(issubclass(table["q8"][q], GridKernel) for q in lattice)
    raw = np.zeros((4, 66), np.uint8)  # IQ2_XXS rows: one block of 66 bytes
    assert QType.IQ2_XXS in lattice
    assert type(jit_kernel(QType.IQ2_XXS, raw, "q8-prompts")) is table["float"][QType.IQ2_XXS]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_model_prompts_on_tiles(converted: Converted, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """The bundled model in each type with ``q8-prompts`` against the same file with ``float``: a prompt under 16
    tokens and a decode step after it give the same logits bit for bit (the float kernels); a 24-token prompt
    multiplies the type's matrices on the AMX tiles where available and its logits stay within the 8-bit
    activations' error of the float prompt's (2^-8 of each product's magnitude, through four layers: a few percent
    of the largest logit)."""
    path = converted("bundled", "gguf", dtype)
    exact, q8 = load(path, kernels="numba"), load(path, kernels="numba", activations="q8-prompts")
    calls = []
    real = jit_amx.blocks_amx_product
    monkeypatch.setattr(jit_amx_blocks, "blocks_amx_product",
                        lambda geometry, *a: calls.append(geometry) or real(geometry, *a))
    caches = exact.make_cache(1, 64), q8.make_cache(1, 64)
    prompt = np.array([[3, 17, 42, 7, 99, 5]])
    assert np.array_equal(exact.forward(prompt, caches[0]), q8.forward(prompt, caches[1]))
    assert np.array_equal(exact.forward(np.array([[11]]), caches[0]), q8.forward(np.array([[11]]), caches[1]))
    assert not calls
    long = (np.arange(24) * 7 % 97 + 3)[None]
    want, got = exact.forward(long, exact.make_cache(1, 32)), q8.forward(long, q8.make_cache(1, 32))
    assert set(calls) == ({jit_amx_blocks.GEOMETRY[QType[dtype.upper()]]} if jit_amx.amx_available() else set())
    assert np.array_equal(got, want) != jit_amx.amx_available()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
