"""Gated DeltaNet kernels: chunked == recurrent, padding is inert, and (with torch) equal to transformers."""

from __future__ import annotations

import numpy as np
import pytest
from float_error import kernel_reference64
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen_runtime.formats.base import V_HEAD_GROUPED, V_HEAD_TILED, v_head_permutation
from qwen_runtime.models import gated_delta as gd

F32 = np.float32


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.normal(size=shape) * scale).astype(F32)


def _inputs(rng: np.random.Generator, b: int, t: int, hk: int, hv: int, dk: int, dv: int,
            order: str = V_HEAD_GROUPED) -> tuple[np.ndarray, ...]:
    """Prepared q, k [B, T, Hv, dk], v [B, T, Hv, dv], g, beta [B, T, Hv] and a state [B, Hv, dk, dv]."""
    q, k = gd.prepare_qk(_rand(rng, b, t, hk, dk), _rand(rng, b, t, hk, dk), hv, v_head_permutation(order, hk, hv))
    v = _rand(rng, b, t, hv, dv)
    g = -rng.uniform(0.0, 2.0, size=(b, t, hv)).astype(F32)
    beta = rng.uniform(0.0, 1.0, size=(b, t, hv)).astype(F32)
    return q, k, v, g, beta, _rand(rng, b, hv, dk, dv, scale=0.5)


# --- pure numpy properties -------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), b=st.integers(1, 3), t=st.integers(1, 150), hk=st.sampled_from([1, 2]),
       ratio=st.sampled_from([1, 2, 3]), dk=st.sampled_from([4, 8, 16]), dv=st.sampled_from([4, 8, 12]),
       chunk=st.sampled_from([8, 16, 64]), n_pad=st.integers(0, 40))
def test_chunked_equals_recurrent(seed: int, b: int, t: int, hk: int, ratio: int, dk: int, dv: int,
                                  chunk: int, n_pad: int) -> None:
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, state = _inputs(rng, b, t, hk, hk * ratio, dk, dv)
    valid = np.ones((b, t), dtype=bool)
    valid[0, : min(n_pad, t)] = False  # padding positions: g = 0, beta = 0 leave the state untouched
    g, beta = np.where(valid[..., None], g, 0), np.where(valid[..., None], beta, 0)
    s_rec, s_chunk = state.copy(), state.copy()
    inputs = [x.copy() for x in (q, k, v, g, beta)]
    o_rec = gd.recurrent_delta_rule(q, k, v, g, beta, s_rec)
    o_chunk = gd.chunked_delta_rule(q, k, v, g, beta, s_chunk, chunk=chunk)
    for before, after in zip(inputs, (q, k, v, g, beta), strict=True):
        np.testing.assert_array_equal(after, before)  # only the state is updated in place
    np.testing.assert_allclose(o_chunk, o_rec, atol=1e-5, rtol=0)
    np.testing.assert_allclose(s_chunk, s_rec, atol=1e-5, rtol=0)


def test_padding_leaves_state_untouched() -> None:
    rng = np.random.default_rng(1)
    q, k, v, g, beta, state = _inputs(rng, 1, 70, 2, 2, 8, 8)
    zeros = np.zeros_like(g)
    for rule in (gd.recurrent_delta_rule, gd.chunked_delta_rule):
        s = state.copy()
        rule(q, k, v, zeros, zeros, s)
        np.testing.assert_array_equal(s, state)


def test_padded_row_equals_solo_row() -> None:
    rng = np.random.default_rng(2)
    q, k, v, g, beta, state = _inputs(rng, 1, 90, 2, 4, 8, 8)
    pad = 13
    padded = [np.concatenate([np.ones_like(x[:, :pad]) * 7, x], axis=1) for x in (q, k, v)]
    gates = [np.concatenate([np.zeros_like(x[:, :pad]), x], axis=1) for x in (g, beta)]
    s_solo, s_pad = state.copy(), state.copy()
    o_solo = gd.chunked_delta_rule(q, k, v, g, beta, s_solo)
    o_pad = gd.chunked_delta_rule(*padded, *gates, s_pad)
    np.testing.assert_allclose(o_pad[:, pad:], o_solo, atol=1e-5)
    np.testing.assert_allclose(s_pad, s_solo, atol=1e-5)


@pytest.mark.parametrize("size", [1, 5, 8, 16, 20, 32, 48, 64, 128])
def test_invert_unit_lower(size: int) -> None:
    """Blocks merged by doubling (16·2^m rows), row by row otherwise: the inverse of I + strict either way."""
    rng = np.random.default_rng(3)
    strict = np.tril(_rand(rng, 3, 2, size, size, scale=0.3), -1)
    inverse = gd.invert_unit_lower(strict, np.full_like(strict, np.nan))
    want = np.linalg.inv(np.eye(size) + strict.astype(np.float64))
    np.testing.assert_allclose(inverse, want, atol=1e-5 * np.abs(want).max(), rtol=0)  # entries grow with size
    assert np.array_equal(np.triu(inverse, 1), np.zeros_like(inverse))


def _conv_reference(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> np.ndarray:
    """Direct definition: c_t = SiLU(Σ_j w[:, j] · m[t − K + 1 + j]) over [state | x]."""
    kernel = weight.shape[1]
    ext = np.concatenate([state, x], axis=1)
    out = np.stack([np.einsum("bkc,ck->bc", ext[:, t:t + kernel], weight) for t in range(x.shape[1])], axis=1)
    return out / (1 + np.exp(-out))


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_conv_prefill_then_decode_equals_one_shot(kernel: int) -> None:
    rng = np.random.default_rng(4)
    x, w = _rand(rng, 2, 9, 6), _rand(rng, 6, kernel)
    zero = np.zeros((2, kernel - 1, 6), F32)
    full, full_state = gd.causal_conv1d(x, w, zero)
    np.testing.assert_allclose(full, _conv_reference(x, w, zero), atol=1e-6)
    out, state = gd.causal_conv1d(x[:, :2], w, zero)
    pieces = [out]
    for t in range(2, 9):
        out, state = gd.causal_conv1d(x[:, t:t + 1], w, state)
        pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-6)
    np.testing.assert_array_equal(state, full_state)


def test_conv_left_padding_skips_pad_positions() -> None:
    rng = np.random.default_rng(5)
    x, w, state = _rand(rng, 3, 6, 5), _rand(rng, 5, 4), _rand(rng, 3, 3, 5)
    valid = np.arange(6)[None, :] >= np.array([0, 2, 6])[:, None]  # row 2 is all padding
    out, new_state = gd.causal_conv1d(x, w, state, valid)
    for row, pad in enumerate([0, 2, 6]):
        solo, solo_state = gd.causal_conv1d(x[row:row + 1, pad:], w, state[row:row + 1])
        np.testing.assert_allclose(out[row:row + 1, pad:], solo, atol=1e-6)
        np.testing.assert_array_equal(out[row, :pad], 0)
        np.testing.assert_array_equal(new_state[row:row + 1], solo_state)
    np.testing.assert_array_equal(new_state[2], state[2])


def test_conv_rejects_non_left_padding() -> None:
    x = np.zeros((1, 4, 3), F32)
    with pytest.raises(ValueError, match="left padding"):
        gd.causal_conv1d(x, np.ones((3, 2), F32), np.zeros((1, 1, 3), F32), np.array([[True, False, True, True]]))


def test_value_head_orders_are_permutations_of_each_other() -> None:
    """Tiled order with value heads permuted from grouped order gives the same per-head result."""
    rng = np.random.default_rng(6)
    hk, ratio = 2, 3
    hv = hk * ratio
    q0, k0 = _rand(rng, 1, 20, hk, 8), _rand(rng, 1, 20, hk, 8)
    v, g = _rand(rng, 1, 20, hv, 4), -rng.uniform(0, 1, (1, 20, hv)).astype(F32)
    beta = rng.uniform(0, 1, (1, 20, hv)).astype(F32)
    # tiled head j = grouped head (j % hk) * ratio + j // hk
    perm = np.array([(j % hk) * ratio + j // hk for j in range(hv)])
    np.testing.assert_array_equal(v_head_permutation(V_HEAD_TILED, hk, hv), perm)
    outs = {}
    for order, p in ((V_HEAD_GROUPED, np.arange(hv)), (V_HEAD_TILED, perm)):
        q, k = gd.prepare_qk(q0, k0, hv, v_head_permutation(order, hk, hv))
        state = np.zeros((1, hv, 8, 4), F32)
        outs[order] = gd.chunked_delta_rule(q, k, v[:, :, p], g[:, :, p], beta[:, :, p], state, chunk=8)
    np.testing.assert_allclose(outs[V_HEAD_TILED], outs[V_HEAD_GROUPED][:, :, perm], atol=1e-6)


@pytest.mark.parametrize(("hk", "hv"), [(2, 2), (2, 6), (3, 12)])
def test_key_head_index_matches_repeat_and_tile(hk: int, hv: int) -> None:
    """Grouped order repeats each key head Hv/Hk times, tiled order tiles the key heads (docs §3.4)."""
    x = np.arange(hk, dtype=F32)[None, None, :, None] * np.ones((1, 2, 1, 3), F32)  # [1, 2, Hk, 3]
    grouped = gd.expand_key_heads(x, hv, v_head_permutation(V_HEAD_GROUPED, hk, hv))
    tiled = gd.expand_key_heads(x, hv, v_head_permutation(V_HEAD_TILED, hk, hv))
    np.testing.assert_array_equal(grouped, np.repeat(x, hv // hk, axis=2))
    np.testing.assert_array_equal(tiled, np.tile(x, (1, 1, hv // hk, 1)))
    with pytest.raises(ValueError, match="value-head order"):
        v_head_permutation("sideways", hk, hv)


def test_gates_zero_on_padding() -> None:
    b, a = np.ones((1, 3, 2), F32), np.zeros((1, 3, 2), F32)
    beta, g = gd.gates(b, a, np.array([-2.0, -0.5], F32), np.array([0.1, 0.2], F32),
                       np.array([[False, True, True]]))
    np.testing.assert_array_equal(beta[0, 0], 0)
    np.testing.assert_array_equal(g[0, 0], 0)
    np.testing.assert_allclose(g[0, 1], [-2.0 * np.log1p(np.exp(0.1)), -0.5 * np.log1p(np.exp(0.2))], rtol=1e-6)
    np.testing.assert_allclose(beta[0, 1], 1 / (1 + np.exp(-1.0)), rtol=1e-6)


# --- transformers' own torch functions as the oracle -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.parametrize("t", [1, 5, 130])
def test_delta_rule_matches_transformers(hf, t: int) -> None:

    rng = np.random.default_rng(7)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 8
    q, k, v = _rand(rng, b, t, hk, dk), _rand(rng, b, t, hk, dk), _rand(rng, b, t, hv, dv)
    g = -rng.uniform(0, 2, (b, t, hv)).astype(F32)
    beta = rng.uniform(0, 1, (b, t, hv)).astype(F32)
    state = _rand(rng, b, hv, dk, dv)
    qn, kn = gd.prepare_qk(q, k, hv, v_head_permutation(V_HEAD_GROUPED, hk, hv))
    for hf_rule, ours in ((hf.torch_recurrent_gated_delta_rule, gd.recurrent_delta_rule),
                          (hf.torch_chunk_gated_delta_rule, gd.chunked_delta_rule)):
        (want_o, want_s), bound = kernel_reference64(
            lambda *a, rule=hf_rule: rule(*a[:5], initial_state=a[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True), q, k, v, g, beta, state)
        s = state.copy()
        got = ours(qn, kn, v, g, beta, s)
        np.testing.assert_allclose(got, want_o, atol=bound, rtol=0)
        np.testing.assert_allclose(s, want_s, atol=bound, rtol=0)


@pytest.mark.oracle
def test_conv_matches_transformers(hf) -> None:
    import torch

    rng = np.random.default_rng(8)
    x, w = _rand(rng, 2, 7, 6), _rand(rng, 6, 4)
    want = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), activation="silu")
    got, state = gd.causal_conv1d(x, w, np.zeros((2, 3, 6), F32))
    np.testing.assert_allclose(got, want.transpose(1, 2).numpy(), atol=1e-6)
    step = _rand(rng, 2, 1, 6)
    conv_state = torch.from_numpy(np.concatenate([np.zeros((2, 1, 6), F32), state], 1).transpose(0, 2, 1).copy())
    want_step = hf.causal_conv1d_update(torch.from_numpy(step).transpose(1, 2), conv_state, torch.from_numpy(w),
                                        activation="silu")
    got_step, _ = gd.causal_conv1d(step, w, state)
    np.testing.assert_allclose(got_step, want_step.transpose(1, 2).numpy(), atol=1e-6)


@pytest.mark.oracle
def test_gated_norm_matches_transformers(hf) -> None:
    import torch

    rng = np.random.default_rng(9)
    o, z, w = _rand(rng, 2, 3, 4, 8), _rand(rng, 2, 3, 4, 8), _rand(rng, 8)
    norm = hf.Qwen3_5RMSNormGated(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        (want,), bound = kernel_reference64(norm, o, z)
    np.testing.assert_allclose(gd.gated_rms_norm(o, z, w, 1e-6), want, atol=bound, rtol=0)


def test_strong_decay_has_no_subnormals() -> None:
    """Log-decays of -40 per token sum to -2500 over a chunk: flushed to 0, never float32 subnormals."""
    rng = np.random.default_rng(10)
    q, k, v, _, beta, state = _inputs(rng, 1, 70, 2, 2, 8, 8)
    g = np.full(beta.shape, -40.0, F32)
    s_rec, s_chunk = state.copy(), state.copy()
    o_rec = gd.recurrent_delta_rule(q, k, v, g, beta, s_rec)
    o_chunk = gd.chunked_delta_rule(q, k, v, g, beta, s_chunk)
    np.testing.assert_allclose(o_chunk, o_rec, atol=1e-5)
    np.testing.assert_allclose(s_chunk, s_rec, atol=1e-5)
    for x in (o_chunk, s_chunk, gd.decay_exp(np.array([-50.0, -61.0, -1000.0], F32))):
        assert not np.any((x != 0) & (np.abs(x) < np.finfo(F32).tiny))
