"""Sampling filters give exact distributions; seeds reproduce; bad parameters are rejected."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_runtime.generation.sampling import (
    GREEDY_BELOW,
    SamplingParams,
    apply_presence_frequency,
    apply_repetition_penalty,
    filtered_probs,
    penalized,
    sample,
)

PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # a shift must not matter


def expect(kept: list[int], base: np.ndarray = PROBS) -> np.ndarray:
    out = np.zeros_like(base)
    out[kept] = base[kept] / base[kept].sum()
    return out


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=1.0, top_k=2), expect([0, 1])),
    (SamplingParams(temperature=1.0, top_k=5), PROBS),
    (SamplingParams(temperature=1.0, top_p=0.65), expect([0, 1])),
    (SamplingParams(temperature=1.0, top_p=0.75), expect([0, 1, 2])),
    (SamplingParams(temperature=1.0, top_p=0.3), expect([0])),
    (SamplingParams(temperature=1.0, min_p=0.3), expect([0, 1, 2])),  # keeps p >= 0.12
    (SamplingParams(temperature=1.0, min_p=0.9), expect([0])),
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.8), expect([0, 1, 2])),
    (SamplingParams(temperature=0.0), np.eye(5)[0]),
])
def test_filtered_distribution_is_exact(params: SamplingParams, expected: np.ndarray) -> None:
    np.testing.assert_allclose(filtered_probs(LOGITS, params), expected, atol=1e-6)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        p = PROBS ** (1 / t)
        np.testing.assert_allclose(filtered_probs(LOGITS, SamplingParams(temperature=t)), p / p.sum(), atol=1e-6)


def test_tiny_temperatures_are_greedy_never_nan() -> None:
    """Below GREEDY_BELOW the division would overflow float32 (1e-40 gave NaN probabilities and always the last
    id); at and just above it the distribution is finite and already the argmax."""
    logits = np.array([3.0, 5.0, -1.0, 4.5], np.float32)
    for t in (1e-40, 1e-7, GREEDY_BELOW, 2e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy == (t < GREEDY_BELOW)
        probs = filtered_probs(logits, params)
        assert np.isfinite(probs).all() and probs.tolist() == [0.0, 1.0, 0.0, 0.0]
        assert sample(logits[None], [params], [np.array([], np.int64)], np.random.default_rng(0)).tolist() == [1]


def test_top_p_uses_the_sorted_distribution() -> None:
    shuffled = np.array([0.1, 0.4, 0.05, 0.3, 0.15])
    got = filtered_probs(np.log(shuffled), SamplingParams(temperature=1.0, top_p=0.65))
    np.testing.assert_allclose(got, expect([1, 3], shuffled), atol=1e-6)


def test_repetition_penalty_follows_transformers() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    got = apply_repetition_penalty(logits, np.array([0, 1, 1]), 2.0)
    np.testing.assert_allclose(got, [1.0, -4.0, 1.0, 0.5])
    # greedy picks the best token after the penalty
    tokens = sample(logits[None], [SamplingParams(repetition_penalty=4.0)], [np.array([0])],
                    np.random.default_rng(0))
    assert tokens.tolist() == [2]


def test_same_seed_same_tokens_and_frequencies_follow_the_distribution() -> None:
    params = [SamplingParams(temperature=1.0, top_k=3)] * 2
    logits = np.stack([LOGITS, LOGITS])
    runs = [[sample(logits, params, [np.array([], np.int64)] * 2, np.random.default_rng(7)).tolist()
             for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]
    rng = np.random.default_rng(1)
    draws = np.concatenate([sample(logits, params, [np.array([], np.int64)] * 2, rng) for _ in range(4000)])
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, expect([0, 1, 2]), atol=0.02)


def test_presence_and_frequency_penalties_follow_openai() -> None:
    """logit[j] -= presence * (count_j > 0) + frequency * count_j, over the output only."""
    logits = np.array([2.0, 1.0, 0.5, -1.0], np.float32)
    got = apply_presence_frequency(logits, np.array([1, 1, 3]), presence=0.5, frequency=0.25)
    np.testing.assert_allclose(got, [2.0, 1.0 - 0.5 - 0.5, 0.5, -1.0 - 0.5 - 0.25])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(penalized(logits, params, seen=np.array([0, 1]), output=np.array([1, 1, 3])), got)
    # the prompt (seen) does not count for them; greedy follows the penalised logits
    assert sample(logits[None], [SamplingParams(presence_penalty=2.0)], [np.array([0, 0])],
                  np.random.default_rng(0), [np.array([], np.int64)]).tolist() == [0]
    assert sample(logits[None], [SamplingParams(presence_penalty=2.0)], [np.array([0])],
                  np.random.default_rng(0), [np.array([0])]).tolist() == [1]
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, frequency_penalty=-2.0), output=np.array([3, 3]))
    expected = np.exp(logits.astype(np.float64) + np.array([0, 0, 0, 4.0]))
    np.testing.assert_allclose(probs, expected / expected.sum(), atol=1e-6)


def test_one_generator_per_row_draws_what_the_row_would_draw_alone() -> None:
    params = [SamplingParams(temperature=1.0)] * 3
    logits = np.stack([LOGITS] * 3)
    seen = [np.array([], np.int64)] * 3
    together = sample(logits, params, seen, [np.random.default_rng(s) for s in (1, 2, 3)])
    alone = [sample(LOGITS[None], params[:1], seen[:1], np.random.default_rng(s))[0] for s in (1, 2, 3)]
    assert together.tolist() == alone


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
    dict(min_p=-0.1), dict(min_p=2.0), dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
    dict(frequency_penalty=-3.0),
])
def test_invalid_parameters_raise_value_error(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@pytest.mark.oracle
def test_filters_match_transformers_warpers() -> None:
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, 64).astype(np.float32)
    seen = np.array([1, 5, 9, 5])
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    scores = torch.from_numpy(logits[None].copy())
    ids = torch.from_numpy(seen[None])
    for proc in (RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(20),
                 TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        scores = proc(ids, scores)
    expected = torch.softmax(scores, dim=-1)[0].numpy()
    np.testing.assert_allclose(filtered_probs(logits, params, seen), expected, atol=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=0.9), SamplingParams(repetition_penalty=3.0),
    SamplingParams(presence_penalty=2.0), SamplingParams(frequency_penalty=1.5),
    SamplingParams(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5),
])
def test_stepper_picks_what_sample_picks_with_the_whole_history(params: SamplingParams) -> None:
    """A row's stepper hands the penalties its prompt and output (and skips building them when no penalty reads
    them): every pick is sample()'s with the full histories, on logits whose best tokens are the history's."""
    from qwen_runtime.generation.stepper import RowStepper

    prompt = [3, 7, 7, 11]
    stepper = RowStepper(prompt, params, np.random.default_rng(9), 12, frozenset())
    reference_rng = np.random.default_rng(9)
    logits_rng = np.random.default_rng(4)
    tokens: list[int] = []
    for _ in range(12):
        logits = logits_rng.normal(0, 0.5, 32).astype(np.float32)
        logits[prompt + tokens] += 2.0  # the history holds the most likely tokens: penalties change the pick
        want = int(sample(logits[None], [params], [np.asarray(prompt + tokens)], [reference_rng],
                          [np.asarray(tokens, np.int64)])[0])
        step = stepper.step(logits)
        assert step.token == want
        tokens.append(want)
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        assert set(tokens) - set(prompt), "the penalties never changed a pick: the test shows nothing"
