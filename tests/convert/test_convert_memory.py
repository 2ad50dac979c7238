"""Peak memory of a conversion stays below 400 MB + 3 x the largest tensor in float32, whatever the model size,
and below the heap the ray executor declares for it.

The model: a ~1.5 GB random bf16 Qwen2 checkpoint of 52 layers whose largest tensor is 4M elements (16 MB
in float32), so the bound (~450 MB) is far below the model's size.  The conversion runs in a fresh
process that reports its own peak resident set (``VmHWM``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from convert_helpers import fixture, write_qwen2
from shared_data import MODEL_CONFIGS, tokenizer_json

from qwen_convert import ray_batch
from qwen_convert.batch import ConversionJob
from qwen_convert.ray_batch import job_memory
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


HEAP_SCRIPT = """
import json, sys, threading, time
from pathlib import Path
from qwen_convert.batch import ConversionJob, run_job
from qwen_convert.verify import BatchVerifier

def anon():
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:")][0]

peak, done = [anon()], threading.Event()
def sample():
    while not done.wait(0.002):
        peak.append(max(peak.pop(), anon()))
sampler = threading.Thread(target=sample)
sampler.start()
result = run_job(ConversionJob(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]), verify=BatchVerifier())
done.set()
sampler.join()
print(json.dumps({"status": result.status, "message": result.message, "peak": max(peak[0], anon())}))
"""
RAY_WORKER_HEAP = 41 * MB  # an idle Ray worker's RssAnon (measured with ray 2.60.0)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "dtype"), [("gguf", "q8_0"), ("npy", "fp32")])
def test_declared_ray_memory_covers_the_measured_heap(tmp_path: Path, fmt: str, dtype: str) -> None:
    """A full-vocabulary model with --verify (the probe's [positions, vocabulary] arrays dominate its heap)."""
    src = write_qwen2(tmp_path / "model", layers=2, hidden=128, inter=256, vocab=151936, heads=4, kv_heads=2)
    shutil.copyfile(tokenizer_json("qwen2_qwen3"), src / "tokenizer.json")
    shutil.copyfile(MODEL_CONFIGS / "qwen2.5-0.5b-instruct" / "tokenizer_config.json", src / "tokenizer_config.json")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"bos_token_id": 151643, "eos_token_id": 151645}))
    job = ConversionJob(src, tmp_path / ("out.gguf" if fmt == "gguf" else "out"), fmt, dtype)
    proc = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, str(job.src), str(job.out), fmt, dtype],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.splitlines()[-1])
    assert measured["status"] == "verified", measured["message"]
    declared = job_memory(job, verify=True)
    print(f"{fmt} {dtype}: peak heap {measured['peak'] / MB:.0f} MiB (+ {RAY_WORKER_HEAP / MB:.0f} MiB Ray "
          f"worker), declared {declared / MB:.0f} MiB")
    assert measured["peak"] + RAY_WORKER_HEAP < declared


def test_declared_memory_follows_the_measured_terms(tmp_path: Path) -> None:
    small = fixture("qwen2-tiny")
    big = write_qwen2(tmp_path / "big", layers=2, hidden=1024, inter=4096)

    def need(src: Path, fmt: str, dtype: str, verify: bool) -> int:
        return ray_batch.job_memory(ConversionJob(src, tmp_path / "out", fmt, dtype), verify)

    assert need(small, "npy", "fp16", False) == need(big, "npy", "q8_0", False) == ray_batch.BASE_BYTES
    assert need(small, "gguf", "fp16", False) > ray_batch.BASE_BYTES  # the GGUF tokenizer metadata
    assert need(small, "npy", "fp16", True) > need(small, "npy", "fp16", False)  # the probe
    assert need(big, "npy", "q8_0", True) > need(big, "npy", "fp16", True)  # q8_0 scales kept while probing
    assert need(tmp_path / "missing", "gguf", "fp16", True) == ray_batch.BASE_BYTES
