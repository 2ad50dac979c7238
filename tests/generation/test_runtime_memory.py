"""Anonymous memory during generation stays small while the weights are much larger (subprocess probe).

A random-weight model with ~180 MB of float32 (~90 MB of fp16, ~48 MB of q8_0) weights is generated from in a
fresh interpreter; RssAnon is read from /proc/self/status after loading and after every decode step.  Weights
stay file-backed (memory-mapped) and BF16/F16/Q8_0 matrices are widened one tile at a time, so anonymous
growth must stay far below the size of the weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import qwen2_shapes
from runtime_helpers import FIXTURES, Converted
from safetensors.numpy import save_file

from qwen_convert.convert import convert

ALLOWED_GROWTH_MB = 24  # tile buffer, activations, logits, KV cache of this small run, allocator slack

PROBE = r"""
import sys, json, numpy as np
from qwen_runtime import GenerationConfig, load
from qwen_runtime.generation.generate import Generation

def anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

model = load(sys.argv[1])
before = anon_kb()
prompt = [list(range(1, 97)), list(range(5, 40))]
gen = Generation(model, prompt, GenerationConfig(max_new_tokens=6, prefill_chunk=64))
peak = before
for _ in gen:
    peak = max(peak, anon_kb())
print(json.dumps({"before_kb": before, "peak_kb": peak}))
"""

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
          "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
          "tie_word_embeddings": False}


def write_random_hf(path: Path, dtype: str) -> int:
    """A Qwen2-shaped HF directory with random weights; returns the bytes of weights written."""
    rng = np.random.default_rng(0)
    shapes = qwen2_shapes(CONFIG) | {"lm_head.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"])}
    tensors = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape, np.float32) * np.float32(0.02)
        tensors[name] = x.astype(np.float16) if dtype == "fp16" else x
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # GGUF output needs a tokenizer
        shutil.copy(FIXTURES / "qwen2-tiny" / name, path / name)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return sum(t.nbytes for t in tensors.values())


def probe(model: Path) -> tuple[float, float]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["before_kb"] / 1024, result["peak_kb"] / 1024


@pytest.fixture(scope="module")
def random_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("memory")
    return {d: (root / d, write_random_hf(root / d, d)) for d in ("fp32", "fp16")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "fp16", "q8_0"])
def test_anonymous_memory_stays_bounded(random_models, tmp_path: Path, kind: str) -> None:
    if kind == "q8_0":
        path = convert(random_models["fp32"][0], tmp_path / "q8.gguf", "gguf", "q8_0").output
        weights_mb = path.stat().st_size / 2**20
    else:
        path, nbytes = random_models[kind]
        weights_mb = nbytes / 2**20
    before, peak = probe(path)
    assert weights_mb > (1.5 if kind == "q8_0" else 3) * ALLOWED_GROWTH_MB  # q8_0 widened whole: 180 MB
    assert peak - before < ALLOWED_GROWTH_MB, f"{kind}: anonymous memory grew {peak - before:.1f} MiB"


def compiled_signatures() -> dict[str, int]:
    """How many machine-code versions each of the runtime's numba functions holds now."""
    from numba.core.dispatcher import Dispatcher

    return {f"{name}.{attr}": len(value.signatures) for name, module in list(sys.modules.items())
            if name.startswith("qwen_runtime") for attr, value in vars(module).items()
            if isinstance(value, Dispatcher)}


@pytest.mark.parametrize("family", ["qwen2-tiny", "qwen3-tiny", "qwen35-tiny", "qwen2-tiny:q8_0", "qwen35-tiny:q4_k_m"])
def test_generation_compiles_nothing_after_load(converted: Converted, family: str) -> None:
    """Every compiled function a generation calls was compiled (or read from numba's cache) while the model
    loaded: a batch of ragged prompts, its prefill and its decode steps add no new signature.  A new one would be
    compiled inside the first prompt, and LLVM's tens of MiB of anonymous memory would land in generation (the
    fp32 probe above once grew 50 MiB that way, from a read-only slot array of a one-row batch)."""
    pytest.importorskip("numba")
    from qwen_runtime import GenerationConfig, load
    from qwen_runtime.generation.generate import Generation

    name, _, dtype = family.partition(":")
    model = load(converted(name, "gguf" if dtype else "hf", dtype or "fp32"), kernels="numba")
    loaded = compiled_signatures()
    for prompts in ([list(range(1, 40)), list(range(5, 12))], [list(range(3, 20))]):
        for _ in Generation(model, prompts, GenerationConfig(max_new_tokens=3, prefill_chunk=16)):
            pass
    grown = {name: n - loaded.get(name, 0) for name, n in compiled_signatures().items() if n != loaded.get(name, 0)}
    assert not grown, f"compiled after load: {grown}"
