"""Qwen3.5 through the public API: stop tokens and chat template from the model's files, batched generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen_runtime import chat_format, generate, load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module", params=["qwen35-tiny", "qwen35-vl-tiny"])
def model(request: pytest.FixtureRequest):
    return load(FIXTURES / request.param)


def test_stop_ids_are_im_end_and_endoftext(model) -> None:
    fmt = chat_format(model)
    wanted = {fmt.tokenizer.token_id("<|im_end|>"), fmt.tokenizer.token_id("<|endoftext|>")}
    assert None not in wanted
    assert wanted <= set(fmt.stop_ids)


def test_chat_template_comes_from_the_model(model) -> None:
    text = chat_format(model).render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_batched_chat_generation_equals_solo(model) -> None:
    prompts = ["你好", "write a haiku about numpy arrays and cats", "1 + 1 ="]
    options = dict(chat=True, enable_thinking=False, max_new_tokens=8, prefill_chunk=7)
    batched = generate(model, prompts, **options)
    for prompt, result in zip(prompts, batched, strict=True):
        [solo] = generate(model, prompt, **options)
        assert result.prompt_ids == solo.prompt_ids
        assert result.token_ids == solo.token_ids
        assert result.text == solo.text
