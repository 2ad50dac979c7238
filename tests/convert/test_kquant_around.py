"""What surrounds the K-quant/IQ4 writers keeps working on their outputs: ``--verify`` and
``qwen-inspect --verify-against`` (the rounding twins of Q2_K..Q6_K, IQ4_NL, IQ4_XS), ``qwen-inspect --compare``,
batch conversion of mixes, npy directories of a mix, and ``--executor ray`` byte-identical to local.

The tiny fixtures have 64 columns, so every mix falls back to 32-value types on them; the model here has 256
columns (every K-quant and IQ4_XS) and a 640-column ffn_down (the fallbacks), so one file holds several types.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import write_qwen2

from qwen_convert.cli import convert_main, inspect_main
from qwen_convert.convert import convert
from qwen_convert.imatrix import write_imatrix
from qwen_convert.imatrix_collect import compute_imatrix
from qwen_convert.inspect import compare, compare_table, open_pair
from qwen_convert.policy import QuantOptions
from qwen_convert.verify import verify_against
from qwen_runtime.formats import open_model_files
from qwen_runtime.formats.gguf_parse import parse_gguf
from qwen_runtime.formats.tensors import QType

pytestmark = pytest.mark.slow  # K-quant conversions of a 256-wide model in nearly every test

K_TYPES = {QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS}
MIXES = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
PURE = {"q2_k": QType.Q2_K, "q3_k_m": QType.Q3_K, "q4_k_m": QType.Q4_K, "q5_k_m": QType.Q5_K, "q6_k": QType.Q6_K,
        "iq4_nl": QType.IQ4_NL, "iq4_xs": QType.IQ4_XS}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bf16 Qwen2, 256 columns (ffn_down 640: rows not a multiple of 256 take the mixes' fallback types)."""
    return write_qwen2(tmp_path_factory.mktemp("k") / "qwen2-k", hidden=256, inter=640, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def imatrix(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen-imatrix file of the model over a short text."""
    text = " ".join(f"def f{i}(x):\n    return x * {i} + 1" for i in range(40))
    path = tmp_path_factory.mktemp("imatrix") / "model.imatrix.gguf"
    write_imatrix(path, compute_imatrix(model, text, "calib", n_ctx=64))
    return path


def gguf_types(path: Path) -> Counter[QType]:
    return Counter(QType(t.qtype) for t in parse_gguf(path).tensors)


@pytest.mark.parametrize("mix", MIXES)
def test_every_mix_verifies_and_holds_several_types(model: Path, tmp_path: Path, mix: str) -> None:
    out = convert(model, tmp_path / f"{mix}.gguf", "gguf", mix).output
    types = gguf_types(out)
    assert len(types) >= 3 and set(types) & K_TYPES, types  # F32 norms, a K/IQ4 type, a fallback or bump
    report = verify_against(out, model, behaviour=False)
    assert report.ok, report.failures()


@pytest.mark.parametrize("mix", sorted(PURE))
def test_pure_types_verify_with_and_without_imatrix(model: Path, imatrix: Path, tmp_path: Path, mix: str) -> None:
    """The rounding twin of each type: llama.cpp's quantizers (and ours) re-round every value to the nearest
    point of the stored sub-block grid, with and without importance weights."""
    from qwen_convert.imatrix import load_importance

    for label, importance in (("plain", None), ("imatrix", load_importance(imatrix))):
        out = convert(model, tmp_path / f"{mix}-{label}.gguf", "gguf", mix, options=QuantOptions(pure=True),
                      importance=importance).output
        assert PURE[mix] in gguf_types(out)
        report = verify_against(out, model, behaviour=False)
        assert report.ok, (label, report.failures())


def test_scaled_k_quant_tensor_fails_verify(model: Path, tmp_path: Path) -> None:
    """A Q4_K tensor whose super-block scales are scaled by 1.25 is named (the bound is not loose)."""
    out = convert(model, tmp_path / "q4.gguf", "gguf", "q4_k_m", options=QuantOptions(pure=True)).output
    [info] = [t for t in parse_gguf(out).tensors if t.name == "blk.0.attn_q.weight"]
    assert QType(info.qtype) == QType.Q4_K
    data = np.memmap(out, dtype=np.uint8, mode="r+", offset=info.offset, shape=(info.nbytes,))
    d = data.reshape(-1, 144)[:, 0:2].copy().view(np.float16)  # [blocks, 1]: d of each super-block
    data.reshape(-1, 144)[:, 0:2] = (d * np.float16(1.25)).view(np.uint8)
    data.flush()
    del data
    report = verify_against(out, model, behaviour=False)
    assert not report.ok and any("blk.0.attn_q.weight" in f for f in report.failures())


def test_convert_cli_verify_and_inspect_verify_against_a_mix(capsys, model: Path, imatrix: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    assert convert_main([str(model), "-o", str(out), "--dtype", "q4_k_m", "--imatrix", str(imatrix),
                         "--verify"]) == 0
    assert "verified" in capsys.readouterr().out.lower()
    assert inspect_main([str(out), "--verify-against", str(model)]) == 0


def test_compare_table_of_a_mix(model: Path, tmp_path: Path) -> None:
    """Per-tensor error against the source: finite, ordered by bits (Q6_K < Q4_K < Q2_K rmse on the same
    tensor), and the table's type column holds six-letter names."""
    rmse: dict[str, float] = {}
    for mix in ("q2_k", "q4_k_m", "q6_k", "iq4_xs"):
        out = convert(model, tmp_path / f"{mix}.gguf", "gguf", mix, options=QuantOptions(pure=True)).output
        result = compare(*open_pair(model, out), r"attn_q\.weight")
        [row] = [r for r in result.tensors if r.name == "blk.0.attn_q.weight"]
        assert row.type_b == PURE[mix].name and np.isfinite(row.rmse) and 0.9 < row.cosine < 1
        rmse[mix] = row.rmse
        table = compare_table(result)
        header, first = table.splitlines()[:2]
        assert first.split()[3] == PURE[mix].name
        assert header.index("rmse") + 4 <= len(first) and first.index(PURE[mix].name) < header.index("rmse")
    assert rmse["q6_k"] < rmse["iq4_xs"] < rmse["q2_k"] and rmse["q6_k"] < rmse["q4_k_m"] < rmse["q2_k"]


def test_npy_directory_of_a_mix_verifies_and_loads_as_the_gguf(model: Path, tmp_path: Path) -> None:
    gguf = convert(model, tmp_path / "m.gguf", "gguf", "q4_k_m").output
    npy = convert(model, tmp_path / "m-npy", "npy", "q4_k_m").output
    report = verify_against(npy, model, behaviour=False)
    assert report.ok, report.failures()
    a, b = open_model_files(gguf), open_model_files(npy)
    assert {n: t.qtype for n, t in a.tensors.items()} == {n: t.qtype for n, t in b.tensors.items()}
    for name, tensor in a.tensors.items():
        assert np.array_equal(tensor.rows2d(), b.tensors[name].rows2d()), name


def test_batch_of_mixes_verifies_each_job(capsys, model: Path, tmp_path: Path) -> None:
    code = convert_main([str(model), "--output-dir", str(tmp_path / "out"), "--format", "gguf,npy",
                         "--dtype", "q4_k_m,q6_k,iq4_xs", "--verify"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("verified") == 6 and "failed" not in out
    single = convert(model, tmp_path / "single.gguf", "gguf", "q4_k_m").output
    assert (tmp_path / "out" / "qwen2-k-q4_k_m.gguf").read_bytes() == single.read_bytes()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1])
def test_weighted_32_value_blocks_are_recognised_and_faults_are_not(qtype: QType) -> None:
    """With importance weights the 32-value types keep their search's integers and store the weighted
    least-squares scale: values leave the nearest-grid bound (which is why the weighted twin exists), every
    block is recognised as a weighted search's, and blocks of another row or with the scale's sign flipped are
    not, nor (no minimum to absorb it) a doubled scale.  A scale off by 1.25 is not caught block by block: the
    weighted fit legitimately moves values by several steps (measured: up to 20 on heavy-tailed weights)."""
    from test_kquant_writers import varied_importance, varied_rows

    from qwen_convert.quantize import encode_rows
    from qwen_convert.verify import GRID_SLACK, weighted_search_blocks
    from qwen_runtime.quants import CODECS

    rng = np.random.default_rng(3)
    x = varied_rows(rng, 60, 256)
    gaussian = np.arange(60) % 10 == 0  # varied_rows' plain gaussian rows
    codec, beyond_nearest = CODECS[qtype], 0

    def scaled(raw: np.ndarray, factor: float) -> np.ndarray:
        out = raw.copy()
        blocks = out.reshape(-1, codec.type_size)
        blocks[:, 0:2] = (blocks[:, 0:2].copy().view("<f2") * np.float16(factor)).view(np.uint8)
        return out

    for kind in range(5):
        raw = encode_rows(x, qtype, varied_importance(rng, 256, kind))
        decoded = codec.reference(raw).reshape(x.shape).astype(np.float64)
        beyond_nearest += int((np.abs(decoded - x) > codec.rounding_bound(raw, x, GRID_SLACK)).sum())
        assert weighted_search_blocks(qtype, raw, x).all()
        assert not weighted_search_blocks(qtype, np.roll(raw[gaussian], 1, axis=0), x[gaussian]).any()
        assert not weighted_search_blocks(qtype, scaled(raw[gaussian], -1.0), x[gaussian]).any()
        if not codec.has_offset:
            assert not weighted_search_blocks(qtype, scaled(raw[gaussian], 2.0), x[gaussian]).any()
    assert beyond_nearest > 0


@pytest.mark.ray
def test_ray_batch_of_a_mix_is_byte_identical_to_local(capsys, model: Path, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="needs the ray extra (pip install -e '.[ray]')")
    from qwen_convert.batch import plan_jobs, run_batch
    from qwen_convert.ray_batch import run_batch_on_ray
    from qwen_convert.verify import BatchVerifier

    local = run_batch(plan_jobs([model], tmp_path / "local", ["gguf", "npy"], ["q4_k_m"]), verify=BatchVerifier())
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, configure_logging=False,
             log_to_driver=False)
    try:
        remote = run_batch_on_ray(plan_jobs([model], tmp_path / "ray", ["gguf", "npy"], ["q4_k_m"]),
                                  verify=BatchVerifier())
    finally:
        ray.shutdown()
    assert [r.status for r in local] == [r.status for r in remote] == ["verified"] * 2, remote

    def tree(directory: Path) -> dict[str, bytes]:
        return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}

    assert tree(tmp_path / "local") == tree(tmp_path / "ray")
