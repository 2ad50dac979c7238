"""The float32 error model of float_error.py against real float32 arithmetic (no torch needed for the first)."""

from __future__ import annotations

import numpy as np
import pytest
from float_error import UNIT_ROUNDOFF, check_rows, tolerance


def test_inner_product_model_matches_sequential_float32_sums() -> None:
    """The modelled variance of a left-to-right float32 sum bounds its measured variance, and not loosely.

    ``np.cumsum`` adds strictly in order, the worst order the model assumes; the product rounding is included by
    rounding each product to float32 first.
    """
    rng = np.random.default_rng(0)
    for k, mean in ((64, 0.0), (1024, 0.0), (1024, 0.3)):
        x = rng.standard_normal((4000, k)) + mean
        w = rng.standard_normal(k)
        terms = (x.astype(np.float32) * w.astype(np.float32)).astype(np.float32)
        exact = x.astype(np.float32).astype(np.float64) @ w.astype(np.float32).astype(np.float64)
        got = np.cumsum(terms, axis=1, dtype=np.float32)[:, -1].astype(np.float64)
        products = terms.astype(np.float64)
        modelled = (UNIT_ROUNDOFF**2 / 3) * ((k / 2 + 1) * (products**2).sum(1) + (k / 3) * exact**2)
        ratio = np.mean((got - exact) ** 2) / np.mean(modelled)
        assert 0.2 < ratio < 1.0, (k, mean, ratio)


def test_check_rows_uses_the_bar_or_the_bound() -> None:
    ref = np.zeros((2, 4))
    bound = np.array([1e-5, 5e-4], np.float32)
    np.testing.assert_array_equal(tolerance(bound), [1e-4, bound[1]])
    check_rows(np.array([[9e-5] * 4, [4e-4] * 4]), ref, bound, "ok")
    with pytest.raises(AssertionError, match="row 0"):
        check_rows(np.array([[2e-4] * 4, [0.0] * 4]), ref, bound, "bad")
