"""Prompts of Q8_0, Q4_0, Q5_0, Q4_K, Q6_K and IQ4_XS weights on AVX2's integer lanes (``backend/kernels/lanes.py``):
the register-blocked GEMM held bit for bit to the references whose error models ``test_jit_amx.py`` (the 32-value
blocks with q8_0 activations, ``q8_act.product_blockwise``) and ``test_jit_amx_k.py`` (the K-quants and IQ4_XS with
q8_K activations, ``q8k_act.product``) prove against float64, the AMX kernels' references too.

Only a CPU with AVX2 and not AVX-512 takes these kernels (``jit_lanes.takes``); elsewhere the product refuses and
the kernel classes keep their other paths, and ``test_the_avx2_form`` runs this file compiled for AVX2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import Converted
from test_jit_amx_k import activations, k_rows, reference

import qwen_runtime
from qwen_runtime.errors import KernelsError
from qwen_runtime.quants import QType, codec
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import amx as jit_amx  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels import jit_kernel  # noqa: E402
from qwen_runtime.backend.kernels import lanes as jit_lanes  # noqa: E402
from qwen_runtime.backend.kernels.amx_k import q8_k_padded  # noqa: E402
from qwen_runtime.quants import q8_act  # noqa: E402

BLOCK_TYPES = (QType.Q8_0, QType.Q4_0, QType.Q5_0)  # blocks of 32, q8_0 activations
K_LANE_TYPES = (QType.Q4_K, QType.Q6_K, QType.IQ4_XS)  # super-blocks of 256, q8_K activations
LANE_TYPES = BLOCK_TYPES + K_LANE_TYPES


def lane_product(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """:func:`jit_lanes.kquant_lanes_product` of ``x`` quantized as the kernel classes quantize it."""
    size = codec(qtype).type_size
    per, dtype = jit_lanes.LANE_SUMS[size]
    q, d, sums = q8_k_padded(x, per)
    q = q.astype(np.int16) if size in jit_lanes.WIDE else q
    out = np.full((len(x), len(raw)), np.nan, np.float32)
    jit_lanes.kquant_lanes_product(raw, jit_lanes.lane_activations(q, d, sums.astype(dtype), len(x)), out)
    return out


def takes(qtype: QType) -> bool:
    return jit_lanes.takes_q8_0() if qtype in BLOCK_TYPES else jit_lanes.takes(codec(qtype).type_size)


@pytest.mark.parametrize("qtype", K_LANE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "rows", "nb"), [(1, 7, 1), (4, 16, 3), (37, 40, 2), (70, 33, 4), (33, 17, 43)])
def test_product_equals_the_reference(qtype: QType, m: int, rows: int, nb: int) -> None:
    """Bit for bit, with activation rows that fill no tile of 4 and weight rows that fill no panel pair of 16, the
    float16 edge values of ``k_rows`` (zeros, subnormals, the largest) and an all-zero super-block of activations;
    43 super-blocks: a row longer than the panels' L1 share.  Where the CPU is not the kernels' the product is
    refused."""
    raw = k_rows(qtype, rows, nb, seed=m + rows)
    x = activations(m, nb * 256, seed=nb)
    if not takes(qtype):
        with pytest.raises(KernelsError, match="AVX2"):
            lane_product(qtype, raw, x)
        return
    np.testing.assert_array_equal(lane_product(qtype, raw, x), reference(qtype, raw, x))


@pytest.mark.parametrize("qtype", (QType.Q4_K, QType.Q6_K), ids=lambda t: t.name)
def test_integer_sums_at_their_extremes(qtype: QType) -> None:
    """The largest weights, scales and activations of both signs: every int32 sum and the ``-32`` term exact.
    Q4_K: q = 15, sc = m = 63; Q6_K: q = 0 (value -32), sc = -128 and 127."""
    size = codec(qtype).type_size
    raw = np.zeros((16, 2 * size), np.uint8)
    for b in range(2):
        o = b * size
        if qtype == QType.Q4_K:
            raw[:, o:o + 4] = np.array([1, 1], np.float16).view(np.uint8)
            raw[:, o + 4:o + 16] = 0xFF
            raw[:, o + 16:o + 144] = 0xFF
        else:
            raw[:, o + 192:o + 208] = np.array([-128, 127] * 8, np.int8).view(np.uint8)
            raw[:, o + 208:o + 210] = np.array([1], np.float16).view(np.uint8)
    x = np.full((8, 512), 127, np.float32)
    x[1::2] = -127
    if not takes(qtype):
        with pytest.raises(KernelsError, match="AVX2"):
            lane_product(qtype, raw, x)
        return
    np.testing.assert_array_equal(lane_product(qtype, raw, x), reference(qtype, raw, x))


def test_refuses_other_shapes() -> None:
    """A mismatch of activations, output or row length is a ValueError naming the shapes; a type other than
    Q4_K, Q6_K or IQ4_XS (or a CPU the kernels are not for) a KernelsError."""
    raw = k_rows(QType.Q4_K, 16, 2, seed=1)
    q, d, sums = q8_k_padded(activations(4, 512, seed=1), 8)
    good = jit_lanes.lane_activations(q, d, sums, 4)
    with pytest.raises(KernelsError):
        jit_lanes.kquant_lanes_product(k_rows(QType.Q5_K, 16, 2, seed=1), good, np.empty((4, 16), np.float32))
    if not takes(QType.Q4_K):
        with pytest.raises(KernelsError, match="AVX2"):
            jit_lanes.kquant_lanes_product(raw, good, np.empty((4, 16), np.float32))
        return
    with pytest.raises(ValueError, match="lanes product"):
        jit_lanes.kquant_lanes_product(raw, good, np.empty((4, 15), np.float32))
    with pytest.raises(ValueError, match="lanes product"):
        jit_lanes.kquant_lanes_product(raw, jit_lanes.lane_activations(q, d, sums.astype(np.int16), 4),
                                    np.empty((4, 16), np.float32))


def block_rows(qtype: QType, rows: int, nb: int, seed: int) -> np.ndarray:
    """Random rows of a 32-value block type: every value and bit pattern, float16 d of about 1e-3 of both signs,
    5 % float16 edge values (zeros, subnormals, the largest)."""
    rng = np.random.default_rng(seed)
    size = codec(qtype).type_size
    blocks = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    d = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
    edge = rng.random(d.shape) < 0.05
    d.view(np.uint16)[edge] = rng.choice(np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0xFBFF], np.uint16),
                                         int(edge.sum()))
    blocks[:, :, :2] = d[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * size)


def block_reference(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    q, d = q8_act.quantize_activations(x)
    w, scales, _ = q8_act.block_weights(qtype, raw)
    return q8_act.product_blockwise(w, scales, q, d)


def block_product(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The lanes' product of a block type's rows, activations quantized as the kernel classes quantize them."""
    q, d = jit_amx.quantized_padded(x)
    out = np.full((len(x), len(raw)), np.nan, np.float32)
    if qtype == QType.Q8_0:
        jit_lanes.q8_0_lanes_product(raw, jit_lanes.q8_0_lane_activations(q, d, len(x), x.shape[1]), out)
    else:
        jit_lanes.nibble_lanes_product(raw, jit_lanes.nibble_lane_activations(q, d, len(x), x.shape[1]), out)
    return out


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("m", "rows", "nb"), [(1, 7, 1), (4, 16, 3), (37, 40, 2), (70, 33, 28), (9, 17, 345)])
def test_block_product_equals_the_reference(qtype: QType, m: int, rows: int, nb: int) -> None:
    """Bit for bit, partial tiles and panels, float16 edge scales, activations at +-127 in one row (Q4_0's and
    Q5_0's largest bias sums); where the CPU is not the kernels' the product is refused."""
    raw = block_rows(qtype, rows, nb, seed=m + rows)
    x = np.random.default_rng(nb).normal(0, 1, (m, nb * 32)).astype(np.float32)
    x[0, ::2], x[0, 1::2] = 5, -5
    if not takes(qtype):
        with pytest.raises(KernelsError, match="AVX2"):
            block_product(qtype, raw, x)
        return
    np.testing.assert_array_equal(block_product(qtype, raw, x), block_reference(qtype, raw, x))
    q, d = jit_amx.quantized_padded(x)
    with pytest.raises(ValueError, match="lanes product"):
        jit_lanes.q8_0_lanes_product(raw[:, :-2], jit_lanes.q8_0_lane_activations(q, d, m, nb * 32),
                                     np.empty((m, rows), np.float32))


@pytest.mark.parametrize("activations_form", ["q8", "q8-prompts"])
@pytest.mark.parametrize("qtype", LANE_TYPES, ids=lambda t: t.name)
def test_kernel_classes_take_prompts_through_the_lanes(qtype: QType, activations_form: str) -> None:
    """``q8`` and ``q8-prompts`` kernels: a product of more than ``direct_rows`` rows (not ``rowwise``) is
    quantized once to q8_K and multiplied through the lanes where :func:`jit_lanes.takes` the type (and AMX is
    absent), each task's rows equal to the reference's columns; segments of it are the same numbers; up to
    ``direct_rows`` rows and ``rowwise`` products keep the kernel's own preparation."""
    raw = block_rows(qtype, 48, 16, seed=5) if qtype in BLOCK_TYPES else k_rows(qtype, 48, 2, seed=5)
    kernel = jit_kernel(qtype, raw, activations_form)
    n = kernel.direct_rows + 5
    x = activations(n, 512, seed=5)
    through_lanes = takes(qtype) and not jit_amx.amx_available()
    assert isinstance(kernel.prepare(x), jit_lanes.LaneActivations) == through_lanes
    assert not isinstance(kernel.prepare(x[:kernel.direct_rows]), jit_lanes.LaneActivations)
    assert not isinstance(kernel.prepare(x, rowwise=True), jit_lanes.LaneActivations)
    if not through_lanes:
        return
    xk = kernel.prepare(x)
    out = np.full((n, 48), np.nan, np.float32)
    for r0, r1 in [(0, 16), (16, 41), (41, 48)]:
        kernel.product(r0, r1, xk, out[:, r0:r1], Scratch())
    want = block_reference(qtype, raw, x) if qtype in BLOCK_TYPES else reference(qtype, raw, x)
    np.testing.assert_array_equal(out, want)
    assert kernel.segments_exact
    segments = np.full((n, 48), np.nan, np.float32)
    kernel.product_segments(0, 48, xk, segments, Scratch(), (n,))
    np.testing.assert_array_equal(segments, out)


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "types"), [("q4_k_m", {QType.Q4_K, QType.Q6_K}), ("q8_0", {QType.Q8_0}),
                                              ("q4_0", {QType.Q4_0, QType.Q6_K}), ("q5_0", {QType.Q5_0, QType.Q6_K}),
                                              ("iq4_xs", {QType.IQ4_XS, QType.Q6_K})])
def test_model_prompts_through_the_lanes(converted: Converted, monkeypatch: pytest.MonkeyPatch, dtype: str,
                                         types: set[QType]) -> None:
    """The bundled model (rows of 256 and 768 values) in q4_k_m (Q4_K and Q6_K matrices), q8_0, q4_0, q5_0 and
    iq4_xs (their tied LM head Q6_K): a 40-token prompt (more than ``direct_rows``; logits of every position) with 8-bit
    activations multiplies its types through the lanes where the CPU takes them and stays within the activations'
    error of the float prompt's logits (2^-8 of each product's magnitude through four layers: a few percent of the
    largest logit), and its chunks prefilled together with others equal each alone (``Model.prefill_many``)."""
    path = converted("bundled", "gguf", dtype)
    exact = qwen_runtime.load(path, kernels="numba", activations="float")
    q8 = qwen_runtime.load(path, kernels="numba", activations="q8")
    sizes = set()
    for name in ("kquant_lanes_product", "q8_0_lanes_product", "nibble_lanes_product"):
        real = getattr(jit_lanes, name)
        monkeypatch.setattr(jit_lanes, name, lambda raw, xk, out, real=real: sizes.add(raw.shape[1] // xk[1].shape[1])
                            or real(raw, xk, out))
    prompt = (np.arange(40) * 7 % 97 + 3)[None]
    want, got = exact.forward(prompt, exact.make_cache(1, 64)), q8.forward(prompt, q8.make_cache(1, 64))
    through_lanes = all(takes(t) for t in types) and not jit_amx.amx_available()
    assert sizes == ({codec(t).type_size for t in types} if through_lanes else set())  # bytes per scale d
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    if q8.segments_exact:
        chunks = [(np.arange(n) * 5 % 89 + 2).tolist() for n in (40, 5, 36)]
        alone = [q8.forward(np.asarray([c]), q8.make_cache(1, 64), last_only=True)[0] for c in chunks]
        together = q8.prefill_many(chunks, [q8.make_cache(1, 64) for _ in chunks])
        np.testing.assert_array_equal(together, np.stack(alone))


@pytest.mark.slow
@pytest.mark.cpu("avx2")
def test_the_avx2_form() -> None:
    """This file's tests in a process compiling for AVX2 without AVX-512 (``NUMBA_CPU_FEATURES``), where the
    kernels are taken."""
    from llvmlite import binding as llvm

    from qwen_runtime.backend.jit_setup import other_instruction_forms

    features = other_instruction_forms(llvm.get_host_cpu_features().flatten())["avx2"]
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                             __file__], capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
