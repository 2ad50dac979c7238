"""Fuzzing the GGUF reader: mutated real files either open (and every tensor view is readable) or raise
FormatError; nothing else may escape.  ``QWEN_FUZZ_EXAMPLES`` sets the number of examples per test."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from gguf import GGUFValueType
from hostile_helpers import FUZZ, MIX_TYPES, RawGGUF, mutated, quantized_mix, touch
from hypothesis import event, given
from hypothesis import strategies as st
from runtime_helpers import Converted

from qwen_runtime.errors import FormatError, TemplateError
from qwen_runtime.formats import open_gguf
from qwen_runtime.text.chat import load_chat_format

pytestmark = pytest.mark.slow  # hypothesis: QWEN_FUZZ_EXAMPLES mutated files per test

SOURCES = (("qwen3-tiny", "fp32"), ("qwen35-tiny", "q8_0"), ("qwen2-tiny", "q4_0"))


@pytest.fixture(scope="module")
def raws(converted: Converted, tmp_path_factory: pytest.TempPathFactory) -> dict[str, RawGGUF]:
    """The files mutated: fixtures as we convert them, and one whose matrices hold every quantized type."""
    root = tmp_path_factory.mktemp("fuzz-gguf")
    files = {name: RawGGUF.from_file(converted(name, "gguf", dtype)) for name, dtype in SOURCES}
    return {**files, "quantized-mix": RawGGUF.from_file(quantized_mix(root))}


def test_quantized_mix_opens_with_every_type(raws: dict[str, RawGGUF], work: Path) -> None:
    work.write_bytes(raws["quantized-mix"].pack())
    files = open_gguf(work)
    assert {t.qtype.name for t in files.tensors.values() if len(t.shape) == 2} == {q.name for q in MIX_TYPES}
    touch(files)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-gguf-work") / "fuzzed.gguf"


def open_or_refuse(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        files = open_gguf(path)
    except FormatError as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("accepted")
    touch(files)
    try:
        load_chat_format(files)  # tokenizer and chat template from the (mutated) metadata
    except (FormatError, TemplateError) as exc:
        event(f"tokenizer/template refused: {type(exc).__name__}")


@FUZZ
@given(data=st.data())
def test_mutated_bytes(raws: dict[str, RawGGUF], work: Path, data: st.DataObject) -> None:
    raw = raws[data.draw(st.sampled_from(sorted(raws)))]
    header = raw.header()
    open_or_refuse(work, data.draw(mutated(raw.pack(), len(header))))


SCALARS = {
    GGUFValueType.UINT32: st.integers(0, 2**32 - 1), GGUFValueType.INT32: st.integers(-2**31, 2**31 - 1),
    GGUFValueType.UINT64: st.integers(0, 2**64 - 1), GGUFValueType.FLOAT32: st.floats(width=32),
    GGUFValueType.BOOL: st.booleans(), GGUFValueType.STRING: st.text(max_size=8),
}


@FUZZ
@given(data=st.data())
def test_shuffled_offsets_and_retyped_keys(raws: dict[str, RawGGUF], work: Path, data: st.DataObject) -> None:
    raw = copy.deepcopy(raws[data.draw(st.sampled_from(sorted(raws)))])
    if data.draw(st.booleans()):
        order = data.draw(st.permutations(range(len(raw.infos))))
        raw.infos = [(*info[:3], raw.infos[j][3]) for info, j in zip(raw.infos, order, strict=True)]
    else:
        index = data.draw(st.integers(0, len(raw.infos) - 1))
        name, dims, qtype, offset = raw.infos[index]
        raw.infos[index] = (name, dims, qtype, max(0, offset + data.draw(st.sampled_from([-64, -32, 32, 1, 2**40]))))
    for _ in range(data.draw(st.integers(0, 2))):
        key = data.draw(st.sampled_from([kv[0] for kv in raw.kvs]))
        vtype = data.draw(st.sampled_from(sorted(SCALARS)))
        raw.set_kv(key, vtype, data.draw(SCALARS[vtype]))
    open_or_refuse(work, raw.pack())
