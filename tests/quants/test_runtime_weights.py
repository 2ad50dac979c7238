"""Weight kernels against the plain reference ``to_float32() @ x.T``, and exact fp16/bf16 widening."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from runtime_helpers import KERNELS

from qwen_runtime.backend.pool import Workspace, blas_controller, single_threaded_blas
from qwen_runtime.backend.weights import F32Weight, TiledWeight, gated_matmul, make_weight, matmul_many
from qwen_runtime.formats.tensors import QType, StoredTensor
from qwen_runtime.models.base import all_float32
from qwen_runtime.quants import CODECS
from qwen_runtime.quants.base import f16_bits_to_f32, f16_bits_to_prescaled, f16_scales
from qwen_runtime.quants.q8_0 import q8_0_activations, q8_0_product, q8_0_row_scales
from qwen_runtime.quants.scratch import Scratch, buffer


def stored(qtype: QType, w: np.ndarray) -> StoredTensor:
    if qtype == QType.F32:
        data = w.astype(np.float32)
    elif qtype == QType.F16:
        data = w.astype(np.float16)
    elif qtype == QType.BF16:
        data = (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = quants.quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0)
    return StoredTensor("w", qtype, w.shape, "mem", data=data)


def test_f16_widening_is_exact_for_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    out = np.empty(bits.shape, np.float32)
    f16_bits_to_f32(bits, out, Scratch())
    expected = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])  # incl. -0, subnormals, inf


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0])
@pytest.mark.parametrize("n", [1, 5])
def test_matmul_matches_reference(qtype: QType, n: int) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (100, 96)).astype(np.float32)
    x = rng.normal(0, 1, (n, 96)).astype(np.float32)
    # 13 rows per tile: several tiles plus a ragged last one
    weight = make_weight(stored(qtype, w), Workspace(), tile_elements=13 * 96)
    assert isinstance(weight, F32Weight if qtype == QType.F32 else TiledWeight)
    ref = x @ weight.to_float32().T
    got = weight.matmul(x)
    assert got.shape == (n, 100) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0])
def test_rows_decode_only_requested_rows_exactly(qtype: QType) -> None:
    w = np.random.default_rng(1).normal(0, 0.05, (50, 64)).astype(np.float32)
    weight = make_weight(stored(qtype, w), Workspace())
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(weight.rows(ids), weight.to_float32()[ids])


def test_tiled_weight_keeps_no_float32_copy() -> None:
    w = np.random.default_rng(2).normal(0, 0.05, (4096, 64)).astype(np.float32)
    ws = Workspace()
    weight = make_weight(stored(QType.Q8_0, w), ws, tile_elements=1024)
    weight.matmul(np.ones((1, 64), np.float32))
    # the only float32 scratch is one tile per pool thread (in Q8_0's 34-values-per-block layout)
    assert all(s.sizes().get("tile", 0) <= 1024 // 32 * 34 for s in ws.scratch)


def test_f16_prescaled_widening_is_exact_for_every_finite_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    finite = (bits & 0x7C00) != 0x7C00
    out = f16_bits_to_prescaled(bits, np.empty(bits.shape, np.float32))
    expected = bits.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal((out * np.float32(2.0**112))[finite], expected[finite])  # incl. -0, subnormals


def test_f16_scales_are_exact_for_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    expected = bits.view(np.float16).astype(np.float32)
    finite = np.r_[0:124, 128:252]  # rows of every finite pattern, positive and negative
    np.testing.assert_array_equal(f16_scales(bits[finite]), expected[finite])
    np.testing.assert_array_equal(f16_scales(bits[124:128]), expected[124:128])  # inf/NaN: numpy's own cast


@pytest.mark.parametrize("n", [1, 3, 8, 9, 40])
def test_q8_0_product_matches_reference_dequantization(n: int) -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.05, (37, 128)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    x = rng.normal(0, 1, (n, 128)).astype(np.float32)
    ref = CODECS[QType.Q8_0].reference(raw) @ x.T  # [37, n]
    out = np.empty((n, 37), np.float32)
    got = q8_0_product(raw, q8_0_row_scales(raw).T, q8_0_activations(x), Scratch(), out)
    np.testing.assert_allclose(got, ref.T, rtol=1e-5, atol=1e-5)  # the scale multiplies block sums: rounding only


@pytest.mark.parametrize("scale", [1.0, 1e5])  # 1e5: activations too large to prescale, the exact path runs
def test_f16_tiles_with_inf_or_large_activations_match_reference(scale: float) -> None:
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.05, (40, 64)).astype(np.float32)
    w[25, 3] = np.inf  # only the tile of rows 20-39 holds a special value
    weight = make_weight(stored(QType.F16, w), Workspace(), tile_elements=20 * 64)
    x = rng.normal(0, scale, (2, 64)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        ref = x @ weight.to_float32().T
        got = weight.matmul(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16, QType.Q8_0])
@pytest.mark.parametrize("n", [1, 4, 20])
def test_pool_gives_the_serial_result(qtype: QType, n: int) -> None:
    rng = np.random.default_rng(5)
    w, x = rng.normal(0, 0.05, (300, 96)).astype(np.float32), rng.normal(0, 1, (n, 96)).astype(np.float32)
    serial = make_weight(stored(qtype, w), Workspace(threads=1), tile_elements=32 * 96)
    pooled = make_weight(stored(qtype, w), Workspace(threads=2), tile_elements=32 * 96)
    if qtype == QType.F32:  # split into row blocks, BLAS may sum in another order: float32 rounding
        np.testing.assert_allclose(pooled.matmul(x), serial.matmul(x), rtol=1e-6, atol=1e-6)
    else:  # the same tiles, only on other threads: bit for bit
        np.testing.assert_array_equal(pooled.matmul(x), serial.matmul(x))


@pytest.mark.parametrize("kernels", KERNELS)  # numba: helpers and caller poll before they sleep (pool_jit)
def test_pool_runs_every_task_once_and_raises_the_first_error(kernels: str) -> None:
    if kernels == "numba":
        pytest.importorskip("numba")
    ws = Workspace(threads=3, kernels=kernels)
    if not ws.pooled:
        pytest.skip("numpy's BLAS is not one threadpoolctl controls: the pool is never used")
    seen: list[int] = []
    ws.run([lambda s, i=i: seen.append(i) for i in range(50)])
    assert sorted(seen) == list(range(50))

    def fail(scratch: Scratch) -> None:
        raise ValueError("task failed")

    with pytest.raises(ValueError, match="task failed"):
        ws.run([fail, *[lambda s: None] * 5])
    ws.run([lambda s, i=i: seen.append(i) for i in range(50, 60)])  # the pool still works after an error
    assert sorted(seen) == list(range(60))


def test_polling_helpers_fall_asleep_when_idle_and_still_take_work() -> None:
    """With the compiled kernels a helper polls for the next batch for a bounded time, then sleeps."""
    pytest.importorskip("numba")
    ws = Workspace(threads=3, kernels="numba")
    if not ws.pooled:
        pytest.skip("numpy's BLAS is not one threadpoolctl controls: the pool is never used")
    seen: list[int] = []
    ws.run([lambda s, i=i: seen.append(i) for i in range(20)])
    helpers = ws._helpers
    assert helpers is not None and helpers.polls is not None
    deadline = time.monotonic() + 30  # SPIN_US is a fraction of a millisecond; a busy machine may delay them
    while helpers.sleeping < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert helpers.sleeping == 2
    ws.run([lambda s, i=i: seen.append(i) for i in range(20, 40)])
    assert sorted(seen) == list(range(40))


def test_polls_see_another_threads_write_or_give_up() -> None:
    """The pool's compiled polling loop reads the counters afresh each time (no hoisted load) and is bounded."""
    pytest.importorskip("numba")
    from qwen_runtime.backend import pool_jit

    counters = np.zeros(2, np.int64)
    assert pool_jit.wait_total(counters, 0, 10) == pool_jit.wait_changed(counters, 1, 10) == pool_jit.CHANGED
    assert pool_jit.wait_total(counters, 1, 50) in (pool_jit.TIMED_OUT, pool_jit.PREEMPTED)
    assert pool_jit.wait_changed(counters, 0, 50) in (pool_jit.TIMED_OUT, pool_jit.PREEMPTED)
    writer = threading.Timer(0.02, counters.__setitem__, (1, 5))
    writer.start()
    while (result := pool_jit.wait_total(counters, 5, 30e6)) == pool_jit.PREEMPTED:
        pass  # a busy machine took the poller's CPU: poll again
    writer.join()
    assert result == pool_jit.CHANGED


def test_run_grid_covers_the_grid_once_by_blocks_or_whole() -> None:
    """Every cell of a 3 x 10 grid cut into 1 x 4 blocks is visited once, one task per block; without sharing
    one call on the calling thread covers the whole grid."""
    ws = Workspace(threads=2)
    seen = np.zeros((3, 10), int)
    blocks: list[tuple[slice, slice]] = []
    lock = threading.Lock()

    def task(rows: slice, cols: slice, scratch: Scratch) -> None:
        with lock:
            seen[rows, cols] += 1
            blocks.append((rows, cols))

    ws.run_grid(task, [3, 10], [1, 4])
    assert (seen == 1).all()
    assert sorted((r.start, c.start, c.stop) for r, c in blocks) == [(r, c, min(c + 4, 10)) for r in range(3)
                                                                      for c in (0, 4, 8)]
    blocks.clear()
    ws.run_grid(task, [3, 10], [1, 4], share=False)
    assert (seen == 2).all() and blocks == [(slice(0, 3), slice(0, 10))]


@pytest.mark.parametrize("kernels", KERNELS)
def test_pool_threads_end_with_their_workspace(kernels: str) -> None:
    if kernels == "numba":
        pytest.importorskip("numba")
    ws = Workspace(threads=2, kernels=kernels)
    if not ws.pooled:
        pytest.skip("numpy's BLAS is not one threadpoolctl controls: the pool is never used")
    before = set(threading.enumerate())
    ws.run([lambda s: None] * 4)
    helpers = [t for t in set(threading.enumerate()) - before if t.name.startswith("qwen-tiles")]
    assert len(helpers) == 1
    del ws
    gc.collect()
    for t in helpers:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in helpers)


def test_matmul_many_equals_separate_products() -> None:
    rng = np.random.default_rng(6)
    ws = Workspace(threads=2)
    weights = [make_weight(stored(qtype, rng.normal(0, 0.05, (rows, 64)).astype(np.float32)), ws, 16 * 64)
               for qtype, rows in ((QType.Q8_0, 50), (QType.F32, 20), (QType.F16, 33))]
    x = rng.normal(0, 1, (3, 64)).astype(np.float32)
    for fused, alone in zip(matmul_many(weights, x), [w.matmul(x) for w in weights], strict=True):
        np.testing.assert_array_equal(fused, alone)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtypes", [(QType.F32, QType.F32), (QType.F16, QType.F16), (QType.Q8_0, QType.Q8_0),
                                    (QType.Q8_0, QType.BF16), (QType.F32, QType.F16)])  # mixed kinds share tasks
@pytest.mark.parametrize("n", [1, 6, 20])
def test_gated_matmul_matches_reference(threads: int, qtypes: tuple[QType, QType], n: int) -> None:
    rng = np.random.default_rng(7)
    ws = Workspace(threads=threads)
    gate, up = (make_weight(stored(q, rng.normal(0, 0.3, (70, 64)).astype(np.float32)), ws, 16 * 64) for q in qtypes)
    x = rng.normal(0, 1, (n, 64)).astype(np.float32)
    g, u = x @ gate.to_float32().T, x @ up.to_float32().T
    ref = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(gated_matmul(gate, up, x), ref, rtol=1e-5, atol=1e-5)


def test_q8_0_scales_cached_per_tile_are_exact_with_zero_subnormal_and_inf_scales() -> None:
    rng = np.random.default_rng(8)
    w = rng.normal(0, 0.05, (40, 64)).astype(np.float32)
    w[3] = 0.0  # zero scales
    w[5] *= 1e-4  # subnormal fp16 scales
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    raw.reshape(40, 2, 34)[30, 1, :2].view(np.uint16)[0] = 0x7C00  # an inf scale in the tile of rows 20-39
    weight = make_weight(StoredTensor("w", QType.Q8_0, w.shape, "mem", data=raw), Workspace(), 20 * 64)
    x = rng.normal(0, 1, (2, 64)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ref, got = x @ weight.to_float32().T, weight.matmul(x)
        again = weight.matmul(x)  # scales now come from the per-tile cache
    np.testing.assert_allclose(got[:, :20], ref[:, :20], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, [20, 29, 31, 39]], ref[:, [20, 29, 31, 39]], rtol=1e-5, atol=1e-6)
    assert not np.isfinite(got[:, 30]).any() and not np.isfinite(ref[:, 30]).any()
    np.testing.assert_array_equal(again, got)


def test_gated_matmul_with_different_blocks_falls_back_to_separate_products() -> None:
    rng = np.random.default_rng(9)
    ws = Workspace(threads=2)
    gate = make_weight(stored(QType.Q8_0, rng.normal(0, 0.3, (70, 64)).astype(np.float32)), ws, 16 * 64)
    up = make_weight(stored(QType.F16, rng.normal(0, 0.3, (70, 64)).astype(np.float32)), ws, 8 * 64)
    assert gate.blocks() != up.blocks()
    x = rng.normal(0, 1, (3, 64)).astype(np.float32)
    g, u = x @ gate.to_float32().T, x @ up.to_float32().T
    np.testing.assert_allclose(gated_matmul(gate, up, x), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)


def test_blas_products_multiply_each_float32_matrix_in_one_call_like_the_pool() -> None:
    rng = np.random.default_rng(10)
    w, x = rng.normal(0, 0.05, (300, 96)).astype(np.float32), rng.normal(0, 1, (3, 96)).astype(np.float32)
    ws = Workspace(threads=2, blas_products=True)
    whole = make_weight(stored(QType.F32, w), ws, tile_elements=32 * 96)
    pooled = make_weight(stored(QType.F32, w), Workspace(threads=2), tile_elements=32 * 96)
    assert whole.blocks() == [(0, 300)] and len(pooled.blocks()) > 1 and not ws.pooled
    np.testing.assert_allclose(whole.matmul(x), pooled.matmul(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(whole.matmul(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_each_workspace_holds_its_own_blas_thread_count() -> None:
    blas = blas_controller()
    if blas is None:
        pytest.skip("numpy's BLAS is not one threadpoolctl controls")
    lib = blas.lib_controllers[0]
    whole, pooled = Workspace(threads=2, blas_products=True), Workspace(threads=2)
    pooled.run([lambda s: None, lambda s: None])
    assert lib.get_num_threads() == 1  # the pool's workers are the parallelism
    whole.run([lambda s: None])
    assert lib.get_num_threads() == 2  # whole-matrix products get BLAS's threads back
    with single_threaded_blas():
        assert lib.get_num_threads() == 1
    assert lib.get_num_threads() == 2


def test_model_policy_follows_stored_types() -> None:
    def files(*qtypes: QType) -> SimpleNamespace:
        tensors = {f"t{i}": StoredTensor(f"t{i}", q, (64, 64), "mem", data=np.zeros((64, 64), np.float32))
                   for i, q in enumerate(qtypes)}
        tensors["norm"] = StoredTensor("norm", QType.F16, (64,), "mem", data=np.zeros(64, np.float16))
        return SimpleNamespace(tensors=tensors)

    assert all_float32(files(QType.F32, QType.F32))  # vectors do not count
    assert not all_float32(files(QType.F32, QType.Q8_0))


def test_scratch_arrays_share_one_buffer() -> None:
    """Arrays asked for together are disjoint views of one buffer, which later requests reuse."""
    scratch = Scratch()
    a, b, c = scratch.arrays("work", [(3, 4), (5,), (2, 2, 2)])
    assert (a.shape, b.shape, c.shape) == ((3, 4), (5,), (2, 2, 2))
    a[...], b[...], c[...] = 1.0, 2.0, 3.0
    assert a.sum() == 12 and b.sum() == 10 and c.sum() == 24  # no overlap
    assert scratch.sizes() == {"work": 25}
    (d,) = scratch.arrays("work", [(10,)])
    assert np.shares_memory(d, a) and scratch.sizes() == {"work": 25}


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_large_scratch_buffers_are_returned_when_dropped() -> None:
    scratch = Scratch()
    before = _rss_anon_mib()
    scratch.array("work", (64, 1 << 16))[...] = 1.0  # 16 MiB, touched: counted as anonymous memory
    assert _rss_anon_mib() - before > 12
    scratch.clear()
    assert _rss_anon_mib() - before < 4
    small = buffer(100, np.int16)
    assert small.shape == (100,) and small.dtype == np.int16 and small.flags.writeable
