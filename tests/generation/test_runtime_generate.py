"""The generation loop (batching, stops, streaming, seeds, context check) and the qwen-run CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import fixture_dir

from qwen_runtime import GenerationConfig, SamplingParams, chat_format, generate, load, stream
from qwen_runtime.cli import main
from qwen_runtime.errors import ContextOverflowError
from qwen_runtime.generation.generate import Generation

PROMPTS = ["Hello world, this is a longer prompt", "你好", "def f(x):\n    return"]


@pytest.fixture(scope="module")
def model():
    return load(fixture_dir("qwen2-tiny"))


def run_ids(model, prompts, steps, stop=frozenset()):
    gen = Generation(model, prompts, GenerationConfig(steps, SamplingParams(), stop, prefill_chunk=4))
    return gen.run()


@pytest.mark.slow
def test_batch_equals_solo_and_finished_rows_stop(model) -> None:
    prompts = [chat_format(model).encode_prompt(p) for p in PROMPTS]
    solo = [run_ids(model, [p], 8)[0].token_ids for p in prompts]
    stop = frozenset({solo[1][2]})  # row 1 stops early at its third token
    batch = run_ids(model, prompts, 8, stop)
    for row, result in enumerate(batch):
        cut = next((k + 1 for k, t in enumerate(solo[row]) if t in stop), len(solo[row]))
        assert result.token_ids == solo[row][:cut]
        assert result.finish_reason == ("stop" if result.token_ids[-1] in stop else "length")
    assert batch[1].finish_reason == "stop" and len(batch[1].token_ids) == 3


def test_stream_text_adds_up_to_results(model) -> None:
    gen = stream(model, PROMPTS, max_new_tokens=6)
    steps = list(gen)
    assert len(steps) <= 6 and all(len(s) == 3 for s in steps)
    for row, result in enumerate(gen.results):
        assert "".join(s[row] for s in steps) == result.text
        assert result.text == chat_format(model).tokenizer.decode(
            [t for t in result.token_ids if t not in chat_format(model).stop_ids])
    assert gen.stats.prompt_tokens == sum(len(r.prompt_ids) for r in gen.results)
    assert gen.stats.prefill_seconds > 0 and gen.stats.decoded_tokens > 0


def test_same_seed_same_text(model) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1)
    a = generate(model, PROMPTS, max_new_tokens=8, sampling=params, seed=3)
    b = generate(model, PROMPTS, max_new_tokens=8, sampling=params, seed=3)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_chat_prompts_use_the_template(model) -> None:
    [result] = generate(model, "hi", chat=True, system="Be brief.", max_new_tokens=2)
    text = chat_format(model).tokenizer.decode(result.prompt_ids, skip_special=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_context_overflow_is_a_clear_error(model) -> None:
    limit = model.config.max_position_embeddings
    with pytest.raises(ContextOverflowError, match="context length"):
        stream(model, [[1, 2, 3]], max_new_tokens=limit)


def test_cli_streams_and_reports_stats(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(fixture_dir("qwen3-tiny"))
    assert main([path, "-p", "def", "--max-new-tokens", "4", "--stats", "--seed", "1", "--temperature", "0.8"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "tok/s" in err and "peak RSS" in err and "anonymous RSS" in err
    assert main([path, "--chat", "-p", "a", "-p", "bb", "--max-new-tokens", "2", "--no-think"]) == 0
    out, _ = capsys.readouterr()
    assert "--- [0]" in out and "--- [1]" in out


@pytest.mark.parametrize(("args", "code", "message"), [
    (["/no/such/model", "-p", "x"], 2, "no such file"),
    (["{corrupt}", "-p", "x"], 2, "GGUF"),
    (["{qwen3}", "-p", "x", "-c", "1"], 8, "context length"),
    (["{qwen3}", "-p", "x", "--top-p", "0"], 2, "--top-p"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], code: int,
                                 message: str) -> None:
    corrupt = tmp_path / "bad.gguf"
    corrupt.write_bytes(b"GGUF" + np.arange(50, dtype=np.uint8).tobytes())
    args = [a.format(corrupt=corrupt, qwen3=fixture_dir("qwen3-tiny")) for a in args]
    assert main(args) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
