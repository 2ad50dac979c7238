"""The ternary writers (TQ1_0, TQ2_0: ``gguf.quants``) against llama.cpp's quantizer, and the values they keep.

* Without llama.cpp: every value decodes (gguf-py's dequantizer) to -d, 0 or +d with d the block's largest
  magnitude, the nearest of the three with halves away from zero, as ``quantize_row_tq*_0_ref``'s ``lroundf``.
* ``peer``: our bytes equal ``ggml_quantize_chunk``'s in llama-cpp-python's ``libggml-base.so`` on rows of varied
  statistics (heavy tails, zeros, constants, subnormal-sized values, exact halves) with and without importance
  weights (which both ignore).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants
from test_kquant_writers import KINDS, _ggml, block_mismatches, ggml_quantize, varied_importance, varied_rows

from qwen_convert.quantize import encode_rows
from qwen_runtime.formats.tensors import QType

TERNARY = (QType.TQ1_0, QType.TQ2_0)


def halves(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows whose values sit on the rounding boundaries: ±amax, ±amax/2 and 0 (exact in float32)."""
    x = rng.choice(np.array([-2.0, -1.0, 0.0, 1.0, 2.0], np.float32), (rows, n)) * np.float32(0.375)
    x[:, ::256] = 0.75  # every block's largest magnitude is 0.75, so ±0.375 is exactly half of it
    return x


@pytest.mark.parametrize("qtype", TERNARY, ids=lambda q: q.name)
def test_values_round_to_the_nearest_of_three(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    x = np.concatenate([varied_rows(rng, 2 * len(KINDS), 512), halves(rng, 4, 512)])
    with np.errstate(all="ignore"):
        decoded = quants.dequantize(encode_rows(x, qtype), qtype)
        blocks = x.reshape(-1, 256)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        scale = amax.astype(np.float16).astype(np.float32)
        ratio = np.where(amax > 0, blocks / np.where(amax > 0, amax, 1), 0)
    trits = np.sign(ratio) * np.floor(np.abs(ratio) + np.float32(0.5))  # halves away from zero
    assert np.array_equal(decoded.reshape(-1, 256), trits * scale)
    assert (trits == 0.0).any() and (np.abs(trits) == 1.0).any()


@pytest.mark.peer
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", TERNARY, ids=lambda q: q.name)
def test_bytes_equal_ggml_quantize_chunk(qtype: QType, weighted: bool) -> None:
    lib = _ggml()
    rng = np.random.default_rng([int(qtype), weighted])
    for width in (256, 4864):
        x = np.concatenate([varied_rows(rng, 3 * len(KINDS), width), halves(rng, 4, width)])
        importance = varied_importance(rng, width, 1) if weighted else None
        ours, theirs = encode_rows(x, qtype, importance), ggml_quantize(lib, x, qtype, importance)
        assert block_mismatches(ours, theirs, qtype) == 0, f"{qtype.name} width {width}"


def test_npy_output_of_a_ternary_type_is_refused() -> None:
    """npy directories hold the types with a block dtype; a planned TQ tensor is refused before any output."""
    from qwen_convert.convert import check_npy_types
    from qwen_convert.policy import TensorSpec
    from qwen_runtime.errors import UsageError

    check_npy_types([TensorSpec("blk.0.ffn_up.weight", (4, 256), QType.Q4_0)])
    with pytest.raises(UsageError, match="'blk.0.ffn_up.weight': an npy directory cannot hold type TQ2_0"):
        check_npy_types([TensorSpec("blk.0.ffn_up.weight", (4, 256), QType.TQ2_0)])
