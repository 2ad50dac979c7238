"""Hostile GGUF files: every malformation is one clear FormatError/ConfigError, found before allocating."""

from __future__ import annotations

import copy
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from hostile_helpers import RawGGUF, pack_string
from runtime_helpers import Converted

from qwen_runtime.errors import ConfigError, FormatError, TemplateError, UnsupportedArchitectureError
from qwen_runtime.formats import open_gguf
from qwen_runtime.formats.gguf_parse import (
    MAX_DECODED_TEXT,
    MAX_KEYS,
    MAX_OTHER_STRINGS,
    MAX_TENSORS,
    SCALAR_FORMATS,
    TENSOR_INFO_MIN_BYTES,
    UTF8_SLICE,
    GGUFStrings,
    parse_gguf,
)
from qwen_runtime.text.chat import load_chat_format

ARCH = "qwen3"


@pytest.fixture(scope="module")
def base(converted: Converted) -> RawGGUF:
    return RawGGUF.from_file(converted("qwen3-tiny", "gguf"))


@pytest.fixture
def raw(base: RawGGUF) -> RawGGUF:
    return copy.deepcopy(base)


def fails(raw: RawGGUF | bytes, tmp_path: Path, *fragments: str, error: type = FormatError) -> str:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(raw if isinstance(raw, bytes) else raw.pack())
    with pytest.raises(error) as info:
        open_gguf(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def minimal(kv_count: int = 1, tensor_count: int = 0) -> bytes:
    """Magic, version and counts of a GGUF header (the caller appends the rest)."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def test_packer_round_trip(raw: RawGGUF, tmp_path: Path) -> None:
    files = open_gguf(raw.write(tmp_path / "ok.gguf"))
    assert files.config.arch == ARCH and files.tensors


@pytest.mark.parametrize(("magic", "version", "fragment"), [
    (b"GGUX", 3, "not a GGUF file"), (b"GGUF", 1, "version 1"), (b"GGUF", 4, "version 4"),
    (b"GGUF", 3 << 24, "big-endian"),
])
def test_bad_magic_or_version(raw: RawGGUF, tmp_path: Path, magic: bytes, version: int, fragment: str) -> None:
    raw.magic, raw.version = magic, version
    fails(raw, tmp_path, fragment)


def test_empty_and_truncated_files(raw: RawGGUF, tmp_path: Path) -> None:
    fails(b"", tmp_path, "empty file")
    fails(b"GGUF\x03\x00", tmp_path, "version", "truncated")
    packed = raw.pack()
    fails(packed[: len(raw.header()) // 2], tmp_path, "truncated")
    fails(packed[:-100], tmp_path, "data section", "truncated")


HUGE = 1 << 60
CLAIMS = {
    "tensor count": minimal(0, HUGE),
    "kv count": minimal(HUGE),
    "key length": minimal() + struct.pack("<Q", HUGE),
    "string value length": minimal() + pack_string("k") + struct.pack("<IQ", GGUFValueType.STRING, HUGE),
    "numeric array count": minimal() + pack_string("k") + struct.pack("<IIQ", GGUFValueType.ARRAY,
                                                                      GGUFValueType.UINT64, HUGE),
    "string array count": minimal() + pack_string("k") + struct.pack("<IIQ", GGUFValueType.ARRAY,
                                                                     GGUFValueType.STRING, HUGE),
    "tensor name length": minimal(0, 1) + struct.pack("<Q", HUGE) + bytes(64),
}


@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_claims_beyond_the_file_are_refused_before_allocating(claim: str, tmp_path: Path) -> None:
    path = tmp_path / "claim.gguf"
    path.write_bytes(CLAIMS[claim] + bytes(256))
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="cannot fit|needs .* bytes"):
            parse_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(("body", "fragment"), [
    (pack_string("k") + struct.pack("<I", 99) + bytes(8), "unknown value type 99"),
    (pack_string("k") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.ARRAY, 1), "nested arrays"),
    (pack_string(b"\xff\xfe") + struct.pack("<IB", GGUFValueType.UINT8, 1), "not valid UTF-8"),
    (pack_string("k") + struct.pack("<I", GGUFValueType.STRING) + pack_string(b"\xc3("), "not valid UTF-8"),
])
def test_malformed_key_values(body: bytes, fragment: str, tmp_path: Path) -> None:
    fails(minimal() + body + bytes(64), tmp_path, fragment)


def string_array(elements: list[bytes], key: str = "k") -> bytes:
    """A one-key GGUF with no tensors whose key ``key`` is a string array of ``elements``."""
    return (minimal() + pack_string(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING,
                                                       len(elements)) + b"".join(map(pack_string, elements)))


@pytest.mark.parametrize(("elements", "bad"), [
    ([b"a", b"\xc3", b"\xa9b"], 1),  # together "\xc3\xa9" would be a valid "é": each element is checked alone
    ([b"\xc3\xa9", b"ok\x80"], 1),
    ([b"\xed\xa0\x80"], 0),  # a UTF-16 surrogate
    ([b"", "ü".encode(), b"x", b"\xe4\xb8"], 3),
])
def test_invalid_utf8_in_a_string_array_names_the_element(elements: list[bytes], bad: int, tmp_path: Path) -> None:
    with pytest.raises(UnicodeDecodeError) as expected:
        elements[bad].decode("utf-8")
    reason = f"{expected.value.reason} at byte {expected.value.start}"
    fails(string_array(elements) + bytes(64), tmp_path, f"element {bad} of 'k' is not valid UTF-8 ({reason})")


@pytest.mark.parametrize(("cut", "fragment"), [
    (1, "element 1 of 'k' needs 2 bytes at offset"), (5, "length of element 1 of 'k' needs 8 bytes at offset"),
])
def test_truncated_string_array(cut: int, fragment: str, tmp_path: Path) -> None:
    fails(string_array([b"x" * 20, b"yz"])[:-cut], tmp_path, fragment, "truncated or corrupt")


def test_string_arrays_are_read_from_the_map(tmp_path: Path) -> None:
    elements = ["", "a", "é", "ĠĠ ĠĠ", "<|im_end|>", "中文"]
    path = tmp_path / "strings.gguf"
    path.write_bytes(string_array([e.encode() for e in elements]))
    value = parse_gguf(path).metadata["k"]
    assert isinstance(value, GGUFStrings) and value == elements and elements == value and value != elements[:-1]
    assert len(value) == 6 and list(value) == elements and value[2] == "é" and value[-1] == "中文"
    assert value[1:5] == elements[1:5] and value[::-2] == elements[::-2] and "é" in value
    assert value == parse_gguf(path).metadata["k"]
    for index in (6, -7):
        with pytest.raises(IndexError):
            value[index]


def test_string_arrays_cost_no_str_per_element(tmp_path: Path) -> None:
    n = 100_000
    path = tmp_path / "vocab.gguf"
    path.write_bytes(string_array([f"tok{i}".encode() for i in range(n)], key="tokenizer.ggml.tokens"))
    tracemalloc.start()
    try:
        layout = parse_gguf(path)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert layout.metadata["tokenizer.ggml.tokens"][-1] == f"tok{n - 1}"
    assert kept < n  # one int64 offset per INDEX_STRIDE elements; a list of str would keep ~60 bytes each


def test_utf8_is_checked_across_slices(tmp_path: Path) -> None:
    """Elements whose characters and length fields straddle the UTF-8 check's slice boundaries."""
    first = b"a" * (UTF8_SLICE - 9) + "é".encode()  # the "é" straddles the first boundary
    elements = [first, b"x" * 3, "中".encode() * (UTF8_SLICE // 3), b"", b"ok"] + [b"y"] * 200
    path = tmp_path / "slices.gguf"
    path.write_bytes(string_array(elements))
    value = parse_gguf(path).metadata["k"]
    assert list(value) == [e.decode() for e in elements] and value[4] == "ok" and value[150] == "y"
    elements[150] = "中".encode()[:2]
    fails(string_array(elements), tmp_path, "element 150 of 'k' is not valid UTF-8 (unexpected end of data at "
                                            "byte 0)")
    at = 3 * (UTF8_SLICE // 6)  # between two characters, before the bad element 150
    elements[2] = elements[2][:at] + b"\xff" + elements[2][at:]
    fails(string_array(elements), tmp_path, f"element 2 of 'k' is not valid UTF-8 (invalid start byte at byte {at})")


def test_numeric_arrays_are_read_only_views_of_the_map(tmp_path: Path) -> None:
    path = tmp_path / "ints.gguf"
    path.write_bytes(minimal() + pack_string("k") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.INT16, 3)
                     + struct.pack("<3h", -1, 2, 300))
    value = parse_gguf(path).metadata["k"]
    assert isinstance(value, np.ndarray) and value.dtype == np.int16 and value.tolist() == [-1, 2, 300]
    assert not value.flags.owndata and not value.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        value[0] = 1


def numeric_array_file(etype: GGUFValueType, nbytes: int) -> bytes:
    """One key 'k' holding ``nbytes`` of ``etype`` elements (each element's bytes 0x01 0x02 ...)."""
    size = struct.calcsize(SCALAR_FORMATS[etype])
    n = nbytes // size
    return (minimal() + pack_string("k") + struct.pack("<IIQ", GGUFValueType.ARRAY, etype, n)
            + bytes(range(1, size + 1)) * n)


RSS_PROBE = """
import sys
from qwen_runtime.formats.gguf_parse import parse_gguf

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
except OSError:
    pass  # the peak then includes the imports': the measure only errs upwards
before = status("VmRSS:")
layout = parse_gguf(sys.argv[1])
print(status("VmHWM:") - before)
"""

MIB = 1 << 20


def most_keys_and_tensors() -> bytes:
    """As many keys and tensors as allowed, with long names and string values (3.6 MB of text)."""
    keys = b"".join(pack_string(f"k{i:0100d}") + struct.pack("<I", GGUFValueType.STRING) + pack_string("v" * 60)
                    for i in range(MAX_KEYS))
    tensors = b"".join(pack_string(f"t{i:060d}") + struct.pack("<IQQQIQ", 3, 32, 1, 1, 0, 128 * i)
                       for i in range(MAX_TENSORS))  # F32 [1, 1, 32] each, one after the other
    return minimal(MAX_KEYS, MAX_TENSORS) + keys + tensors + bytes(128 * MAX_TENSORS + 64)


HOSTILE_SIZES = {  # what each file cost before numeric arrays stayed in the map and string arrays were indexed
    "INT16 array (+411 MB)": lambda: numeric_array_file(GGUFValueType.INT16, 20 * MIB),
    "FLOAT32 array": lambda: numeric_array_file(GGUFValueType.FLOAT32, 20 * MIB),
    "UINT8 array": lambda: numeric_array_file(GGUFValueType.UINT8, 20 * MIB),
    "empty strings (+95 MB)": lambda: string_array([b""] * (20 * MIB // 8), key="tokenizer.ggml.tokens"),
    "one long string": lambda: string_array([b"\xf0\x9f\x99\x82" * (5 * MIB)]),
    "the most keys and tensors allowed": most_keys_and_tensors,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE_SIZES))
def test_parsing_a_hostile_file_costs_at_most_its_size_plus_32_mib(name: str, tmp_path: Path) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE_SIZES[name]() + bytes(64))
    run = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path)], capture_output=True, text=True, check=True)
    peak = int(run.stdout)
    assert peak <= path.stat().st_size + 32 * MIB, f"{name}: +{peak / MIB:.1f} MiB for {path.stat().st_size} bytes"


def test_decoded_text_keys_and_tensors_are_bounded(tmp_path: Path) -> None:
    value = pack_string("k") + struct.pack("<I", GGUFValueType.STRING) + pack_string(b"x" * (MAX_DECODED_TEXT + 1))
    fails(minimal() + value, tmp_path, "'k'", f"at most {MAX_DECODED_TEXT} bytes of text")
    keys = b"".join(pack_string(f"k{i}") + struct.pack("<IB", GGUFValueType.UINT8, 0) for i in range(MAX_KEYS + 1))
    fails(minimal(MAX_KEYS + 1) + keys, tmp_path, f"{MAX_KEYS + 1} metadata keys, more than the {MAX_KEYS}")
    fails(minimal(0, MAX_TENSORS + 1) + bytes(TENSOR_INFO_MIN_BYTES * (MAX_TENSORS + 1)), tmp_path,
          f"{MAX_TENSORS + 1} tensors, more than the {MAX_TENSORS}")
    fails(string_array([b""] * (MAX_OTHER_STRINGS + 1)), tmp_path,
          f"key 'k': a string array of {MAX_OTHER_STRINGS + 1} elements, more than the {MAX_OTHER_STRINGS} allowed "
          f"outside the vocabulary")


def test_duplicate_key(raw: RawGGUF, tmp_path: Path) -> None:
    raw.kvs.append(raw.kvs[0])
    fails(raw, tmp_path, repr(raw.kvs[0][0]), "twice")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_bad_alignment_key(raw: RawGGUF, tmp_path: Path, alignment: int) -> None:
    raw.set_kv("general.alignment", GGUFValueType.UINT32, alignment)
    fails(raw, tmp_path, "general.alignment", "power of two")


def test_tensor_offset_out_of_range(raw: RawGGUF, tmp_path: Path) -> None:
    name, dims, qtype, _ = raw.infos[-1]
    raw.infos[-1] = (name, dims, qtype, 1 << 40)
    fails(raw, tmp_path, repr(name), "truncated or corrupt")


def test_misaligned_offset(raw: RawGGUF, tmp_path: Path) -> None:
    name, dims, qtype, offset = raw.infos[1]
    raw.infos[1] = (name, dims, qtype, offset + 4)
    fails(raw, tmp_path, repr(name), "not a multiple of the alignment 32")


def test_overlapping_tensors(raw: RawGGUF, tmp_path: Path) -> None:
    name, dims, qtype, _ = raw.infos[1]
    raw.infos[1] = (name, dims, qtype, raw.infos[0][3])
    fails(raw, tmp_path, "overlap")


@pytest.mark.parametrize(("qtype", "fragment"), [(999, "unknown GGML type 999"),
                                                 (GGMLQuantizationType.MXFP4, "type MXFP4; supported")])
def test_unknown_or_unsupported_tensor_type(raw: RawGGUF, tmp_path: Path, qtype: int, fragment: str) -> None:
    name, dims, _, offset = raw.infos[0]
    raw.infos[0] = (name, dims, qtype, offset)
    fails(raw, tmp_path, repr(name), fragment)


@pytest.mark.parametrize(("dims", "fragment"), [
    ((1 << 40, 1 << 40, 1 << 40), "overflow"), ((), "0 dims"), ((1, 1, 1, 1, 1), "5 dims"),
    ((33, 2), "not a multiple"),
])
def test_bad_dims(raw: RawGGUF, tmp_path: Path, dims: tuple[int, ...], fragment: str) -> None:
    name, _, _, offset = raw.infos[0]
    raw.infos[0] = (name, dims, GGMLQuantizationType.Q8_0 if dims == (33, 2) else 0, offset)
    fails(raw, tmp_path, repr(name), fragment)


@pytest.mark.parametrize(("qtype", "dims", "fragment"), [
    (GGMLQuantizationType.Q4_K, (128, 2), "not a multiple"),  # 256-value super-blocks
    (GGMLQuantizationType.Q6_K, (320, 2), "not a multiple"),
    (GGMLQuantizationType.IQ4_XS, (64, 4), "not a multiple"),
    (GGMLQuantizationType.Q5_0, (48, 2), "not a multiple"),
    (GGMLQuantizationType.Q4_K, (1 << 16, 1 << 12), "needs bytes"),  # blocks past the end of the file
    (GGMLQuantizationType.Q5_1, (1 << 12, 1 << 12), "needs bytes"),
])
def test_block_arithmetic_of_quantized_types(raw: RawGGUF, tmp_path: Path, qtype: GGMLQuantizationType,
                                             dims: tuple[int, ...], fragment: str) -> None:
    name, _, _, offset = raw.infos[0]
    raw.infos[0] = (name, dims, qtype, offset)
    fails(raw, tmp_path, repr(name), fragment)


def test_duplicate_tensor_name(raw: RawGGUF, tmp_path: Path) -> None:
    name, dims, qtype, offset = raw.infos[1]
    raw.infos[1] = (raw.infos[0][0], dims, qtype, offset)
    fails(raw, tmp_path, repr(raw.infos[0][0]), "twice")


def test_tensor_count_must_match_the_architecture(raw: RawGGUF, tmp_path: Path) -> None:
    raw.infos.pop()
    fails(raw, tmp_path, f"a {ARCH} model of this config has")


def test_renamed_tensor(raw: RawGGUF, tmp_path: Path) -> None:
    name, dims, qtype, offset = raw.infos[-1]
    raw.infos[-1] = ("blk.0.surprise.weight", dims, qtype, offset)
    fails(raw, tmp_path, repr(name), "is missing")


@pytest.mark.parametrize("key", [f"{ARCH}.embedding_length", f"{ARCH}.block_count", f"{ARCH}.context_length"])
def test_missing_required_key(raw: RawGGUF, tmp_path: Path, key: str) -> None:
    raw.drop_kv(key)
    fails(raw, tmp_path, "missing metadata key", repr(key), error=ConfigError)


@pytest.mark.parametrize(("key", "vtype", "value", "fragment"), [
    (f"{ARCH}.block_count", GGUFValueType.STRING, "2", "should be int"),
    (f"{ARCH}.block_count", GGUFValueType.UINT64, 10**9, "block_count' - nextn_predict_layers must be in"),
    (f"{ARCH}.attention.layer_norm_rms_epsilon", GGUFValueType.STRING, "x", "should be float"),
    (f"{ARCH}.rope.freq_base", GGUFValueType.FLOAT32, float("nan"), "finite"),
    (f"{ARCH}.embedding_length", GGUFValueType.UINT32, 0, "hidden_size must be in"),
    ("tokenizer.ggml.eos_token_id", GGUFValueType.STRING, "eos", "token id"),
])
def test_wrong_typed_or_absurd_key(raw: RawGGUF, tmp_path: Path, key: str, vtype: GGUFValueType, value: object,
                                   fragment: str) -> None:
    raw.set_kv(key, vtype, value)
    fails(raw, tmp_path, fragment, error=ConfigError)


@pytest.fixture(scope="module")
def qwen35(converted: Converted) -> RawGGUF:
    return RawGGUF.from_file(converted("qwen35-tiny", "gguf"))


@pytest.mark.parametrize(("key", "value", "etype", "fragment"), [
    ("qwen35.attention.recurrent_layers", [1, 0, 1, 1], GGUFValueType.INT32, "should be an array of booleans"),
    ("qwen35.attention.recurrent_layers", [True] * 5000, GGUFValueType.BOOL, "5000 entries, more than 4096"),
    ("qwen35.rope.dimension_sections", [1.0, 2.0], GGUFValueType.FLOAT32, "array of non-negative integers"),
    ("qwen35.rope.dimension_sections", [-1, 2, 0, 0], GGUFValueType.INT32, "array of non-negative integers"),
])
def test_wrong_typed_model_arrays(qwen35: RawGGUF, tmp_path: Path, key: str, value: list, etype: GGUFValueType,
                                  fragment: str) -> None:
    raw = copy.deepcopy(qwen35)
    raw.set_kv(key, GGUFValueType.ARRAY, value, etype)
    fails(raw, tmp_path, repr(key), fragment, error=ConfigError)


def test_unsupported_architecture(raw: RawGGUF, tmp_path: Path) -> None:
    raw.set_kv("general.architecture", GGUFValueType.STRING, "llama")
    fails(raw, tmp_path, "'llama'", error=UnsupportedArchitectureError)


@pytest.mark.parametrize(("key", "vtype", "value", "etype", "fragment"), [
    ("tokenizer.ggml.pre", GGUFValueType.ARRAY, [1], GGUFValueType.INT32, "pre-tokenizer"),
    ("tokenizer.ggml.token_type", GGUFValueType.ARRAY, ["x"], GGUFValueType.STRING, "array of integers"),
    ("tokenizer.ggml.merges", GGUFValueType.ARRAY, ["nospace"], GGUFValueType.STRING, "without a space"),
    ("tokenizer.ggml.merges", GGUFValueType.ARRAY, ["zz9 qq8"], GGUFValueType.STRING, "merges"),
    ("tokenizer.ggml.tokens", GGUFValueType.STRING, "abc", None, "tokenizer.ggml.tokens"),
])
def test_hostile_tokenizer_metadata(raw: RawGGUF, tmp_path: Path, key: str, vtype: GGUFValueType, value: object,
                                    etype: GGUFValueType | None, fragment: str) -> None:
    raw.set_kv(key, vtype, value, etype)
    path = raw.write(tmp_path / "tok.gguf")
    with pytest.raises(FormatError, match=fragment):
        load_chat_format(open_gguf(path))


def test_hostile_chat_template_in_metadata(raw: RawGGUF, tmp_path: Path) -> None:
    raw.set_kv("tokenizer.chat_template", GGUFValueType.STRING, "{{ cycler.__init__.__globals__ }}")
    fmt = load_chat_format(open_gguf(raw.write(tmp_path / "tpl.gguf")))
    with pytest.raises(TemplateError):
        fmt.render([{"role": "user", "content": "hi"}])


def test_same_metadata_and_tensors_as_gguf_reader(converted: Converted) -> None:
    path = converted("qwen35-tiny", "gguf", "q8_0")
    reader = GGUFReader(path)
    files = open_gguf(path)
    ours = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in files.metadata.items()}
    assert ours == {n: f.contents() for n, f in reader.fields.items() if not n.startswith("GGUF.")}
    arrays = [v for v in files.metadata.values() if isinstance(v, np.ndarray)]  # token types, rope sections, ...
    assert len(arrays) >= 2 and all(not a.flags.owndata and not a.flags.writeable for a in arrays)
    for t in reader.tensors:
        data = files.tensors[t.name].data
        assert not data.flags.owndata and not data.flags.writeable  # a view of the read-only map
        assert data.tobytes() == np.asarray(t.data).tobytes()
