"""Prompts of K-quant weights (Q2_K to Q6_K) and IQ4_XS with q8_K activations: the numpy reference of llama.cpp's
arithmetic (``q8k_act``) and the AMX tile kernels (``backend/kernels/amx_k.py``) held to it bit for bit.

Error model of the reference: the per-super-block integer sums are exact (int64 in numpy, int32 on the tiles:
at most 256 * 4096 * 128 < 2^31), so against the float64 product of the dequantized activations (``q * d``) and
the weights decoded from the integer parts it differs only by float32 rounding.  Per super-block ``b`` the term
``f32(sumi) * fl(d_w d_x)`` carries at most three roundings (the conversion of a sum above 2^24, the scale, the
product) and its add to ``acc`` one more, the minimums' term likewise: ``|ref - exact| <= (4 nb + 2) * eps32 *
S`` with ``S = sum_b (|sumi| + |summ|) |d_w d_x|`` <= the sum of the magnitudes of all the terms (first order).
The codec decodes ``(d * sc) * w`` rounded per value, the reference uses the exact ``d * (sc * w)``, so the float64
oracle multiplies the integer parts (checked separately to decode as the codec); the kernels do the reference's
operations in its order, so they equal it bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import Converted

from qwen_runtime import load
from qwen_runtime.quants import QType, codec, q8k_act
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import amx as jit_amx  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels import amx_k as jit_amx_k  # noqa: E402
from qwen_runtime.backend.kernels import jit_kernel, kernel_table  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
K_TYPES = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_XS)
# Bytes of each block's float16 d (and dmin) per type.
SCALE_AT = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,),
            QType.IQ4_XS: (0,)}
# float16 edge values for d and dmin: zeros of both signs, subnormals, the largest of both signs.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF], np.uint16)


def k_rows(qtype: QType, rows: int, nb: int, seed: int) -> np.ndarray:
    """Random rows of ``qtype``: every quant and scale bit pattern, float16 d (and dmin) of about 1e-3, both
    signs, 5 % of them float16 edge values; the first block of the first row has all-zero quants and scale
    bytes (Q3_K: every ``sc * q`` is ``-32 * -4 = 128``, the one value whose negation the narrow form needs)."""
    rng = np.random.default_rng(seed)
    size = codec(qtype).type_size
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    blocks[0, 0] = 0
    for at in SCALE_AT[qtype]:
        scale = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        edge = rng.random(scale.shape) < 0.05
        scale.view(np.uint16)[edge] = rng.choice(EDGE_F16, int(edge.sum()))
        blocks[:, :, at:at + 2] = scale[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * size)


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows with an all-zero super-block, a tiny value in another, a negative largest value."""
    x = np.random.default_rng(seed).normal(0, 1, (n, cols)).astype(np.float32)
    if cols >= 2 * 256:
        x[:, 0:256] = 0
        x[:, 5] = 1e-30
        x[:, 300] = -40
    return x


def reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    q, d, bsums = q8k_act.quantize_q8_k(x)
    return q8k_act.product(qtype, raw, q, d, bsums)


def test_quantize_as_llama_cpp() -> None:
    """llama.cpp's ``quantize_row_q8_K_ref`` written out per value (first value of largest magnitude, ``-127 /
    max``, round half to even, at most 127, ``d = 1 / iscale``, sums per 16)."""
    x = activations(3, 512, seed=1)
    x[1, 256:512] = np.linspace(-2, 2, 256, dtype=np.float32)  # -2 and 2: the first, -2, is max
    q, d, bsums = q8k_act.quantize_q8_k(x)
    for i in range(3):
        for b in range(2):
            block = x[i, 256 * b:256 * b + 256]
            amax, top = np.float32(0), np.float32(0)
            for v in block:
                if abs(v) > amax:
                    amax, top = abs(v), v
            if amax == 0:
                assert d[i, b] == 0 and not q[i, 256 * b:256 * b + 256].any()
                continue
            iscale = np.float32(-127) / top
            expected = [min(127, int(np.rint(iscale * v))) for v in block]
            assert q[i, 256 * b:256 * b + 256].tolist() == expected
            assert d[i, b] == np.float32(1) / iscale
    assert np.array_equal(bsums, q.reshape(3, -1, 16).astype(np.int32).sum(axis=2))
    assert (q[1, 256], q[1, 511], d[1, 1]) == (-127, 127, np.float32(1) / np.float32(127 / 2))  # max: -2, first


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_parts_decode_as_the_codec(qtype: QType) -> None:
    """``(d * sc) * w - dmin * m`` in float32, the codec reference's operations, gives its values bit for bit."""
    raw = k_rows(qtype, 7, 3, seed=2)
    p = q8k_act.PARTS[qtype](raw)
    subs = p.sc.shape[2]
    values = (p.d[..., None] * p.sc.astype(np.float32))[..., None] * p.w.reshape(7, 3, subs, -1).astype(np.float32)
    if p.m is not None:
        values = values - (p.dmin[..., None] * p.m.astype(np.float32))[..., None]
    assert np.array_equal(values.reshape(7, -1), codec(qtype).reference(raw))


def exact_terms(qtype: QType, raw: np.ndarray, q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product of the integer parts, ``sum_b d_x d_w sumi - d_x dmin summ``, and ``S = sum_b
    (|sumi| + |summ|) |d_w d_x|``.  # -> float64 [N, R] each"""
    p = q8k_act.PARTS[qtype](raw)
    subs = p.sc.shape[2]
    n, nb = len(q), p.d.shape[1]
    wq = np.einsum("rbjk,nbjk->nrbj", p.w.reshape(len(raw), nb, subs, -1).astype(np.float64),
                   q.reshape(n, nb, subs, -1).astype(np.float64))
    sumi = np.einsum("nrbj,rbj->nrb", wq, p.sc.astype(np.float64))
    scale = p.d.astype(np.float64)[None] * d.astype(np.float64)[:, None]  # [N, R, nb]
    exact, size = np.sum(sumi * scale, axis=2), np.sum(np.abs(sumi * scale), axis=2)
    if p.m is not None:
        per_sub = q.reshape(n, nb, subs, -1).astype(np.float64).sum(axis=3)  # [N, nb, J]
        summ = np.einsum("nbj,rbj->nrb", per_sub, p.m.astype(np.float64))
        min_scale = p.dmin.astype(np.float64)[None] * d.astype(np.float64)[:, None]
        exact -= np.sum(summ * min_scale, axis=2)
        size += np.sum(np.abs(summ * min_scale), axis=2)
    return exact, size


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_reference_against_float64(qtype: QType) -> None:
    """Within ``(2 nb + 3) eps32 S`` of the float64 product of the integer parts (module docstring), and that
    product within the codec's rounding of the float64 product of the codec's decoded weights: each decoded value
    is ``(d * sc) * w - dmin * m`` rounded up to three times, so ``3 eps32 sum |x_d| (|d sc w| + |dmin m|)``."""
    nb = 3
    raw = k_rows(qtype, 21, nb, seed=3)
    x = activations(5, nb * 256, seed=3)
    q, d, _ = q8k_act.quantize_q8_k(x)
    exact, size = exact_terms(qtype, raw, q, d)
    ref = reference(qtype, raw, x)
    assert np.all(np.abs(ref - exact) <= (2 * nb + 3) * EPS32 * size)
    assert np.abs(ref - exact).max() > 0  # float32, not float64: the bound is what is tested
    p = q8k_act.PARTS[qtype](raw)
    subs = p.sc.shape[2]
    terms = np.abs(p.d[..., None, None] * p.sc[..., None] * p.w.reshape(21, nb, subs, -1).astype(np.float64))
    if p.m is not None:
        terms += np.abs(p.dmin[..., None, None] * p.m[..., None].astype(np.float64))
    xd = q.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)
    decoded = xd @ codec(qtype).reference(raw).astype(np.float64).T
    assert np.all(np.abs(decoded - exact) <= 3 * EPS32 * (np.abs(xd) @ terms.reshape(21, -1).T))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "rows", "nb"), [(16, 16, 1), (37, 53, 2), (64, 40, 3), (33, 40, 130)])
@pytest.mark.cpu("amx")
def test_amx_product_equals_the_reference(qtype: QType, m: int, rows: int, nb: int) -> None:
    """Bit for bit (partial activation and weight tiles; 130 super-blocks: one 16-row panel per L2 chunk)."""
    raw = k_rows(qtype, rows, nb, seed=m + rows)
    x = activations(m, nb * 256, seed=nb)
    out = np.full((m, rows), np.nan, np.float32)
    form = jit_amx_k.K_FORMS[qtype]
    jit_amx_k.kquant_amx_product(raw, jit_amx_k.q8_k_padded(x, form.mins), out)
    assert np.array_equal(out, reference(qtype, raw, x))


@pytest.mark.cpu("amx")
def test_amx_integer_sums_exact() -> None:
    """Q3_K's extreme ``sc * q = 128`` (stored negated) against activations of +-127: every sum exact."""
    raw = np.zeros((16, 110), np.uint8)
    raw[:, 108:110] = np.array([1], np.float16).view(np.uint8)  # d = 1, every scale -32, every q -4
    x = np.full((32, 256), 127, np.float32)
    x[1::2] = -127
    out = np.empty((32, 16), np.float32)
    jit_amx_k.kquant_amx_product(raw, jit_amx_k.q8_k_padded(x, 0), out)
    assert np.array_equal(out[0::2], np.full((16, 16), 256 * 128 * 127, np.float32))
    assert np.array_equal(out[1::2], np.full((16, 16), -256 * 128 * 127, np.float32))


@pytest.mark.parametrize("sums", [0, 8, 16])
def test_compiled_quantization_equals_the_reference(sums: int) -> None:
    """``q8_k_padded`` (compiled) gives :func:`q8k_act.quantize_q8_k`'s q and d, zero padding rows, and the sums
    per 32 (``sums=8``: pairs of ``bsums``) or per 16 (the ``bsums``), or none."""
    x = activations(37, 3 * 256, seed=4)
    x[2, 256:512] = np.linspace(-2, 2, 256, dtype=np.float32)
    q, d, bsums = q8k_act.quantize_q8_k(x)
    pq, pd, pbs = jit_amx_k.q8_k_padded(x, sums)
    assert pq.shape == (64, 768) and not pq[37:].any() and not pd[37:].any() and pbs.shape == (64, 3 * sums)
    assert np.array_equal(pq[:37], q) and np.array_equal(pd[:37], d)
    if sums:
        per = bsums.reshape(37, 3 * sums, -1).sum(axis=2).astype(np.float32)
        assert np.array_equal(pbs[:37], per) and not pbs[37:].any()


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_kernel_choice_for_prompts(qtype: QType) -> None:
    """``activations="q8"`` picks the AMX kernel class over the integer decode kernels; a prompt of 16 rows or
    more (not ``rowwise``) is quantized once to q8_K and each tile of weight rows equals the reference's columns
    bit for bit; fewer rows and ``rowwise`` products keep the integer decode kernels' preparation."""
    raw = k_rows(qtype, 48, 2, seed=5)
    kernel = jit_kernel(qtype, raw, activations="q8")
    assert type(kernel) is kernel_table()["q8"][qtype] and type(kernel).__name__ == f"{qtype.name}AmxKernel"
    assert isinstance(kernel, jit_amx_k.KQuantAmxPrompts)
    x = activations(20, 512, seed=5)
    assert not isinstance(kernel.prepare(x[:15]), jit_amx_k.KActivations)
    assert not isinstance(kernel.prepare(x, rowwise=True), jit_amx_k.KActivations)
    if not jit_amx.amx_available():
        assert not isinstance(kernel.prepare(x), jit_amx_k.KActivations)
        return
    xk = kernel.prepare(x)
    assert isinstance(xk, jit_amx_k.KActivations)
    out = np.full((20, 48), np.nan, np.float32)
    for r0, r1 in [(0, 16), (16, 41), (41, 48)]:
        kernel.product(r0, r1, xk, out[:, r0:r1], Scratch())
    assert np.array_equal(out, reference(qtype, raw, x))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_prompt_kernels_are_the_float_kernels_outside_prompts(qtype: QType) -> None:
    """``q8-prompts`` picks a kernel that is the exact float kernel (no integer row product for the decode step)
    with AMX prompts: fewer than 16 rows and ``rowwise`` products give the float kernel's numbers bit for bit; a
    prompt of 16 rows or more is quantized once to q8_K where AMX is available."""
    raw = k_rows(qtype, 48, 2, seed=3)
    kernel, exact = jit_kernel(qtype, raw, "q8-prompts"), jit_kernel(qtype, raw, "float")
    assert isinstance(kernel, type(exact)) and not hasattr(kernel, "q8_row_product")
    x = activations(20, 512, seed=3)
    for rows, rowwise in ((15, False), (20, True)):
        got, want = (np.full((rows, 48), np.nan, np.float32) for _ in range(2))
        xk, xe = kernel.prepare(x[:rows], rowwise), exact.prepare(x[:rows], rowwise)
        kernel.product(0, 48, xk, got, Scratch())
        exact.product(0, 48, xe, want, Scratch())
        assert np.array_equal(got, want)
    assert isinstance(kernel.prepare(x), jit_amx_k.KActivations) == jit_amx.amx_available()


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "types"), [
    ("q2_k", {QType.Q2_K, QType.Q3_K, QType.Q6_K}), ("q3_k_s", {QType.Q3_K, QType.Q6_K}),
    ("q5_k_s", {QType.Q5_K, QType.Q6_K}), ("iq4_xs", {QType.IQ4_XS, QType.Q6_K})])
def test_model_prompts_on_tiles(converted: Converted, monkeypatch: pytest.MonkeyPatch, dtype: str,
                                types: set[QType]) -> None:
    """The bundled model (rows of 256 and 768 values: whole super-blocks) in a q8_K-activation mix with ``q8-prompts``
    against the same file with ``float``: a prompt under 16 tokens and a decode step after it give the same
    logits bit for bit (the float kernels); a 24-token prompt multiplies the mix's types (and the LM head's Q6_K)
    on the AMX tiles where
    available and its logits stay within the 8-bit activations' error of the float prompt's (2^-8 of each
    product's magnitude, through four layers: a few percent of the largest logit)."""
    path = converted("bundled", "gguf", dtype)
    exact, q8 = load(path, kernels="numba"), load(path, kernels="numba", activations="q8-prompts")
    sizes = []
    real = jit_amx_k.kquant_amx_product
    monkeypatch.setattr(jit_amx_k, "kquant_amx_product",
                        lambda raw, xk, out: sizes.append(raw.shape[1] // xk[1].shape[1]) or real(raw, xk, out))
    caches = exact.make_cache(1, 64), q8.make_cache(1, 64)
    prompt = np.array([[3, 17, 42, 7, 99, 5]])
    assert np.array_equal(exact.forward(prompt, caches[0]), q8.forward(prompt, caches[1]))
    assert np.array_equal(exact.forward(np.array([[11]]), caches[0]), q8.forward(np.array([[11]]), caches[1]))
    assert not sizes
    long = (np.arange(24) * 7 % 97 + 3)[None]
    want, got = exact.forward(long, exact.make_cache(1, 32)), q8.forward(long, q8.make_cache(1, 32))
    if jit_amx.amx_available():
        assert {jit_amx_k.BY_SIZE[size] for size in sizes} == types
    assert np.array_equal(got, want) != jit_amx.amx_available()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
