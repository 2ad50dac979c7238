"""KV cache types (``cache_type_k``/``cache_type_v``): an f16 cache against the f32 one on every family, on the numpy
and the compiled paths, and the memory each type is counted at."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import fixture_dir

from qwen_runtime import load
from qwen_runtime.backend.cache import Cache, KVCache
from qwen_runtime.errors import UsageError
from qwen_runtime.formats.archs import FULL_ATTENTION
from qwen_runtime.models.attention import attend

F16_ROUNDING = 2.0 ** -11  # float16 round to nearest: |rounded - x| <= 2^-11 |x| in its normal range
U = 2.0 ** -24  # float32 unit roundoff
FAMILIES = ("qwen2-tiny", "qwen3-tiny", "qwen35-tiny")
PROMPT = np.array([[1, 5, 9, 14, 3, 7, 22, 11, 4, 8, 17, 2]])
PREFILL = 6


class RoundingCache(KVCache):
    """A float32 cache that rounds what it stores to float16 and back: float32 arithmetic on exactly the values an
    f16 cache holds."""

    def update(self, k: np.ndarray, v: np.ndarray, state) -> tuple[np.ndarray, np.ndarray]:
        rounded = (a.astype(np.float16).astype(np.float32) for a in (k, v))
        return super().update(*rounded, state)


def run(model, cache: Cache) -> np.ndarray:
    """A prefill of PREFILL tokens then one-token steps over the rest of PROMPT: the last logits of each pass."""
    out = [model.forward(PROMPT[:, :PREFILL], cache, last_only=True)]
    for i in range(PREFILL, PROMPT.shape[1]):
        out.append(model.forward(PROMPT[:, i:i + 1], cache, last_only=True))
    return np.concatenate(out)  # [passes, V]


def logits(name: str, kernels: str, cache_type: str) -> np.ndarray:
    if kernels == "numba":
        pytest.importorskip("numba")
    model = load(fixture_dir(name), kernels=kernels, cache_type_k=cache_type, cache_type_v=cache_type)
    return run(model, model.make_cache(1, PROMPT.shape[1]))


def attention_bound(q: np.ndarray, keys: np.ndarray, values: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """How far attention over float16-rounded keys and values may be from attention over the float32 ones.

    With δ = 2^-11 each stored k and v is k(1 + θ), |θ| ≤ δ.  A score s = q·k/√hd then moves by at most
    ε = δ Σ|q_i k_i| / √hd, plus float32 error on either side (hd-term sums: 2·hd·u Σ|q_i k_i| / √hd each).  With
    E the largest ε over a query's visible slots, softmax(s + Δs)_j / softmax(s)_j lies in [e^-2E, e^2E], so
    |Δp_j| ≤ (e^2E - 1) p_j.  The output o_i = Σ_j p_j v_ji then moves by at most
    Σ_j p_j |v_ji| ((1 + δ) e^2E - 1), plus float32 error of the S-term sums (2·S·u Σ_j p_j |v_ji| each side).
    q [B, nh, T, hd], keys/values [B, nkv, S, hd] float32, probs [B, nh, T, S] (the f32 run's, float64) ->
    [B, nh, T, hd]
    """
    b, nh, t, hd = q.shape
    nkv, s = keys.shape[1], keys.shape[2]
    k = np.repeat(keys, nh // nkv, axis=1).astype(np.float64)  # [B, nh, S, hd]
    v = np.repeat(values, nh // nkv, axis=1).astype(np.float64)
    magnitude = np.abs(q.astype(np.float64)) @ np.abs(k).transpose(0, 1, 3, 2) / np.sqrt(hd)  # [B, nh, T, S]
    eps = (F16_ROUNDING + 4 * hd * U) * magnitude
    causal = np.tril(np.ones((t, s), bool), s - t)
    worst = np.where(causal, eps, 0).max(axis=-1, keepdims=True)  # [B, nh, T, 1]
    weighted = probs @ np.abs(v)  # Σ p |v|  [B, nh, T, hd]
    return weighted * ((1 + F16_ROUNDING) * np.exp(2 * worst) - 1 + 4 * s * U)


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
def test_attention_over_an_f16_cache_is_within_the_rounding_bound(kernels: str) -> None:
    """Attention of 8 tokens (GQA, 4 query heads on 2 kv heads) over float16 keys and values against the same
    attention over their float32 originals: every output within :func:`attention_bound`, and not equal (the
    values were rounded)."""
    rng = np.random.default_rng(0)
    b, nh, nkv, s, hd = 2, 4, 2, 8, 16
    q = rng.standard_normal((b, nh, s, hd)).astype(np.float32)
    keys, values = (rng.standard_normal((b, nkv, s, hd)).astype(np.float32) for _ in range(2))
    state = Cache([], b, s).begin(np.ones((b, s), bool))
    if kernels == "numba":
        jit = pytest.importorskip("qwen_runtime.models.attention_jit")
        run_attention = lambda k, v: jit.attend(q, k, v, *state.slots())  # noqa: E731
    else:
        run_attention = lambda k, v: attend(q, k, v, state)  # noqa: E731
    exact = run_attention(keys, values)
    rounded = run_attention(keys.astype(np.float16), values.astype(np.float16))
    logits = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), np.repeat(keys, nh // nkv, axis=1)) / np.sqrt(hd)
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    diff = np.abs(rounded.astype(np.float64) - exact)
    assert (diff <= attention_bound(q, keys, values, probs)).all()
    assert diff.max() > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_an_f16_cache_is_f32_arithmetic_on_rounded_keys_and_values(name: str) -> None:
    """The numpy path over an f16 cache gives, bit for bit, the f32 path's logits over keys and values rounded to
    float16 as they are stored: the only error an f16 cache adds is that rounding, whose effect on one attention
    is bounded above.  Qwen3.5's recurrent state stays float32; its gated-attention layers take the type."""
    model = load(fixture_dir(name), kernels="numpy", cache_type_k="f16", cache_type_v="f16")
    cache = model.make_cache(1, PROMPT.shape[1])
    kv = [layer for layer in cache.layers if isinstance(layer, KVCache)]
    assert kv and all(a.dtype == np.float16 for layer in kv for a in (layer.keys, layer.values))
    assert all(a.dtype == np.float32 for layer in cache.layers if not isinstance(layer, KVCache)
               for a in vars(layer).values() if isinstance(a, np.ndarray))
    f16 = run(model, cache)
    f32_model = load(fixture_dir(name), kernels="numpy")
    rounding = f32_model.make_cache(1, PROMPT.shape[1])
    for i, layer in enumerate(rounding.layers):
        if isinstance(layer, KVCache):
            rounding.layers[i] = RoundingCache(1, layer.keys.shape[1], PROMPT.shape[1], layer.keys.shape[3])
    assert np.array_equal(f16, run(f32_model, rounding))
    assert not np.array_equal(f16, run(f32_model, f32_model.make_cache(1, PROMPT.shape[1])))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_compiled_path_over_an_f16_cache_matches_the_numpy_path(name: str) -> None:
    """Compiled kernels (the decode step reading float16 through vcvtph2ps) against the numpy path, both over an
    f16 cache: within the compiled path's own float32 distance from numpy (f32 caches) plus twice the f16 cache's
    effect (a float32 ulp of difference before rounding can move a stored value by one float16 step, 2δ)."""
    numpy16, numba16 = logits(name, "numpy", "f16"), logits(name, "numba", "f16")
    numpy32, numba32 = logits(name, "numpy", "f32"), logits(name, "numba", "f32")
    bound = np.abs(numba32 - numpy32).max() + 2 * np.abs(numpy16 - numpy32).max()
    assert np.abs(numba16 - numpy16).max() <= bound
    assert (numba16.argmax(-1) == numpy16.argmax(-1)).all()


@pytest.mark.parametrize("types", [("f16", "f16"), ("f16", "f32"), ("f32", "f16")])
def test_the_compiled_decode_step_reads_f16_caches_as_its_ops_do(types: tuple[str, str]) -> None:
    """The compiled decode step over f16 keys and/or values gives the per-operation compiled path's logits bit for
    bit (Qwen3.5: gated attention and Gated DeltaNet layers in one step)."""
    pytest.importorskip("numba")
    model = load(fixture_dir("qwen35-tiny"), kernels="numba", cache_type_k=types[0], cache_type_v=types[1])
    assert model.step is not None
    stepped = run(model, model.make_cache(1, PROMPT.shape[1]))
    step, model.step = model.step, None
    try:
        assert np.array_equal(stepped, run(model, model.make_cache(1, PROMPT.shape[1])))
    finally:
        model.step = step


@pytest.mark.parametrize("name", FAMILIES)
def test_an_f16_cache_holds_half_the_bytes_per_token(name: str) -> None:
    """Bytes per token are 2 x kv heads x head dim x the types' sizes, summed over the attention layers (exactly
    half of f32's for f16 keys and values, three quarters for one of them), what make_cache allocates and what
    --max-memory checks; a recurrent row state is the same in every type."""
    sizes = {}
    for types in (("f32", "f32"), ("f16", "f16"), ("f16", "f32")):
        model = load(fixture_dir(name), kernels="numpy", cache_type_k=types[0], cache_type_v=types[1])
        c = model.config
        attention = sum(t == FULL_ATTENTION for t in c.layer_types)
        sizes[types] = size = model.cache_size
        itemsize = {"f32": 4, "f16": 2}
        assert size.token == attention * c.num_key_value_heads * c.head_dim * sum(itemsize[t] for t in types)
        assert model.make_cache(3, 40).nbytes == model.cache_bytes(3, 40)
    assert 2 * sizes["f16", "f16"].token == sizes["f32", "f32"].token
    assert 4 * sizes["f16", "f32"].token == 3 * sizes["f32", "f32"].token
    assert sizes["f16", "f16"].row == sizes["f32", "f32"].row


def test_an_unknown_cache_type_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cache type: expected one of f32, f16, got 'q8_0'"):
        load(fixture_dir("qwen3-tiny"), kernels="numpy", cache_type_k="q8_0")
