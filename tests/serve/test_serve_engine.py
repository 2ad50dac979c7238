"""The serving engine without HTTP: ragged slot rows with row-invariant decoding give every row the logits it
would get alone, bit for bit, in every family and stored type; rows move and copy without changing them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir, use_kernels

import qwen_runtime
from qwen_runtime.generation.sampling import SamplingParams
from qwen_runtime.models import Model
from qwen_runtime.text.chat import chat_format

SlotCache = pytest.importorskip("qwen_serve.slots", reason="qwen_serve needs the serve extra").SlotCache
PrefixCache = pytest.importorskip("qwen_serve.prefix_cache").PrefixCache


def decode_logits(model: Model, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Prefill each prompt in a row of its own, then decode all rows together greedily.  # -> [steps, B, V]"""
    slots = SlotCache(model, len(prompts), 64)
    tokens = []
    for i, prompt in enumerate(prompts):
        slots.reset(i)
        logits = model.forward(np.asarray([prompt]), slots.rows(i, i + 1), last_only=True)
        tokens.append(int(np.argmax(logits[0])))
    out = []
    ws = model.lm_head.ws
    for _ in range(steps):
        with ws.rowwise():
            logits = model.forward(np.asarray(tokens)[:, None], slots.rows(0, len(prompts)), last_only=True)
        out.append(logits)
        tokens = np.argmax(logits, axis=1).tolist()
    return np.stack(out)


@pytest.mark.parametrize(("family", "fmt", "dtype", "kernels"), [
    ("qwen3-tiny", "hf", "fp32", "numpy"), ("qwen2-tiny", "gguf", "q8_0", "numpy"),
    ("qwen35-tiny", "hf", "fp32", "numpy"), ("qwen35-tiny-gqa", "gguf", "q8_0", "numpy"),
    ("qwen3-tiny", "gguf", "fp16", "numpy"), ("qwen2-tiny", "gguf", "q8_0", "numba"),
    ("qwen35-tiny-gqa", "gguf", "q8_0", "numba"),
])
def test_a_row_decodes_the_same_alone_and_among_others(converted: Converted, family: str, fmt: str,
                                                       dtype: str, kernels: str) -> None:
    check_rows_alone_and_together(use_kernels(qwen_runtime.load(converted(family, fmt, dtype)), kernels))


@pytest.mark.parametrize(("family", "dtype"), [("qwen2-tiny", "q4_k_m"), ("qwen35-tiny-gqa", "q8_0"),
                                               ("qwen3-tiny", "q5_0")])
def test_rows_are_invariant_with_8_bit_activations(converted: Converted, family: str, dtype: str) -> None:
    """``activations="q8"`` (``auto`` where only AVX2 multiplies) keeps the batch row-invariant: each row's
    activations are quantized alone and go through the same operations in any group of rows."""
    pytest.importorskip("numba")
    check_rows_alone_and_together(qwen_runtime.load(converted(family, "gguf", dtype), kernels="numba",
                                                    activations="q8"))


def check_rows_alone_and_together(model: Model) -> None:
    """Rows 0, 4 and 8 of nine decode the same logits alone as together, bit for bit, and row 0 the tokens of the
    plain generation loop."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, int(rng.integers(2, 30))).tolist() for _ in range(9)]
    together = decode_logits(model, prompts, 6)
    for i in (0, 4, 8):
        alone = decode_logits(model, [prompts[i]], 6)
        assert np.array_equal(together[:, i], alone[:, 0]), f"row {i} differs"
    # a row's result matches the plain (slot-aligned) generation loop up to float32 rounding
    [result] = qwen_runtime.generate(model, [prompts[0]], max_new_tokens=7)
    assert np.argmax(together[:, 0], axis=1).tolist() == result.token_ids[1:]


def test_moved_and_copied_rows_continue_unchanged() -> None:
    model = qwen_runtime.load(fixture_dir("qwen35-tiny"))
    slots = SlotCache(model, 4, 32)
    ids = np.asarray([[5, 9, 200, 31]])
    slots.reset(2)
    model.forward(ids, slots.rows(2, 3), last_only=True)
    slots.copy(2, 0)
    slots.move(2, 1)
    assert slots.lengths.tolist() == [4, 4, 0, 0]
    with model.lm_head.ws.rowwise():
        logits = model.forward(np.asarray([[7], [7]]), slots.rows(0, 2), last_only=True)
    reference = model.logits(np.asarray([[5, 9, 200, 31, 7]]))[0, -1]
    assert np.array_equal(logits[0], logits[1])
    np.testing.assert_allclose(logits[0], reference, atol=1e-4)
    with pytest.raises(ValueError, match="overflow"):
        model.forward(np.zeros((2, 30), np.int64), slots.rows(0, 2))


# --- isolation: a request that fails inside a step fails alone -----------------------------------------------

Engine = pytest.importorskip("qwen_serve.engine", reason="qwen_serve needs the serve extra")


class Outcome:
    """A job's events: its tokens, whether it failed, and an Event set when it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.failed: str | None = None
        self.ended = threading.Event()

    def emit(self, event) -> None:
        if isinstance(event, Engine.Delta):
            self.tokens.extend(event.token_ids)
        elif isinstance(event, Engine.Failed):
            self.failed = event.message
            self.ended.set()
        elif isinstance(event, Engine.Done):
            self.ended.set()


def run_jobs(engine, prompts: list[list[int]], max_tokens: int, emits=None) -> list[Outcome]:
    outcomes = [Outcome() for _ in prompts]
    for i, (prompt, outcome) in enumerate(zip(prompts, outcomes, strict=True)):
        emit = emits[i](outcome) if emits and emits[i] else outcome.emit
        engine.submit(Engine.Job(prompt, max_tokens, SamplingParams(), emit))
    for outcome in outcomes:
        assert outcome.ended.wait(60), "a job never ended"
    return outcomes


@pytest.fixture
def engine():
    model = qwen_runtime.load(fixture_dir("qwen3-tiny"))
    fmt = chat_format(model)
    eng = Engine.Engine(model, fmt.tokenizer, frozenset(), max_batch=8)
    eng.start()
    yield eng
    eng.stop()


PROMPTS = [[229, 248, 366, 460, 16], [419, 365, 406, 260, 396], [198, 312, 266, 41, 13], [421, 205, 132, 401, 124]]


def test_a_request_that_raises_while_emitting_fails_alone(engine) -> None:
    solo = [run_jobs(engine, [p], 12)[0].tokens for p in PROMPTS]

    def raising_on_third(outcome: Outcome):
        def emit(event) -> None:
            if isinstance(event, Engine.Delta) and len(outcome.tokens) == 2:
                raise RuntimeError("injected emit failure")
            outcome.emit(event)
        return emit

    together = run_jobs(engine, PROMPTS, 12, emits=[None, raising_on_third, None, None])
    assert "injected emit failure" in together[1].failed and len(together[1].tokens) == 2
    assert [o.tokens for i, o in enumerate(together) if i != 1] == [t for i, t in enumerate(solo) if i != 1]
    assert engine.status()["running_rows"] == 0 and engine.status()["reserved_bytes"] == 0


def test_a_request_whose_pass_raises_fails_alone_and_the_others_step_is_retried(engine,
                                                                             monkeypatch: pytest.MonkeyPatch
                                                                             ) -> None:
    """A decode pass raises whenever one request's token is in it: the rows are run again one by one, that
    request fails, the others get exactly the tokens they get alone (rows do not depend on their neighbours)."""
    solo = [run_jobs(engine, [p], 12)[0].tokens for p in PROMPTS]
    others = {t for i, tokens in enumerate(solo) if i != 2 for t in tokens}
    poison = next(t for t in solo[2][1:] if t not in others)  # fed to a decode pass by request 2 only
    real = engine.model.forward
    passes = []

    def forward(ids, cache, *args, **kwargs):
        passes.append(ids.shape[0])
        if ids.shape[1] == 1 and poison in ids[:, 0]:
            raise RuntimeError("injected pass failure")
        return real(ids, cache, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)
    together = run_jobs(engine, PROMPTS, 12)
    assert "injected pass failure" in together[2].failed
    assert [o.tokens for i, o in enumerate(together) if i != 2] == [t for i, t in enumerate(solo) if i != 2]
    assert max(passes) == len(PROMPTS) and 1 in passes  # batched, then retried row by row
    assert engine.status()["restarts"] == 0


def test_a_dead_loop_is_restarted_then_reported_and_refused_consistently(engine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine._drop_cancelled
    deaths = []

    def dying() -> None:
        if len(deaths) < 1:
            deaths.append(1)
            raise RuntimeError("injected loop failure")
        real()

    monkeypatch.setattr(engine, "_drop_cancelled", dying)
    [first] = run_jobs(engine, [PROMPTS[0]], 4)  # died before its prefill: it was waiting, so it ran afterwards
    assert first.failed is None and len(first.tokens) == 4
    status = engine.status()
    assert status["restarts"] == 1 and "injected loop failure" in status["last_error"] and engine.error is None

    def always_dying() -> None:
        raise RuntimeError("injected loop failure")

    monkeypatch.setattr(engine, "_drop_cancelled", always_dying)
    [second] = run_jobs(engine, [PROMPTS[1]], 4)
    assert "injected loop failure" in second.failed and engine.error is not None
    with pytest.raises(Engine.EngineStoppedError, match="injected loop failure"):
        engine.submit(Engine.Job(PROMPTS[2], 4, SamplingParams(), Outcome().emit))


# --- the prefix cache ------------------------------------------------------------------------------------------


class Logged(Outcome):
    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[float] = []

    def emit(self, event) -> None:
        if isinstance(event, Engine.Delta):
            self.logprobs.extend(lp.logprob for lp in event.logprobs)
        super().emit(event)


def turns(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt in turn (greedy, 6 tokens, logprobs), the next one starting with the previous answer."""
    out, previous = [], []
    for prompt in prompts:
        full = previous + prompt
        outcome = Logged()
        engine.submit(Engine.Job(full, 6, SamplingParams(), outcome.emit, logprobs=0))
        assert outcome.ended.wait(60) and outcome.failed is None
        out.append((outcome.tokens, outcome.logprobs))
        previous = full + outcome.tokens
    return out


@pytest.mark.parametrize(("family", "cache_type"), [("qwen3-tiny", "f32"), ("qwen35-tiny", "f32"),
                                                    ("qwen3-tiny", "bf16"), ("qwen3-tiny", "q8_0"),
                                                    ("qwen35-tiny", "q4_0")])
def test_prefix_cache_gives_the_same_tokens_and_logprobs(family: str, cache_type: str) -> None:
    """Turns of a conversation (each prompt the whole history) with the cache off and on: identical greedy
    tokens and logprobs, bit for bit, while the later turns restore most of their prompt (for Qwen3.5 the
    Gated DeltaNet state checkpointed at block ends); with each KV cache type (blocks are kept in the type: a
    restored block is the bytes the row had written)."""
    model = qwen_runtime.load(fixture_dir(family), cache_type_k=cache_type, cache_type_v=cache_type)
    tok = chat_format(model).tokenizer
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 400, n).tolist() for n in (37, 11, 20)]
    results = {}
    for cache in (0, 64 << 20):
        engine = Engine.Engine(model, tok, frozenset(), max_batch=4, prefill_chunk=8, cache_memory=cache)
        engine.start()
        try:
            results[cache] = turns(engine, prompts)
            status = engine.status()["prefix_cache"]
        finally:
            engine.stop()
    assert results[0] == results[64 << 20]
    # turn 2 restores turn 1's 4 whole blocks, turn 3 those of turn 1 and 2 (prompt + answer are not stored)
    assert status["hits"] == 2 and status["hit_tokens"] == 32 + 48 and status["blocks"] == 10


def test_prefix_cache_evicts_the_least_recently_used_leaf() -> None:
    """A block goes only when no cached block follows it (a chain is never cut in the middle); among those,
    the least recently used goes first."""
    model = qwen_runtime.load(fixture_dir("qwen35-tiny"))
    slots = SlotCache(model, 1, 64)

    def fill(prompt: list[int], cache: PrefixCache, last: int) -> None:
        slots.reset(0)
        for end in range(8, last + 1, 8):
            model.forward(np.asarray([prompt[end - 8:end]]), slots.rows(0, 1))
            cache.store(0, prompt, end)

    a, b = list(range(30)), list(range(8)) + list(range(100, 122))
    sizer = PrefixCache(slots, 8, 10**9)
    fill(a, sizer, 8)
    cache = PrefixCache(slots, 8, 2 * sizer.nbytes)
    fill(a, cache, 24)  # the third block finds no leaf to evict but its own parent: not stored
    assert len(cache.blocks) == 2 and cache.nbytes == 2 * sizer.nbytes
    fill(b, cache, 16)  # shares a's first block; its second evicts a's second, the least recently used leaf
    assert [len(cache.lookup(a).blocks), len(cache.lookup(b).blocks)] == [1, 2]


# --- turns: the cache also keeps where each request stopped ----------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_cache_turns_resume_where_the_last_turn_stopped(family: str) -> None:
    """With ``cache_turns`` each turn restores the previous turn's prompt and answer (all but the answer's last
    token, which was never fed back) and prefills only the rest.  The restored answer was decoded token by token
    where a cache-off prompt prefills it, so only float32 rounding may differ: the same greedy tokens, logprobs
    within 1e-4 (a few ulps of the logits, through a few layers), and no block is stored from a resumed row.
    Qwen3.5's tails are its answers' and its prompts' but for their last token (see the next test)."""
    model = qwen_runtime.load(fixture_dir(family))
    tok = chat_format(model).tokenizer
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 400, n).tolist() for n in (37, 11, 20)]
    results, status = {}, {}
    for turns_on in (False, True):
        engine = Engine.Engine(model, tok, frozenset(), max_batch=4, prefill_chunk=8, cache_memory=64 << 20,
                               cache_turns=turns_on)
        engine.start()
        try:
            results[turns_on] = turns(engine, prompts)
            status[turns_on] = engine.status()["prefix_cache"]
        finally:
            engine.stop()
    for (tokens_off, logprobs_off), (tokens_on, logprobs_on) in zip(results[False], results[True], strict=True):
        assert tokens_on == tokens_off
        np.testing.assert_allclose(logprobs_on, logprobs_off, rtol=0, atol=1e-4)
    if family == "qwen3-tiny":  # turn 1 restores nothing: bit for bit (Qwen3.5's last prompt token gets a pass
        assert results[True][0] == results[False][0]  # of its own, for the tail before it)
    # turn 2 resumes at 37 + 5 tokens, turn 3 at 54 + 5; the blocks stay turn 1's 4, plus each answer's tail and
    # each prompt's (Qwen3.5: turn 1's only, before its last token; resumed prompts go on in one pass)
    assert status[False]["hit_tokens"] == 32 + 48 and status[False]["tails"] == 0
    assert status[True]["hits"] == 2 and status[True]["hit_tokens"] == 42 + 59
    assert status[True]["blocks"] == 4 and status[True]["tails"] == (6 if family == "qwen3-tiny" else 4)


@pytest.mark.parametrize(("family", "resumed"), [("qwen3-tiny", 36), ("qwen35-tiny", 36)])
def test_a_next_prompt_that_changes_the_last_prompt_token_resumes_before_it(family: str, resumed: int) -> None:
    """A next prompt whose text tokenized differently where the last prompt met its answer (its last token is
    another): attention restores the part of a tail that matches, and Qwen3.5 the tail kept before the prompt's
    last token (a recurrent state restores only whole)."""
    model = qwen_runtime.load(fixture_dir(family))
    engine = Engine.Engine(model, chat_format(model).tokenizer, frozenset(), max_batch=2, prefill_chunk=8,
                           cache_memory=64 << 20, cache_turns=True)
    engine.start()
    try:
        first = list(range(100, 137))  # 37 tokens: blocks end at 32, the last token is at 36
        turns(engine, [first])
        turns(engine, [first[:-1] + [5, 6, 7]])
        status = engine.status()["prefix_cache"]
    finally:
        engine.stop()
    assert status["hits"] == 1 and status["hit_tokens"] == resumed


@pytest.mark.parametrize(("family", "resumed"), [("qwen3-tiny", 18), ("qwen35-tiny", 16)])
def test_a_tail_restores_partly_only_without_recurrent_state(family: str, resumed: int) -> None:
    """A prompt that leaves a tail after 2 of its 4 tokens: attention layers take those 2 tokens' keys and values
    (and the row then computes exactly what the original row cut back there computes), a recurrent state only
    the whole tail, so Qwen3.5 restores the blocks alone."""
    model = qwen_runtime.load(fixture_dir(family))
    slots = SlotCache(model, 2, 64)
    cache = PrefixCache(slots, 8, 10**9, turns=True)
    tokens = list(range(50, 70))
    slots.reset(0)
    for start, end in ((0, 8), (8, 16), (16, 20)):  # two whole blocks, then a tail of 4 tokens
        model.forward(np.asarray([tokens[start:end]]), slots.rows(0, 1))
        if end % 8:
            cache.store_tail(0, tokens)
        else:
            cache.store(0, tokens, end)
    assert len(cache.blocks) == 2 and len(cache.tails) == 1
    prompt = tokens[:18] + [7, 9]
    hit = cache.lookup(prompt)
    assert hit.length == resumed and len(hit.blocks) == 2
    slots.reset(1)
    assert cache.restore(1, hit) == resumed
    slots.lengths[0] = resumed
    ws = model.lm_head.ws
    with ws.rowwise():
        original = model.forward(np.asarray([prompt[resumed:]]), slots.rows(0, 1), last_only=True)
    if family == "qwen3-tiny":
        with ws.rowwise():
            restored = model.forward(np.asarray([prompt[resumed:]]), slots.rows(1, 2), last_only=True)
        assert np.array_equal(restored, original)


def test_tails_are_evicted_first_by_age_and_keep_their_parent_block() -> None:
    """Tails are leaves: the least recently used goes first, and the block a tail follows stays while it has one."""
    model = qwen_runtime.load(fixture_dir("qwen35-tiny"))
    slots = SlotCache(model, 1, 64)
    sizer = PrefixCache(slots, 8, 10**9, turns=True)
    block, tail = list(range(10, 18)), [3, 4, 5]
    slots.reset(0)
    model.forward(np.asarray([block]), slots.rows(0, 1))
    sizer.store(0, block, 8)
    model.forward(np.asarray([tail]), slots.rows(0, 1))
    sizer.store_tail(0, block + tail)
    cache = PrefixCache(slots, 8, sizer.nbytes, turns=True)  # a block and a tail of 3 tokens
    slots.lengths[0] = 8
    cache.store(0, block, 8)
    for last in (3, 4):  # two tails after the block, room for one: the second evicts the first
        slots.lengths[0] = 8
        model.forward(np.asarray([[1, 2, last]]), slots.rows(0, 1))
        cache.store_tail(0, block + [1, 2, last])
    assert len(cache.blocks) == 1 and [t.tokens.tolist() for t in cache.tails.values()] == [[1, 2, 4]]
    assert next(iter(cache.blocks.values())).children == 1
    assert cache.lookup(block + [1, 2, 4, 0]).length == 11 and cache.lookup(block + [1, 2, 3, 0]).length == 8


# --- prompts under concurrency: passes of several prompts, within a budget, oldest first ----------------------


def scheduled(eng, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[list[int]]]]:
    """What the engine runs, in order: ("prefill", each chunk's tokens) per pass and ("decode", []) per step."""
    log: list[tuple[str, list[list[int]]]] = []
    prefill_many, decode = eng.model.prefill_many, eng._decode_step

    def recording_prefill(chunks, caches):
        log.append(("prefill", [list(c) for c in chunks]))
        return prefill_many(chunks, caches)

    def recording_decode():
        log.append(("decode", []))
        decode()

    monkeypatch.setattr(eng.model, "prefill_many", recording_prefill)
    monkeypatch.setattr(eng, "_decode_step", recording_decode)
    return log


def submit_together(eng, prompts: list[list[int]], max_tokens: int) -> list[Outcome]:
    """Submit while holding the engine's lock, so its loop admits them all at once."""
    outcomes = [Outcome() for _ in prompts]
    with eng._cond:
        for prompt, outcome in zip(prompts, outcomes, strict=True):
            eng.submit(Engine.Job(prompt, max_tokens, SamplingParams(), outcome.emit))
    for outcome in outcomes:
        assert outcome.ended.wait(60), "a job never ended"
    return outcomes


def test_prompts_arriving_together_prefill_in_one_pass_with_their_solo_tokens(engine, monkeypatch) -> None:
    solo = [run_jobs(engine, [p], 6)[0].tokens for p in PROMPTS]
    log = scheduled(engine, monkeypatch)
    together = submit_together(engine, PROMPTS, 6)
    assert log[0] == ("prefill", PROMPTS)  # one pass of every prompt, oldest first, before any decode step
    assert [o.tokens for o in together] == solo


def test_a_budget_bounds_each_pause_and_the_oldest_prompt_always_advances(monkeypatch) -> None:
    """Prompts of 30, 5, 21 and 12 tokens in chunks of 8 with a budget of 16 tokens between two decode steps:
    no pause prefills more than the budget, each pause starts with the oldest unfinished prompt's next chunk,
    the running rows step between pauses, and every request gets its solo tokens."""
    model = qwen_runtime.load(fixture_dir("qwen3-tiny"))
    eng = Engine.Engine(model, chat_format(model).tokenizer, frozenset(), max_batch=8, prefill_chunk=8,
                        prefill_budget=16, cache_memory=0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (30, 5, 21, 12)]
    try:
        solo = [run_jobs(eng, [p], 5)[0].tokens for p in prompts]
        log = scheduled(eng, monkeypatch)
        together = submit_together(eng, prompts, 5)
    finally:
        eng.stop()
    assert [o.tokens for o in together] == solo
    done = [0] * len(prompts)  # tokens prefilled per prompt
    pauses: list[list[list[int]]] = [[]]  # the passes between two decode steps
    for kind, chunks in log:
        if kind == "decode":
            pauses.append([])
        else:
            pauses[-1].append(chunks)
    assert len([p for p in pauses if p]) > 2  # the prompts did not all fit in one pause: decode steps between
    for pause in (p for p in pauses if p):
        oldest = next(i for i, n in enumerate(done) if n < len(prompts[i]))
        assert pause[0][0] == prompts[oldest][done[oldest]:done[oldest] + len(pause[0][0])]
        assert sum(len(c) for chunks in pause for c in chunks) <= 16
        for chunks in pause:
            for chunk in chunks:
                i = next(i for i, p in enumerate(prompts) if p[done[i]:done[i] + len(chunk)] == chunk)
                assert done[i] % 8 == 0  # chunks start at multiples of the chunk size, as alone
                done[i] += len(chunk)
    assert done == [len(p) for p in prompts]
