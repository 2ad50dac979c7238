"""The 4- and 5-bit writers (``--dtype q4_0, q4_1, q5_0, q5_1``): gguf-py's bytes, npy = GGUF, verified outputs.

Byte-identity with llama.cpp's own quantizer on the same float32 input is in tests/interop/test_quant_interop.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from convert_helpers import fixture
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from runtime_helpers import Converted

import qwen_runtime
from qwen_convert.quantize import encode_rows
from qwen_convert.verify import verify_against
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.tensors import QType
from qwen_runtime.quants import CODECS

WRITTEN = {"q4_0": QType.Q4_0, "q4_1": QType.Q4_1, "q5_0": QType.Q5_0, "q5_1": QType.Q5_1}


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(list(WRITTEN.values())),
       x=arrays(np.float32, (3, 64), elements=st.floats(-1e4, 1e4, width=32)))
def test_encoding_is_gguf_quants(qtype: QType, x: np.ndarray) -> None:
    encoded = encode_rows(x, qtype)
    assert encoded.dtype == np.uint8 and encoded.tobytes() == quants.quantize(x, qtype).tobytes()
    assert np.array_equal(CODECS[qtype].reference(encoded), quants.dequantize(encoded, qtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", WRITTEN)
def test_npy_and_gguf_hold_the_same_blocks_and_verify(converted: Converted, dtype: str) -> None:
    qtype = WRITTEN[dtype]
    npy_out, gguf_out = converted("qwen3-tiny", "npy", dtype), converted("qwen3-tiny", "gguf", dtype)
    npy, gguf = open_model_files(npy_out), open_model_files(gguf_out)
    manifest = json.loads((npy_out / "manifest.json").read_text())
    assert manifest["dtype"] == dtype
    quantized = [name for name, t in gguf.tensors.items() if t.qtype == qtype]
    assert "token_embd.weight" in quantized and len(quantized) == 1 + 7 * 2  # embedding and 7 matrices a layer
    for name, tensor in npy.tensors.items():
        assert tensor.qtype == gguf.tensors[name].qtype, name
        assert np.array_equal(tensor.data, gguf.tensors[name].data), name
    array = np.load(npy_out / "token_embd.weight.npy", mmap_mode="r")
    assert array.dtype == CODECS[qtype].npy_dtype and array.shape == (512, 64 // 32)
    ids = np.array([[1, 5, 9, 200, 7]])
    assert np.array_equal(qwen_runtime.load(npy_out).logits(ids), qwen_runtime.load(gguf_out).logits(ids))
    for out in (npy_out, gguf_out):
        report = verify_against(out, fixture("qwen3-tiny"))
        assert report.ok, report.failures()
