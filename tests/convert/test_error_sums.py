"""The one streaming error accumulator of inspect and verify (qwen_convert/error_sums.py) against whole-array numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qwen_convert.error_sums import ErrorSums


def whole(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = b64 - a64
    return {"max_abs": float(np.abs(d).max()), "rmse": float(np.sqrt(np.mean(d * d))),
            "snr_db": float(10 * np.log10((a64 @ a64) / (d @ d))),
            "cosine": float(a64 @ b64 / np.sqrt((a64 @ a64) * (b64 @ b64)))}


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_streamed_chunks_and_merged_totals_equal_whole_arrays(chunk: int) -> None:
    """Sums over row chunks, and two halves merged, give numpy's statistics of the whole tensor (float64 sums of
    float32 data: relative differences of a few float64 ulps per row summed)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 96)).astype(np.float32)
    b = (a + rng.standard_normal(a.shape) * 1e-3).astype(np.float32)
    sums, halves = ErrorSums(), [ErrorSums(), ErrorSums()]
    for r in range(0, len(a), chunk):
        sums.add(a[r:r + chunk], b[r:r + chunk])
        halves[r >= len(a) // 2].add(a[r:r + chunk], b[r:r + chunk])
    halves[0].merge(halves[1])
    want = whole(a, b)
    for got in (sums, halves[0]):
        assert got.n == a.size and got.nonfinite == 0
        assert got.max_abs == want["max_abs"]
        for name in ("rmse", "snr_db", "cosine"):
            assert getattr(got, name) == pytest.approx(want[name], rel=1e-12)


def test_non_finite_differences_are_counted_not_summed() -> None:
    """An inf or NaN difference makes max |error| infinite and leaves the other statistics to the finite pairs
    (before the one accumulator, inspect --compare crashed on inf and reported NaN statistics)."""
    a = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    b = np.array([[1.5, np.inf, np.nan, 4.0]], np.float32)
    sums = ErrorSums()
    diff = sums.add(a, b)
    assert np.isinf(diff[0, 1]) and np.isnan(diff[0, 2])
    assert sums.n == 2 and sums.nonfinite == 2 and sums.max_abs == math.inf
    assert sums.rmse == pytest.approx(math.sqrt(0.25 / 2), rel=1e-15)
    assert math.isfinite(sums.snr_db) and math.isfinite(sums.cosine)


def test_equal_tensors_and_detected_offset_and_scale() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 32)).astype(np.float32)
    same = ErrorSums()
    same.add(a, a)
    assert same.max_abs == 0 and same.snr_db == math.inf and same.cosine == pytest.approx(1.0, rel=1e-15)
    assert same.offset() is None and same.scale() is None
    shifted, scaled = ErrorSums(), ErrorSums()
    shifted.add(a, a + np.float32(0.25))
    scaled.add(a, a * np.float32(1.007))
    assert shifted.offset() == pytest.approx(0.25, rel=1e-6)
    assert scaled.scale() == pytest.approx(1.007, rel=1e-6) and scaled.offset() is None
