"""qwen-serve through the official openai client: chat and text completions, streamed and not, and
continuous batching that gives every request the tokens it would get alone."""

from __future__ import annotations

import threading

import pytest
from runtime_helpers import fixture_dir
from serve_helpers import RunningServer, http, running_server

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server() -> RunningServer:
    with running_server(fixture_dir("qwen3-tiny"), max_batch=16, max_queue=8) as srv:
        yield srv


def chat(client, content: str, **options):
    return client.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": content}],
                                          **{**GREEDY, **options})


def test_models_and_health(server: RunningServer) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["qwen3-tiny"]
    status, _, health = http("GET", f"{server.url}/health")
    assert status == 200 and health["status"] == "ok" and health["max_batch"] == 16


def test_chat_streamed_equals_not_streamed(server: RunningServer) -> None:
    client = server.client()
    whole = chat(client, "Explain attention", max_tokens=12)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(chat(client, "Explain attention", max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_streamed_equals_not_streamed(server: RunningServer) -> None:
    client = server.client()
    whole = client.completions.create(model="qwen3-tiny", prompt="def fib(n):", max_tokens=10, **GREEDY)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    parts = list(client.completions.create(model="qwen3-tiny", prompt="def fib(n):", max_tokens=10, stream=True,
                                           **GREEDY))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"


def run_concurrently(jobs: list) -> list:
    results: list = [None] * len(jobs)
    errors: list = []

    def work(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as exc:  # reported below with the index
            errors.append((i, exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def streamed_tokens(client, prompt: str, max_tokens: int) -> tuple[str, list[tuple[bytes, float]]]:
    """The text and the (token bytes, logprob) of every sampled token of a streamed greedy chat."""
    text, tokens = [], []
    for chunk in chat(client, prompt, max_tokens=max_tokens, stream=True, logprobs=True):
        if not chunk.choices:
            continue
        text.append(chunk.choices[0].delta.content or "")
        if chunk.choices[0].logprobs is not None:
            tokens.extend((bytes(t.bytes), t.logprob) for t in chunk.choices[0].logprobs.content)
    return "".join(text), tokens


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_sixteen_concurrent_streams_equal_their_solo_runs(family: str) -> None:
    """Greedy tokens and their logprobs (bit for bit) alone and among 15 others: the batch is row-invariant."""
    prompts = [f"Question {i}: " + "why " * (i % 5) + "is the sky blue?" for i in range(16)]
    lengths = [8 + (i * 5) % 17 for i in range(16)]  # rows leave the batch at different steps
    with running_server(fixture_dir(family), max_batch=16, model_name="qwen3-tiny") as srv:
        client = srv.client()
        solo = [streamed_tokens(client, p, n) for p, n in zip(prompts, lengths, strict=True)]
        together = run_concurrently([lambda p=p, n=n: streamed_tokens(srv.client(), p, n)
                                     for p, n in zip(prompts, lengths, strict=True)])
        assert srv.engine.peak_rows >= 8  # the requests really ran side by side
    for i, (alone, among) in enumerate(zip(solo, together, strict=True)):
        assert 0 < len(alone[1]) <= lengths[i]
        assert among == alone, f"request {i} differs when batched"
