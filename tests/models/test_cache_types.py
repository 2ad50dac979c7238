"""KV cache types (``cache_type_k``/``cache_type_v``): each type against the f32 cache on every family, on the numpy
and the compiled paths, its encoder's bytes against ggml's, and the memory each type is counted at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import fixture_dir

from qwen_runtime import load, stream
from qwen_runtime.backend.cache import CACHE_TYPE, CACHE_TYPES, Cache, KVCache, cache_type
from qwen_runtime.errors import UsageError
from qwen_runtime.formats.archs import FULL_ATTENTION
from qwen_runtime.models.attention import attend, kernel_view

U = 2.0 ** -24  # float32 unit roundoff
F16_ROUNDING = 2.0 ** -11  # float16 round to nearest: |rounded - x| <= 2^-11 |x| in its normal range
BF16_ROUNDING = 2.0 ** -8  # bfloat16: 8 bits of significand
FAMILIES = ("qwen2-tiny", "qwen3-tiny", "qwen35-tiny")
NARROW = tuple(t for t in CACHE_TYPES if t != "f32")
PROMPT = np.array([[1, 5, 9, 14, 3, 7, 22, 11, 4, 8, 17, 2]])
PREFILL = 6


def element_error(x: np.ndarray, name: str) -> np.ndarray:
    """The most a value of ``x`` [..., hd] (float32, float16's normal range) moves when stored in cache type ``name``.

    f16/bf16: half a unit in the last place, relative.  q8_0: d = max|x|/127 over the block, q = round(x/d) in
    [-127, 127], stored as fp16(d)·q: |fp16(d)·q - x| <= d/2 + |fp16(d) - d|·127 <= d (1/2 + 127·2^-11).  q4_0:
    d = x_max/-8 (x_max of largest magnitude), q = min(15, trunc(x/d + 8.5)); a value of x_max's magnitude and
    the other sign clamps from 16 to 15, so |d| instead of |d|/2; plus |fp16(d) - d|·8.
    """
    x = np.abs(x.astype(np.float64))
    if name == "f32":
        return np.zeros_like(x)
    if name in ("f16", "bf16"):
        return (F16_ROUNDING if name == "f16" else BF16_ROUNDING) * x
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    if name == "q8_0":
        d = blocks.max(-1, keepdims=True) / 127
        err = d * (0.5 + 127 * F16_ROUNDING)
    else:
        d = blocks.max(-1, keepdims=True) / 8
        err = d * (1 + 8 * F16_ROUNDING)
    return np.broadcast_to(err, blocks.shape).reshape(x.shape)


class RoundingCache(KVCache):
    """A float32 cache that rounds what it stores through cache type ``name`` and back: float32 arithmetic on exactly
    the values a cache of that type holds."""

    def __init__(self, like: KVCache, name: str, max_len: int) -> None:
        super().__init__(like.keys.shape[0], like.keys.shape[1], max_len, like.keys.shape[3])
        self.rounding = cache_type(name)

    def update(self, k: np.ndarray, v: np.ndarray, state) -> tuple[np.ndarray, np.ndarray]:
        rounded = (self.rounding.decode(self.rounding.encode(a)) for a in (k, v))
        return super().update(*rounded, state)


def run(model, cache: Cache) -> np.ndarray:
    """A prefill of PREFILL tokens then one-token steps over the rest of PROMPT: the last logits of each pass."""
    out = [model.forward(PROMPT[:, :PREFILL], cache, last_only=True)]
    for i in range(PREFILL, PROMPT.shape[1]):
        out.append(model.forward(PROMPT[:, i:i + 1], cache, last_only=True))
    return np.concatenate(out)  # [passes, V]


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen2-tiny with 2 query heads on 1 kv head of 32 (the same weights, their rows read as wider heads): the
    Qwen2 family with heads the 32-value blocks of q8_0/q4_0 divide (the fixture's 16-wide heads are refused)."""
    path = tmp_path_factory.mktemp("qwen2-wide") / "qwen2-tiny-hd32"
    shutil.copytree(fixture_dir("qwen2-tiny"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_attention_heads=2, num_key_value_heads=1)
    (path / "config.json").write_text(json.dumps(config))
    return path


def family_path(name: str, kind: str, wide: Path) -> Path:
    """The fixture of family ``name`` whose heads cache type ``kind`` can store."""
    return wide if name == "qwen2-tiny" and CACHE_TYPE[kind].block > 1 else fixture_dir(name)


def logits(path: Path, kernels: str, cache_type: str) -> np.ndarray:
    if kernels == "numba":
        pytest.importorskip("numba")
    model = load(path, kernels=kernels, cache_type_k=cache_type, cache_type_v=cache_type)
    return run(model, model.make_cache(1, PROMPT.shape[1]))


def attention_bound(q: np.ndarray, keys: np.ndarray, values: np.ndarray, probs: np.ndarray, key_type: str,
                    value_type: str) -> np.ndarray:
    """How far attention over keys and values stored in their types may be from attention over the float32 ones.

    With e_k, e_v the most each stored element moves (:func:`element_error`), a score s = q·k/√hd moves by at most
    ε = Σ|q_i| e_k,i / √hd, plus float32 error on either side (hd-term sums: 2·hd·u Σ|q_i k_i| / √hd each).  With E
    the largest ε over a query's visible slots, softmax(s + Δs)_j / softmax(s)_j lies in [e^-2E, e^2E], so
    |Δp_j| <= (e^2E - 1) p_j.  The output o_i = Σ_j p_j v_ji then moves by at most
    (e^2E - 1) Σ_j p_j |v_ji| + e^2E Σ_j p_j e_v,ji, plus float32 error of the S-term sums and the blocks' merge
    (4·S·u Σ_j p_j |v_ji|).  q [B, nh, T, hd], keys/values [B, nkv, S, hd] float32, probs [B, nh, T, S] (the f32
    run's, float64) -> [B, nh, T, hd]
    """
    b, nh, t, hd = q.shape
    nkv, s = keys.shape[1], keys.shape[2]
    k = np.repeat(keys, nh // nkv, axis=1).astype(np.float64)  # [B, nh, S, hd]
    v = np.repeat(values, nh // nkv, axis=1).astype(np.float64)
    ek = np.repeat(element_error(keys, key_type), nh // nkv, axis=1)
    ev = np.repeat(element_error(values, value_type), nh // nkv, axis=1)
    aq = np.abs(q.astype(np.float64))
    magnitude = aq @ np.abs(k).transpose(0, 1, 3, 2) / np.sqrt(hd)  # [B, nh, T, S]
    eps = (aq @ ek.transpose(0, 1, 3, 2)) / np.sqrt(hd) + 4 * hd * U * magnitude
    causal = np.tril(np.ones((t, s), bool), s - t)
    worst = np.where(causal, eps, 0).max(axis=-1, keepdims=True)  # [B, nh, T, 1]
    grow = np.exp(2 * worst)
    return (grow - 1 + 4 * s * U) * (probs @ np.abs(v)) + grow * (probs @ ev)


def softmax_probs(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Causal softmax of float64 scores, the last T of S slots being the queries'.  # [B, nh, T, S]"""
    nh, t, hd, s = q.shape[1], q.shape[2], q.shape[3], keys.shape[2]
    logits = np.einsum("bhtd,bhsd->bhts", q.astype(np.float64), np.repeat(keys, nh // keys.shape[1], axis=1))
    logits = np.where(np.tril(np.ones((t, s), bool), s - t), logits / np.sqrt(hd), -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return probs / probs.sum(-1, keepdims=True)


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize(("key_type", "value_type"), [(t, t) for t in NARROW] + [("q8_0", "q4_0"), ("q4_0", "f16")])
def test_attention_over_each_cache_type_is_within_its_rounding_bound(kernels: str, key_type: str,
                                                                     value_type: str) -> None:
    """Attention of 3 new tokens (GQA, 4 query heads on 2 kv heads) over 600 cached slots (three blocks of the
    compiled kernel's online softmax) stored in each type against the same attention over their float32 originals:
    every output within :func:`attention_bound`, and not equal (the values were rounded)."""
    rng = np.random.default_rng(0)
    b, nh, nkv, s, t, hd = 2, 4, 2, 600, 3, 64
    q = rng.standard_normal((b, nh, t, hd)).astype(np.float32)
    keys, values = (rng.standard_normal((b, nkv, s, hd)).astype(np.float32) for _ in range(2))
    bookkeeping = Cache([], b, s)
    bookkeeping.commit(bookkeeping.begin(np.ones((b, s - t), bool)))
    state = bookkeeping.begin(np.ones((b, t), bool))
    if kernels == "numba":
        jit = pytest.importorskip("qwen_runtime.models.attention_jit")
        run_attention = lambda k, v: jit.attend(q, k, v, *state.slots())  # noqa: E731
    else:
        run_attention = lambda k, v: attend(q, k, v, state)  # noqa: E731
    exact = run_attention(keys, values)
    stored = run_attention(cache_type(key_type).encode(keys), cache_type(value_type).encode(values))
    diff = np.abs(stored.astype(np.float64) - exact)
    assert (diff <= attention_bound(q, keys, values, softmax_probs(q, keys), key_type, value_type)).all()
    assert diff.max() > 0


def test_the_compiled_encoders_write_ggmls_bytes_and_decode_them_back() -> None:
    """The compiled decode step's writes (``store_row``) give, for every type, the bytes of the numpy encoder (numpy's
    float16 cast, gguf's bf16/q8_0/q4_0 quantizers: ggml's own rounding), over rows of mixed scales, a zero row, a
    zero block, a tiny and a huge block; ``widen_row`` reads them back as the numpy decoder does."""
    numba = pytest.importorskip("numba")
    from qwen_runtime.models import attention_jit as aj

    @numba.njit
    def encode(x, out):
        for r in range(x.shape[0]):
            aj.store_row(x[r], out[r])

    @numba.njit
    def decode(stored, out):
        for r in range(stored.shape[0]):
            out[r] = aj.widen_row(stored[r], out[r])

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 64)) * rng.uniform(0, 4, (64, 1))).astype(np.float32)
    x[3], x[4, :32], x[5] = 0, 0, np.float32(1e-30)
    x[6, 32:] = np.float32(3e4) * np.sign(x[6, 32:])
    x[7, ::7] = -x[7].max()  # q4_0: x_max negative, its mirror positive: the clamp at 15
    for name, kind in CACHE_TYPE.items():
        expected = kernel_view(kind.encode(x))
        written = np.zeros_like(expected)
        encode(x, written)
        assert written.tobytes() == expected.tobytes(), name
        widened = np.empty_like(x)
        decode(written, widened)
        assert np.array_equal(widened, kind.decode(kind.encode(x))), name


@pytest.mark.parametrize("kind", NARROW)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_cache_type_is_f32_arithmetic_on_its_stored_keys_and_values(name: str, kind: str, wide_heads: Path) -> None:
    """The numpy path over a cache of each type gives, bit for bit, the f32 path's logits over keys and values
    rounded through the type as they are stored: the only error a cache type adds is that rounding, whose effect on
    one attention is bounded above.  Qwen3.5's recurrent state stays float32; its gated-attention layers take the
    type."""
    path = family_path(name, kind, wide_heads)
    model = load(path, kernels="numpy", cache_type_k=kind, cache_type_v=kind)
    cache = model.make_cache(1, PROMPT.shape[1])
    kv = [layer for layer in cache.layers if isinstance(layer, KVCache)]
    assert kv and all(a.dtype == CACHE_TYPE[kind].dtype for layer in kv for a in (layer.keys, layer.values))
    assert all(a.dtype == np.float32 for layer in cache.layers if not isinstance(layer, KVCache)
               for a in vars(layer).values() if isinstance(a, np.ndarray))
    stored = run(model, cache)
    f32_model = load(path, kernels="numpy", cache_type_k="f32", cache_type_v="f32")
    rounding = f32_model.make_cache(1, PROMPT.shape[1])
    for i, layer in enumerate(rounding.layers):
        if isinstance(layer, KVCache):
            rounding.layers[i] = RoundingCache(layer, kind, PROMPT.shape[1])
    assert np.array_equal(stored, run(f32_model, rounding))
    assert not np.array_equal(stored, run(f32_model, f32_model.make_cache(1, PROMPT.shape[1])))


@pytest.mark.parametrize("kind", NARROW)
@pytest.mark.parametrize("name", FAMILIES)
def test_the_compiled_path_over_each_cache_type_matches_the_numpy_path(name: str, kind: str, wide_heads: Path) -> None:
    """Compiled kernels (the decode step reading the type directly) against the numpy path (decoding it), both over
    a cache of the type: within the compiled path's own float32 distance from numpy (f32 caches) plus twice the
    type's effect (a float32 ulp of difference before rounding can move a stored value by one step of the type)."""
    path = family_path(name, kind, wide_heads)
    numpy_kind, numba_kind = logits(path, "numpy", kind), logits(path, "numba", kind)
    numpy32, numba32 = logits(path, "numpy", "f32"), logits(path, "numba", "f32")
    bound = np.abs(numba32 - numpy32).max() + 2 * np.abs(numpy_kind - numpy32).max()
    assert np.abs(numba_kind - numpy_kind).max() <= bound
    assert (numba_kind.argmax(-1) == numpy_kind.argmax(-1)).all()


@pytest.mark.parametrize("types", [(t, t) for t in NARROW] + [("f16", "f32"), ("f32", "q4_0"), ("q8_0", "bf16")])
def test_the_compiled_decode_step_reads_each_cache_type_as_its_ops_do(types: tuple[str, str]) -> None:
    """The compiled decode step over keys and values of each type gives the per-operation compiled path's logits bit
    for bit (Qwen3.5: gated attention and Gated DeltaNet layers in one step)."""
    pytest.importorskip("numba")
    model = load(fixture_dir("qwen35-tiny"), kernels="numba", cache_type_k=types[0], cache_type_v=types[1])
    assert model.step is not None
    stepped = run(model, model.make_cache(1, PROMPT.shape[1]))
    step, model.step = model.step, None
    try:
        assert np.array_equal(stepped, run(model, model.make_cache(1, PROMPT.shape[1])))
    finally:
        model.step = step


BYTES_PER_VALUE = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}  # ggml's type sizes


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen35-tiny-gqa"])
def test_each_cache_type_holds_its_bytes_per_token_and_the_plan_counts_them(name: str) -> None:
    """Bytes per token are kv heads x head dim x (the keys' type's bytes per value + the values'), summed over the
    attention layers: what make_cache allocates, what the memory plan a generation checks against --max-memory
    counts; a recurrent row state is the same in every type."""
    rows = {}
    for types in [(t, t) for t in CACHE_TYPES] + [("q8_0", "f16"), ("f32", "q4_0")]:
        model = load(fixture_dir(name), kernels="numpy", cache_type_k=types[0], cache_type_v=types[1])
        c = model.config
        attention = sum(t == FULL_ATTENTION for t in c.layer_types)
        size = model.cache_size
        assert size.token == attention * c.num_key_value_heads * c.head_dim * sum(BYTES_PER_VALUE[t] for t in types)
        assert model.make_cache(3, 40).nbytes == model.cache_bytes(3, 40)
        gen = stream(model, [[1, 2, 3], [4, 5]], max_new_tokens=4, prefill_chunk=8)
        assert gen.plan.cache == model.make_cache(2, 7).nbytes
        rows[types] = size.row
    assert len(set(rows.values())) == 1


def test_an_unknown_cache_type_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cache type: expected one of f32, f16, bf16, q8_0, q4_0, got 'q5_0'"):
        load(fixture_dir("qwen3-tiny"), kernels="numpy", cache_type_k="q5_0")


def test_blocks_that_do_not_divide_the_heads_are_refused_before_loading() -> None:
    """qwen2-tiny's heads are 16 values wide: q8_0/q4_0's 32-value blocks cannot store them (llama.cpp refuses the
    same), said in one line naming the type and the head size."""
    with pytest.raises(UsageError, match="cache type q4_0: head_dim 16 is not a multiple of its 32-value blocks"):
        load(fixture_dir("qwen2-tiny"), kernels="numpy", cache_type_v="q4_0")
