"""Pooled attention (one task per kv head) against a plain per-head softmax reference."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import KERNELS

from qwen_runtime.backend.cache import BatchState
from qwen_runtime.backend.ops import rope_cos_sin
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.models import attention


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, key_valid: np.ndarray, start: int) -> np.ndarray:
    """Loop over rows, heads and queries: causal over slots, padding slots masked, own slot always seen."""
    b, nh, t, hd = q.shape
    group = nh // keys.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for h in range(nh):
            for i in range(t):
                slot = start + i
                seen = [s for s in range(slot + 1) if key_valid[r, s] or s == slot]
                k, v = keys[r, h // group, seen], values[r, h // group, seen]
                scores = k @ q[r, h, i] / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                out[r, h, i] = p / p.sum() @ v
    return out


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start, t", [(0, 9), (9, 1), (6, 3)])  # prefill, one decode step, a chunk after a cache
@pytest.mark.parametrize("score_elements", [1 << 22, 40])  # 40: queries tiled one or two at a time
def test_attend_matches_reference(monkeypatch: pytest.MonkeyPatch, threads: int, start: int, t: int,
                                  score_elements: int, kernels: str) -> None:
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", score_elements)
    monkeypatch.setattr(attention, "POOL_WORK", 0)  # the pool even for these few scores
    rng = np.random.default_rng(0)
    b, nh, nkv, hd, s = 2, 6, 2, 8, start + t
    q = rng.normal(0, 1, (b, nh, t, hd)).astype(np.float32)
    keys, values = (rng.normal(0, 1, (b, nkv, s, hd)).astype(np.float32) for _ in range(2))
    key_valid = np.ones((b, s), bool)
    key_valid[1, :3] = False  # row 1 is left-padded by three slots
    positions = np.arange(start, s)[None].repeat(b, 0)
    state = BatchState(positions=positions, valid=key_valid[:, start:], start=start, key_valid=key_valid)
    if kernels == "numba":
        pytest.importorskip("numba")
    got = attention.attend(q, keys, values, state, Workspace(threads=threads, kernels=kernels))
    expected = reference(q, keys, values, key_valid, start)
    rows = key_valid[:, start:]  # outputs of padding queries are ignored by the model
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[rows], expected.transpose(0, 2, 1, 3)[rows],
                               rtol=1e-5, atol=1e-5)
    serial = attention.attend(q, keys, values, state, Workspace(threads=1, kernels=kernels))
    np.testing.assert_array_equal(got, serial)  # pool == serial, bit for bit


def test_batch_state_derives_once_per_pass() -> None:
    """Rotary cos/sin and the hidden slots are computed once and shared by every layer; an unpadded decode step
    hides nothing (its scores are not masked) and still matches the reference."""
    rng = np.random.default_rng(1)
    b, nh, nkv, hd, start = 2, 4, 2, 8, 5
    key_valid = np.ones((b, start + 1), bool)
    state = BatchState(positions=np.full((b, 1), start), valid=key_valid[:, start:], start=start, key_valid=key_valid)
    cos, sin = state.rotary(hd, 10000.0)
    assert state.rotary(hd, 10000.0)[0] is cos
    expected_cos, expected_sin = rope_cos_sin(state.positions, hd, 10000.0)
    assert np.array_equal(cos, expected_cos) and np.array_equal(sin, expected_sin)
    assert state.hidden() is None
    q = rng.normal(0, 1, (b, nh, 1, hd)).astype(np.float32)
    keys, values = (rng.normal(0, 1, (b, nkv, start + 1, hd)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(attention.attend(q, keys, values, state), reference(q, keys, values, key_valid, start),
                               rtol=1e-5, atol=1e-5)
    padded = key_valid.copy()
    padded[1, :2] = False
    state = BatchState(positions=np.full((b, 1), start), valid=padded[:, start:], start=start, key_valid=padded)
    hidden = state.hidden()  # [B, 1, 1, T, S]
    assert state.hidden() is hidden and hidden.shape == (b, 1, 1, 1, start + 1)
    assert np.array_equal(hidden[:, 0, 0, 0], ~padded)
