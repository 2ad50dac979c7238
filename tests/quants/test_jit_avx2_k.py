"""Prompts of Q4_K and Q6_K weights on AVX2's integer lanes (``backend/kernels/avx2_k.py``): the register-blocked
GEMM with q8_K activations held bit for bit to ``quants.q8k_act.product``, the reference whose error model
``test_jit_amx_k.py`` proves against float64 (the AMX kernels' reference too).

Only a CPU with AVX2 and not AVX-512 takes these kernels (``avx2_k.takes``); elsewhere the product refuses and
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
from qwen_runtime.backend.kernels import avx2_k, jit_kernel  # noqa: E402
from qwen_runtime.backend.kernels.amx_k import q8_k_padded  # noqa: E402

LANE_TYPES = (QType.Q4_K, QType.Q6_K)


def lanes(qtype: QType, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """:func:`avx2_k.kquant_lanes_product` of ``x`` quantized as the kernel classes quantize it."""
    per, dtype = avx2_k.LANE_SUMS[codec(qtype).type_size]
    q, d, sums = q8_k_padded(x, per)
    out = np.full((len(x), len(raw)), np.nan, np.float32)
    avx2_k.kquant_lanes_product(raw, avx2_k.lane_activations(q, d, sums.astype(dtype), len(x)), out)
    return out


def takes(qtype: QType) -> bool:
    return avx2_k.takes(codec(qtype).type_size)


@pytest.mark.parametrize("qtype", LANE_TYPES, ids=lambda t: t.name)
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
            lanes(qtype, raw, x)
        return
    np.testing.assert_array_equal(lanes(qtype, raw, x), reference(qtype, raw, x))


@pytest.mark.parametrize("qtype", LANE_TYPES, ids=lambda t: t.name)
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
            lanes(qtype, raw, x)
        return
    np.testing.assert_array_equal(lanes(qtype, raw, x), reference(qtype, raw, x))


def test_refuses_other_shapes() -> None:
    """A mismatch of activations, output or row length is a ValueError naming the shapes; a type other than
    Q4_K or Q6_K (or a CPU the kernels are not for) a KernelsError."""
    raw = k_rows(QType.Q4_K, 16, 2, seed=1)
    q, d, sums = q8_k_padded(activations(4, 512, seed=1), 8)
    good = avx2_k.lane_activations(q, d, sums, 4)
    with pytest.raises(KernelsError):
        avx2_k.kquant_lanes_product(k_rows(QType.Q5_K, 16, 2, seed=1), good, np.empty((4, 16), np.float32))
    if not takes(QType.Q4_K):
        with pytest.raises(KernelsError, match="AVX2"):
            avx2_k.kquant_lanes_product(raw, good, np.empty((4, 16), np.float32))
        return
    with pytest.raises(ValueError, match="lanes product"):
        avx2_k.kquant_lanes_product(raw, good, np.empty((4, 15), np.float32))
    with pytest.raises(ValueError, match="lanes product"):
        avx2_k.kquant_lanes_product(raw, avx2_k.lane_activations(q, d, sums.astype(np.int16), 4),
                                    np.empty((4, 16), np.float32))


@pytest.mark.parametrize("activations_form", ["q8", "q8-prompts"])
@pytest.mark.parametrize("qtype", LANE_TYPES, ids=lambda t: t.name)
def test_kernel_classes_take_prompts_through_the_lanes(qtype: QType, activations_form: str) -> None:
    """``q8`` and ``q8-prompts`` kernels: a product of more than ``direct_rows`` rows (not ``rowwise``) is
    quantized once to q8_K and multiplied through the lanes where :func:`avx2_k.takes` the type (and AMX is
    absent), each task's rows equal to the reference's columns; segments of it are the same numbers; up to
    ``direct_rows`` rows and ``rowwise`` products keep the kernel's own preparation."""
    raw = k_rows(qtype, 48, 2, seed=5)
    kernel = jit_kernel(qtype, raw, activations_form)
    n = kernel.direct_rows + 5
    x = activations(n, 512, seed=5)
    through_lanes = takes(qtype) and not jit_amx.amx_available()
    assert isinstance(kernel.prepare(x), avx2_k.LaneActivations) == through_lanes
    assert not isinstance(kernel.prepare(x[:kernel.direct_rows]), avx2_k.LaneActivations)
    assert not isinstance(kernel.prepare(x, rowwise=True), avx2_k.LaneActivations)
    if not through_lanes:
        return
    xk = kernel.prepare(x)
    out = np.full((n, 48), np.nan, np.float32)
    for r0, r1 in [(0, 16), (16, 41), (41, 48)]:
        kernel.product(r0, r1, xk, out[:, r0:r1], Scratch())
    np.testing.assert_array_equal(out, reference(qtype, raw, x))
    assert kernel.segments_exact
    segments = np.full((n, 48), np.nan, np.float32)
    kernel.product_segments(0, 48, xk, segments, Scratch(), (n,))
    np.testing.assert_array_equal(segments, out)


@pytest.mark.slow
def test_model_prompts_through_the_lanes(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled model in q4_k_m (Q4_K and Q6_K matrices of rows of 256 and 768 values): a 40-token prompt
    (more than ``direct_rows``) with 8-bit activations multiplies both types through the lanes where the CPU takes
    them and stays within the activations' error of the float prompt's logits (2^-8 of each product's magnitude
    through four layers: a few percent of the largest logit), and its chunks prefilled together with others
    equal each alone (``Model.prefill_many``)."""
    path = converted("bundled", "gguf", "q4_k_m")
    exact = qwen_runtime.load(path, kernels="numba", activations="float")
    q8 = qwen_runtime.load(path, kernels="numba", activations="q8")
    sizes = set()
    real = avx2_k.kquant_lanes_product
    monkeypatch.setattr(avx2_k, "kquant_lanes_product",
                        lambda raw, xk, out: sizes.add(raw.shape[1] // xk[1].shape[1]) or real(raw, xk, out))
    prompt = (np.arange(40) * 7 % 97 + 3)[None]
    want, got = exact.forward(prompt, exact.make_cache(1, 64)), q8.forward(prompt, q8.make_cache(1, 64))
    lane_sizes = {codec(t).type_size for t in LANE_TYPES}
    assert sizes == (lane_sizes if takes(QType.Q4_K) and not jit_amx.amx_available() else set())
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
