"""The compiled (numba) twins of a decode step's small ops against their numpy references.

Tolerances are the float32 error bounds the twins' docstrings derive (u = 2^-24): each implementation is within a
bound of the exact result, so the two are within twice it.  Where a twin rounds in the reference's order the test
asserts bit equality.  Edge cases: a length-1 cache, left padding, ragged rows, several heads and groups, query
heads sharing a kv head, tiled and grouped value heads, decays flushed to 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from qwen_runtime.backend import ops
from qwen_runtime.backend.cache import BatchState
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.formats.base import V_HEAD_GROUPED, V_HEAD_TILED, v_head_permutation
from qwen_runtime.models import attention
from qwen_runtime.models import gated_delta as gd

numba = pytest.importorskip("numba")
ops_jit = pytest.importorskip("qwen_runtime.backend.ops_jit")
aj = pytest.importorskip("qwen_runtime.models.attention_jit")
gdj = pytest.importorskip("qwen_runtime.models.gated_delta_jit")

F32 = np.float32
U = 2.0**-24  # float32 unit roundoff
EXP_ULPS = 2 + 2.5  # exp32 (2 ulp) and numpy's float32 exp (2.5 ulp) apart, in ulp (2u each)
SIGMOID = 2 * EXP_ULPS * U + 6 * U  # 1/(1+e^-x), x/(1+e^-x): the exps apart, plus add, divide, multiply on each side


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.normal(size=shape) * scale).astype(F32)


@numba.njit
def _exp_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.size):
        out[i] = ops_jit.exp32(x[i])


def test_exp32_within_two_ulp() -> None:
    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001), [0.0, -1e-30, 1e-30, 0.5, -0.5]]).astype(F32)
    out = np.empty_like(x)
    _exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    assert np.all(np.abs(out - exact) <= 2.0**-22 * exact)
    edges = np.array([-np.inf, -1000.0, -88.0, 89.0, 1000.0, np.inf], F32)
    clamped = np.empty_like(edges)
    _exp_all(edges, clamped)
    tiny = np.finfo(F32).tiny
    assert np.all(np.isfinite(clamped)) and np.all(clamped[:3] >= tiny) and np.all(clamped[:3] <= 1.05 * tiny)


@pytest.mark.parametrize("shape", [(1, 1, 896), (3, 5, 64), (2, 1), (4, 7, 128)])
def test_rms_norm_within_bound(shape: tuple[int, ...]) -> None:
    """|twin - numpy| ≤ (D + 10)·u·|numpy| (ops_jit's docstring); in place and on strided rows too."""
    rng = np.random.default_rng(0)
    x, w = rand(rng, *shape, scale=3.0), rand(rng, shape[-1])
    want = ops.rms_norm(x, w, 1e-6)
    bound = (shape[-1] + 10) * U * np.abs(want)
    assert np.all(np.abs(ops_jit.rms_norm(x, w, 1e-6) - want) <= bound)
    inplace = x.copy()
    assert ops_jit.rms_norm(inplace, w, 1e-6, out=inplace) is inplace
    assert np.all(np.abs(inplace - want) <= bound)
    if len(shape) == 3:  # the last token of each row (a strided view, as ``forward(last_only=True)`` passes it)
        last = ops_jit.rms_norm(x[:, -1:], w, 1e-6)
        assert np.all(np.abs(last - want[:, -1:]) <= bound[:, -1:])


def test_add_rms_norm() -> None:
    rng = np.random.default_rng(1)
    h, delta, w = rand(rng, 2, 3, 96), rand(rng, 2, 3, 96), rand(rng, 96)
    total, normed = ops_jit.add_rms_norm(h, delta, w, 1e-6)
    np.testing.assert_array_equal(total, h + delta)
    want = ops.rms_norm(h + delta, w, 1e-6)
    assert np.all(np.abs(normed - want) <= (96 + 10) * U * np.abs(want))


def test_silu_mul() -> None:
    """Within SiLU's bound of ops.silu_mul (plus the product's rounding), on a column block of a wider array as
    ``weights.gated_matmul`` passes it, and in place."""
    rng = np.random.default_rng(11)
    gate, up = rand(rng, 3, 50, scale=6.0), rand(rng, 3, 50)
    want = ops.silu_mul(gate.copy(), up)
    bound = (SIGMOID + U) * np.abs(want) + np.finfo(F32).tiny
    assert np.all(np.abs(ops_jit.silu_mul(gate, up) - want) <= bound)
    wide = np.zeros((3, 80), F32)
    wide[:, 10:60] = gate
    block = wide[:, 10:60]
    assert ops_jit.silu_mul(block, up, out=block) is block
    assert np.all(np.abs(wide[:, 10:60] - want) <= bound) and not wide[:, :10].any() and not wide[:, 60:].any()


# --- attention ---------------------------------------------------------------------------------------------------


def reference_heads(y: np.ndarray, hd: int, bias: np.ndarray | None, norm: np.ndarray | None, cos: np.ndarray | None,
                    sin: np.ndarray | None) -> np.ndarray:
    """The numpy path: bias, rms_norm, heads first, rope.  # [B, T, heads, width] -> [B, heads, T, hd]"""
    x = y[..., :hd] + (0 if bias is None else bias.reshape(y.shape[2], hd))
    if norm is not None:
        x = ops.rms_norm(x, norm, 1e-6)
    x = x.transpose(0, 2, 1, 3)
    return x if cos is None else ops.apply_rope(x, cos, sin)


@pytest.mark.parametrize("rotary", [16, 4])  # whole head, Qwen3.5's partial rotary
@pytest.mark.parametrize("width", [16, 32])  # a plain projection, Qwen3.5's query + gate per head
def test_prepare_heads(rotary: int, width: int) -> None:
    """Bias and RoPE round as the numpy path (bit-identical); the norm within its bound, carried through RoPE."""
    rng = np.random.default_rng(2)
    b, t, heads, hd, slots = 2, 3, 3, 16, 9
    y, bias, norm = rand(rng, b, t, heads, width), rand(rng, heads * hd), rand(rng, hd)
    positions = np.array([[4, 5, 6], [0, 1, 2]])
    cos, sin = ops.rope_cos_sin(positions, rotary, 10000.0)
    eps = F32(1e-6)
    out = np.empty((b, heads, t, hd), F32)
    aj.prepare_heads(y, bias, None, eps, cos, sin, None, out)
    np.testing.assert_array_equal(out, reference_heads(y, hd, bias, None, cos, sin))
    aj.prepare_heads(y, None, norm, eps, cos, sin, None, out)
    want = reference_heads(y, hd, None, norm, cos, sin)
    normed = np.abs(reference_heads(y, hd, None, norm, None, None))  # |x| before the rotation
    half = rotary // 2
    carried = normed.copy()  # |x1 c| + |x2 s| and |x2 c| + |x1 s| on the rotated dims
    c, s = np.abs(cos[:, None]), np.abs(sin[:, None])
    carried[..., :half] = normed[..., :half] * c + normed[..., half:rotary] * s
    carried[..., half:rotary] = normed[..., half:rotary] * c + normed[..., :half] * s
    assert np.all(np.abs(out - want) <= 2 * (hd + 10) * U * carried)
    cache = np.full((b, heads, slots, hd), np.nan, F32)  # writes land at the slots, nowhere else
    where = np.array([[2, 3, 4], [6, 7, 8]])
    aj.prepare_heads(y, bias, None, eps, None, None, where, cache)
    plain = reference_heads(y, hd, bias, None, None, None)
    for row in range(b):
        np.testing.assert_array_equal(cache[row][:, where[row]], plain[row])
    assert np.isnan(cache[0][:, [0, 1, 5, 6, 7, 8]]).all() and np.isnan(cache[1][:, :6]).all()


def attention_bound(q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState) -> np.ndarray:
    """Per-output bound of one float32 implementation (attention_jit's docstring).  # -> [B, nh, T, hd]

    Scores: (hd + 2)·u·Σ|q̃·k| (q̃ = the scaled query); weights p: the scores' errors twice (own and the max), the
    exp's EXP_ULPS ulp, S roundings of the sum and the division; outputs: (ε_p + S·u)·Σ p|v|.
    """
    b, nh, t, hd = q.shape
    group = nh // keys.shape[1]
    slots, real = state.slots()
    bound = np.zeros(q.shape)
    scaled = q.astype(np.float64) * float(F32(1.0 / np.sqrt(hd)))
    for r in range(b):
        for h in range(nh):
            for i in range(t):
                own = slots[r, i]
                seen = [s for s in range(own + 1) if real[r, s] or s == own]
                k, v = keys[r, h // group, seen].astype(np.float64), values[r, h // group, seen].astype(np.float64)
                scores = k @ scaled[r, h, i]
                err = (hd + 2) * U * (np.abs(k) @ np.abs(scaled[r, h, i]))
                p = np.exp(scores - scores.max())
                p /= p.sum()
                eps_p = 2 * (2 * err.max() + U * np.ptp(scores) + 2 * EXP_ULPS * U) + (len(seen) + 1) * U
                bound[r, h, i] = (eps_p + len(seen) * U) * (p @ np.abs(v))
    return bound


def aligned_state(valid: np.ndarray, start: int, t: int) -> BatchState:
    """Slot-aligned batch: new tokens at slots start..start+t-1; ``valid`` [B, start + t]."""
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)[:, start:]
    return BatchState(positions, valid[:, start:], start, valid)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize(("start", "t", "pad"), [(0, 1, 0), (8, 1, 3), (6, 3, 2), (0, 4, 0)])
def test_attend_within_bound(heads: int, kv_heads: int, start: int, t: int, pad: int) -> None:
    """A length-1 cache, decode steps over left-padded rows, a few tokens after a cache, a first chunk."""
    rng = np.random.default_rng(3)
    b, hd, cap = 2, 16, 16
    q = rand(rng, b, heads, t, hd)
    keys, values = rand(rng, b, kv_heads, cap, hd, scale=2.0), rand(rng, b, kv_heads, cap, hd)
    valid = np.ones((b, start + t), bool)
    valid[1, :pad] = False
    state = aligned_state(valid, start, t)
    ws = Workspace(threads=1, kernels="numba")
    got = attention.attend(q, keys, values, state, ws)
    want = attention.attend(q, keys[:, :, :start + t], values[:, :, :start + t], state)
    rows = valid[:, start:]  # outputs of padding queries are ignored by the model
    bound = 2 * attention_bound(q, keys, values, state)
    assert np.all((np.abs(got - want) <= bound).transpose(0, 2, 1, 3)[rows])


def test_ragged_attention_reads_only_own_slots() -> None:
    """Rows holding 3, 11 and 7 tokens: each within bound of numpy's row-by-row result, slots past a row unread."""
    rng = np.random.default_rng(4)
    lengths, t, heads, kv, hd, cap = np.array([3, 11, 7]), 2, 4, 2, 16, 20
    q = rand(rng, 3, heads, t, hd)
    keys, values = rand(rng, 3, kv, cap, hd), rand(rng, 3, kv, cap, hd)
    valid = np.ones((3, t), bool)
    state = BatchState(lengths[:, None] + np.arange(t), valid, 0, valid, lengths)
    want = attention.attend(q, keys, values, state)
    for row, length in enumerate(lengths.tolist()):
        keys[row, :, length + t:] = np.nan
        values[row, :, length + t:] = np.nan
    got = attention.attend(q, keys, values, state, Workspace(threads=1, kernels="numba"))
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= 2 * attention_bound(q, np.nan_to_num(keys), np.nan_to_num(values), state))


def test_attention_step_is_its_parts() -> None:
    """The fused call equals prepare_heads of q, k, v and attention over the written cache, bit for bit."""
    rng = np.random.default_rng(9)
    b, t, heads, kv, hd, cap = 2, 2, 4, 2, 16, 12
    yq, yk, yv = rand(rng, b, t, heads, 2 * hd), rand(rng, b, t, kv, hd), rand(rng, b, t, kv, hd)
    norms = rand(rng, hd), rand(rng, hd)
    valid = np.ones((b, 5 + t), bool)
    valid[0, :2] = False
    state = aligned_state(valid, 5, t)
    cos, sin = state.rotary(8, 10000.0)
    slots, real = state.slots()
    keys, values = rand(rng, b, kv, cap, hd), rand(rng, b, kv, cap, hd)
    keys2, values2 = keys.copy(), values.copy()
    eps = F32(1e-6)
    got = aj.attention_step(yq, yk, yv, None, None, None, *norms, eps, cos, sin, slots, real, keys, values)
    q = np.empty((b, heads, t, hd), F32)
    aj.prepare_heads(yq, None, norms[0], eps, cos, sin, None, q)
    aj.prepare_heads(yk, None, norms[1], eps, cos, sin, slots, keys2)
    aj.prepare_heads(yv, None, None, eps, None, None, slots, values2)
    np.testing.assert_array_equal(keys, keys2)
    np.testing.assert_array_equal(values, values2)
    np.testing.assert_array_equal(got, aj.attend(q, keys2, values2, slots, real))


def test_sigmoid_gate() -> None:
    rng = np.random.default_rng(5)
    b, heads, t, hd = 2, 3, 2, 8
    o, q_gate = rand(rng, b, heads, t, hd), rand(rng, b, t, heads, 2 * hd, scale=4.0)
    want = attention.merge_heads(o) * ops.sigmoid(q_gate[..., hd:].reshape(b * t, heads * hd))
    assert np.all(np.abs(aj.gate(o, q_gate) - want) <= SIGMOID * np.abs(want))


# --- Gated DeltaNet ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3])
def test_conv_step(t: int) -> None:
    """Sums in the reference's tap order (bit-identical state and pre-activation), SiLU within its bound;
    padding: zero output, state untouched."""
    rng = np.random.default_rng(6)
    b, c, k = 3, 40, 4
    x, weight, state = rand(rng, b, t, c), rand(rng, c, k), rand(rng, b, k - 1, c)
    valid = np.ones((b, t), bool)
    valid[1, :1] = False
    valid[2, :] = False
    want, want_state = gd.causal_conv1d(x, weight, state, valid)
    got, got_state = x.copy(), state.copy()
    gdj.conv_step(got, np.ascontiguousarray(weight.T), got_state, valid)
    np.testing.assert_array_equal(got_state, want_state)
    np.testing.assert_array_equal(got_state[2], state[2])
    assert np.all(np.abs(got - want) <= SIGMOID * np.abs(want) + np.finfo(F32).tiny)
    assert not got[~valid].any()


def delta_inputs(rng: np.random.Generator, b: int, t: int, hk: int, hv: int, dk: int, dv: int,
                 ) -> dict[str, np.ndarray]:
    """Random conv output, gate inputs and a state, as a decode step of GatedDeltaNet sees them."""
    return {"mixed": rand(rng, b, t, 2 * hk * dk + hv * dv), "z": rand(rng, b, t, hv, dv),
            "b_gate": rand(rng, b, t, hv), "a_gate": rand(rng, b, t, hv),
            "ssm_a": -rng.uniform(1.0, 16.0, hv).astype(F32), "dt_bias": rand(rng, hv),
            "norm": rand(rng, dv), "state": rand(rng, b, hv, dk, dv, scale=0.5)}


def delta_reference(inp: dict[str, np.ndarray], hk: int, order: str, valid: np.ndarray,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The numpy path of a decode step: (gated-norm output [B, T, Hv, dv], new state)."""
    hv, dk, dv = inp["state"].shape[1:]
    q, k, v = gd.split_qkv(inp["mixed"], hk, dk, dv)
    qh, kh = gd.prepare_qk(q, k, hv, v_head_permutation(order, hk, hv))
    beta, g = gd.gates(inp["b_gate"], inp["a_gate"], inp["ssm_a"], inp["dt_bias"], valid)
    state = inp["state"].copy()
    o = gd.recurrent_delta_rule(qh, kh, v, g, beta, state)
    return gd.gated_rms_norm(o, inp["z"], inp["norm"], 1e-6), state


def delta_compiled(inp: dict[str, np.ndarray], hk: int, order: str, valid: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray]:
    hv, _, dv = inp["state"].shape[1:]
    state = inp["state"].copy()
    out = np.empty((*inp["mixed"].shape[:2], hv, dv), F32)
    keys = gd.key_head_index(hk, hv, v_head_permutation(order, hk, hv))
    gdj.delta_step(inp["mixed"], inp["z"], inp["b_gate"], inp["a_gate"], keys,
                   inp["ssm_a"], inp["dt_bias"], inp["norm"], F32(1e-6), valid, state, out)
    return out, state


def delta_bound(inp: dict[str, np.ndarray], hk: int, order: str) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of one float32 implementation of a one-token step (gated_delta_jit's docstring), from float64
    magnitudes.  # -> [B, 1, Hv, dv], [B, Hv, dk, dv]

    l2 norms: (dk + 6)·u per element; β: 8u; e^g: (8|g| + 8)·u; reads Sᵀk, Sᵀq and q·k: (dk + 2·(dk + 6))·u of their
    absolute sums; u, o and S: those carried through, plus two roundings of their terms; the gated norm: o's error
    scaled by the norm, its own rms error (half the relative error of the mean square) and SiLU's.
    """
    hv, dk, dv = inp["state"].shape[1:]
    q, k, v = (x.astype(np.float64) for x in gd.split_qkv(inp["mixed"][:, :1], hk, dk, dv))
    keys = gd.key_head_index(hk, hv, v_head_permutation(order, hk, hv))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + gd.L2_EPS) * dk**-0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + gd.L2_EPS)
    q, k, v = q[:, 0, keys], k[:, 0, keys], v[:, 0]  # [B, Hv, d]
    beta = 1 / (1 + np.exp(-inp["b_gate"][:, 0].astype(np.float64)))  # [B, Hv]
    g = inp["ssm_a"] * np.logaddexp(0.0, inp["a_gate"][:, 0].astype(np.float64) + inp["dt_bias"])
    decay = np.exp(g)
    s = inp["state"].astype(np.float64)  # [B, Hv, dk, dv]
    eps_n, eps_beta, eps_decay = (dk + 6) * U, 8 * U, (8 * np.abs(g) + 8) * U
    sums = (dk + 2 * (dk + 6)) * U
    rq, rk = np.einsum("bhi,bhid->bhd", q, s), np.einsum("bhi,bhid->bhd", k, s)
    err_rq = sums * np.einsum("bhi,bhid->bhd", np.abs(q), np.abs(s))
    err_rk = sums * np.einsum("bhi,bhid->bhd", np.abs(k), np.abs(s))
    d, bt = decay[..., None], beta[..., None]
    u = bt * (v - d * rk)
    err_u = bt * (d * err_rk + eps_decay[..., None] * d * np.abs(rk) + 2 * U * (np.abs(v) + d * np.abs(rk))) \
        + (eps_beta + U) * np.abs(u)
    qk = (q * k).sum(-1, keepdims=True)
    err_qk = sums * np.abs(q * k).sum(-1, keepdims=True)
    o = d * rq + qk * u
    err_o = d * err_rq + eps_decay[..., None] * d * np.abs(rq) + err_qk * np.abs(u) + np.abs(qk) * err_u \
        + 2 * U * (d * np.abs(rq) + np.abs(qk * u))
    absk, dd = np.abs(k)[..., None], d[..., None]
    err_s = eps_decay[..., None, None] * dd * np.abs(s) + eps_n * absk * np.abs(u)[:, :, None] \
        + absk * err_u[:, :, None] + 2 * U * (dd * np.abs(s) + absk * np.abs(u)[:, :, None])
    z = inp["z"][:, 0].astype(np.float64)
    inv = 1 / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-6)
    gate = inp["norm"] * z / (1 + np.exp(-z))
    final = o * inv * gate
    eps_inv = (np.abs(o) * err_o).sum(-1, keepdims=True) / (o * o).sum(-1, keepdims=True) + (dv + 10) * U
    err_final = np.abs(inv * gate) * err_o + np.abs(final) * (eps_inv + SIGMOID + 3 * U)
    return err_final[:, None], err_s


@pytest.mark.parametrize(("hk", "hv", "order"), [(2, 2, V_HEAD_GROUPED), (2, 4, V_HEAD_GROUPED), (2, 6, V_HEAD_TILED)])
def test_delta_step_within_bound(hk: int, hv: int, order: str) -> None:
    rng = np.random.default_rng(7)
    inp = delta_inputs(rng, 2, 1, hk, hv, 16, 8)
    valid = np.ones((2, 1), bool)
    (want, want_state), (got, got_state) = (f(inp, hk, order, valid) for f in (delta_reference, delta_compiled))
    err_out, err_state = delta_bound(inp, hk, order)
    assert np.all(np.abs(got_state - want_state) <= 2 * err_state)
    assert np.all(np.abs(got - want) <= 2 * err_out)


def test_delta_step_tokens_in_turn_and_padding() -> None:
    """Three tokens in one call are three calls of one token, bit for bit; a padding token leaves the state as it
    was; a decay below e^-60 is exactly 0 (no subnormals)."""
    rng = np.random.default_rng(8)
    hk, hv, order = 2, 4, V_HEAD_TILED
    inp = delta_inputs(rng, 2, 3, hk, hv, 16, 8)
    valid = np.ones((2, 3), bool)
    valid[1, 0] = False
    out, state = delta_compiled(inp, hk, order, valid)
    step_state = inp["state"]
    for i in range(3):
        one = {**{name: x[:, i:i + 1] for name, x in inp.items() if name in ("mixed", "z", "b_gate", "a_gate")},
               **{name: inp[name] for name in ("ssm_a", "dt_bias", "norm")}, "state": step_state}
        step_out, new_state = delta_compiled({n: np.ascontiguousarray(x) for n, x in one.items()}, hk, order,
                                             np.ascontiguousarray(valid[:, i:i + 1]))
        if i == 0:
            np.testing.assert_array_equal(new_state[1], step_state[1])  # row 1's first token is padding
        np.testing.assert_array_equal(step_out[valid[:, i]], out[:, i:i + 1][valid[:, i]])
        step_state = new_state
    np.testing.assert_array_equal(state, step_state)
    strong = delta_inputs(rng, 2, 1, hk, hv, 16, 8)
    strong["ssm_a"], strong["a_gate"] = np.full(hv, -1e4, F32), np.full_like(strong["a_gate"], 5.0)
    ones = np.ones((2, 1), bool)
    (want, want_state), (got, got_state) = (f(strong, hk, order, ones) for f in (delta_reference, delta_compiled))
    assert not np.any((got_state != 0) & (np.abs(got_state) < np.finfo(F32).tiny))
    err_out, err_state = delta_bound(strong, hk, order)
    assert np.all(np.abs(got_state - want_state) <= 2 * err_state)
    assert np.all(np.abs(got - want) <= 2 * err_out)


def test_delta_heads_shared_among_threads_equal_one_delta_step() -> None:
    """A pass's (row, value head) pairs shared out in any blocks (the pool's threads) give delta_step's numbers."""
    rng = np.random.default_rng(10)
    hk, hv, order = 2, 4, V_HEAD_GROUPED
    inp = delta_inputs(rng, 2, 3, hk, hv, 16, 8)
    valid = np.array([[False, True, True], [True, True, True]])
    keys = gd.key_head_index(hk, hv, v_head_permutation(order, hk, hv))
    args = (inp["mixed"], inp["z"], inp["b_gate"], inp["a_gate"], keys, inp["ssm_a"], inp["dt_bias"], inp["norm"],
            F32(1e-6), valid)
    want, state = np.empty((2, 3, hv, 8), F32), inp["state"].copy()
    gdj.delta_step(*args, state, want)
    got, shared = np.empty_like(want), inp["state"].copy()
    for b0, b1, h0, h1 in ((1, 2, 1, 4), (0, 1, 0, 3), (1, 2, 0, 1), (0, 1, 3, 4)):
        gdj.delta_heads(*args, shared, b0, b1, h0, h1, got)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(shared, state)
