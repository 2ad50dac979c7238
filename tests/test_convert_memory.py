"""Peak memory of a conversion stays below 400 MB + 3 x the largest tensor in float32, whatever the model size.

The model: a ~1.5 GB random bf16 Qwen2 checkpoint of 52 layers whose largest tensor is 4M elements (16 MB
in float32), so the bound (~450 MB) is far below the model's size.  The conversion runs in a fresh
process that reports its own peak resident set (``VmHWM``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from convert_helpers import write_qwen2

from qwen_runtime.formats import open_model_files

MB = 1 << 20
BASE_ALLOWANCE = 400 * MB

SCRIPT = """
import sys
from qwen_convert.convert import convert
convert(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
status = open("/proc/self/status").read().split("\\n")
print([line.split()[1] for line in status if line.startswith("VmHWM:")][0])
"""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2(tmp_path_factory.mktemp("big") / "model", layers=52, hidden=1024, inter=4096,
                       heads=16, kv_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "dtype"), [("gguf", "q8_0"), ("npy", "fp16")])
def test_peak_memory_is_bounded(big_model: Path, tmp_path: Path, fmt: str, dtype: str) -> None:
    files = open_model_files(big_model)
    total = sum(t.nbytes for t in files.tensors.values())
    largest_f32 = max(t.n_elements for t in files.tensors.values()) * 4
    bound = BASE_ALLOWANCE + 3 * largest_f32
    assert total > 3 * bound  # the model could not fit under the bound
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(big_model), str(out), fmt, dtype],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1]) * 1024
    print(f"{fmt} {dtype}: peak RSS {peak / MB:.0f} MiB, bound {bound / MB:.0f} MiB, model {total / MB:.0f} MiB")
    assert peak < bound, f"peak RSS {peak / MB:.0f} MiB >= bound {bound / MB:.0f} MiB"
    assert open_model_files(out).tensors["blk.51.ffn_down.weight"].shape == (1024, 4096)
