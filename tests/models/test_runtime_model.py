"""The numpy decoder against transformers (stored references; live oracle when torch is present).

float32 logits are compared with transformers run in float64, within 1e-4 or the fixture's float32 error bound
where that is larger (``float_error.py`` derives it).

Every dense family is checked from its HF directory and, once the converter is available, from npy and
GGUF fp32 copies; fp16 and q8_0 copies are checked against fp32 with tolerances derived from their
rounding error (see ``test_quantized_types_stay_close_to_fp32``).
"""

from __future__ import annotations

import numpy as np
import pytest
from float_error import check_greedy, check_rows, reference64
from runtime_helpers import DENSE_FAMILIES, Converted, fixture_dir, load_exact, reference, use_kernels

from qwen_runtime.backend import pool
from qwen_runtime.generation.generate import left_pad

FORMATS = ("hf", "npy", "gguf")


@pytest.fixture(scope="module", params=[(n, f, "numpy") for n in DENSE_FAMILIES for f in FORMATS]
                + [(n, "gguf", "numba") for n in DENSE_FAMILIES], ids=lambda p: "-".join(p))
def model_and_ref(request: pytest.FixtureRequest, converted: Converted):
    """Each family from each format with the numpy kernels, and from GGUF with the compiled twins too."""
    name, fmt, kernels = request.param
    return use_kernels(load_exact(converted(name, fmt)), kernels), reference(name)


def greedy_decode(model, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill then ``steps`` greedy cached steps: (ids [steps], logits [steps, V])."""
    cache = model.make_cache(1, len(prompt) + steps)
    logits = model.forward(prompt[None], cache, last_only=True)  # [1, V]
    ids, out = [], []
    for _ in range(steps):
        out.append(logits[0])
        ids.append(int(np.argmax(logits[0])))
        logits = model.forward(np.array([[ids[-1]]]), cache, last_only=True)
    return np.array(ids), np.stack(out)


def test_logits_match_transformers(model_and_ref) -> None:
    model, ref = model_and_ref
    for i in range(3):
        got = model.logits(ref[f"prompt_{i}"][None])[0]
        check_rows(got, ref[f"logits64_{i}"], ref[f"bound_{i}"], f"logits_{i}")


def test_greedy_cached_decode_matches_transformers(model_and_ref) -> None:
    model, ref = model_and_ref
    ids, logits = greedy_decode(model, ref["prompt_0"], len(ref["greedy_ids"]))
    check_greedy(ids, logits, ref, "cached greedy decoding")


def test_padded_batch_equals_solo_runs(model_and_ref) -> None:
    model, ref = model_and_ref
    prompts = [ref[f"prompt_{i}"] for i in range(3)]  # lengths 5, 11, 17
    ids, valid = left_pad(prompts)
    batch = model.logits(ids, valid)
    for row in range(len(prompts)):
        check_rows(batch[row, valid[row]], ref[f"logits64_{row}"], ref[f"bound_{row}"], f"padded row {row}")
    # cached decoding of the batch follows each row's solo greedy path
    cache = model.make_cache(3, ids.shape[1] + 6)
    logits = model.forward(ids, cache, valid, last_only=True)
    tokens = [[] for _ in prompts]
    for _ in range(6):
        nxt = logits.argmax(axis=-1)
        for row in range(3):
            tokens[row].append(int(nxt[row]))
        logits = model.forward(nxt[:, None], cache, last_only=True)
    for row, prompt in enumerate(prompts):
        np.testing.assert_array_equal(tokens[row], greedy_decode(model, prompt, 6)[0])


def test_chunked_prefill_equals_one_shot(model_and_ref) -> None:
    model, ref = model_and_ref
    prompt = ref["prompt_2"]
    cache = model.make_cache(1, len(prompt) + 1)
    parts = [model.forward(prompt[None, a:b], cache) for a, b in ((0, 3), (3, 4), (4, 12), (12, len(prompt)))]
    check_rows(np.concatenate(parts, axis=1)[0], ref["logits64_2"], ref["bound_2"], "chunked prefill")
    assert cache.offset == len(prompt) and cache.lengths.tolist() == [len(prompt)]


def test_tied_head_reuses_the_embedding(model_and_ref) -> None:
    model, _ = model_and_ref
    assert (model.lm_head is model.embed) == model.config.tie_word_embeddings


@pytest.mark.parametrize("name", DENSE_FAMILIES)
@pytest.mark.parametrize("fmt", ["npy", "gguf"])
def test_quantized_types_stay_close_to_fp32(converted: Converted, name: str, fmt: str) -> None:
    """fp16 and q8_0 logits stay within a tolerance derived from each type's rounding error.

    A Q8_0 weight is rounded to a step of amax/127 of its block of 32, so its error is at most 1/254 of the
    block's largest magnitude; fp16 rounds with relative error at most 2**-11.  A logit goes through about
    15 matmuls in series in these 2-layer fixtures (q, k, v, o, gate, up, down per layer, plus the head);
    adding the per-matmul bound linearly gives 15/254 = 5.9 % (q8_0) and 15 * 2**-11 = 0.73 % (fp16) of
    the logit scale.  Where fp32's top-2 margin exceeds twice that, the top token must match.
    (Measured on the fixtures: q8_0 2.6-3.6 %, fp16 < 1e-6 since their weights are bf16/fp16 already.)
    """
    ref = reference(name)
    prompt = ref["prompt_2"][None]
    base = load_exact(converted(name, "hf")).logits(prompt)[0]
    scale = float(np.abs(base).max())
    for dtype, rel in (("fp16", 15 * 2.0**-11), ("q8_0", 15 / 254)):
        got = load_exact(converted(name, fmt, dtype)).logits(prompt)[0]
        assert float(np.abs(got - base).max()) <= rel * scale, dtype
        top2 = np.sort(base, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2 * rel * scale
        np.testing.assert_array_equal(got.argmax(-1)[clear], base.argmax(-1)[clear])


@pytest.mark.oracle
@pytest.mark.parametrize("name", DENSE_FAMILIES)
def test_live_transformers_oracle_padded_batch(name: str) -> None:
    pytest.importorskip("torch")
    path = fixture_dir(name)
    rng = np.random.default_rng(3)
    model = load_exact(path)
    ids = rng.integers(0, model.config.vocab_size, (2, 9))
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    expected, bound = reference64(path, ids, mask)
    got = model.logits(ids, mask)
    valid = mask.astype(bool)
    check_rows(got[valid], expected[valid], bound[valid], "padded batch")


def _decode_scratch(model, steps: int) -> list[int]:
    """Workspace bytes after a 16-token prefill (asserted empty) and after each of ``steps`` decode steps."""
    cache = model.make_cache(1, 16 + steps)
    logits = model.forward(np.arange(1, 17)[None], cache, last_only=True)
    assert model.workspace.nbytes == 0
    sizes = []
    for _ in range(steps):
        logits = model.forward(np.array([[int(np.argmax(logits[0]))]]), cache, last_only=True)
        sizes.append(model.workspace.nbytes)
    return sizes


def test_prefill_scratch_is_released_before_decoding(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's tile and work buffers are dropped after its pass; decode steps keep their own from step to step.

    On one thread the buffers are exactly those of the first step.  In the pool, which helper claims which tile
    depends on timing, but no thread ever needs more than the single thread that runs every task.
    """
    path = converted("qwen2-tiny", "gguf", "q8_0")
    pooled = load_exact(path, kernels="numpy")  # the compiled kernels decode steps need no tile scratch
    monkeypatch.setattr(pool, "default_threads", lambda: 1)
    alone = load_exact(path, kernels="numpy")
    assert not alone.workspace.pooled
    one = _decode_scratch(alone, 4)
    assert one[0] > 0 and one == [one[0]] * 4
    assert max(_decode_scratch(pooled, 4)) <= pooled.workspace.threads * one[0]


def test_chunked_passes_keep_scratch_while_asked(converted: Converted) -> None:
    """Inside the workspace's keep_scratch() passes of several tokens keep the scratch (the chunks of one prompt, a
    server's prefill steps); the outermost block's end drops it, and so does a pass outside any block."""
    model = load_exact(converted("qwen2-tiny", "gguf", "q8_0"), kernels="numpy")  # whose tiles are scratch
    cache = model.make_cache(1, 24)
    with model.workspace.keep_scratch():
        model.forward(np.arange(1, 9)[None], cache, last_only=True)
        kept = model.workspace.nbytes
        assert kept > 0
        with model.workspace.keep_scratch():
            model.forward(np.arange(9, 17)[None], cache, last_only=True)
        assert model.workspace.nbytes >= kept  # an inner block's end keeps them
    assert model.workspace.nbytes == 0
    model.forward(np.arange(17, 21)[None], cache, last_only=True)
    assert model.workspace.nbytes == 0
    model.hidden_states(np.arange(1, 9)[None])
    assert model.workspace.nbytes == 0
