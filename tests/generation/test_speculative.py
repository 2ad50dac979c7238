"""Speculative decoding by prompt lookup: a verify pass gives each token exactly a one-token step's logits (every
family, stored types, Qwen3.5's recurrent state restored and replayed), so greedy output with drafts is plain
decoding's, token for token, in the generation loop and in the server's engine, with stops, stop strings, token
budgets and structured output cutting a pass of accepted drafts where plain decoding would stop."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from runtime_helpers import Converted, fixture_dir, use_kernels

import qwen_runtime
from qwen_runtime.generation.generate import Generation, GenerationConfig
from qwen_runtime.generation.sampling import SamplingParams
from qwen_runtime.generation.stepper import PromptLookup, RowStepper
from qwen_runtime.models import Model
from qwen_runtime.text.chat import chat_format

pytest.importorskip("numba")

FAMILIES = ("qwen2-tiny", "qwen3-tiny", "deepseek-tiny", "qwen35-tiny", "qwen35-tiny-gqa")
DENSE = ("qwen2-tiny", "qwen3-tiny", "deepseek-tiny")
MODELS: dict[str, Model] = {}


def compiled(family: str) -> Model:
    """The fixture (bf16 or fp32 products) on the compiled kernels, loaded once."""
    if family not in MODELS:
        MODELS[family] = use_kernels(qwen_runtime.load(fixture_dir(family), kernels="numba"), "numba")
    return MODELS[family]


def steps(model: Model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits of each of ``tokens`` fed one plain step at a time after ``prompt``.  # -> [T, V]"""
    cache = model.make_cache(1, len(prompt) + len(tokens))
    model.forward(np.asarray([prompt]), cache)
    return np.stack([model.forward(np.asarray([[t]]), cache, last_only=True)[0] for t in tokens])


def repetitive(model: Model, seed: int = 0) -> list[int]:
    """A prompt that repeats a random phrase: the model's greedy reply soon repeats too."""
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, 6).tolist() * 5


# --- the verify pass --------------------------------------------------------------------------------------------


def check_verify(model: Model) -> None:
    """Passes of 2, 7 and 16 tokens equal one-token steps bit for bit; cut back to some of their tokens, the
    cache continues as if only those had been fed."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, 9).tolist()
    tokens = rng.integers(0, model.config.vocab_size, 16).tolist()
    after = rng.integers(0, model.config.vocab_size, 3).tolist()
    expected = steps(model, prompt, tokens)
    for length, keep in ((2, 1), (7, 3), (16, 16)):
        cache = model.make_cache(1, len(prompt) + 20)
        model.forward(np.asarray([prompt]), cache)
        cache.checkpoint()
        got = model.verify(np.asarray([tokens[:length]]), cache)[0]
        assert np.array_equal(got.view(np.uint32), expected[:length].view(np.uint32)), f"a pass of {length} differs"
        cache.rollback(np.asarray([keep]))
        assert cache.lengths.tolist() == [len(prompt) + keep]
        continued = np.stack([model.forward(np.asarray([[t]]), cache, last_only=True)[0] for t in after])
        plain = steps(model, prompt, tokens[:keep] + after)[keep:]
        assert np.array_equal(continued.view(np.uint32), plain.view(np.uint32)), f"cut back to {keep} of {length}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_pass_gives_each_token_a_steps_logits(family: str) -> None:
    check_verify(compiled(family))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), [("qwen2-tiny", "q4_k_m"), ("qwen3-tiny", "q8_0"),
                                               ("qwen35-tiny-gqa", "q8_0"), ("qwen35-tiny", "iq4_xs")])
def test_a_verify_pass_is_exact_for_stored_types(converted: Converted, family: str, dtype: str) -> None:
    check_verify(qwen_runtime.load(converted(family, "gguf", dtype), kernels="numba"))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "dtype"), [("qwen2-tiny", "q4_k_m"), ("qwen3-tiny", "q8_0"),
                                               ("qwen35-tiny", "q4_0")])
def test_a_verify_pass_is_exact_with_8_bit_activations(converted: Converted, family: str, dtype: str) -> None:
    """With ``activations="q8"`` (what ``auto`` is where only AVX2 multiplies) a verify pass still gives each token
    its one-token step's logits bit for bit: each activation row is quantized alone and its integer sums are exact,
    and a row's float operations are the same alone and in a group of rows."""
    check_verify(qwen_runtime.load(converted(family, "gguf", dtype), kernels="numba", activations="q8"))


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_a_verify_pass_is_exact_for_each_cache_type(family: str, cache_type: str) -> None:
    """Under each KV cache type a verify pass gives each token its one-token step's logits under the same type, bit
    for bit (each token's keys and values are rounded or quantized alone, and each token's attention sums only its
    own slots), so greedy output with drafts stays plain decoding's."""
    model = qwen_runtime.load(fixture_dir(family), kernels="numba", cache_type_k=cache_type, cache_type_v=cache_type)
    check_verify(use_kernels(model, "numba"))


@pytest.mark.parametrize("family", ["qwen2-tiny", "qwen35-tiny"])
def test_a_padded_verify_pass_of_ragged_rows_is_exact(family: str) -> None:
    """Rows of a server's ragged cache bring 5 and 2 tokens (3 of padding): each row's own tokens get their
    one-token steps' logits, the padding multiplies nothing, and cut back the rows continue exactly."""
    slots_module = pytest.importorskip("qwen_serve.slots")
    model = compiled(family)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (7, 4)]
    tokens = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 2)]
    slots = slots_module.SlotCache(model, 2, 32)
    for i, prompt in enumerate(prompts):
        slots.reset(i)
        model.forward(np.asarray([prompt]), slots.rows(i, i + 1))
    cache = slots.rows(0, 2)
    cache.checkpoint()
    ids = np.asarray([tokens[0], tokens[1] + [tokens[1][-1]] * 3])
    valid = np.asarray([[True] * 5, [True] * 2 + [False] * 3])
    got = model.verify(ids, cache, valid)
    cache.rollback(np.asarray([3, 2]))
    assert slots.lengths[:2].tolist() == [10, 6]
    after = rng.integers(0, model.config.vocab_size, 2).tolist()
    with model.workspace.rowwise():
        continued = [model.forward(np.asarray([[t], [t]]), slots.rows(0, 2), last_only=True) for t in after]
    for row, own in enumerate((5, 2)):
        keep = (3, 2)[row]
        expected = steps(model, prompts[row], tokens[row][:keep] + after)
        plain = steps(model, prompts[row], tokens[row])
        assert np.array_equal(got[row, :own].view(np.uint32), plain.view(np.uint32))
        assert np.array_equal(np.stack([c[row] for c in continued]).view(np.uint32), expected[keep:].view(np.uint32))


# --- prompt lookup ----------------------------------------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_longest_match() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    lookup.append(2)
    lookup.append(3)
    assert lookup.propose(3) == [7, 8, 2]  # "2 3" last came before 7 8 (the 3-gram "x 2 3" never repeats)
    lookup.append(4)
    assert lookup.propose(2) == [5, 9]  # "2 3 4" earlier: its continuation
    lookup.append(6)
    assert lookup.propose(4) == []  # 6 never came before
    greedy = RowStepper([5, 6, 5], SamplingParams(), np.random.default_rng(0), 10, frozenset(), draft_tokens=4)
    greedy.record(6)
    assert greedy.drafts() == [5, 6]
    sampled = RowStepper([5, 6, 5], SamplingParams(temperature=0.7), np.random.default_rng(0), 10, frozenset(),
                         draft_tokens=4)
    sampled.record(6)
    assert sampled.drafts() == []  # sampled rows never draft
    short = RowStepper([5, 6, 5, 6, 5, 6], SamplingParams(), np.random.default_rng(0), 3, frozenset(), draft_tokens=4)
    short.record(5)
    assert short.drafts() == [6]  # two tokens of budget left: one draft, then the token after it


# --- generation -------------------------------------------------------------------------------------------------


class Spy:
    """Wraps a stepper's ``accept``: the drafts of each verify pass and the steps taken."""

    def __init__(self, stepper: RowStepper) -> None:
        self.passes: list[tuple[list[int], int, int]] = []  # (drafts, tokens before, steps taken)
        accept = stepper.accept

        def spied(logits: np.ndarray, drafts: list[int]) -> list:
            before = len(stepper.tokens)
            taken = accept(logits, drafts)
            self.passes.append((list(drafts), before, len(taken)))
            return taken

        stepper.accept = spied  # type: ignore[method-assign]


def generate(model: Model, prompt: list[int], drafts: int, spy: bool = False, **config: object,
             ) -> tuple[Generation, Spy | None]:
    gen = Generation(model, [prompt], GenerationConfig(draft_tokens=drafts, **config))  # type: ignore[arg-type]
    watcher = Spy(gen._rows[0]) if spy else None
    return gen, watcher


@pytest.mark.parametrize("family", DENSE)
def test_greedy_generation_is_the_same_with_drafts(family: str) -> None:
    model = compiled(family)
    prompt = repetitive(model)
    plain, _ = generate(model, prompt, 0, max_new_tokens=40)
    plain.run()
    for drafts in (3, 15):
        gen, _ = generate(model, prompt, drafts, max_new_tokens=40)
        chunks = list(gen)
        assert gen.results[0].token_ids == plain.results[0].token_ids
        assert len(chunks) == len(plain.results[0].token_ids)  # one yield per token, as plain decoding
        assert gen.stats.draft_accepted > 0 and gen.stats.draft_proposed >= gen.stats.draft_accepted
        assert gen.stats.decoded_tokens == plain.stats.decoded_tokens


class Oracle:
    """A lookup that proposes the plain greedy continuation, wrong at every third draft after the first: Qwen3.5
    tiny's random replies rarely repeat, and this makes its verify passes keep some drafts and drop others."""

    def __init__(self, stepper: RowStepper, continuation: list[int]) -> None:
        self.stepper, self.continuation = stepper, continuation

    def append(self, token: int) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        done = len(self.stepper.tokens)
        out = list(self.continuation[done:done + limit])
        for i in range(1, len(out), 3):
            if (done + i) % 2:
                out[i] = (out[i] + 1) % 50
        return out


def check_oracle_drafts(model: Model, new_tokens: int) -> None:
    """Greedy generation with :class:`Oracle`'s drafts gives plain decoding's tokens, some passes cut back after
    some of their drafts (a recurrent state rolled back)."""
    prompt = repetitive(model, 3)
    plain, _ = generate(model, prompt, 0, max_new_tokens=new_tokens)
    plain.run()
    gen, spy = generate(model, prompt, 6, spy=True, max_new_tokens=new_tokens)
    gen._rows[0].lookup = Oracle(gen._rows[0], plain.results[0].token_ids)
    gen.run()
    assert gen.results[0].token_ids == plain.results[0].token_ids
    assert gen.stats.draft_accepted > 0 and any(1 < t < 7 for _, _, t in spy.passes)


@pytest.mark.parametrize("family", ["qwen35-tiny", "qwen35-tiny-gqa"])
def test_qwen35_keeps_its_recurrent_state_exact_through_drafts(family: str) -> None:
    model = compiled(family)
    check_oracle_drafts(model, 30)
    # and real prompt lookup: the same tokens (its drafts are mostly refused on these random weights)
    prompt = repetitive(model, 0)
    plain, _ = generate(model, prompt, 0, max_new_tokens=30)
    plain.run()
    looked_up, _ = generate(model, prompt, 6, max_new_tokens=30)
    looked_up.run()
    assert looked_up.results[0].token_ids == plain.results[0].token_ids and looked_up.stats.draft_proposed > 0


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_the_numpy_path_verifies_and_drafts_too(family: str) -> None:
    """The reference path covers the feature: a verify pass feeds its tokens one step at a time (exact by
    construction), Qwen3.5's recurrent state rolls back pass by pass through the numpy step, and greedy generation
    with drafts gives plain decoding's tokens.  (The server drafts on the compiled kernels only: on the numpy path
    its batched steps are not row-invariant to begin with.)"""
    model = use_kernels(qwen_runtime.load(fixture_dir(family), kernels="numpy"), "numpy")
    assert not model.exact_steps
    check_verify(model)
    check_oracle_drafts(model, 20)


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_a_stop_inside_accepted_drafts_ends_the_row_there(family: str) -> None:
    """A stop id met in the middle of a pass's accepted drafts ends the row there (drafts from :class:`Oracle`:
    the tiny models' own repeats bring no token first seen inside a pass)."""
    model = compiled(family)
    prompt = repetitive(model, 2)
    free, _ = generate(model, prompt, 0, max_new_tokens=40)
    tokens = free.run()[0].token_ids
    probe, spy = generate(model, prompt, 8, spy=True, max_new_tokens=40)
    probe._rows[0].lookup = Oracle(probe._rows[0], tokens)
    probe.run()
    inside = [before + i for _, before, taken in spy.passes for i in range(1, taken - 1)
              if tokens[before + i] not in tokens[:before + i]]  # first seen strictly inside a pass's steps
    assert inside, "no pass took a new token in the middle of its drafts"
    stop = frozenset({tokens[inside[0]]})
    plain, _ = generate(model, prompt, 0, max_new_tokens=40, stop_ids=stop)
    plain.run()
    gen, spy = generate(model, prompt, 8, spy=True, max_new_tokens=40, stop_ids=stop)
    gen._rows[0].lookup = Oracle(gen._rows[0], tokens)
    gen.run()
    assert gen.results[0].token_ids == plain.results[0].token_ids == tokens[:inside[0] + 1]
    assert gen.results[0].finish_reason == plain.results[0].finish_reason == "stop"
    drafts, before, taken = spy.passes[-1]
    assert before + taken == inside[0] + 1 and taken - 1 < len(drafts)  # the pass had drafts past the stop


@pytest.mark.parametrize("budget", [9, 10, 11, 17])
def test_the_token_budget_cuts_drafts(budget: int) -> None:
    model = compiled("qwen2-tiny")
    prompt = repetitive(model)
    plain, _ = generate(model, prompt, 0, max_new_tokens=budget)
    plain.run()
    gen, spy = generate(model, prompt, 8, spy=True, max_new_tokens=budget)
    gen.run()
    assert gen.results[0].token_ids == plain.results[0].token_ids and len(gen.results[0].token_ids) == budget
    assert gen.results[0].finish_reason == "length"
    assert spy.passes and all(before + len(drafts) < budget for drafts, before, _ in spy.passes)


# --- the server's engine ----------------------------------------------------------------------------------------

engine_module = pytest.importorskip("qwen_serve.engine", reason="qwen_serve needs the serve extra")


class Outcome:
    """A job's events per choice (the choices of one job interleave differently when a step gives several tokens)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.texts: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.failed: str | None = None
        self.ended = threading.Event()

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    def emit(self, event: object) -> None:
        if isinstance(event, engine_module.Delta):
            self.tokens.setdefault(event.choice, []).extend(event.token_ids)
            self.texts[event.choice] = self.texts.get(event.choice, "") + event.text
        elif isinstance(event, engine_module.Finished):
            self.finish[event.choice] = event.reason
        elif isinstance(event, engine_module.Failed):
            self.failed = event.message
            self.ended.set()
        elif isinstance(event, engine_module.Done):
            self.ended.set()


def serve(model: Model, drafts: int, jobs: list[dict]) -> tuple[list[Outcome], object]:
    fmt = chat_format(model)
    engine = engine_module.Engine(model, fmt.tokenizer, fmt.stop_ids, max_batch=8, draft_tokens=drafts)
    outcomes = [Outcome() for _ in jobs]
    try:
        for job, outcome in zip(jobs, outcomes, strict=True):  # submitted together: they share decode steps
            engine.submit(engine_module.Job(emit=outcome.emit, **job))
        for outcome in outcomes:
            assert outcome.ended.wait(120), "a job never ended"
    finally:
        engine.stop()
    return outcomes, engine


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_concurrent_requests_are_the_same_with_drafts(family: str) -> None:
    model = compiled(family)
    rng = np.random.default_rng(4)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8)
    jobs = [{"prompt_ids": repetitive(model, i), "max_tokens": int(rng.integers(8, 30)), "sampling": greedy}
            for i in range(5)]
    jobs.append({"prompt_ids": repetitive(model, 7), "max_tokens": 20, "sampling": sampled, "seed": 3})
    jobs.append({"prompt_ids": repetitive(model, 8), "max_tokens": 20, "sampling": greedy, "n": 2})
    plain, _ = serve(model, 0, jobs)
    drafted, engine = serve(model, 6, jobs)
    for a, b in zip(plain, drafted, strict=True):
        assert a.failed is None and b.failed is None
        assert (b.tokens, b.texts, b.finish) == (a.tokens, a.texts, a.finish)
    proposed = engine.metrics.draft_proposed.value()
    assert proposed > 0 and "draft_tokens_accepted_total" in engine.metrics.render()
    if family == "qwen3-tiny":
        assert engine.metrics.draft_accepted.value() > 0


def test_stop_strings_and_structured_output_cut_drafts_as_plain_decoding() -> None:
    structured = pytest.importorskip("qwen_runtime.generation.structured")
    model = compiled("qwen3-tiny")
    fmt = chat_format(model)
    prompt = repetitive(model)
    free, _ = serve(model, 0, [{"prompt_ids": prompt, "max_tokens": 30, "sampling": SamplingParams()}])
    text = free[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    grammar = structured.Grammar(None, structured.Vocabulary(fmt.tokenizer, model.config.vocab_size))
    stop_ids = frozenset(fmt.stop_ids)
    jobs = [{"prompt_ids": prompt, "max_tokens": 30, "sampling": SamplingParams(), "stop": (stop,)},
            {"prompt_ids": prompt, "max_tokens": 24, "sampling": SamplingParams(),
             "constraint": lambda: structured.JsonConstraint(grammar, stop_ids)}]
    plain, _ = serve(model, 0, jobs)
    drafted, engine = serve(model, 8, jobs)
    for a, b in zip(plain, drafted, strict=True):
        assert a.failed is None and b.failed is None
        assert (b.tokens, b.texts, b.finish) == (a.tokens, a.texts, a.finish)
    assert plain[0].finish == {0: "stop"} and len(plain[0].text) < len(text)
    assert engine.metrics.draft_proposed.value() > 0


def test_qwen_run_prints_the_same_with_draft(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen_runtime import cli

    model = str(fixture_dir("qwen3-tiny"))
    prompt = "one two three one two three one two three one two"
    outputs = []
    for extra in ([], ["--draft", "6"]):
        assert cli.main([model, "-p", prompt, "-n", "30", "--kernels", "numba", "--stats", *extra]) == 0
        outputs.append(capsys.readouterr())
    assert outputs[0].out == outputs[1].out and outputs[0].out.strip()
    assert "drafts:" in outputs[1].err and "drafts:" not in outputs[0].err


def test_the_banner_says_whether_drafting_runs() -> None:
    app_module = pytest.importorskip("qwen_serve.app")
    on = app_module.create_app(compiled("qwen3-tiny"), draft_tokens=4)
    assert "up to 4 prompt-lookup drafts" in app_module.startup_banner(on, "http://x")
    off = app_module.create_app(qwen_runtime.load(fixture_dir("qwen3-tiny"), kernels="numpy"), draft_tokens=4)
    assert "speculative decoding: off" in app_module.startup_banner(off, "http://x")
    assert off.state.server.engine.status()["draft_tokens"] == 0


def test_a_verify_pass_that_raises_falls_back_to_plain_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model without recurrent state whose verify pass raises steps its rows plainly: same tokens."""
    model = compiled("qwen3-tiny")
    jobs = [{"prompt_ids": repetitive(model, i), "max_tokens": 20, "sampling": SamplingParams()} for i in range(3)]
    plain, _ = serve(model, 0, jobs)
    calls = []

    def broken(*args: object, **kwargs: object) -> np.ndarray:
        calls.append(1)
        raise RuntimeError("a verify pass broke")

    monkeypatch.setattr(model, "verify", broken)
    drafted, engine = serve(model, 6, jobs)
    assert calls and engine.metrics.draft_proposed.value() == 0
    for a, b in zip(plain, drafted, strict=True):
        assert b.failed is None and (b.tokens, b.texts, b.finish) == (a.tokens, a.texts, a.finish)


@pytest.mark.parametrize("family", ["qwen3-tiny", "qwen35-tiny"])
def test_drafting_compiles_nothing_after_load(family: str) -> None:
    """Verify passes, their padding and Qwen3.5's replays use the compiled signatures the load made."""
    from test_runtime_memory import compiled_signatures

    model = qwen_runtime.load(fixture_dir(family), kernels="numba")
    loaded = compiled_signatures()
    gen = Generation(model, [repetitive(model)], GenerationConfig(max_new_tokens=30, draft_tokens=6))
    gen.run()
    jobs = [{"prompt_ids": repetitive(model, i), "max_tokens": 12, "sampling": SamplingParams()} for i in range(3)]
    serve(model, 6, jobs)
    assert gen.stats.draft_proposed > 0
    grown = {name: n - loaded.get(name, 0) for name, n in compiled_signatures().items() if n != loaded.get(name, 0)}
    assert not grown, f"compiled after load: {grown}"
