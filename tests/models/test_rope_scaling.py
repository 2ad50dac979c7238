"""RoPE scaling (YaRN, linear) against transformers, in every format, in the reference and in llama.cpp.

The tiny fixtures get ``rope_scaling: yarn x4`` over an original context of 32 positions, so a 48-token prompt
runs past it and the scaled frequencies (and YaRN's attention factor) change every logit; each output format
must still give transformers' logits within the float32 error model (``float_error.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from float_error import check_rows, reference64, tolerance
from runtime_helpers import fixture_dir, load_exact, use_kernels

from qwen_convert.convert import convert
from qwen_convert.verify.metadata import gguf_model_checks
from qwen_runtime.cli_support import add_rope_scaling_options, rope_scaling_arg
from qwen_runtime.errors import ConfigError, ContextOverflowError, UsageError
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.gguf_keys import rope_scaling_from_metadata, rope_scaling_metadata
from qwen_runtime.formats.hf_config import config_from_hf
from qwen_runtime.formats.rope import RopeScaling
from qwen_runtime.generation.generate import check_prompt_fits
from qwen_runtime.models.reference import forward

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = ("qwen2-tiny", "qwen3-tiny")
PROMPT = 48  # tokens: 16 past the original context of 32


def scaled_copy(name: str, root: Path, rope_scaling: dict | None = YARN) -> Path:
    """A copy of fixture ``name`` whose config.json has ``rope_scaling`` (and the 128-position window it makes)."""
    out = root / name
    shutil.copytree(fixture_dir(name), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(max_position_embeddings=128, rope_scaling=rope_scaling)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def yarn_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(scaled source directory, prompt [1, T], transformers' float64 logits, float32 bounds)."""
    pytest.importorskip("torch")
    src = scaled_copy(request.param, tmp_path_factory.mktemp("yarn"))
    ids = np.random.default_rng(7).integers(0, load_exact(src).config.vocab_size, (1, PROMPT))
    expected, bound = reference64(src, ids)
    return src, ids, expected, bound


def hf_rope(cfg: dict) -> tuple[np.ndarray, float]:
    """transformers' inverse frequencies and attention scaling for a Qwen2 config dict."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hc = Qwen2Config(**cfg)
    inv, scale = ROPE_INIT_FUNCTIONS[hc.rope_parameters["rope_type"]](hc)
    return inv.double().numpy(), scale


@pytest.mark.oracle
@pytest.mark.parametrize("scaling", [
    YARN,
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},  # the older spelling
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
     "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 4.0},  # original context: max_position_embeddings
    {"rope_type": "linear", "factor": 2.0},
], ids=["yarn", "type-key", "betas-attention", "no-truncate", "mscale", "no-original", "linear"])
def test_frequencies_match_transformers(scaling: dict) -> None:
    pytest.importorskip("transformers")
    cfg = json.loads((fixture_dir("qwen2-tiny") / "config.json").read_text())
    cfg.update(max_position_embeddings=128, rope_scaling=scaling)
    config = config_from_hf(cfg)
    inv_freq, scale = hf_rope(cfg)
    ours = config.rope_scaling.inv_freq(config.rotary_dim, config.rope_theta)
    np.testing.assert_allclose(ours, inv_freq, rtol=1e-6)  # transformers computes them in float32
    assert config.rope_scaling.attention_scale == pytest.approx(scale, rel=1e-12)
    assert config.context_window == max(128, int(config.rope_scaling.factor * config.rope_scaling.original_context))


@pytest.mark.oracle
def test_logits_match_transformers_in_every_format(yarn_model, tmp_path: Path) -> None:
    src, ids, expected, bound = yarn_model
    plain = load_exact(fixture_dir(src.name)).logits(ids)
    assert (np.abs(plain - expected).max(-1) > 100 * tolerance(bound)).any(), "the scaling changes nothing here"
    for fmt in ("hf", "npy", "gguf"):
        path = src if fmt == "hf" else convert(src, tmp_path / f"out-{fmt}", fmt, "fp32").output
        for kernels in ("numpy", "numba") if fmt == "gguf" else ("numpy",):
            model = use_kernels(load_exact(path), kernels)
            assert model.config.rope_scaling == RopeScaling("yarn", 4.0, 32)
            check_rows(model.logits(ids)[0], expected[0], bound[0], f"{src.name} {fmt} {kernels}")
            cache = model.make_cache(1, PROMPT)  # prefill to the original context, then decode past it
            rows = [model.forward(ids[:, :30], cache)[0]]
            rows += [model.forward(ids[:, t:t + 1], cache)[0] for t in range(30, PROMPT)]
            check_rows(np.concatenate(rows), expected[0], bound[0], f"{src.name} {fmt} {kernels} cached decode")


@pytest.mark.oracle
def test_reference_matches_transformers(yarn_model) -> None:
    src, ids, expected, bound = yarn_model
    got = forward(open_model_files(src), ids[0])
    np.testing.assert_allclose(got, expected[0], rtol=0, atol=1e-9)  # both float64


def test_gguf_keys_round_trip(tmp_path: Path) -> None:
    """Our GGUF carries llama.cpp's rope.scaling.* keys and reads back the same scaling; non-default betas and
    attention factor (llama.cpp's yarn_* keys) round-trip too, and verify checks every key."""
    src = scaled_copy("qwen3-tiny", tmp_path)
    gguf = convert(src, tmp_path / "yarn.gguf", "gguf", "fp32").output
    files = open_model_files(gguf)
    meta = files.metadata
    assert str(meta["qwen3.rope.scaling.type"]) == "yarn"
    assert float(meta["qwen3.rope.scaling.factor"]) == 4.0
    assert int(meta["qwen3.rope.scaling.original_context_length"]) == 32
    assert not any("yarn_" in key for key in meta)  # defaults, as llama.cpp's converter leaves them out
    assert files.config.rope_scaling == open_model_files(src).config.rope_scaling
    assert all(check.ok for check in gguf_model_checks(dict(meta), open_model_files(src).config))
    custom = open_model_files(src).config.replace(
        rope_scaling=RopeScaling("yarn", 8.0, 64, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25))
    written = {key: value for key, _, value in rope_scaling_metadata(custom)}
    assert {k.removeprefix("qwen3.rope.scaling.") for k in written} == {
        "type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow", "yarn_attn_factor"}
    assert rope_scaling_from_metadata(written, "qwen3", 128) == custom.rope_scaling
    failed = [c.key for c in gguf_model_checks(dict(meta), custom) if not c.ok]
    assert len(failed) == 5, failed  # verify notices a file whose scaling is not the source's


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported (its frequencies follow the length"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32}, "factor must be"),
    ({"rope_type": "linear"}, "needs field 'rope_scaling.factor'"),
])
def test_unsupported_scaling_is_refused(scaling: dict, message: str) -> None:
    cfg = json.loads((fixture_dir("qwen2-tiny") / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    with pytest.raises(ConfigError, match=r"config\.json: .*" + message.replace("(", r"\(")):
        config_from_hf(cfg)


def test_gguf_yarn_options_without_a_counterpart_are_refused() -> None:
    meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.yarn_ext_factor": 0.5}
    with pytest.raises(ConfigError, match="'qwen2.rope.scaling.yarn_ext_factor' = 0.5 is not supported"):
        rope_scaling_from_metadata(meta, "qwen2", 32)
    assert rope_scaling_from_metadata({"qwen2.rope.scaling.type": "none"}, "qwen2", 32) is None
    original = rope_scaling_from_metadata({**meta, "qwen2.rope.scaling.yarn_ext_factor": 1.0}, "qwen2", 32)
    assert original == RopeScaling("yarn", 4.0, 32)  # the original context defaults to the context length


@pytest.mark.peer
@pytest.mark.oracle
def test_llama_cpp_runs_our_yarn_gguf_like_us(yarn_model, tmp_path: Path) -> None:
    """llama.cpp reads our rope.scaling.* keys and its YaRN (ggml's ramp over angles, mscale inside the rotation)
    gives our logits within the fp32 bound of tests/interop (measured 8e-7 and 1.1e-6 of the largest logit)."""
    pytest.importorskip("llama_cpp")
    import llama_interop as li

    src, ids, expected, bound = yarn_model
    gguf = convert(src, tmp_path / "yarn.gguf", "gguf", "fp32").output
    ours = load_exact(gguf).logits(ids)[0]
    llm = li.LlamaModel(gguf, n_ctx=128)
    try:
        theirs = llm.logits(ids[0].tolist())
    finally:
        llm.close()
    assert np.abs(theirs - ours).max() / np.abs(ours).max() < 1e-3


def test_run_time_override_equals_the_config(tmp_path: Path) -> None:
    """``load(rope_scaling=...)`` (qwen-run/-serve/-eval's --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx N) on a
    model without rope_scaling runs as the same model with it in config.json, the file untouched, and the context
    window grows to factor x original; the flags make that RopeScaling and refuse half of one."""
    plain = scaled_copy("qwen2-tiny", tmp_path / "plain", rope_scaling=None)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["max_position_embeddings"] = 32
    (plain / "config.json").write_text(json.dumps(cfg))
    scaled = load_exact(scaled_copy("qwen2-tiny", tmp_path / "scaled"))
    p = argparse.ArgumentParser()
    add_rope_scaling_options(p)
    override = rope_scaling_arg(p.parse_args(["--rope-scaling", "yarn", "--rope-scale", "4"]))
    model = load_exact(plain, rope_scaling=override)
    assert model.config.rope_scaling == scaled.config.rope_scaling == RopeScaling("yarn", 4.0, 32)
    assert model.config.context_window == 128 and load_exact(plain).config.context_window == 32
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, PROMPT))
    np.testing.assert_array_equal(model.logits(ids), scaled.logits(ids))
    check_prompt_fits(model, [list(range(100))], 28)
    with pytest.raises(ContextOverflowError):
        check_prompt_fits(load_exact(plain), [list(range(100))], 28)
    assert json.loads((plain / "config.json").read_text()) == cfg
    assert rope_scaling_arg(p.parse_args([])) is None
    for flags, message in ((["--rope-scale", "4"], "needs --rope-scaling"),
                           (["--rope-scaling", "yarn"], "needs --rope-scale"),
                           (["--rope-scaling", "linear", "--rope-scale", "0.5"], "factor must be")):
        with pytest.raises(UsageError, match=message):
            rope_scaling_arg(p.parse_args(flags))


def test_serve_and_eval_take_the_override_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """qwen-serve (create_app) and qwen-eval take the same flags as qwen-run: a model of 32 positions served
    with yarn x4 admits the 128-token window, and qwen-eval scores 100-token windows, which without the flags it
    cuts to 32 with a note (and then refuses the stride of 50 as a usage error)."""
    from qwen_runtime.eval_cli import main as eval_main

    plain = scaled_copy("qwen2-tiny", tmp_path / "plain", rope_scaling=None)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["max_position_embeddings"] = 32
    (plain / "config.json").write_text(json.dumps(cfg))
    pytest.importorskip("starlette")
    from qwen_serve import create_app

    app = create_app(plain, rope_scaling=RopeScaling("yarn", 4.0, 32), max_memory=1 << 30)
    assert app.state.server.engine.context == 128
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 60)
    argv = [str(plain), "-f", str(text), "--ctx", "100", "--stride", "50"]
    assert eval_main([*argv, "--rope-scaling", "yarn", "--rope-scale", "4"]) == 0
    captured = capsys.readouterr()
    assert "cut" not in captured.err and "100" in captured.out
    assert eval_main(argv) == 2
    assert "context length of 32; using 32" in capsys.readouterr().err
