"""Prefill products of Q8_0 weights with 8-bit activations: the blockwise float32 reference
(``q8_act.product_blockwise``) and the AMX tile kernel (``backend/kernels/amx.py``) held to it.

Error model: the int32 block sums are exact (at most 32 * 128 * 127 < 2^24, so also exact in float32).  The
reference adds the blocks in order, ``acc = acc + f32(s_b) * fl(d_w * d_x)``, three roundings per block; against
the float64 value of the exact sums ``|ref - exact| <= (nb + 2) * eps32 * S`` with ``S = sum_b |s_b| d_w d_x``
(first order).  The decode kernels (``jit_int8``) round partial sums of 4 products per lane (lanes over pairs of
blocks, fused adds, a pairwise sum of 16 lanes), so their bound is ``(nb + 17) * eps32 * A`` with ``A = sum_b
(sum_k |w_k q_k|) |d_w d_x|`` (cancellation inside a block shows: a block whose sum is 13 from products of
~10^4 is off by far more than eps32 of 13), and the two agree within ``(2 nb + 19) * eps32 * A``, not bit for
bit.  The AMX kernel does the reference's operations in its order, so it must equal it bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from runtime_helpers import Converted

from qwen_runtime import load
from qwen_runtime.backend.jit_setup import AVX2_FEATURES
from qwen_runtime.backend.pool import Workspace, resolve_activations
from qwen_runtime.errors import KernelsError
from qwen_runtime.quants import QType, codec, q8_act
from qwen_runtime.quants.scratch import Scratch

pytest.importorskip("numba")
from qwen_runtime.backend.kernels import amx as jit_amx  # noqa: E402 (numba is needed from here on)
from qwen_runtime.backend.kernels import base as jit_base  # noqa: E402
from qwen_runtime.backend.kernels.base import GEMV_ROWS  # noqa: E402
from qwen_runtime.backend.kernels.int8 import Q8_0Int8Kernel  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def q8_0_rows(rows: int, nb: int, seed: int, scale: np.float16 | None = None) -> np.ndarray:
    """Random Q8_0 rows [rows, nb * 34]: every int8 value (-128 included), float16 scales of about 1e-3 of both
    signs with a few zeros and subnormals, or all ``scale``."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, nb, 34), dtype=np.uint8)
    if scale is None:
        scales = (rng.uniform(2e-4, 2e-3, (rows, nb)) * rng.choice([-1, 1], (rows, nb))).astype(np.float16)
        edge = rng.random(scales.shape) < 0.05
        scales[edge] = rng.choice(np.array([0, 1e-7, -6e-8], np.float16), int(edge.sum()))
    else:
        scales = np.full((rows, nb), scale, np.float16)
    blocks[:, :, :2] = scales[..., None].view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * 34)


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


def reference(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, scales = q8_act.q8_0_weights(raw)
    q, d = q8_act.quantize_activations(x)
    return q8_act.product_blockwise(w, scales, q, d)


def magnitude(raw: np.ndarray, x: np.ndarray, products: bool = False) -> np.ndarray:
    """``S = sum_b |s_b| |d_w d_x|`` per output, float64 (``products``: ``A``, with ``sum |w q|`` for ``|s_b|``)."""
    w, scales = q8_act.q8_0_weights(raw)
    q, d = q8_act.quantize_activations(x)
    if products:
        sums = q8_act.block_sums(np.abs(w.astype(np.int16)), np.abs(q)).astype(np.float64)
    else:
        sums = np.abs(q8_act.block_sums(w, q)).astype(np.float64)
    return np.einsum("nrb,rb,nb->nr", sums, np.abs(scales.astype(np.float64)), d.astype(np.float64))


def decode_kernel(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The existing q8-activation decode kernels, every row by the integer row kernels (``rowwise``: above
    ``direct_rows`` rows :meth:`product` takes the float kernel)."""
    kernel = Q8_0Int8Kernel(raw)
    out = np.empty((len(x), len(raw)), np.float32)
    kernel.product_rows(0, len(raw), kernel.prepare(x, rowwise=True), out, Scratch())
    return out


def test_weights_of_the_stored_blocks() -> None:
    raw = q8_0_rows(5, 3, seed=0)
    w, scales = q8_act.q8_0_weights(raw)
    decoded = codec(QType.Q8_0).reference(raw)
    assert np.array_equal(decoded, (scales[..., None] * w.reshape(5, 3, 32).astype(np.float32)).reshape(5, -1))


@pytest.mark.parametrize("n", [1, 3, GEMV_ROWS + 5])
def test_reference_against_the_decode_kernel(n: int) -> None:
    """Within float32 summation-order error of the q8 decode kernel, and of the exact float64 sums."""
    nb = 14
    raw = q8_0_rows(45, nb, seed=n)
    x = activations(n, nb * 32, seed=n)
    ref, size = reference(raw, x), magnitude(raw, x)
    w, scales = q8_act.q8_0_weights(raw)
    exact = q8_act.product(w, scales, x)
    assert np.all(np.abs(ref - exact) <= (nb + 2) * EPS32 * size)
    products = magnitude(raw, x, products=True)
    assert np.all(np.abs(decode_kernel(raw, x) - ref) <= (2 * nb + 19) * EPS32 * products)
    assert np.all(np.isfinite(ref))


def test_reference_integer_sums_exact() -> None:
    """Scales of 1 and activation blocks whose largest value is 127 (``q = x``, ``d_x = 1``): the reference is
    the exact int32 sum, and equals the decode kernel's bit for bit."""
    rng = np.random.default_rng(1)
    nb = 3
    raw = q8_0_rows(37, nb, seed=1, scale=np.float16(1))
    x = rng.integers(-127, 128, (GEMV_ROWS, nb * 32)).astype(np.float32)
    x[:, ::32] = 127
    w, _ = q8_act.q8_0_weights(raw)
    expected = (x.astype(np.int64) @ w.astype(np.int64).T).astype(np.float32)
    assert np.array_equal(reference(raw, x), expected)
    assert np.array_equal(decode_kernel(raw, x), expected)


@pytest.mark.parametrize(("m", "rows", "nb"), [(1, 16, 1), (37, 53, 14), (32, 64, 3), (50, 33, 7), (96, 40, 28),
                                             (33, 150, 301)])
def test_amx_product_equals_the_reference(m: int, rows: int, nb: int) -> None:
    """Bit for bit on AMX (partial row tiles: M and R not multiples of 16 or 32; K = 32 nb, nb not a multiple of
    the float step's group of blocks; 301 blocks: the 32-row weight panels in more than one L2 chunk, the last one
    partial); where AMX is absent or refused, the product is the reference's and says so."""
    raw = q8_0_rows(rows, nb, seed=m + rows)
    x = activations(m, nb * 32, seed=nb)
    out = np.full((m, rows), np.nan, np.float32)
    path = jit_amx.q8_0_q8_product(raw, x, out)
    assert path == ("amx" if jit_amx.amx_available() else "reference")
    assert np.array_equal(out, reference(raw, x))


def test_amx_integer_sums_exact() -> None:
    """Scales of 1, ``q = x``: the exact int32 sums, extremes included (-128 weights against -127 activations)."""
    rng = np.random.default_rng(2)
    raw = q8_0_rows(35, 4, seed=2, scale=np.float16(1))
    raw.reshape(35, 4, 34)[0, :, 2:] = np.uint8(128)
    x = rng.integers(-127, 128, (19, 4 * 32)).astype(np.float32)
    x[:, ::32] = 127
    x[0] = -127
    w, _ = q8_act.q8_0_weights(raw)
    expected = x.astype(np.int64) @ w.astype(np.int64).T
    assert expected[0, 0] == 4 * 32 * 128 * 127
    out = np.empty((19, 35), np.float32)
    jit_amx.q8_0_q8_product(raw, x, out)
    assert np.array_equal(out, expected.astype(np.float32))


def test_fallback_where_amx_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without amx-int8 in numba's target nothing is asked of the kernel and the reference multiplies."""
    assert not jit_amx.cpu_has_amx(frozenset({"avx512f", "avx512vnni", "amx-tile"}))
    monkeypatch.setattr(jit_amx, "FEATURES", frozenset({"avx512f"}))
    monkeypatch.setattr(jit_amx, "tiles_granted", lambda: pytest.fail("permission asked without AMX"))
    assert not jit_amx.amx_available()
    raw, x = q8_0_rows(20, 2, seed=5), activations(17, 64, seed=5)
    out = np.empty((17, 20), np.float32)
    assert jit_amx.q8_0_q8_product(raw, x, out) == "reference"
    assert np.array_equal(out, reference(raw, x))


def test_fallback_where_the_kernel_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit_amx, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(jit_amx, "tiles_granted", lambda: False)
    assert not jit_amx.amx_available()
    raw, x = q8_0_rows(20, 2, seed=6), activations(17, 64, seed=6)
    out = np.empty((17, 20), np.float32)
    assert jit_amx.q8_0_q8_product(raw, x, out) == "reference"
    assert np.array_equal(out, reference(raw, x))


def test_tile_config() -> None:
    """Palette 1; activation tiles 16 x 32 bytes, weight tiles 8 x 64 (VNNI: K = 32), results 16 x 64 bytes."""
    cfg = jit_amx.tile_config()
    assert cfg[0] == 1 and not cfg[1:16].any()
    assert cfg[16:32].view(np.uint16).tolist() == [32, 32, 64, 64, 64, 64, 64, 64]
    assert cfg[48:56].tolist() == [16, 16, 8, 8, 16, 16, 16, 16] and not cfg[56:].any()


def test_amx_product_refused_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called directly where AMX is not available: a KernelsError, not a tile instruction (illegal instruction)."""
    monkeypatch.setattr(jit_amx, "amx_available", lambda: False)
    q, d = jit_amx.quantized_padded(activations(3, 64, seed=0))
    with pytest.raises(KernelsError, match="AMX"):
        jit_amx.q8_0_amx_product(q8_0_rows(4, 2, seed=0), q, d, np.empty((3, 4), np.float32))


def test_prompt_logits_on_amx_match_the_decode_kernels(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """``activations="q8"``: a 24-token prompt's Q8_0 products go through the AMX tiles where available (else the
    exact float kernel, as before), and its logits at every position stay within float32 summation-order error
    of the same prompt through the q8 decode kernels (``rowwise``: every row by the integer row kernels), which
    compound through the layers, and where an activation lands on a rounding boundary of the 8-bit quantization,
    one step of it (2^-8 of its block's largest value): measured 2.7e-7 of the largest logit on the tiny model
    (the exact float prefill: 1.9e-2, the 8-bit activations' own error)."""
    calls = []
    real = jit_amx.q8_0_amx_product
    monkeypatch.setattr(jit_amx, "q8_0_amx_product", lambda *a: calls.append(1) or real(*a))
    model = load(converted("qwen2-tiny", "gguf", "q8_0"), kernels="numba", activations="q8")
    assert isinstance(model.workspace, Workspace)
    ids = (np.arange(24) * 7 % 97 + 3)[None]
    prompt = model.forward(ids, model.make_cache(1, 32))
    assert bool(calls) == jit_amx.amx_available()
    calls.clear()
    with model.workspace.rowwise():
        rows = model.forward(ids, model.make_cache(1, 32))
    assert not calls
    assert np.all(np.isfinite(prompt))
    tolerance = 1e-4 if jit_amx.amx_available() else 0.05  # without AMX: the exact float prefill's (q8 error)
    assert np.abs(prompt - rows).max() <= tolerance * np.abs(rows).max()


def test_auto_resolves_by_the_kernels() -> None:
    assert resolve_activations("auto", "numba") == ("q8" if jit_base.MADDUBS else "q8-prompts")
    assert resolve_activations("auto", "numpy") == "float"
    assert resolve_activations("q8", "numba") == "q8"
    with pytest.raises(KernelsError, match="activations"):
        resolve_activations("int4", "numba")
    with pytest.raises(KernelsError, match="compiled kernels"):
        Workspace(kernels="numpy", activations="q8-prompts")


@pytest.mark.parametrize(("features", "expected"), [
    (AVX2_FEATURES, "q8"),
    (AVX2_FEATURES + ",+avx512f,+avx512bw,+avx512vl,+avx512dq", "q8-prompts"),
])
def test_auto_by_the_cpu_form(features: str, expected: str) -> None:
    """``auto`` follows the CPU the kernels compile for (``NUMBA_CPU_FEATURES``, read when numba imports): 8-bit
    decode too where only AVX2 multiplies, exact decode where AVX-512 does."""
    code = "from qwen_runtime.backend.pool import resolve_activations; print(resolve_activations('auto', 'numba'))"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CPU_FEATURES": features},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == expected


def test_decode_and_verify_exact_prompts_quantized(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 model with ``q8-prompts`` against the same file with ``float``: a prompt under 16 tokens, every decode
    step after it and a speculative verify pass give the same logits bit for bit (the float kernels); a 24-token
    prompt goes through the AMX tiles where available and its logits stay within the 8-bit activations' error (as
    ``activations="q8"``: 2^-8 of each product's magnitude through a few layers) of the float prompt's."""
    path = converted("qwen2-tiny", "gguf", "q8_0")
    exact, q8 = load(path, kernels="numba"), load(path, kernels="numba", activations="q8-prompts")
    assert q8.workspace.activations == "q8-prompts" and q8.exact_steps
    calls = []
    real = jit_amx.q8_0_amx_product
    monkeypatch.setattr(jit_amx, "q8_0_amx_product", lambda *a: calls.append(1) or real(*a))
    caches = exact.make_cache(1, 64), q8.make_cache(1, 64)
    prompt = np.array([[3, 17, 42, 7, 99, 5]])
    assert np.array_equal(exact.forward(prompt, caches[0]), q8.forward(prompt, caches[1]))
    for token in (11, 12, 13):
        step = np.array([[token]])
        assert np.array_equal(exact.forward(step, caches[0]), q8.forward(step, caches[1]))
    drafts = np.array([[21, 22, 23, 24]])
    assert np.array_equal(exact.verify(drafts, caches[0]), q8.verify(drafts, caches[1]))
    assert not calls
    long = (np.arange(24) * 7 % 97 + 3)[None]
    want, got = exact.forward(long, exact.make_cache(1, 32)), q8.forward(long, q8.make_cache(1, 32))
    assert bool(calls) == jit_amx.amx_available()
    assert np.array_equal(got, want) != jit_amx.amx_available()
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
