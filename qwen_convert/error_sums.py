"""One streaming error accumulator: the error of a tensor against a reference, chunk by chunk, in float64.

``qwen-inspect --compare`` (RMSE, max |error|, SNR and cosine per tensor and over a model) and verify's tensor
checks (max |error| beside each element's bound; on a failure, whether it is a constant offset or a scale) feed
it float32 row chunks and keep nothing but the sums, so a tensor of any size costs one chunk.  A pair whose
difference is not finite is counted, not summed: it makes ``max_abs`` infinite and leaves the other statistics
to the finite pairs.
"""

from __future__ import annotations

import math

import numpy as np


class ErrorSums:
    """Streaming float64 sums for the error of ``b`` against reference ``a``: the count of finite differences
    ``d = b - a`` (``nonfinite`` of the others), max ``|d|``, and the sums of ``a²``, ``b²``, ``a·b``, ``d`` and
    ``d²``."""

    def __init__(self) -> None:
        self.n = self.nonfinite = 0
        self.max_abs = self.aa = self.bb = self.ab = self.d = self.dd = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Add one chunk of ``a`` and ``b`` (same shape); returns ``b - a`` in float64, non-finite differences
        included, for a caller that checks each element."""
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        diff = b64 - a64
        finite = np.isfinite(diff)
        if finite.all():
            a64, b64, d = a64.ravel(), b64.ravel(), diff.ravel()
            self.max_abs = max(self.max_abs, float(np.abs(d).max(initial=0.0)))
        else:
            a64, b64, d = a64[finite], b64[finite], diff[finite]
            self.nonfinite += diff.size - d.size
            self.max_abs = math.inf
        self.n += d.size
        self.aa += float(a64 @ a64)
        self.bb += float(b64 @ b64)
        self.ab += float(a64 @ b64)
        self.d += float(d.sum())
        self.dd += float(d @ d)
        return diff

    def merge(self, other: ErrorSums) -> None:
        """Add another accumulator's sums (a model's total from its tensors')."""
        self.n, self.nonfinite = self.n + other.n, self.nonfinite + other.nonfinite
        self.max_abs = max(self.max_abs, other.max_abs)
        self.aa, self.bb, self.ab, self.d, self.dd = (self.aa + other.aa, self.bb + other.bb, self.ab + other.ab,
                                                      self.d + other.d, self.dd + other.dd)

    @property
    def rmse(self) -> float:
        return math.sqrt(self.dd / self.n) if self.n else 0.0

    @property
    def snr_db(self) -> float:
        """``10 log10(sum a² / sum d²)``; inf when ``b`` equals ``a``."""
        if self.dd == 0:
            return math.inf
        return 10 * math.log10(self.aa / self.dd) if self.aa > 0 else -math.inf

    @property
    def cosine(self) -> float:
        if self.aa == 0 or self.bb == 0:
            return 1.0 if self.aa == self.bb else 0.0
        return self.ab / math.sqrt(self.aa * self.bb)

    def offset(self) -> float | None:
        """The constant c when every difference is (nearly) the same non-zero c: ``b ≈ a + c``."""
        if not self.n:
            return None
        mean = self.d / self.n
        std = math.sqrt(max(self.dd / self.n - mean * mean, 0.0))
        return mean if abs(mean) > 0 and std <= 0.01 * abs(mean) else None

    def scale(self) -> float | None:
        """The least-squares k of ``b ≈ k·a`` when it differs from 1 beyond its own noise."""
        if not self.n or self.aa == 0:
            return None
        k = self.ab / self.aa
        residual = max(self.bb - 2 * k * self.ab + k * k * self.aa, 0.0)
        noise = math.sqrt(residual / self.aa)  # relative rms of what k does not explain
        return k if abs(k - 1) > 5 * noise / math.sqrt(self.n) + 1e-6 and noise < 0.5 * abs(k - 1) + 0.01 else None
