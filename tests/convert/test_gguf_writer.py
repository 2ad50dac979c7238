"""The GGUF writer's one reach into gguf's private API, held to gguf's own bytes.

``StreamingGGUFWriter._pack_val`` overrides ``gguf.GGUFWriter._pack_val`` (a private method) to pack the big
tokenizer arrays in bulk.  gguf is pinned below its next minor release in pyproject.toml; these tests fail
when a gguf release changes the method's signature or what it writes, so the pin is moved knowingly.
"""

from __future__ import annotations

import inspect

import pytest
from gguf import GGUFValueType, GGUFWriter

from qwen_convert.gguf_writer import StreamingGGUFWriter


def _writers(tmp_path) -> tuple[GGUFWriter, StreamingGGUFWriter]:
    return GGUFWriter(tmp_path / "a.gguf", "qwen2"), StreamingGGUFWriter(tmp_path / "b.gguf", "qwen2")


def test_private_method_keeps_the_signature_we_override() -> None:
    assert list(inspect.signature(GGUFWriter._pack_val).parameters) == \
        list(inspect.signature(StreamingGGUFWriter._pack_val).parameters)


@pytest.mark.parametrize(("values", "sub_type"), [
    ([f"tok{i}\u00e9" if i % 7 else "" for i in range(3000)], None),  # token strings, empty and non-ASCII
    ([i % 5 - 2 for i in range(2048)], GGUFValueType.INT32),  # token types
    ([i * 7919 % 4_000_000_000 for i in range(1500)], GGUFValueType.UINT32),
    ([i for i in range(1024)], None),  # ints without a sub type: gguf infers INT32
])
@pytest.mark.parametrize("add_vtype", [True, False])
def test_bulk_packing_equals_gguf(tmp_path, values: list, sub_type: GGUFValueType | None, add_vtype: bool) -> None:
    theirs, ours = _writers(tmp_path)
    expected = theirs._pack_val(values, GGUFValueType.ARRAY, add_vtype, sub_type)
    assert ours._pack_val(values, GGUFValueType.ARRAY, add_vtype, sub_type) == expected


def test_other_values_are_gguf_s_own(tmp_path) -> None:
    theirs, ours = _writers(tmp_path)
    for val, vtype, sub in [([1.5] * 2000, GGUFValueType.ARRAY, None), (["a", "b"], GGUFValueType.ARRAY, None),
                            ("text", GGUFValueType.STRING, None), (7, GGUFValueType.UINT32, None)]:
        assert ours._pack_val(val, vtype, True, sub) == theirs._pack_val(val, vtype, True, sub)
