"""Models by Hub id: resolution through a Hugging Face cache laid out on disk by the test, offline.

The cache has huggingface_hub's real layout (``models--ORG--NAME/{blobs,refs,snapshots/<commit>}``, snapshot
files as relative symlinks to ``blobs/``) and the tiny fixtures as contents; ``HF_HUB_OFFLINE=1`` and
``HF_HUB_CACHE`` point the hub library at it.  Downloads are exercised with the library's two network calls
replaced by a fake Hub that serves a dict of files, to check which files are asked for.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from runtime_helpers import Converted

from qwen_convert.cli import convert_main, inspect_main
from qwen_convert.gguf_metadata import add_model_metadata, add_tokenizer_metadata
from qwen_convert.gguf_writer import StreamingGGUFWriter
from qwen_runtime import cli, eval_cli, load
from qwen_runtime.errors import FormatError, ModelNotFoundError
from qwen_runtime.formats.hub import HubId, model_name, parse_hub_id, resolve_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QWEN2 = FIXTURES / "qwen2-tiny"  # two shards and an index
QWEN3 = FIXTURES / "qwen3-tiny"  # one model.safetensors
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def fixture_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def add_snapshot(cache: Path, repo: str, files: dict[str, bytes], commit: str = COMMIT_A,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """One cached revision of ``repo``, as huggingface_hub writes it: content-addressed blobs, a snapshot of
    relative symlinks to them, and ``refs/<branch or tag>`` holding the commit."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """huggingface_hub, offline, with an empty cache under tmp_path (also the working directory, so that no
    ``org/name`` path exists by accident).  The library reads its settings at import: both are patched."""
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the hub extra")
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "cache", cache, raising=False)  # where the tests lay out repos
    return huggingface_hub


@pytest.fixture(scope="module")
def ggufs(converted: Converted) -> dict[str, bytes]:
    """qwen2-tiny converted to q8_0 and fp16 GGUF files (the contents of a GGUF repo)."""
    return {dtype: converted("qwen2-tiny", "gguf", dtype).read_bytes() for dtype in ("q8_0", "fp16")}


def gguf_repo(cache: Path, ggufs: dict[str, bytes], repo: str = "org/tiny-GGUF") -> Path:
    """A GGUF repo: Q8_0, F16, an unsloth-style UD-Q8_0, a Q4_0 split in two parts, an mmproj file, a README."""
    return add_snapshot(cache, repo, {
        "tiny-Q8_0.gguf": ggufs["q8_0"],
        "tiny-F16.gguf": ggufs["fp16"],
        "tiny-UD-Q8_0.gguf": ggufs["q8_0"] + b"ud",
        "Q4_0/tiny-Q4_0-00001-of-00002.gguf": b"GGUF part 1",
        "Q4_0/tiny-Q4_0-00002-of-00002.gguf": b"GGUF part 2",
        "mmproj-tiny-Q8_0.gguf": b"GGUF projector",
        "README.md": b"# tiny\n",
    })


# -- ids ------------------------------------------------------------------------------------------------------

def test_parse_hub_id() -> None:
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B")
    spec = "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M@refs/pr/3"
    assert parse_hub_id(spec) == HubId("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M", "refs/pr/3")
    assert str(parse_hub_id(spec)) == spec
    for not_an_id in ("model.gguf", "/abs/org/name", "./org/name", "a/b/c", "org/name@../../x", "org/na--me",
                      "org/name@", "org/name:", ""):
        assert parse_hub_id(not_an_id) is None, not_an_id


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release-2024_01", COMMIT_A])
def test_branch_tag_and_commit_names_are_revisions(revision: str) -> None:
    assert parse_hub_id(f"org/name@{revision}") == HubId("org/name", None, revision)


@pytest.mark.parametrize("revision", ["/etc/passwd", "/abs/refs/main", "a//b", "a/", ".hidden", "refs/.x", "x.lock",
                                      "refs/x.lock/y", "v1.", "a/../b"])
def test_revisions_that_are_no_ref_names_are_refused(hub, revision: str) -> None:
    assert parse_hub_id(f"org/name@{revision}") is None
    with pytest.raises(ModelNotFoundError, match=r"nor a Hugging Face Hub id"):
        resolve_model(f"org/name@{revision}")


def test_an_absolute_revision_never_reads_a_file_outside_refs(hub, tmp_path: Path) -> None:
    """``org/name@/ABS/file`` read ``/ABS/file`` as the ref (``refs / "/ABS/file"`` is the absolute path) and
    served the snapshot of the commit written in it."""
    add_snapshot(hub.cache, "org/qwen2-tiny", fixture_files(QWEN2), COMMIT_A, refs=())
    planted = tmp_path / "planted-ref"
    planted.write_text(COMMIT_A)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(f"org/qwen2-tiny@{planted}")
    assert str(info.value) == (f"org/qwen2-tiny@{planted}: no such file or directory (nor a Hugging Face Hub id "
                               f"ORG/NAME[:QUANT][@REVISION]; {str(planted)!r} is not a branch, tag or commit)")


def test_not_a_path_nor_an_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"a/b/c: no such file or directory \(nor a Hugging Face Hub id"):
        resolve_model("a/b/c")
    assert cli.main(["missing.gguf", "-p", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "qwen-run: error: missing.gguf: no such file or directory (nor a Hugging Face Hub id "
        "ORG/NAME[:QUANT][@REVISION])"]


def test_missing_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # ``import huggingface_hub`` raises ImportError
    with pytest.raises(ModelNotFoundError, match=r"pip install 'qwen-numpy\[hub\]'"):
        resolve_model("Qwen/Qwen3-0.6B")
    assert cli.main(["Qwen/Qwen3-0.6B", "-p", "x"]) == 2  # README's exit code of a missing model file
    assert capsys.readouterr().err.strip().splitlines() == [
        "qwen-run: error: Qwen/Qwen3-0.6B: no such file or directory, and as a Hugging Face Hub id: "
        "huggingface_hub is not installed (the hub extra: pip install 'qwen-numpy[hub]')"]


# -- safetensors repos ----------------------------------------------------------------------------------------

def test_cached_repo_resolves_to_its_snapshot(hub) -> None:
    snapshot = add_snapshot(hub.cache, "org/qwen2-tiny", fixture_files(QWEN2))
    assert resolve_model("org/qwen2-tiny") == snapshot
    assert model_name(snapshot) == "qwen2-tiny"
    ids = [[1, 2, 3, 4]]
    np.testing.assert_array_equal(load("org/qwen2-tiny").logits(ids), load(QWEN2).logits(ids))


def test_revision_branch_tag_and_commit(hub) -> None:
    main = add_snapshot(hub.cache, "org/tiny", fixture_files(QWEN2), COMMIT_A, refs=("main",))
    tagged = add_snapshot(hub.cache, "org/tiny", fixture_files(QWEN3), COMMIT_B, refs=("v1", "refs/pr/1"))
    assert resolve_model("org/tiny") == main
    assert resolve_model("org/tiny@main") == main
    assert resolve_model("org/tiny@v1") == tagged
    assert resolve_model("org/tiny@refs/pr/1") == tagged
    assert resolve_model(f"org/tiny@{COMMIT_A}") == main
    assert load("org/tiny@v1").config.arch == load(QWEN3).config.arch
    with pytest.raises(ModelNotFoundError, match=r"org/tiny@v2: no such file or directory, and as a Hugging "
                       r"Face Hub id org/tiny@v2: it is not in the Hub cache .*, and HF_HUB_OFFLINE is set"):
        resolve_model("org/tiny@v2")


@pytest.mark.parametrize("missing", ["model-00002-of-00002.safetensors", "tokenizer.json"])
def test_incomplete_snapshot_names_the_missing_file(hub, missing: str) -> None:
    files = fixture_files(QWEN2)
    del files[missing]
    add_snapshot(hub.cache, "org/qwen2-tiny", files)
    with pytest.raises(ModelNotFoundError, match=rf"the cached snapshot .*/snapshots/{COMMIT_A} lacks {missing}, "
                       r"and HF_HUB_OFFLINE is set"):
        resolve_model("org/qwen2-tiny")


def test_an_existing_path_beats_an_id_of_the_same_spelling(hub) -> None:
    add_snapshot(hub.cache, "org/qwen2-tiny", fixture_files(QWEN2))
    shutil.copytree(QWEN3, "org/qwen2-tiny")  # a local directory spelled like the id, holding another model
    assert resolve_model("org/qwen2-tiny") == Path("org/qwen2-tiny")
    assert load("org/qwen2-tiny").config.arch == load(QWEN3).config.arch


@pytest.mark.slow
def test_conversion_from_an_id_equals_the_one_from_the_path(hub, tmp_path: Path, capsys) -> None:
    add_snapshot(hub.cache, "org/qwen2-tiny", fixture_files(QWEN2))
    for source, out in (("org/qwen2-tiny", "from-id"), (str(QWEN2), "from-path")):
        assert convert_main([source, "-o", f"{out}.gguf", "--dtype", "q8_0", "--verify"]) == 0
        assert convert_main([source, "--out-dir", out, "--format", "gguf,npy", "--dtype", "fp16"]) == 0
    assert Path("from-id.gguf").read_bytes() == Path("from-path.gguf").read_bytes()
    # batch outputs are named after the repo, not the snapshot's commit
    assert Path("from-id/qwen2-tiny-fp16.gguf").read_bytes() == Path("from-path/qwen2-tiny-fp16.gguf").read_bytes()
    npy_files = sorted(p.name for p in Path("from-path/qwen2-tiny-fp16").iterdir())
    assert npy_files == sorted(p.name for p in Path("from-id/qwen2-tiny-fp16").iterdir())
    for name in npy_files:
        if name != "manifest.json":  # it records the source path
            assert Path("from-id/qwen2-tiny-fp16", name).read_bytes() == \
                Path("from-path/qwen2-tiny-fp16", name).read_bytes(), name
    capsys.readouterr()
    assert inspect_main(["org/qwen2-tiny", "--compare", "from-id.gguf", "--json"]) == 0
    assert inspect_main(["from-id.gguf", "--verify-against", "org/qwen2-tiny"]) == 0


def test_run_eval_and_serve_take_an_id(hub, tmp_path: Path, capsys) -> None:
    add_snapshot(hub.cache, "org/qwen2-tiny", fixture_files(QWEN2))
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 8, encoding="utf-8")
    generated, scores = [], []
    for model in ("org/qwen2-tiny", str(QWEN2)):
        assert cli.main([model, "-p", "hello", "--max-new-tokens", "4"]) == 0
        generated.append(capsys.readouterr().out)
        assert eval_cli.main([model, "-f", str(text), "--ctx", "16", "--json"]) == 0
        [result] = json.loads(capsys.readouterr().out)["results"]
        scores.append((result["scored"], result["nll"]))
    assert generated[0] == generated[1] and scores[0] == scores[1]
    pytest.importorskip("starlette", reason="qwen-serve needs the serve extra")
    from qwen_serve import create_app

    assert create_app("org/qwen2-tiny").state.server.model_name == "qwen2-tiny"  # the repo's name


# -- GGUF repos -----------------------------------------------------------------------------------------------

def test_quant_picks_the_file_of_that_type(hub, ggufs) -> None:
    snapshot = gguf_repo(hub.cache, ggufs)
    assert resolve_model("org/tiny-GGUF:F16") == snapshot / "tiny-F16.gguf"
    assert resolve_model("org/tiny-GGUF:f16") == snapshot / "tiny-F16.gguf"  # any case, as llama.cpp
    assert resolve_model("org/tiny-GGUF:UD-Q8_0") == snapshot / "tiny-UD-Q8_0.gguf"
    assert resolve_model("org/tiny-GGUF:tiny-Q8_0") == snapshot / "tiny-Q8_0.gguf"
    assert resolve_model("org/tiny-GGUF:tiny-Q8_0.gguf") == snapshot / "tiny-Q8_0.gguf"
    assert resolve_model("org/tiny-GGUF:Q4_0") == snapshot / "Q4_0/tiny-Q4_0-00001-of-00002.gguf"
    ids = [[5, 6, 7]]
    gguf_model = load("org/tiny-GGUF:F16")
    assert gguf_model.files.format == "gguf"
    np.testing.assert_array_equal(gguf_model.logits(ids), load(snapshot / "tiny-F16.gguf").logits(ids))


def test_missing_quant_lists_what_the_repo_has(hub, ggufs) -> None:
    gguf_repo(hub.cache, ggufs)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/tiny-GGUF:Q6_K")
    message = str(info.value)
    assert "no GGUF file of type Q6_K among: Q4_0/tiny-Q4_0-00001-of-00002.gguf (2 parts), tiny-F16.gguf, " \
           "tiny-Q8_0.gguf, tiny-UD-Q8_0.gguf" in message
    assert "mmproj" not in message and message.endswith("and HF_HUB_OFFLINE is set")
    assert message.startswith("org/tiny-GGUF:Q6_K: no such file or directory, and as a Hugging Face Hub id")


def test_ambiguous_quant_lists_the_candidates(hub, ggufs) -> None:
    gguf_repo(hub.cache, ggufs)
    with pytest.raises(ModelNotFoundError, match=r"type Q8_0 matches 2 GGUF models: tiny-Q8_0.gguf, "
                       r"tiny-UD-Q8_0.gguf; give more of the file name after ':'"):
        resolve_model("org/tiny-GGUF:Q8_0")


def test_split_gguf_needs_every_part(hub) -> None:
    add_snapshot(hub.cache, "org/split-GGUF", {"m-Q4_0-00001-of-00003.gguf": b"1", "m-Q4_0-00003-of-00003.gguf": b"3"})
    with pytest.raises(ModelNotFoundError, match=r"lacks m-Q4_0-00002-of-00003.gguf, and HF_HUB_OFFLINE"):
        resolve_model("org/split-GGUF:Q4_0")


def test_gguf_repo_without_quant(hub, ggufs) -> None:
    one = add_snapshot(hub.cache, "org/one-GGUF", {"tiny-F16.gguf": ggufs["fp16"], "mmproj-F16.gguf": b"x"})
    assert resolve_model("org/one-GGUF") == one / "tiny-F16.gguf"  # the only model
    two = add_snapshot(hub.cache, "org/two-GGUF", {"tiny-F16.gguf": ggufs["fp16"], "tiny-Q8_0.gguf": ggufs["q8_0"]})
    assert resolve_model("org/two-GGUF") == two / "tiny-Q8_0.gguf"  # llama.cpp's default: Q4_K_M, else Q8_0
    add_snapshot(hub.cache, "org/many-GGUF", {"tiny-F16.gguf": b"1", "tiny-BF16.gguf": b"2"})
    with pytest.raises(ModelNotFoundError, match=r"several GGUF models and no :QUANT to choose one among: "
                       r"tiny-BF16.gguf, tiny-F16.gguf"):
        resolve_model("org/many-GGUF")


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_snapshot_link_leading_outside_is_refused(hub, ggufs, tmp_path: Path, kind: str) -> None:
    """A snapshot file whose symlink points outside the snapshot and the repo's blobs is refused, GGUF files as
    safetensors shards (a GGUF symlink was followed wherever it pointed)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if kind == "gguf":
        snapshot = add_snapshot(hub.cache, "org/linked-GGUF", {"tiny-F16.gguf": ggufs["fp16"]})
        (outside / "secret.gguf").write_bytes(ggufs["q8_0"])
        (snapshot / "tiny-Q8_0.gguf").symlink_to(outside / "secret.gguf")
        spec, name = "org/linked-GGUF:Q8_0", "tiny-Q8_0.gguf"
        assert resolve_model("org/linked-GGUF:F16") == snapshot / "tiny-F16.gguf"  # blob links stay allowed
    else:
        files = fixture_files(QWEN3)
        (outside / "tokenizer.json").write_bytes(files.pop("tokenizer.json"))
        snapshot = add_snapshot(hub.cache, "org/linked", files)
        (snapshot / "tokenizer.json").symlink_to(outside / "tokenizer.json")
        spec, name = "org/linked", "tokenizer.json"
    with pytest.raises(ModelNotFoundError, match=rf"{name} leads outside the snapshot and the repo's blobs \(to "
                       rf"{outside}/.*\), and HF_HUB_OFFLINE is set"):
        resolve_model(spec)


def test_quant_of_a_safetensors_repo(hub) -> None:
    add_snapshot(hub.cache, "org/qwen3-tiny", fixture_files(QWEN3))
    with pytest.raises(ModelNotFoundError, match=r"org/qwen3-tiny has no GGUF files, so no type Q8_0 \(it has: "
                       r"config.json, generation_config.json, model.safetensors"):
        resolve_model("org/qwen3-tiny:Q8_0")


def write_split_gguf(single: Path, first: Path, tensors_per_part: int) -> list[Path]:
    """The tensors of ``single`` (our fp16 GGUF of qwen2-tiny) re-written by gguf's own writer as a split GGUF
    (llama.cpp's gguf-split layout: ``split.*`` keys in every part, the model's metadata in the first)."""
    model = load(single)
    writer = StreamingGGUFWriter(first, model.config.arch, split_max_tensors=tensors_per_part)
    add_model_metadata(writer, model.config, "fp16", "qwen2-tiny")
    add_tokenizer_metadata(writer, QWEN2, model.config)
    for name, tensor in model.files.tensors.items():
        writer.add_tensor(name, np.asarray(tensor.data), raw_dtype=GGMLQuantizationType[tensor.qtype.name])
    paths = writer.format_shard_names(first)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return paths


def test_split_gguf_reads_as_one_model(hub, ggufs, tmp_path: Path) -> None:
    single = tmp_path / "single.gguf"
    single.write_bytes(ggufs["fp16"])
    parts = write_split_gguf(single, tmp_path / "tiny-F16.gguf", tensors_per_part=10)
    assert len(parts) > 2 and parts[0].name == f"tiny-F16-00001-of-{len(parts):05d}.gguf"
    ids = [[3, 1, 4, 1, 5]]
    expected = load(single).logits(ids)
    np.testing.assert_array_equal(load(parts[0]).logits(ids), expected)
    snapshot = add_snapshot(hub.cache, "org/split-GGUF", {f"F16/{p.name}": p.read_bytes() for p in parts})
    assert resolve_model("org/split-GGUF:F16") == snapshot / "F16" / parts[0].name
    np.testing.assert_array_equal(load("org/split-GGUF:F16").logits(ids), expected)
    assert inspect_main([str(parts[0]), "--verify-against", str(QWEN2)]) == 0
    with pytest.raises(FormatError, match=r"open the first part"):
        load(parts[1])
    parts[-1].unlink()
    with pytest.raises(FormatError, match=rf"{parts[-1].name}: part {len(parts)} of {len(parts)} of the split "
                       rf"GGUF {parts[0].name} is missing"):
        load(parts[0])


# -- downloads (the hub library's network calls replaced by a fake Hub) -------------------------------------

class FakeHub:
    """Serves ``files`` at one commit the way the hub library would: ``list_repo_files`` lists them and
    ``snapshot_download(allow_patterns=...)`` writes the matching ones into the cache, recording each call."""

    def __init__(self, hub, repo: str, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
        self.cache, self.repo, self.files = hub.cache, repo, files
        self.calls: list[tuple[str | None, list[str]]] = []
        monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hub.HfApi, "list_repo_files", self.list_repo_files)
        monkeypatch.setattr(hub.HfApi, "model_info", self.model_info)
        monkeypatch.setattr(hub, "snapshot_download", self.snapshot_download)

    def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
        assert repo_id == self.repo
        return sorted(self.files)

    def model_info(self, repo_id: str, revision: str | None = None, timeout: float | None = None) -> None:
        assert repo_id == self.repo and timeout is not None

    def snapshot_download(self, repo_id: str, revision: str | None = None,
                          allow_patterns: list[str] | None = None) -> str:
        assert repo_id == self.repo and allow_patterns is not None
        chosen = {n for n in self.files if any(fnmatch.fnmatch(n, p) for p in allow_patterns)}
        self.calls.append((revision, sorted(chosen)))
        return str(add_snapshot(self.cache, repo_id, {n: self.files[n] for n in chosen}, COMMIT_A))


def fetched(fake: FakeHub) -> list[str]:
    return sorted(n for _, names in fake.calls for n in names)


def test_download_fetches_only_what_the_tools_read(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {**fixture_files(QWEN2), "README.md": b"#", "model-extra.safetensors": b"{}", "onnx/model.onnx": b"",
             "vocab.json": b"{}", "chat_template.jinja": b"{{ messages }}"}
    fake = FakeHub(hub, "org/qwen2-tiny", files, monkeypatch)
    snapshot = resolve_model("org/qwen2-tiny")
    assert fake.calls[0] == (None, ["chat_template.jinja", "config.json", "generation_config.json",
                                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"])
    assert fake.calls[1] == (COMMIT_A, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert len(fake.calls) == 2 and snapshot.name == COMMIT_A
    assert resolve_model("org/qwen2-tiny") == snapshot and len(fake.calls) == 2  # now cached: no call


def test_download_of_a_split_gguf_fetches_its_parts(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = {f"big-Q4_K_M-0000{i}-of-00003.gguf": b"GGUF" for i in (1, 2, 3)}
    fake = FakeHub(hub, "org/big-GGUF", {**parts, "big-Q8_0.gguf": b"GGUF", "mmproj-big-F16.gguf": b""},
                   monkeypatch)
    first = resolve_model("org/big-GGUF")  # no tag: Q4_K_M first, as llama.cpp
    assert first.name == "big-Q4_K_M-00001-of-00003.gguf" and fetched(fake) == sorted(parts)
    assert resolve_model("org/big-GGUF:q4_k_m") == first and len(fake.calls) == 1  # cached now
    assert resolve_model("org/big-GGUF:Q8_0").name == "big-Q8_0.gguf" and fake.calls[-1] == (None, ["big-Q8_0.gguf"])


def test_download_names_what_the_repo_lacks(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    files = fixture_files(QWEN2)
    del files["model-00002-of-00002.safetensors"]
    FakeHub(hub, "org/broken", files, monkeypatch)
    with pytest.raises(ModelNotFoundError, match=rf"the repo at {COMMIT_A} lacks model-00002-of-00002.safetensors"):
        resolve_model("org/broken")


def test_hub_errors_become_one_line(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(self, repo_id: str, revision: str | None = None) -> list[str]:
        raise ValueError("Repository Not Found for url: https://huggingface.co/api/models/org/x\nRequest id: 1")

    FakeHub(hub, "org/x", {}, monkeypatch)
    monkeypatch.setattr(hub.HfApi, "list_repo_files", missing)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/x")
    assert str(info.value) == ("org/x: no such file or directory, and as a Hugging Face Hub id org/x: "
                               "ValueError: Repository Not Found for url: https://huggingface.co/api/models/org/x")


def test_without_network_one_quick_attempt_then_one_line(hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network and no HF_HUB_OFFLINE: one request with the library's metadata timeout, then a line saying
    how to use the cache alone; the listing, whose retries took 24 s and printed six lines, is not tried."""
    asked: list[float | None] = []

    def unreachable(self, repo_id: str, revision: str | None = None, timeout: float | None = None) -> None:
        asked.append(timeout)
        raise ConnectionError("Failed to resolve 'huggingface.co'\nRequest id: 123")

    def never(self, repo_id: str, revision: str | None = None) -> list[str]:
        raise AssertionError("listed the repo without network")

    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(hub.HfApi, "list_repo_files", never)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("org/x")
    assert str(info.value) == ("org/x: no such file or directory, and as a Hugging Face Hub id org/x: cannot reach "
                               "the Hub (ConnectionError: Failed to resolve 'huggingface.co'); set HF_HUB_OFFLINE=1 "
                               f"to use only the Hub cache {hub.cache}")
    assert asked == [hub.constants.HF_HUB_ETAG_TIMEOUT]


def test_resolver_is_callable_from_any_tool() -> None:
    resolver: Callable[[str], Path] = resolve_model
    assert resolver(str(QWEN2)) == QWEN2  # an existing path is returned as given, without huggingface_hub
