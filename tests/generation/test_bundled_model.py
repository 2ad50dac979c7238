"""The bundled model (qwen_runtime/assets/qwen3-stdlib) against its own model card.

The card states the greedy samples a runtime must reproduce token for token and the held-out perplexity of the
shipped bf16 weights; both are read from MODEL_CARD.md, so the card and this test cannot drift apart.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import qwen_runtime
from qwen_convert.demo import bundled_model_path
from qwen_runtime import chat_format
from qwen_runtime.generation.evaluate import evaluate
from qwen_runtime.models import Model

SAMPLE = re.compile(r"Prompt '(.*?)', (plain|space-healed) greedy:\n\n```python\n(.*?)\n```", re.S)
PERPLEXITY_ROW = re.compile(r"\| heldout\.txt, bf16 weights \(as shipped\) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \|")
NEW_TOKENS = 48
WINDOW = 256


@pytest.fixture(scope="module")
def path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="module")
def card(path: Path) -> str:
    return (path / "MODEL_CARD.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def model(path: Path) -> Model:
    return qwen_runtime.load(path)


def greedy(model: Model, ids: list[int], steps: int, first_allowed: np.ndarray | None = None) -> list[int]:
    """``steps`` greedy tokens after ``ids`` through the cache (EOS does not stop); the first one may be
    restricted to ``first_allowed`` (a boolean mask over the vocabulary)."""
    cache = model.make_cache(1, len(ids) + steps)
    logits = model.forward(np.asarray([ids]), cache, last_only=True)[0]
    out: list[int] = []
    for step in range(steps):
        if step == 0 and first_allowed is not None:
            logits = np.where(first_allowed, logits, -np.inf)
        out.append(int(np.argmax(logits)))
        logits = model.forward(np.asarray([[out[-1]]]), cache, last_only=True)[0]
    return out


def test_card_has_the_samples_and_the_perplexity(card: str) -> None:
    assert [(p, k) for p, k, _ in SAMPLE.findall(card)] == [
        ("def ", "plain"), ("import ", "plain"), ("def ", "space-healed"), ("import ", "space-healed")]
    assert PERPLEXITY_ROW.search(card)


@pytest.mark.parametrize("index", range(4))
def test_greedy_samples_of_the_card(model: Model, card: str, index: int) -> None:
    """Plain: the prompt as is. Space-healed: the trailing space dropped and the first new token restricted to
    tokens that start with a space (the card's simple token healing)."""
    prompt, kind, expected = SAMPLE.findall(card)[index]
    tokenizer = chat_format(model).tokenizer
    allowed = None
    if kind == "space-healed":
        prompt = prompt.rstrip(" ")
        allowed = np.array([tokenizer.token_bytes(i).startswith(b" ") for i in range(model.config.vocab_size)])
    ids = tokenizer.encode(prompt)
    new = greedy(model, ids, NEW_TOKENS, allowed)
    assert tokenizer.decode(ids + new, skip_special=False) == expected


@pytest.mark.slow
def test_heldout_perplexity_of_the_card(model: Model, card: str, path: Path) -> None:
    """Non-overlapping 256-token windows (remainder dropped), each scored from an empty cache at positions
    1..255. The card gives the mean NLL to 4 decimals; float32 vs the card's float32 run differs by ~1e-6."""
    scored, nll, perplexity = PERPLEXITY_ROW.search(card).groups()
    text = (path / "heldout.txt").read_text(encoding="utf-8")
    n_tokens = len(chat_format(model).encode_prompt(text))
    windows = n_tokens // WINDOW
    [result] = evaluate([model], text, ctx=WINDOW, stride=WINDOW, max_tokens=windows * WINDOW)
    assert result.scored == int(scored.replace(",", "")) == windows * (WINDOW - 1)
    assert abs(result.nll - float(nll)) <= 0.5e-4 + 1e-5
    assert f"{result.perplexity:.2f}" == perplexity
    assert math.isclose(result.perplexity, math.exp(result.nll))
