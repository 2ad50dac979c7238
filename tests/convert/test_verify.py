"""Semantic verification: correct conversions pass; deliberately broken ones fail, naming the cause."""

from __future__ import annotations

import importlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import ALL_FIXTURES, fixture
from gguf import GGUFValueType, TokenType
from hostile_helpers import RawGGUF
from runtime_helpers import Converted

from qwen_convert.cli import convert_main, inspect_main
from qwen_convert.convert import convert
from qwen_convert.demo import bundled_model_path
from qwen_convert.verify import FAILED_SUFFIX, report_json, round_to_bf16, verify_against
from qwen_convert.verify.behaviour import BehaviourCheck, behaviour_check
from qwen_runtime.errors import EXIT_CODES, FormatError, VerificationError
from qwen_runtime.formats import open_hf_dir
from qwen_runtime.formats.archs import PLUS_ONE
from qwen_runtime.formats.base import V_HEAD_GROUPED
from qwen_runtime.formats.gguf_parse import parse_gguf
from qwen_runtime.formats.hf_dir import shard_entries
from qwen_runtime.formats.naming import TRANSFORM_NOTES
from qwen_runtime.formats.tensors import Q8_0_DTYPE, to_float32

convert_module = importlib.import_module("qwen_convert.convert")
DTYPES = ("fp32", "fp16", "q8_0")


def copy_of(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / path.name
    if path.is_dir():
        shutil.copytree(path, target)
    else:
        shutil.copyfile(path, target)
    return target


def gguf_tensor_bytes(path: Path, name: str) -> np.memmap:
    """A writable map of one tensor's bytes in a GGUF file."""
    info = next(t for t in parse_gguf(path).tensors if t.name == name)
    return np.memmap(path, dtype=np.uint8, mode="r+", offset=info.offset, shape=(info.nbytes,))


def edit_f32(path: Path, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    data = gguf_tensor_bytes(path, name)
    values = data.view(np.float32)
    values[:] = edit(values.copy())
    data.flush()


def set_gguf_float(path: Path, key: str, value: float) -> None:
    """Overwrite a FLOAT32 metadata value in place (the key string, u32 type 6, then 4 bytes)."""
    raw = bytearray(path.read_bytes())
    encoded = struct.pack("<Q", len(key)) + key.encode()
    at = raw.index(encoded) + len(encoded)
    assert struct.unpack_from("<I", raw, at)[0] == 6
    raw[at + 4:at + 8] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


def behaviour_alone(path: Path, source: Path, dtype: str) -> BehaviourCheck:
    """The behavioural check on its own (no tensor or metadata check)."""
    return behaviour_check(open_hf_dir(source), path, dtype)


def first_failure(path: Path, source: str, behaviour: bool = False) -> str:
    report = verify_against(path, fixture(source), behaviour=behaviour)
    assert not report.ok
    return report.failures()[0]


# --- correct conversions pass ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_correct_gguf_of_every_family_and_type_verifies(converted, name: str, dtype: str) -> None:
    report = verify_against(converted(name, "gguf", dtype), fixture(name))
    assert report.ok, report.failures()
    assert report.tensors and all(t.ok for t in report.tensors)
    assert report.behaviour is not None and report.behaviour.positions > 10
    if dtype == "fp32":
        assert report.behaviour.max_kl <= 1e-6 and report.behaviour.top1_agreement == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen35-tiny-gqa"])
def test_correct_npy_output_verifies(converted, name: str, dtype: str) -> None:
    report = verify_against(converted(name, "npy", dtype), fixture(name), behaviour=dtype == "q8_0")
    assert report.ok, report.failures()
    assert {m.key for m in report.metadata} >= {"architecture", "config.json", "tokenizer.json"}


def test_fp32_is_exact_and_q8_0_within_its_block_bound(converted) -> None:
    exact = verify_against(converted("qwen3-tiny", "gguf", "fp32"), fixture("qwen3-tiny"), behaviour=False)
    assert all(t.max_error == 0 for t in exact.tensors)
    quantized = verify_against(converted("qwen3-tiny", "gguf", "q8_0"), fixture("qwen3-tiny"), behaviour=False)
    matrices = [t for t in quantized.tensors if t.type == "Q8_0"]
    assert matrices and all(0 < t.max_error <= t.max_bound for t in matrices)


def test_skipped_source_tensors_are_accounted_for_with_reasons(converted) -> None:
    report = verify_against(converted("qwen35-vl-tiny", "gguf", "fp16"), fixture("qwen35-vl-tiny"),
                            behaviour=False)
    reasons = set(report.skipped.values())
    assert any("vision" in r for r in reasons) and any("multi-token" in r for r in reasons)
    assert report.ok and not report.problems
    assert json.dumps(report_json(report))  # JSON-ready


def test_npy_in_hf_value_head_order_verifies(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(convert_module, "open_source", lambda src: open_hf_dir(src, v_head_order=V_HEAD_GROUPED))
    out = convert(fixture("qwen35-tiny-gqa"), tmp_path / "grouped", "npy", "fp32").output
    assert json.loads((out / "manifest.json").read_text())["v_head_order"] == V_HEAD_GROUPED
    assert verify_against(out, fixture("qwen35-tiny-gqa"), behaviour=False).ok


# --- broken conversions fail, naming the cause ---------------------------------------------------------------

@pytest.mark.slow
def test_norm_offset_applied_twice_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen35-tiny", "gguf", "fp32"), tmp_path)
    edit_f32(bad, "blk.1.attn_norm.weight", lambda w: w + 1)
    report = verify_against(bad, fixture("qwen35-tiny"))
    failures = report.failures()
    assert "'blk.1.attn_norm.weight'" in failures[0] and "(1 + w) norm offset is applied twice" in failures[0]
    assert not report.behaviour.ok
    assert "first divergence at layer 1 (blk.1.*)" in report.behaviour.failure


@pytest.mark.slow
def test_value_heads_in_the_wrong_order_are_caught(tmp_path: Path, monkeypatch) -> None:
    # The bug of GGUFs made before llama.cpp tiled the value heads: HF's grouped order under a tiled file.
    monkeypatch.setattr(convert_module, "open_source", lambda src: open_hf_dir(src, v_head_order=V_HEAD_GROUPED))
    out = convert(fixture("qwen35-tiny-gqa"), tmp_path / "grouped.gguf", "gguf", "fp32").output
    report = verify_against(out, fixture("qwen35-tiny-gqa"))
    failed = [t for t in report.tensors if not t.ok]
    assert failed and all("value heads are in grouped order, but the output declares tiled" in t.cause
                          for t in failed)
    assert {t.name.split(".", 2)[2] for t in failed} >= {"attn_qkv.weight", "ssm_out.weight", "ssm_a"}
    assert not report.behaviour.ok and report.behaviour.mean_kl > 0.1


def test_missing_tensor_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen2-tiny", "npy", "fp16"), tmp_path)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["tensors"]["blk.0.ffn_up.weight"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    (bad / "blk.0.ffn_up.weight.npy").unlink()
    report = verify_against(bad, fixture("qwen2-tiny"))
    assert report.failures()[0] == ("missing tensor 'blk.0.ffn_up.weight' (source "
                                    "'model.layers.0.mlp.up_proj.weight' was not converted)")
    assert "does not load" in report.behaviour.failure


def test_npy_output_is_opened_with_the_readers_checks(converted, tmp_path: Path) -> None:
    """verify reads an npy output through the npy reader: each file's header and size against the manifest."""
    bad = copy_of(converted("qwen2-tiny", "npy", "fp16"), tmp_path)
    path = bad / "blk.0.ffn_up.weight.npy"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(FormatError, match=r"tensor 'blk\.0\.ffn_up\.weight': file has \d+ bytes, its header needs"):
        verify_against(bad, fixture("qwen2-tiny"), behaviour=False)


def test_dropped_lm_head_is_caught(tmp_path: Path, monkeypatch) -> None:
    plan = convert_module.plan_outputs
    monkeypatch.setattr(convert_module, "plan_outputs",
                        lambda *args: [s for s in plan(*args) if s.name != "output.weight"])
    out = convert(fixture("deepseek-tiny"), tmp_path / "no-head.gguf", "gguf", "fp16").output
    assert first_failure(out, "deepseek-tiny").startswith("missing tensor 'output.weight' (source 'lm_head.weight'")
    assert not behaviour_alone(out, fixture("deepseek-tiny"), "fp16").ok


def test_wrong_rope_base_in_metadata_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "fp16"), tmp_path)
    set_gguf_float(bad, "qwen3.rope.freq_base", 10000.0)
    assert first_failure(bad, "qwen3-tiny") == ("metadata 'qwen3.rope.freq_base': is 10000.0, the source says "
                                                "1000000.0")
    assert not behaviour_alone(bad, fixture("qwen3-tiny"), "fp16").ok


def test_scaled_tensor_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "fp32"), tmp_path)
    edit_f32(bad, "blk.1.ffn_up.weight", lambda w: w * np.float32(1.01))
    failure = first_failure(bad, "qwen3-tiny")
    assert "'blk.1.ffn_up.weight'" in failure and "values are scaled by x1.01 relative to the source" in failure
    assert not behaviour_alone(bad, fixture("qwen3-tiny"), "fp32").ok


def test_scaled_q8_0_tensor_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "q8_0"), tmp_path)
    blocks = gguf_tensor_bytes(bad, "blk.0.ffn_down.weight").view(Q8_0_DTYPE)
    blocks["d"] = (blocks["d"].astype(np.float32) * 1.01).astype(np.float16)
    blocks.flush()
    failure = first_failure(bad, "qwen3-tiny")
    assert "'blk.0.ffn_down.weight'" in failure and "scaled by x1.01" in failure


def test_ssm_a_without_its_transform_is_caught(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen35-tiny", "gguf", "fp32"), tmp_path)
    a_log = shard_entries(fixture("qwen35-tiny"))["model.layers.0.linear_attn.A_log"]
    edit_f32(bad, "blk.0.ssm_a", lambda _: to_float32(a_log.qtype, a_log.view()))
    failure = first_failure(bad, "qwen35-tiny")
    assert "'blk.0.ssm_a'" in failure and "stored without the transform (A_log -> -exp(A_log))" in failure
    assert not behaviour_alone(bad, fixture("qwen35-tiny"), "fp32").ok


def test_report_raises_verification_error_with_exit_code(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "fp32"), tmp_path)
    edit_f32(bad, "output_norm.weight", lambda w: w * np.float32(1.5))
    with pytest.raises(VerificationError, match="'output_norm.weight'.*scaled by x1.5") as info:
        verify_against(bad, fixture("qwen3-tiny"), behaviour=False).raise_for_failure()
    assert EXIT_CODES[type(info.value)] == 9


# --- (1 + w) norms are compared exactly, as stored ----------------------------------------------------------

def plus_one_norms(path: Path, source: str) -> dict[str, np.ndarray]:
    """Output name -> float32 source w of every (1 + w) norm of a converted fixture."""
    entries = shard_entries(fixture(source))
    report = verify_against(path, fixture(source), behaviour=False)
    return {t.name: to_float32(entries[t.source].qtype, entries[t.source].view()).reshape(-1)
            for t in report.tensors if TRANSFORM_NOTES[PLUS_ONE] in t.transform}


def test_every_norm_scaled_by_1_007_in_a_qwen35_q8_0_gguf_fails_naming_each(converted, tmp_path: Path) -> None:
    # A band of eps_bf16·|output| (2^-7) let this through, and the probe's KL (0.019) stays under its limit.
    bad = copy_of(converted("qwen35-tiny", "gguf", "q8_0"), tmp_path)
    norms = plus_one_norms(bad, "qwen35-tiny")
    assert len(norms) >= 10 and not any("ssm_norm" in name for name in norms)
    for name in norms:
        edit_f32(bad, name, lambda w: w * np.float32(1.007))
    report = verify_against(bad, fixture("qwen35-tiny"), behaviour=False)
    failed = {t.name: t.cause for t in report.tensors if not t.ok}
    assert set(failed) == set(norms)
    assert all("values are scaled by x1.007 relative to 1 + w of the source" in cause for cause in failed.values())
    assert all(f"tensor {name!r}" in "\n".join(report.failures()) for name in norms)


def test_norms_rounded_as_another_converter_rounds_them_verify(converted, tmp_path: Path) -> None:
    """1 + w rounded to the bf16 source's own dtype (torch arithmetic on the bf16 tensor) is a convention too;
    one value one float32 ulp away from both conventions is not."""
    good = copy_of(converted("qwen35-tiny", "gguf", "fp32"), tmp_path)
    norms = plus_one_norms(good, "qwen35-tiny")
    for name, w in norms.items():
        edit_f32(good, name, lambda _, w=w: round_to_bf16(w + np.float32(1)))
    assert any(not np.array_equal(round_to_bf16(w + np.float32(1)), w + np.float32(1)) for w in norms.values())
    assert verify_against(good, fixture("qwen35-tiny"), behaviour=False).ok
    name = next(iter(norms))
    edit_f32(good, name, lambda v: np.concatenate([np.nextafter(v[:1], np.float32(3)), v[1:]]))
    failure = first_failure(good, "qwen35-tiny")
    assert f"tensor {name!r}" in failure and "1 values outside the bound" in failure


# --- the tokenizer is compared in full -----------------------------------------------------------------------

def metadata_bytes(path: Path, key: str) -> np.memmap:
    """A writable map of a numeric array value's bytes in a GGUF file."""
    layout = parse_gguf(path)
    value = layout.metadata[key]
    offset = value.__array_interface__["data"][0] - layout.data.__array_interface__["data"][0]
    return np.memmap(path, dtype=value.dtype, mode="r+", offset=offset, shape=value.shape)


def test_twenty_normal_tokens_retyped_as_control_fail(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "q8_0"), tmp_path)
    types = metadata_bytes(bad, "tokenizer.ggml.token_type")
    retyped = np.flatnonzero(types == TokenType.NORMAL)[100:120]
    types[retyped] = TokenType.CONTROL
    types.flush()
    tokens = parse_gguf(bad).metadata["tokenizer.ggml.tokens"]
    first = int(retyped[0])
    assert first_failure(bad, "qwen3-tiny") == (
        f"metadata 'tokenizer.ggml.token_type': 20 token types differ from tokenizer.json's; first: token {first} "
        f"({tokens[first]!r}) is CONTROL, expected NORMAL")


def test_added_token_retyped_or_renamed_fails_naming_it(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "fp16"), tmp_path)
    tokens = parse_gguf(bad).metadata["tokenizer.ggml.tokens"]
    im_end = list(tokens).index("<|im_end|>")
    types = metadata_bytes(bad, "tokenizer.ggml.token_type")
    types[im_end] = TokenType.USER_DEFINED
    types.flush()
    assert first_failure(bad, "qwen3-tiny") == (
        f"metadata 'tokenizer.ggml.token_type': 1 token types differ from tokenizer.json's; first: added token "
        f"{im_end} ('<|im_end|>') is USER_DEFINED, expected CONTROL")
    (tmp_path / "renamed").mkdir()
    renamed = copy_of(converted("qwen3-tiny", "gguf", "fp16"), tmp_path / "renamed")
    raw = bytearray(renamed.read_bytes())
    at = raw.index(b"<|im_end|>")
    raw[at:at + 10] = b"<|im_eNd|>"
    renamed.write_bytes(bytes(raw))
    assert first_failure(renamed, "qwen3-tiny") == (f"metadata 'tokenizer.ggml.tokens': added token {im_end} is "
                                                    f"'<|im_eNd|>', tokenizer.json has '<|im_end|>'")


def test_two_merges_swapped_fail(converted, tmp_path: Path) -> None:
    bad = copy_of(converted("qwen3-tiny", "gguf", "q8_0"), tmp_path)
    merges = list(parse_gguf(bad).metadata["tokenizer.ggml.merges"])
    i = len(merges) // 2
    j = next(k for k in range(i + 1, len(merges)) if len(merges[k].encode()) == len(merges[i].encode()))
    raw = bytearray(bad.read_bytes())
    start = raw.index(b"tokenizer.ggml.merges")
    a, b = (raw.index(struct.pack("<Q", len(m.encode())) + m.encode(), start) for m in (merges[i], merges[j]))
    width = 8 + len(merges[i].encode())
    raw[a:a + width], raw[b:b + width] = raw[b:b + width], raw[a:a + width]
    bad.write_bytes(bytes(raw))
    assert first_failure(bad, "qwen3-tiny") == (f"metadata 'tokenizer.ggml.merges': merge {i} is {merges[j]!r}, "
                                                f"the source has {merges[i]!r}")


def test_special_token_ids_are_compared_in_full(converted, tmp_path: Path) -> None:
    good = converted("qwen3-tiny", "gguf", "q8_0")
    eos = parse_gguf(good).metadata["tokenizer.ggml.eos_token_id"]
    raw = RawGGUF.from_file(good)
    raw.set_kv("tokenizer.ggml.eos_token_id", GGUFValueType.UINT32, eos + 1)
    bad = raw.write(tmp_path / "eos.gguf")
    assert first_failure(bad, "qwen3-tiny") == (f"metadata 'tokenizer.ggml.eos_token_id': is {eos + 1}, the source "
                                                f"says {eos}")
    raw = RawGGUF.from_file(good)
    raw.set_kv("tokenizer.ggml.mask_token_id", GGUFValueType.UINT32, 5)
    raw.set_kv("tokenizer.ggml.add_eos_token", GGUFValueType.BOOL, True)
    report = verify_against(raw.write(tmp_path / "extra.gguf"), fixture("qwen3-tiny"), behaviour=False)
    assert report.failures() == [
        "metadata 'tokenizer.ggml.mask_token_id': is 5, the source's tokenizer files give none",
        "metadata 'tokenizer.ggml.add_eos_token': is True, the source's tokenizer files give none"]
    raw.set_kv("tokenizer.ggml.add_eos_token", GGUFValueType.BOOL, False)  # what an absent flag means anyway
    raw.drop_kv("tokenizer.ggml.mask_token_id")
    assert verify_against(raw.write(tmp_path / "false.gguf"), fixture("qwen3-tiny"), behaviour=False).ok


# --- faults a tensor check might miss fail on behaviour alone (qwen_convert/verify/behaviour.py) ----------------

FAULTS = ("matrix x1.25", "one head's rotary halves swapped", "norm +1")
# (source, output type): the trained bundled model at q8_0 and fp16, every family's fp32, and the dense families'
# q8_0. On the random-weight Qwen3.5 fixtures q8_0 rounding alone moves the probe as much as a swapped head
# (mean KL 1.7e-2..3.8e-2 vs 3.1e-2..5.2e-2), so there only the gross fault is asserted at q8_0.
FAULT_CASES = [("bundled", "q8_0"), ("bundled", "fp16"), ("qwen2-tiny", "fp32"), ("qwen2-tiny", "q8_0"),
               ("qwen3-tiny", "q8_0"), ("qwen35-tiny", "fp32"), ("qwen35-tiny-gqa", "fp32")]


def apply_fault(path: Path, fault: str, source: Path) -> None:
    """Edit a GGUF in place: scale blk.1.ffn_down, swap the rotary halves of query head 0 (of the first
    full-attention layer), or add 1 to blk.1.attn_norm."""
    config = open_hf_dir(source).config
    if fault == "norm +1":
        edit_f32(path, "blk.1.attn_norm.weight", lambda w: w + np.float32(1))
    elif fault == "matrix x1.25":
        info = next(t for t in parse_gguf(path).tensors if t.name == "blk.1.ffn_down.weight")
        data = gguf_tensor_bytes(path, info.name)
        bytes_per_value = info.nbytes / int(np.prod(info.shape))
        if bytes_per_value in (2, 4):
            values = data.view(np.float32 if bytes_per_value == 4 else np.float16)
            values[:] = values * values.dtype.type(1.25)
        else:
            blocks = data.view(Q8_0_DTYPE)
            blocks["d"] = (blocks["d"].astype(np.float32) * 1.25).astype(np.float16)
        data.flush()
    else:
        layer = config.layer_types.index("full_attention") if config.layer_types else 0
        rows = gguf_tensor_bytes(path, f"blk.{layer}.attn_q.weight")
        half = config.head_dim // 2
        by_row = rows.reshape(config.num_attention_heads * config.head_dim * (2 if config.arch == "qwen35" else 1),
                              -1)
        first = by_row[:half].copy()
        by_row[:half] = by_row[half:2 * half]
        by_row[half:2 * half] = first
        rows.flush()


def test_a_correct_conversion_of_trained_weights_passes_with_margin(converted: Converted) -> None:
    check = behaviour_alone(converted("bundled", "gguf", "q8_0"), bundled_model_path(), "q8_0")
    assert check.ok and check.mean_kl <= check.thresholds.mean_kl / 2 and check.max_kl <= check.thresholds.max_kl / 2


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(("name", "dtype"), FAULT_CASES, ids=[f"{n}-{d}" for n, d in FAULT_CASES])
def test_fault_fails_on_behaviour_alone(converted: Converted, tmp_path: Path, name: str, dtype: str,
                                        fault: str) -> None:
    bad = copy_of(converted(name, "gguf", dtype), tmp_path)
    apply_fault(bad, fault, converted(name, "hf"))
    check = behaviour_alone(bad, converted(name, "hf"), dtype)
    assert not check.ok, check.summary()


@pytest.mark.parametrize("name", ["qwen35-tiny", "qwen35-tiny-gqa"])
def test_norm_fault_in_qwen35_q8_0_fails_on_behaviour_alone(converted: Converted, tmp_path: Path, name: str) -> None:
    good = behaviour_alone(converted(name, "gguf", "q8_0"), fixture(name), "q8_0")
    assert good.ok
    bad = copy_of(converted(name, "gguf", "q8_0"), tmp_path)
    apply_fault(bad, "norm +1", fixture(name))
    assert not behaviour_alone(bad, fixture(name), "q8_0").ok


# --- command line ----------------------------------------------------------------------------------------

@pytest.fixture()
def broken_norms(monkeypatch) -> None:
    """Make the converter bake +2 instead of +1 into the (1 + w) norms (the verifier undoes +1)."""
    from qwen_runtime.formats import naming

    monkeypatch.setitem(naming.TRANSFORMS, "plus_one", lambda x: x.astype(np.float32) + np.float32(2.0))


def test_convert_verify_removes_a_failed_output(capsys, tmp_path: Path, broken_norms) -> None:
    out = tmp_path / "bad.gguf"
    code = convert_main([str(fixture("qwen35-tiny")), "-o", str(out), "--dtype", "fp32", "--verify"])
    stdout, stderr = capsys.readouterr()
    assert code == 9 and not out.exists() and not list(tmp_path.iterdir())
    assert "result:    FAILED" in stdout
    assert "(1 + w) norm offset is applied twice" in stderr and "output removed" in stderr


def test_convert_verify_keep_failed_keeps_a_marked_output(capsys, tmp_path: Path, broken_norms) -> None:
    out = tmp_path / "bad"
    code = convert_main([str(fixture("qwen35-tiny")), "-o", str(out), "--dtype", "fp16", "--verify",
                         "--keep-failed"])
    assert code == 9 and not out.exists()
    kept = tmp_path / f"bad{FAILED_SUFFIX}"
    assert (kept / "manifest.json").is_file()
    assert f"kept as {kept}" in capsys.readouterr().err


def test_batch_verify_marks_each_job(capsys, tmp_path: Path) -> None:
    code = convert_main([str(fixture("qwen3-tiny")), "--out-dir", str(tmp_path), "--format", "npy,gguf",
                         "--dtype", "q8_0", "--verify"])
    table = capsys.readouterr().out
    assert code == 0 and table.count("verified") == 2


def test_batch_verify_failure_is_reported_and_exits_non_zero(capsys, tmp_path: Path, broken_norms) -> None:
    code = convert_main([str(fixture("qwen2-tiny")), str(fixture("qwen35-tiny")), "--out-dir", str(tmp_path),
                         "--format", "gguf", "--dtype", "fp32", "--verify", "--keep-failed"])
    table = capsys.readouterr().out
    assert code == 1
    lines = {line.split()[0]: line.split()[-1] for line in table.splitlines()[1:3]}
    assert lines == {str(tmp_path / "qwen2-tiny-fp32.gguf"): "verified",
                     str(tmp_path / "qwen35-tiny-fp32.gguf"): "failed"}
    assert (tmp_path / f"qwen35-tiny-fp32.gguf{FAILED_SUFFIX}").is_file()
    assert "verification against" in table


def test_inspect_verify_against(capsys, converted, tmp_path: Path) -> None:
    good = converted("qwen3-tiny", "gguf", "q8_0")
    assert inspect_main([str(good), "--verify-against", str(fixture("qwen3-tiny"))]) == 0
    assert "result:    verified" in capsys.readouterr().out
    bad = copy_of(good, tmp_path)
    set_gguf_float(bad, "qwen3.rope.freq_base", 10000.0)
    assert inspect_main([str(bad), "--verify-against", str(fixture("qwen3-tiny")), "--json"]) == 9
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] is False and "qwen3.rope.freq_base" in err
