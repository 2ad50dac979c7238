"""Q8_0 / F16 encoding against gguf's reference, streaming chunk boundaries, and the dtype policy."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qwen_convert import quantize
from qwen_convert.policy import plan_outputs, tensor_qtype
from qwen_convert.quantize import quantize_q8_0, round_half_away, stream_rows
from qwen_runtime.formats.tensors import QType, StoredTensor


def test_q8_0_bytes_equal_gguf_reference() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((257, 96)) * rng.uniform(0, 4, (257, 1))).astype(np.float32)
    x[0] = 0  # all-zero blocks: scale 0
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # exact halves after scaling
    x[2, :32] = np.float32(1e-6)  # subnormal scale in fp16
    x[3, :32] = np.float32(3e5)  # scale overflows fp16 to inf, as in ggml
    x[4, :32] = np.linspace(-127, 127, 32, dtype=np.float32)
    assert np.array_equal(quantize_q8_0(x), quants.quantize(x, QType.Q8_0))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([32, 64])),
                  elements=st.floats(-1e4, 1e4, width=32)))
def test_q8_0_matches_reference_on_any_values(x: np.ndarray) -> None:
    assert np.array_equal(quantize_q8_0(x), quants.quantize(x, QType.Q8_0))


def test_round_half_away_matches_gguf_np_roundf() -> None:
    x = np.array([0.5, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 126.5, -126.5, 3.2, -3.7, 0.0],
                 dtype=np.float32)
    assert np.array_equal(round_half_away(x.copy()), quants.np_roundf(x))


def _tensor(values: np.ndarray, qtype: QType) -> StoredTensor:
    if qtype == QType.BF16:
        data = (values.view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = values.astype(np.float16 if qtype == QType.F16 else np.float32)
    return StoredTensor("blk.0.ffn_up.weight", qtype, values.shape, "mem", data=data)


@pytest.mark.parametrize("source", [QType.BF16, QType.F16, QType.F32])
@pytest.mark.parametrize("target", [QType.F32, QType.F16, QType.Q8_0])
def test_streamed_chunks_equal_whole_tensor_encoding(monkeypatch: pytest.MonkeyPatch, source: QType,
                                                     target: QType) -> None:
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 200)  # several chunks and a short last one
    values = np.random.default_rng(2).standard_normal((23, 64)).astype(np.float32)
    tensor = _tensor(values, source)
    streamed = b"".join(chunk.tobytes() for chunk in stream_rows(tensor, target))
    whole = quants.quantize(tensor.to_float32(), target)
    assert streamed == np.ascontiguousarray(whole).tobytes()


@pytest.mark.parametrize(("name", "shape", "dtype", "expected"), [
    ("token_embd.weight", (512, 64), "q8_0", QType.Q8_0),
    ("output.weight", (512, 64), "fp16", QType.F16),
    ("blk.0.attn_norm.weight", (64,), "q8_0", QType.F32),
    ("blk.0.attn_q.bias", (64,), "fp16", QType.F32),
    ("blk.0.ssm_a", (4,), "q8_0", QType.F32),
    ("blk.0.ssm_dt.bias", (4,), "fp16", QType.F32),
    ("blk.3.attn_q_norm.weight", (32,), "q8_0", QType.F32),
    ("blk.0.ssm_conv1d.weight", (128, 4), "q8_0", QType.F32),
    ("blk.0.ssm_conv1d.weight", (128, 4), "fp16", QType.F32),
    ("blk.0.ssm_beta.weight", (4, 64), "q8_0", QType.Q8_0),
    ("blk.0.ffn_down.weight", (64, 48), "q8_0", QType.F16),  # 48 is not a multiple of 32
    ("blk.0.ffn_down.weight", (64, 48), "fp32", QType.F32),
    ("token_embd.weight", (512, 64), "q4_0", QType.Q4_0),
    ("output.weight", (512, 64), "q4_1", QType.Q4_1),
    ("blk.0.attn_v.weight", (32, 64), "q5_0", QType.Q5_0),
    ("blk.0.ffn_up.weight", (128, 64), "q5_1", QType.Q5_1),
    ("blk.0.attn_norm.weight", (64,), "q4_0", QType.F32),
    ("blk.0.ssm_conv1d.weight", (128, 4), "q5_1", QType.F32),
    ("blk.0.ffn_down.weight", (64, 48), "q4_0", QType.F16),  # 48 is not a multiple of 32
])
def test_dtype_policy(name: str, shape: tuple[int, ...], dtype: str, expected: QType) -> None:
    assert tensor_qtype(name, shape, dtype) == expected


def test_plan_orders_embedding_layers_numerically_then_head() -> None:
    shapes = {"output.weight": (8, 32), "blk.10.ffn_up.weight": (8, 32), "blk.2.ffn_up.weight": (8, 32),
              "token_embd.weight": (8, 32), "output_norm.weight": (32,)}
    names = [spec.name for spec in plan_outputs(shapes, "fp16")]
    assert names == ["token_embd.weight", "blk.2.ffn_up.weight", "blk.10.ffn_up.weight", "output.weight",
                     "output_norm.weight"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.slow
def test_streaming_releases_source_pages(tmp_path) -> None:
    """Read pages of the memory-mapped source do not pile up in RSS (64 MiB source, bf16 -> Q8_0)."""
    path = tmp_path / "big.bin"
    rows, width = 8192, 4096
    np.random.default_rng(0).integers(0, 1 << 14, (rows, width), dtype=np.uint16).tofile(path)
    source = np.memmap(path, dtype=np.uint16, mode="r", shape=(rows, width))
    tensor = StoredTensor("w", QType.BF16, (rows, width), path, data=source)
    before, peak = _rss_mib(), 0.0
    for _ in stream_rows(tensor, QType.Q8_0):
        peak = max(peak, _rss_mib())
    assert peak - before < 40, f"RSS grew by {peak - before:.0f} MiB while streaming a 64 MiB source"
