"""Prefill attention in tiles with an online softmax: the compiled tiles (``models/prefill_jit.py``) and the numpy
path of ``attention.attend``, against exact attention, against each other's invariances, and what they hold.

Tolerances come from the float32 error model of ``prefill_jit``'s docstring (u = 2^-24), evaluated per output from
the operands in float64 (:func:`bound`): each implementation is within it of the exact attention over the same
decoded keys and values.  The cases cross several blocks of slots and several tiles, and cover GQA groups of 1 to 7,
head dims 16 to 256, left padding longer than a block, a chunk after a long cache, a ragged batch and every cache
type.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import KERNELS, fixture_dir, load_exact, use_kernels

from qwen_runtime.backend.cache import CACHE_TYPE, BatchState, stored_type
from qwen_runtime.backend.pool import Workspace
from qwen_runtime.models import attention

U = 2.0**-24  # float32 unit roundoff
EXP_ULP = 2.5  # exp32 is within 2 ulp, numpy's float32 exp within 2.5 (its SIMD loops' documented bound)
NUMPY_BLOCK = 64  # slots of the numpy path's blocks in these tests (SCORE_ELEMENTS set to match)
COMPILED_BLOCK = 128  # prefill_jit.BLOCK (checked below where numba is present)


def aligned_state(valid: np.ndarray, start: int) -> BatchState:
    """A slot-aligned batch whose new tokens are slots ``start ..``; ``valid`` bool [B, S] (False: left padding)."""
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)[:, start:]
    return BatchState(positions, valid[:, start:], start, valid)


def ragged_state(lengths: np.ndarray, t: int) -> BatchState:
    """A ragged batch: row b holds ``lengths[b]`` tokens and gets ``t`` new ones after them."""
    ones = np.ones((len(lengths), t), bool)
    return BatchState(lengths[:, None] + np.arange(t), ones, 0, ones, lengths)


# (batch, heads, kv heads, head dim, start, new tokens, left padding per row); ragged: start = None, lengths below
CASES = {
    "first chunk, group 7": (1, 14, 2, 64, 0, 300, (0,)),
    "padding past a block": (2, 4, 2, 32, 0, 230, (0, 150)),
    "chunk after a cache, group 2": (1, 16, 8, 128, 500, 40, (0,)),
    "few tokens, head dim 256": (1, 3, 1, 256, 130, 7, (0,)),
    "head dim 16": (2, 4, 2, 16, 60, 90, (3, 0)),
    "ragged rows": (3, 4, 2, 32, None, 9, (5, 260, 131)),
}


def make_case(name: str, cache_type: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, BatchState]:
    """q [B, nh, T, hd] and keys/values [B, nkv, cap, hd / block] in ``cache_type`` (every slot written), the state."""
    b, nh, nkv, hd, start, t, rows = CASES[name]
    rng = np.random.default_rng(seed)
    if start is None:
        state = ragged_state(np.array(rows), t)
        cap = max(rows) + t + 3
    else:
        valid = np.ones((b, start + t), bool)
        for row, pad in enumerate(rows):
            valid[row, :pad] = False
        state = aligned_state(valid, start)
        cap = start + t
    q = rng.normal(0, 1, (b, nh, t, hd)).astype(np.float32)
    kind = CACHE_TYPE[cache_type]
    keys = kind.encode(rng.normal(0, 2, (b, nkv, cap, hd)).astype(np.float32))
    values = kind.encode(rng.normal(0, 1, (b, nkv, cap, hd)).astype(np.float32))
    return q, keys, values, state


def exact_and_bound(q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState,
                    block: int) -> tuple[np.ndarray, np.ndarray]:
    """Attention in float64 over the decoded keys and values, and the bound of one float32 implementation that takes
    the slots in blocks of ``block``.  # -> 2 x [B, nh, T, hd]

    Scores: (hd + 2)·u·Σ|q̃·k| (q̃ = q times the float32 scale, rounded once; hd fma roundings).  Each unnormalised
    weight: its own score's error and the running maximum's, the subtraction (u·ptp), exp's EXP_ULP ulp, and per
    block it crosses a rescale factor's (its argument's rounding, exp's ulp, the multiplication); normalised, twice
    that plus the sum's n + 2·blocks roundings and the division's.  Outputs: (ε_p + (n + 2·blocks + 2)·u)·Σ p|v|.
    """
    b, nh, t, hd = q.shape
    group = nh // keys.shape[1]
    k64, v64 = (stored_type(x).decode(x).astype(np.float64) for x in (keys, values))
    scaled = q.astype(np.float64) * float(np.float32(1.0 / np.sqrt(hd)))
    slots, real = state.slots()
    out, bound = np.zeros(q.shape), np.zeros(q.shape)
    for r in range(b):
        own = slots[r]  # [T]
        s = int(own.max()) + 1
        every = np.arange(s)
        seen = (every <= own[:, None]) & (real[r, :s] | (every == own[:, None]))  # [T, S]
        n, blocks = seen.sum(axis=1), own // block + 1  # [T]
        for h in range(nh):
            k, v = k64[r, h // group, :s], v64[r, h // group, :s]
            x = np.where(seen, scaled[r, h] @ k.T, -np.inf)  # [T, S]
            err = np.where(seen, (hd + 2) * U * (np.abs(scaled[r, h]) @ np.abs(k).T), 0).max(axis=1)
            top = x.max(axis=1)
            spread = top - np.where(seen, x, np.inf).min(axis=1)
            p = np.exp(x - top[:, None])
            p /= p.sum(axis=1, keepdims=True)
            eps_w = 2 * err + U * spread * (blocks + 1) + (blocks + 1) * (2 * EXP_ULP + 2) * U
            eps_p = 2 * eps_w + (n + 2 * blocks + 2) * U
            out[r, h] = p @ v
            bound[r, h] = (eps_p + (n + 2 * blocks + 2) * U)[:, None] * (p @ np.abs(v))
    return out, bound


def run(kernels: str, q: np.ndarray, keys: np.ndarray, values: np.ndarray, state: BatchState,
        threads: int = 2) -> np.ndarray:
    if kernels == "numba":
        pytest.importorskip("numba")
    return attention.attend(q, keys, values, state, Workspace(threads=threads, kernels=kernels))


@pytest.fixture
def numpy_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy path cut into blocks of NUMPY_BLOCK slots for tiles of QUERY_ROWS rows, so it crosses several."""
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", NUMPY_BLOCK * attention.QUERY_ROWS)


# Every case with every cache type whose blocks divide its head dim (a head of 16 holds no block of 32).
STORABLE = [(case, cache_type) for case in CASES for cache_type in CACHE_TYPE
            if CASES[case][3] % CACHE_TYPE[cache_type].block == 0]


@pytest.mark.usefixtures("numpy_blocks")
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("case", "cache_type"), STORABLE)
def test_within_float32_error_model(case: str, cache_type: str, kernels: str) -> None:
    q, keys, values, state = make_case(case, cache_type)
    block = COMPILED_BLOCK if kernels == "numba" else NUMPY_BLOCK  # (the numpy path's smaller tiles: longer blocks)
    want, bound = exact_and_bound(q, keys, values, state, block)
    got = run(kernels, q, keys, values, state)
    valid = state.valid  # [B, T]: outputs of padding queries are ignored by the model
    assert np.all((np.abs(got - want) <= bound).transpose(0, 2, 1, 3)[valid])


def test_compiled_block_is_the_tests() -> None:
    prefill_jit = pytest.importorskip("qwen_runtime.models.prefill_jit")
    assert prefill_jit.BLOCK == COMPILED_BLOCK


@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_compiled_rows_are_the_same_bits_in_any_tile_or_chunk(monkeypatch: pytest.MonkeyPatch,
                                                               cache_type: str) -> None:
    """A token's attention is the same bits whatever tile, strip, thread or pass it comes in: one pass of 300
    tokens, tiles of one strip, one thread, and the prompt fed in chunks of 37, 163 and 100 over the same cache."""
    prefill_jit = pytest.importorskip("qwen_runtime.models.prefill_jit")
    q, keys, values, state = make_case("first chunk, group 7", cache_type)
    whole = run("numba", q, keys, values, state)
    np.testing.assert_array_equal(run("numba", q, keys, values, state, threads=1), whole)
    monkeypatch.setattr(prefill_jit, "TILE_ROWS", prefill_jit.STRIP)
    np.testing.assert_array_equal(run("numba", q, keys, values, state), whole)
    monkeypatch.undo()
    valid = state.key_valid
    for c0, c1 in [(0, 37), (37, 200), (200, 300)]:
        chunk = aligned_state(valid[:, :c1], c0)
        np.testing.assert_array_equal(run("numba", q[:, :, c0:c1], keys, values, chunk), whole[:, :, c0:c1])


@pytest.mark.usefixtures("numpy_blocks")
@pytest.mark.parametrize("kernels", KERNELS)
def test_each_row_of_a_batch_is_its_own(kernels: str) -> None:
    """Rows of a padded batch and of a ragged one give the bits they give alone (each row of a ragged batch, and
    for the compiled tiles each row of any batch, is computed as if alone)."""
    q, keys, values, state = make_case("ragged rows", "f16")
    got = run(kernels, q, keys, values, state)
    for row, length in enumerate(state.lengths.tolist()):
        alone = ragged_state(np.array([length]), q.shape[2])
        np.testing.assert_array_equal(got[row], run(kernels, q[row:row + 1], keys[row:row + 1],
                                                    values[row:row + 1], alone)[0])
    if kernels == "numba":
        q, keys, values, state = make_case("padding past a block", "f32")
        got = run(kernels, q, keys, values, state)
        for row in range(q.shape[0]):
            alone = aligned_state(state.key_valid[row:row + 1], state.start)
            np.testing.assert_array_equal(got[row], run(kernels, q[row:row + 1], keys[row:row + 1],
                                                        values[row:row + 1], alone)[0])


@pytest.mark.usefixtures("numpy_blocks")
@pytest.mark.parametrize("kernels", KERNELS)
def test_reads_no_slot_after_the_last_token(kernels: str) -> None:
    """Slots after the last new token's own (tiles above the diagonal, a ragged row's end) are never read: NaN there
    changes nothing."""
    q, keys, values, state = make_case("ragged rows", "f32")
    want = run(kernels, q, keys, values, state)
    for row, length in enumerate(state.lengths.tolist()):
        keys[row, :, length + q.shape[2]:] = np.nan
        values[row, :, length + q.shape[2]:] = np.nan
    np.testing.assert_array_equal(run(kernels, q, keys, values, state), want)


def test_numpy_blocks_hide_only_what_they_must() -> None:
    """BatchState.hidden of a block of slots is the block's columns of the whole answer (None when nothing is
    hidden there)."""
    _, _, _, state = make_case("padding past a block", "f32")
    whole = state.hidden()  # [B, 1, 1, T, S]
    assert np.array_equal(state.hidden(10, 40, 100, 230), whole[..., 10:40, 100:230])
    assert state.hidden(200, 230, 160, 170) is None  # below the diagonal, past the padding


@pytest.mark.usefixtures("numpy_blocks")
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_long_prefill_holds_tiles_not_scores(kernels: str) -> None:
    """A 4,000-token prompt in one pass of a tiny model: what each layer's attention allocates (tracemalloc: numpy's
    arrays) is a few arrays the size of its queries (the scaled copy, the output) plus a tile's scores per kv head,
    far below the [heads, T, S] float32 scores (125 times the queries here); the compiled tiles' scratch is their
    fixed shapes, whatever the prompt."""
    model = use_kernels(load_exact(fixture_dir("qwen3-tiny"), kernels=kernels), kernels)
    c = model.config
    t = 4000
    ids = np.random.default_rng(0).integers(0, c.vocab_size, (1, t))
    peaks: list[int] = []
    attend = attention.attend

    def measured(q: np.ndarray, *args: object) -> np.ndarray:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = attend(q, *args)
        peaks.append(tracemalloc.get_traced_memory()[1] - before)
        return out

    ws = model.workspace
    with pytest.MonkeyPatch.context() as patch, ws.keep_scratch():
        patch.setattr(attention, "attend", measured)
        tracemalloc.start()
        try:
            model.forward(ids, model.make_cache(1, t), last_only=True)
        finally:
            tracemalloc.stop()
        tiles = [s.sizes().get("attention tile", 0) for s in ws.scratch]
    queries = c.num_attention_heads * t * c.head_dim * 4  # bytes of q, and of the output
    scores = c.num_attention_heads * t * t * 4
    tile = 4 * attention.SCORE_ELEMENTS * 4  # a numpy tile's scores with their mask and matmul copies, per kv head
    allowed = 4 * queries + c.num_key_value_heads * tile
    assert len(peaks) == c.num_hidden_layers
    assert max(peaks) <= allowed < scores / 10
    if kernels == "numba":
        prefill_jit = pytest.importorskip("qwen_runtime.models.prefill_jit")
        shapes = prefill_jit.scratch_shapes(prefill_jit.TILE_ROWS, c.head_dim)
        assert 0 < max(tiles) <= sum(int(np.prod(shape)) for shape in shapes)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny-gqa"])
def test_long_prompt_matches_transformers(name: str) -> None:
    """A 700-token prompt (several tiles and blocks), in one pass and in chunks of 256, on each kernel set, against
    transformers in float64 (computed once) within the float32 error bound of float_error.py."""
    pytest.importorskip("torch")
    from float_error import check_rows, reference64

    prompt = None
    for kernels in KERNELS:
        if kernels == "numba":
            pytest.importorskip("numba")
        model = use_kernels(load_exact(fixture_dir(name), kernels=kernels), kernels)
        if prompt is None:
            prompt = np.random.default_rng(11).integers(0, model.config.vocab_size, (1, 700))
            want, bound = reference64(fixture_dir(name), prompt)
        check_rows(model.logits(prompt)[0], want[0], bound[0], f"{name} {kernels} one pass")
        cache = model.make_cache(1, 700)
        chunks = [model.forward(prompt[:, c0:c0 + 256], cache)[0] for c0 in range(0, 700, 256)]
        check_rows(np.concatenate(chunks), want[0], bound[0], f"{name} {kernels} chunks of 256")


@pytest.mark.slow
@pytest.mark.cpu("avx2")
def test_the_avx2_form() -> None:
    """This file's tests in a process compiling for AVX2 (``NUMBA_CPU_FEATURES``): vectors of 8 lanes, strips of
    16 rows, 4 keys a step."""
    from llvmlite import binding as llvm

    from qwen_runtime.backend.jit_setup import other_instruction_forms

    features = other_instruction_forms(llvm.get_host_cpu_features().flatten())["avx2"]
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                             "-k", "numba or compiled", __file__], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
