"""The prefix cache on disk (``--cache-dir``): a restarted engine or server starts with the blocks its predecessor
cached and gives the tokens it gives without any cache; damaged files and another model's files are never used."""

from __future__ import annotations

import io
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import fixture_dir

import qwen_runtime
from qwen_runtime.errors import OutputError
from qwen_runtime.generation.sampling import SamplingParams
from qwen_runtime.text.chat import chat_format

Engine = pytest.importorskip("qwen_serve.engine", reason="qwen_serve needs the serve extra")
from qwen_serve.prefix_cache import ROOT, block_key  # noqa: E402

BLOCK = 8
CACHE = 64 << 20


class Logged:
    """A job's tokens and logprobs, and an Event set when it ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.failed: str | None = None
        self.ended = threading.Event()

    def emit(self, event) -> None:
        if isinstance(event, Engine.Delta):
            self.tokens.extend(event.token_ids)
            self.logprobs.extend(lp.logprob for lp in event.logprobs)
        elif isinstance(event, Engine.Failed | Engine.Done):
            self.failed = getattr(event, "message", None)
            self.ended.set()


def ask(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy, 6 tokens, with logprobs."""
    outcome = Logged()
    engine.submit(Engine.Job(prompt, 6, SamplingParams(), outcome.emit, logprobs=0))
    assert outcome.ended.wait(60) and outcome.failed is None
    return outcome.tokens, outcome.logprobs


def make_engine(model, **options):
    engine = Engine.Engine(model, chat_format(model).tokenizer, frozenset(), max_batch=2, prefill_chunk=BLOCK,
                           **options)
    engine.start()
    return engine


def conversation(model, cache_dir: Path | None, cache_memory: int = CACHE) -> tuple[list[int], list[int]]:
    """Turn 1 (37 tokens: 4 whole blocks) in one engine, and the prompt of turn 2 (turn 1, its answer, 11 more)."""
    rng = np.random.default_rng(5)
    first, more = rng.integers(0, 400, 37).tolist(), rng.integers(0, 400, 11).tolist()
    engine = make_engine(model, cache_memory=cache_memory, cache_dir=cache_dir)
    try:
        answer, _ = ask(engine, first)
    finally:
        engine.stop()
    return first, first + answer + more


def written_within(engine, blocks: int, seconds: float) -> None:
    """Wait until the engine's disk store has written ``blocks`` blocks."""
    deadline = time.monotonic() + seconds
    while engine.status()["prefix_cache"]["disk"]["written"] < blocks:
        assert time.monotonic() < deadline, engine.status()["prefix_cache"]["disk"]
        time.sleep(0.01)


def block_keys(prompt: list[int], blocks: int) -> list[bytes]:
    keys, key = [], ROOT
    for i in range(blocks):
        key = block_key(key, prompt[i * BLOCK:(i + 1) * BLOCK])
        keys.append(key)
    return keys


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen35-tiny"])
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A private copy of a fixture model (tests change its files' times), loaded."""
    copy = tmp_path_factory.mktemp("model") / request.param
    shutil.copytree(fixture_dir(request.param), copy)
    return copy, qwen_runtime.load(copy)


@pytest.fixture(scope="module")
def reference(family_model) -> list[tuple[list[int], list[float]]]:
    """Turn 2 without any cache."""
    _, model = family_model
    _, second = conversation(model, None, cache_memory=0)
    engine = make_engine(model, cache_memory=0)
    try:
        return ask(engine, second)
    finally:
        engine.stop()


@pytest.mark.slow
def restarted_answer(model, cache_dir: Path, prompt, caplog: pytest.LogCaptureFixture) -> tuple[object, dict]:
    """A new engine on ``cache_dir`` (its warnings captured): its answer to ``prompt`` and its prefix-cache
    status."""
    with caplog.at_level(logging.WARNING, logger="qwen_serve"):
        engine = make_engine(model, cache_dir=cache_dir)
    try:
        return ask(engine, prompt), engine.status()["prefix_cache"]
    finally:
        engine.stop()


def test_a_restarted_engine_starts_with_the_cached_prefixes(family_model, reference, tmp_path: Path) -> None:
    """Turn 1 in one engine, turn 2 in a new one on a freshly loaded model: turn 2 restores turn 1's 4 blocks from
    disk (for Qwen3.5 the Gated DeltaNet state checkpoint too) and its greedy tokens and logprobs are bit-identical
    to those without a cache."""
    path, model = family_model
    first, second = conversation(model, tmp_path)
    files = sorted(tmp_path.glob("*/*.npz"))
    assert len(files) == 4 and {f.stem for f in files} == {k.hex() for k in block_keys(first, 4)}
    engine = make_engine(qwen_runtime.load(path), cache_dir=tmp_path)
    try:
        assert ask(engine, second) == reference
        status = engine.status()["prefix_cache"]
    finally:
        engine.stop()
    assert status["hits"] == 1 and status["hit_tokens"] == 4 * BLOCK and status["disk"]["loaded"] == 4
    # turn 2's own whole blocks (5 and 6) were written too, once stop() drained the writer's queue (read before,
    # the count could miss the last block, still queued: 5 files in one CI run); nothing was skipped
    disk = engine.status()["prefix_cache"]["disk"]
    assert disk["files"] == 6 and disk["skipped"] == 0 and len(list(tmp_path.glob("*/*"))) == 6


@pytest.mark.parametrize(("damage", "block", "restored"), [("corrupt", 3, 3), ("truncated", 1, 1), ("empty", 0, 0),
                                                          ("garbage", 2, 2)])
def test_a_damaged_file_is_skipped_with_a_warning(family_model, reference, tmp_path: Path, damage: str, block: int,
                                                  restored: int, caplog: pytest.LogCaptureFixture) -> None:
    """A block file with flipped bytes inside an array (zip's CRC), cut short, empty or not a zip at all is
    skipped and deleted with a warning, the blocks after it in the chain too; the request restores the blocks
    before it and still gets exactly the tokens it gets without a cache."""
    path, model = family_model
    first, second = conversation(model, tmp_path)
    [target] = tmp_path.glob(f"*/{block_keys(first, 4)[block].hex()}.npz")
    raw = target.read_bytes()
    target.write_bytes({"corrupt": raw[:len(raw) // 2] + bytes(b ^ 0xFF for b in raw[len(raw) // 2:][:64])
                                   + raw[len(raw) // 2 + 64:],
                        "truncated": raw[:len(raw) - 100], "empty": b"", "garbage": b"PK\x03\x04" + raw[:50]}[damage])
    answer, status = restarted_answer(model, tmp_path, second, caplog)
    assert answer == reference
    assert any(target.name in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)
    assert status["disk"]["loaded"] == restored and status["disk"]["skipped"] == 1
    assert status["hit_tokens"] == restored * BLOCK and status["hits"] == (restored > 0)


@pytest.mark.slow
def test_another_models_entries_are_never_used(tmp_path: Path) -> None:
    """Blocks of one model are invisible to another model and to the same model once its weight files change
    (another identity subdirectory); a file moved into another identity's directory is refused by its header."""
    a = tmp_path / "a"
    shutil.copytree(fixture_dir("qwen3-tiny"), a)
    cache = tmp_path / "cache"
    first, _ = conversation(qwen_runtime.load(a), cache)
    [mine] = [d for d in cache.iterdir() if d.is_dir()]  # and the cache's CACHEDIR.TAG
    assert len(list(mine.iterdir())) == 4
    for other in (qwen_runtime.load(fixture_dir("qwen2-tiny")), "touched"):
        if other == "touched":
            weights = next(a.glob("*.safetensors"))
            weights.touch()
            other = qwen_runtime.load(a)
        engine = make_engine(other, cache_dir=cache)
        try:
            status = engine.status()["prefix_cache"]
            theirs = Path(status["disk"]["directory"])
            assert theirs != mine and status["disk"]["loaded"] == 0 and status["disk"]["files"] == 0
            ask(engine, first)
            assert engine.status()["prefix_cache"]["hits"] == 0
        finally:
            engine.stop()
        assert len(list(mine.iterdir())) == 4  # left alone
    foreign = next(mine.iterdir())
    shutil.copy(foreign, theirs / foreign.name)
    engine = make_engine(other, cache_dir=cache)
    try:
        assert engine.status()["prefix_cache"]["disk"]["skipped"] == 1 and not (theirs / foreign.name).exists()
    finally:
        engine.stop()


@pytest.mark.slow
def test_blocks_of_one_cache_type_are_never_used_by_another(tmp_path: Path) -> None:
    """Blocks cached by an engine with an f32 KV cache are invisible to one with an f16 cache (another identity
    subdirectory: the layout's dtypes are part of it) and the reverse; an f16 engine restarted on its own blocks
    restores them (stored as float16, half the bytes) and answers turn 2 bit for bit as without a cache."""
    path = fixture_dir("qwen3-tiny")
    f32, f16 = qwen_runtime.load(path, **qwen_runtime.EXACT_CACHE), qwen_runtime.load(path)  # f16: load()'s default
    first, second = conversation(f32, tmp_path)
    [f32_dir] = [d for d in tmp_path.iterdir() if d.is_dir()]
    engine = make_engine(f16, cache_memory=0)
    try:
        uncached = ask(engine, second)
    finally:
        engine.stop()
    engine = make_engine(f16, cache_dir=tmp_path)
    try:
        status = engine.status()["prefix_cache"]
        assert status["disk"]["loaded"] == 0 and Path(status["disk"]["directory"]) != f32_dir
        assert ask(engine, first) != ([], []) and engine.status()["prefix_cache"]["hits"] == 0
    finally:
        engine.stop()
    engine = make_engine(f16, cache_dir=tmp_path)
    try:
        assert ask(engine, second) == uncached
        status = engine.status()["prefix_cache"]
    finally:
        engine.stop()
    assert status["hits"] == 1 and status["disk"]["loaded"] == 4
    f16_dir = Path(status["disk"]["directory"])
    for block in f32_dir.iterdir():  # turn 1's blocks, under the same names
        assert (f16_dir / block.name).stat().st_size < block.stat().st_size
    engine = make_engine(qwen_runtime.load(path, **qwen_runtime.EXACT_CACHE), cache_dir=tmp_path)
    try:
        assert Path(engine.status()["prefix_cache"]["disk"]["directory"]) == f32_dir  # f32 keeps its own blocks
    finally:
        engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "q8_0", "q4_0"])
def test_each_cache_type_restores_its_own_blocks_bit_for_bit(tmp_path: Path, kind: str) -> None:
    """An engine whose KV cache stores keys and values as ``kind``: turn 1's blocks go to disk in the type (records
    of the type's bytes, smaller than f32's), and a restarted engine answers turn 2 from them bit for bit as
    without a cache."""
    path = fixture_dir("qwen3-tiny")
    model = qwen_runtime.load(path, cache_type_k=kind, cache_type_v=kind)
    _, second = conversation(model, tmp_path)
    engine = make_engine(model, cache_memory=0)
    try:
        uncached = ask(engine, second)
    finally:
        engine.stop()
    engine = make_engine(qwen_runtime.load(path, cache_type_k=kind, cache_type_v=kind), cache_dir=tmp_path)
    try:
        assert ask(engine, second) == uncached
        status = engine.status()["prefix_cache"]
    finally:
        engine.stop()
    assert status["hits"] == 1 and status["disk"]["loaded"] == 4


def test_the_disk_holds_at_most_the_budget_least_recently_used_leaves_going_first(tmp_path: Path) -> None:
    """With room for 5 blocks, two prompts of 4 blocks sharing the first two: the second prompt's blocks replace
    the first's last ones on disk as in memory (a chain is never cut in the middle)."""
    model = qwen_runtime.load(fixture_dir("qwen3-tiny"))
    probe = make_engine(model, cache_memory=CACHE)
    try:
        ask(probe, list(range(9)))
        block_bytes = probe.prefix.nbytes
    finally:
        probe.stop()
    a = list(range(33))
    b = a[:16] + list(range(200, 217))
    engine = make_engine(model, cache_memory=5 * block_bytes, cache_dir=tmp_path)
    try:
        ask(engine, a)
        # The writer's queue holds at most the budget: under load b's blocks could find a's still queued and be
        # dropped (by design). The eviction order is what this test is about, so a's blocks are written first.
        written_within(engine, 4, seconds=60)
        ask(engine, b)
    finally:
        engine.stop()
    names = {f.stem for f in tmp_path.glob("*/*.npz")}
    assert names == {k.hex() for k in block_keys(a, 2) + block_keys(b, 4)[2:] + block_keys(a, 3)[2:]}


def test_a_directory_that_cannot_be_written_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="prefix cache directory"):
        make_engine(qwen_runtime.load(fixture_dir("qwen3-tiny")), cache_dir=blocker / "cache")


@pytest.mark.slow
def test_a_restarted_server_hits_the_cache_in_turn_2(tmp_path: Path) -> None:
    """Through HTTP: turn 1 on one server, turn 2 on a new server with the same --cache-dir: /metrics counts the
    restored blocks and a hit, and turn 2's greedy answer is the one a server without a cache gives."""
    from serve_helpers import running_server
    from test_serve import scrape

    model = fixture_dir("qwen3-tiny")
    turn1 = [{"role": "user", "content": "Tell me about the rivers and the mountains of the north, in detail."}]
    options = {"model": "qwen3-tiny", "temperature": 0.0, "max_tokens": 8}

    def turn2(first: str) -> list[dict[str, str]]:
        return turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the lakes?"}]

    with running_server(model, prefill_chunk=BLOCK, cache_memory=0) as plain:
        first = plain.client().chat.completions.create(messages=turn1, **options).choices[0].message.content
        expected = plain.client().chat.completions.create(messages=turn2(first), **options).choices[0].message
    with running_server(model, prefill_chunk=BLOCK, cache_dir=tmp_path) as before:
        assert before.client().chat.completions.create(messages=turn1, **options).choices[0].message.content == first
        written = scrape(before.url)["qwen_serve_prefix_cache_disk_written_blocks"]
    with running_server(model, prefill_chunk=BLOCK, cache_dir=tmp_path) as after:
        loaded = scrape(after.url)
        got = after.client().chat.completions.create(messages=turn2(first), **options).choices[0].message
        metrics = scrape(after.url)
    assert written >= 2 and loaded["qwen_serve_prefix_cache_disk_loaded_blocks"] == written
    assert loaded["qwen_serve_prefix_cache_hits"] == 0 and metrics["qwen_serve_prefix_cache_hits"] == 1
    assert metrics["qwen_serve_prefix_cache_hit_tokens"] >= BLOCK
    assert got.model_dump() == expected.model_dump() and got.content


@pytest.mark.slow
def test_a_chats_turn_2_resumes_from_a_tail_over_http() -> None:
    """Through HTTP with cache_turns (``--cache-turns``): turn 2 of a chat restores more of its prompt than whole
    blocks give (a tail of turn 1's prompt and answer, as far as the rendered history matches it), and its greedy
    answer is the one a server without tails gives."""
    from serve_helpers import running_server
    from test_serve import scrape

    model = fixture_dir("qwen3-tiny")
    turn1 = [{"role": "user", "content": "Tell me about the rivers and the mountains of the north, in detail."}]
    options = {"model": "qwen3-tiny", "temperature": 0.0, "max_tokens": 8}
    answers, restored = [], []
    for turns in (False, True):
        with running_server(model, prefill_chunk=BLOCK, cache_turns=turns) as server:
            first = server.client().chat.completions.create(messages=turn1, **options).choices[0].message.content
            turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And the lakes?"}]
            answers.append(server.client().chat.completions.create(messages=turn2, **options).choices[0].message)
            metrics = scrape(server.url)
            restored.append(metrics["qwen_serve_prefix_cache_hit_tokens"])
            assert metrics["qwen_serve_prefix_cache_tails"] == (4 if turns else 0)  # two per request
    assert answers[1].model_dump() == answers[0].model_dump() and answers[0].content
    assert restored[1] > restored[0] and restored[1] % BLOCK


def test_cache_dir_without_a_prefix_cache_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen_serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["model.gguf", "--cache-dir", "x", "--cache-memory", "0"])
    assert exit_info.value.code == 2 and "--cache-dir needs the prefix cache" in capsys.readouterr().err
    from qwen_serve.cli import configure_parser

    assert configure_parser().parse_args(["m", "--cache-memory", "0"]).cache_memory == 0


# --- the directory is the cache's own, and nothing read from it is trusted (issue #42) ---------------------------

def tiny_store(directory: Path, blocks: int = 3):
    """A store of qwen3-tiny's blocks with room for ``blocks`` of them (the engine is not needed)."""
    from qwen_serve.prefix_store import PrefixStore
    from qwen_serve.slots import SlotCache

    model = qwen_runtime.load(fixture_dir("qwen3-tiny"))
    slots = SlotCache(model, 1, 8 * BLOCK)
    store = PrefixStore(directory, model, slots, BLOCK, CACHE)
    store.capacity = blocks * block_bytes(store)
    return store


def block_bytes(store) -> int:
    return sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for layer in store.layout for _, dtype, shape in layer)


def chain(store, tokens: list[int], seed: int = 0) -> list:
    """The blocks of ``tokens`` (whole blocks), with random arrays of the store's layout."""
    from qwen_serve.prefix_cache import Block

    rng, parent, blocks = np.random.default_rng(seed), ROOT, []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        own = np.asarray(tokens[start:start + BLOCK], np.int64)
        arrays = [{name: rng.standard_normal(shape).astype(dtype) for name, dtype, shape in layer}
                  for layer in store.layout]
        kv = [(a["keys"], a["values"]) for a in arrays]
        blocks.append(Block(parent, kv, [], block_bytes(store), key=block_key(parent, own), tokens=own))
        parent = blocks[-1].key
    return blocks


def write(store, blocks: list) -> None:
    """Start ``store``, queue ``blocks`` and wait until they are written (or dropped)."""
    store.load(store.capacity)
    store.start()
    for b in blocks:
        store.put(b)
    store.close()


def block_files(directory: Path) -> set[str]:
    """The names of the block files in the cache ``directory`` (links not followed)."""
    return {f.name for d in directory.iterdir() if d.is_dir() and not d.is_symlink() for f in d.glob("*.npz")
            if f.is_file() and not f.is_symlink() and len(f.stem) == 64}


def test_a_users_files_survive_start_and_eviction_and_links_are_not_followed(tmp_path: Path) -> None:
    """A user's ``results.npz`` next to the blocks (in the cache and in its identity subdirectory), a linked
    directory holding npz files (one named like a block) and a link named like a block all survive a start and
    an eviction: only the store's own block files go (before, every ``*.npz`` that was not named like a block
    was deleted at start as 'not a block file name')."""
    cache, user = tmp_path / "cache", tmp_path / "user"
    user.mkdir()
    store = tiny_store(cache)
    write(store, chain(store, list(range(3 * BLOCK))))
    root = store.root
    mine = {"results.npz": b"results", f"{'ab' * 32}.npz": b"not a block"}
    for name, data in mine.items():
        np.savez(user / name, data=np.frombuffer(data, np.uint8))
    planted = [cache / "results.npz", root / "results.npz", root / f"{'cd' * 32}.npz", root / "linked",
               cache / "linked"]
    for path in planted[:2]:
        shutil.copy(user / "results.npz", path)
    planted[2].symlink_to(user / "results.npz")
    planted[3].symlink_to(user, target_is_directory=True)
    planted[4].symlink_to(user, target_is_directory=True)
    before = {p: p.read_bytes() for p in [*planted[:2], *(user / n for n in mine)]}
    store = tiny_store(cache)
    second = chain(store, list(range(100, 100 + 3 * BLOCK)), seed=1)
    write(store, second)  # evicts the first chain
    assert store.status()["skipped"] == 0 and store.written == 3
    assert block_files(cache) == {f"{b.key.hex()}.npz" for b in second}
    assert all(p.read_bytes() == data for p, data in before.items())
    assert all(p.is_symlink() for p in planted[2:])


def test_a_linked_identity_directory_is_refused(tmp_path: Path) -> None:
    """The identity subdirectory replaced by a link to a user's folder: the store refuses to start (one line
    naming it) and leaves the folder as it was."""
    cache, user = tmp_path / "cache", tmp_path / "user"
    user.mkdir()
    store = tiny_store(cache)
    root = store.root
    store.close()
    root.rmdir()
    root.symlink_to(user, target_is_directory=True)
    victim = user / f"{'ab' * 32}.npz"
    np.savez(victim, data=np.zeros(3))
    with pytest.raises(OutputError, match=f"cannot use {root} .*symbolic link"):
        tiny_store(cache)
    assert victim.exists() and sorted(user.iterdir()) == [victim]


@pytest.mark.parametrize("content", ["user", "other tag"])
def test_a_non_empty_directory_without_our_tag_is_refused(tmp_path: Path, content: str) -> None:
    """A folder holding a user's files, or another tool's CACHEDIR.TAG, is refused with one line naming it and
    nothing in it changes; an empty folder is tagged and used."""
    folder = tmp_path / "folder"
    folder.mkdir()
    if content == "user":
        np.savez(folder / "results.npz", data=np.zeros(3))
    else:
        (folder / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(OutputError, match=f"^{folder} is not empty and is not a qwen-serve prefix cache"):
        tiny_store(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny_store(empty).close()
    tiny_store(empty).close()  # tagged by the first
    assert (empty / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55\n")


def test_an_earlier_versions_cache_is_tagged_and_used(tmp_path: Path) -> None:
    """A folder holding only identity subdirectories of block files (what an earlier version wrote, untagged,
    0755) is tagged and used, its subdirectories made 0700; one more file of a user's in it and it is refused."""
    earlier = tmp_path / "earlier"
    (earlier / ("0f" * 16)).mkdir(0o755, parents=True)
    (earlier / ("0f" * 16) / f"{'ab' * 32}.npz").write_bytes(b"an earlier format's block")
    tiny_store(earlier).close()
    assert (earlier / "CACHEDIR.TAG").is_file() and (earlier / ("0f" * 16)).stat().st_mode & 0o777 == 0o700
    with_user = tmp_path / "with_user"
    (with_user / ("0f" * 16)).mkdir(parents=True)
    (with_user / ("0f" * 16) / "results.npz").write_bytes(b"a user's")
    with pytest.raises(OutputError, match="is not a qwen-serve prefix cache"):
        tiny_store(with_user)
    assert not (with_user / "CACHEDIR.TAG").exists()


def test_files_are_0600_and_directories_0700_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 022 (files 0644, directories 0755 before), the cache's directory, its identity subdirectory,
    its tag and its block files are readable by their owner only: blocks hold prompts' token ids."""
    old = os.umask(0o022)
    try:
        store = tiny_store(tmp_path / "new" / "cache")
        write(store, chain(store, list(range(2 * BLOCK))))
        adopted = tmp_path / "adopted"
        adopted.mkdir(0o755)
        tiny_store(adopted).close()
    finally:
        os.umask(old)
    made = [tmp_path / "new" / "cache", adopted, *(tmp_path / "new" / "cache").rglob("*"), *adopted.rglob("*")]
    assert len(made) == 8 and len(block_files(tmp_path / "new" / "cache")) == 2  # 2 x (tag, identity) + 2 blocks
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made}
    assert modes == {str(p.relative_to(tmp_path)): "0o700" if p.is_dir() else "0o600" for p in made}


def test_an_altered_block_is_rejected_and_does_not_change_the_answer(family_model, reference, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A block file rewritten with other values (a valid zip, its CRCs right, its header as it was) is refused
    by its checksum, deleted with a warning, the block after it too; turn 2 restores the blocks before it and
    answers exactly as without a cache (before, the altered block was restored)."""
    path, model = family_model
    first, second = conversation(model, tmp_path)
    [target] = tmp_path.glob(f"*/{block_keys(first, 4)[2].hex()}.npz")
    with np.load(target) as npz:
        arrays = {name: npz[name] for name in npz.files}
    for name, value in arrays.items():
        if name[0].isdigit():
            arrays[name] = (value * -3 + 1).astype(value.dtype)
    with open(target, "wb") as handle:
        np.savez(handle, **arrays)
    altered = target.read_bytes()
    answer, status = restarted_answer(model, tmp_path, second, caplog)
    assert answer == reference
    assert status["disk"]["loaded"] == 2 and status["disk"]["skipped"] == 1 and status["hit_tokens"] == 2 * BLOCK
    assert any(target.name in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
    assert target.read_bytes() != altered  # deleted, then written again by turn 2's prefill


def bomb(path: Path, member: str, kind: str) -> None:
    """Rewrite a block file with ``member`` replaced: 'deflated' 256 MiB of zeros (about 250 KB on disk),
    'small' 2 MiB deflated (a file no bigger than a block's), 'declared' a stored npy header claiming 2**36
    floats in a few bytes."""
    import zipfile

    with zipfile.ZipFile(path) as source:
        members = {name: source.read(name) for name in source.namelist()}
    size = {"deflated": 256 << 20, "small": 2 << 20, "declared": 1 << 38}[kind]
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.float32)) | {"shape": (size // 4,)}
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, header)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as target:
        for name, data in members.items():
            if name != member:
                target.writestr(name, data, zipfile.ZIP_STORED)
            elif kind == "declared":
                target.writestr(name, head.getvalue() + bytes(64), zipfile.ZIP_STORED)
            else:
                with target.open(name, "w", force_zip64=True) as out:
                    out.write(head.getvalue())
                    zeros = bytes(1 << 20)
                    for _ in range(size >> 20):
                        out.write(zeros)


@pytest.mark.parametrize("kind", ["deflated", "small", "declared"])
def test_an_oversized_entry_is_rejected_before_anything_big_is_allocated(tmp_path: Path, kind: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A block file whose member would decompress to 256 MiB (or 2 MiB) or whose npy header claims 1 TiB is
    skipped and deleted at start, and the start allocates less than 1 MiB (blocks of 8 KiB: before, np.load
    decompressed the member, 569 MB more resident in the audit's case); the block before it still loads."""
    import tracemalloc

    store = tiny_store(tmp_path)
    blocks = chain(store, list(range(2 * BLOCK)))
    write(store, blocks)
    target = store.path(blocks[1].key)
    bomb(target, "1.values.npy", kind)
    store = tiny_store(tmp_path)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="qwen_serve"):
            loaded = store.load(store.capacity)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    assert [b.key for b in loaded] == [blocks[0].key] and store.status()["skipped"] == 1 and not target.exists()
    assert peak < 1 << 20, peak
    assert any(target.name in r.getMessage() and "skipping" in r.getMessage() for r in caplog.records)


def test_two_stores_on_one_directory_share_one_budget(tmp_path: Path) -> None:
    """Two servers of one model on one directory, each with room for 3 blocks, each writing 3 blocks of its
    own at the same time: the directory never holds more than 3 (before, each counted only its own: 6), and
    each store's count is the directory's."""
    one, two = tiny_store(tmp_path), tiny_store(tmp_path)
    chains = [chain(one, list(range(3 * BLOCK))), chain(two, list(range(100, 100 + 3 * BLOCK)), seed=1)]
    for store in (one, two):
        store.load(store.capacity)
        store.start()
    for a, b in zip(*chains, strict=True):
        one.put(a)
        two.put(b)
    one.close()
    two.close()
    files = block_files(tmp_path)
    assert 0 < len(files) <= 3 and one.written + two.written >= 3
    assert files <= {f"{b.key.hex()}.npz" for c in chains for b in c}
    last = tiny_store(tmp_path)
    assert len(last.load(last.capacity)) == len(files) and last.status()["skipped"] == 0
    last.close()
