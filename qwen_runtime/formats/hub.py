"""Model arguments by name: a local path, or a Hugging Face Hub id resolved through the local Hub cache.

    resolve_model("qwen2.5-0.5b-q8_0.gguf")                 an existing path always wins, returned as given
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")             the snapshot directory of a safetensors repo
    resolve_model("Qwen/Qwen3-0.6B@refs/pr/1")              the same at a revision (branch, tag or commit)
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") the GGUF file of that type (first part when split)

Resolution goes through ``huggingface_hub`` (the optional ``hub`` extra): the cached snapshot of the revision
is used when it holds every file the tools need, with no network; otherwise, unless ``HF_HUB_OFFLINE`` is set,
exactly those files are downloaded into the cache with the library's progress bars: ``config.json``, the
tokenizer files, ``generation_config.json`` and the safetensors shards the index lists; or the one GGUF file
(every part of a split one).  A GGUF type is picked as llama.cpp's ``-hf`` does: the tag followed by ``.`` or
``-`` in a file name, ``mmproj`` and ``imatrix`` files left out; without a tag a repo of GGUF files gives its
Q4_K_M, else its Q8_0, else its only model.  Unlike llama.cpp, a tag that matches two models is an error
listing them.  Every failure is a :class:`~qwen_runtime.errors.ModelNotFoundError` saying what was tried.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from ..errors import FormatError, ModelNotFoundError
from .base import TOKENIZER_FILES, contained_path
from .gguf_file import SPLIT_NAME, split_names
from .hf_dir import INDEX_NAME, SINGLE_NAME
from .safetensors import read_index

T = TypeVar("T")
HUB_EXTRA = "pip install 'qwen-numpy[hub]'"
CONFIG_NAME = "config.json"
# A safetensors repo's files every tool reads: a cached snapshot without them is incomplete (the other
# tokenizer files and generation_config.json are fetched when the repo has them).
REQUIRED = (CONFIG_NAME, TOKENIZER_FILES[0])
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when a GGUF repo is named without a tag
NOT_MODELS = ("mmproj", "imatrix")  # GGUF files of a repo that are not a language model
ID_SYNTAX = "ORG/NAME[:QUANT][@REVISION]"
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?(?:@(?P<revision>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ID_REVISION = re.compile(r"[\w./-]+")
# git's ref-name rules (git check-ref-format) as far as _ID's characters allow them to be broken: no empty
# component (leading, trailing or double "/"), none starting with "." (so no ".."), none ending in ".lock",
# no trailing "."; _ID itself leaves out "\\", spaces, control characters and "~^:?*[@{".
_BAD_REF = re.compile(r"^/|/$|//|(^|/)\.|\.lock(/|$)|\.$")


@dataclass(frozen=True)
class HubId:
    """``repo`` (``org/name``), an optional GGUF ``tag`` (``Q4_K_M``) and an optional ``revision``."""

    repo: str
    tag: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo + (f":{self.tag}" if self.tag else "") + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class GGUFModel:
    """One GGUF model of a repo: a single file, or the parts ``prefix-0000i-of-0000n.gguf`` of a split one."""

    first: str  # the file a reader opens (part 1)
    parts: tuple[str, ...]  # every file, in order

    def describe(self) -> str:
        return self.first if len(self.parts) == 1 else f"{self.first} ({len(self.parts)} parts)"


class _Incomplete(Exception):
    """The cached snapshot lacks files: the Hub may still have them."""


class _HubFailure(Exception):
    """The hub library failed (repo or revision not found, no network, ...); the message is its first line."""


def parse_hub_id(text: str) -> HubId | None:
    """The Hub id spelled by ``text`` (``ORG/NAME[:QUANT][@REVISION]``), or None when it spells none (a
    revision must be a branch or tag name by git's rules, or a commit: never a path, which would be read)."""
    match = _ID.fullmatch(text)
    if match is None or ".." in text or "--" in match["repo"]:
        return None
    revision = match["revision"]
    if revision is not None and not valid_revision(revision):
        return None
    return HubId(match["repo"], match["tag"], revision)


def valid_revision(revision: str) -> bool:
    """Whether ``revision`` is a 40-hex commit or a well-formed ref name (``main``, ``v1.0``, ``refs/pr/1``):
    it names a file under the cache's ``refs/``, so an absolute path or ``..`` would read any file."""
    return bool(_COMMIT.fullmatch(revision)) or (_ID_REVISION.fullmatch(revision) is not None
                                                  and _BAD_REF.search(revision) is None)


def resolve_model(model: str | Path) -> Path:
    """The local path of a model argument: ``model`` itself when it exists, else the files of the Hub id it
    spells (see the module docstring).  Raises :class:`ModelNotFoundError` naming what was tried."""
    path = Path(model)
    if path.exists():
        return path
    text = str(model)
    hub_id = parse_hub_id(text)
    if hub_id is None:
        match = _ID.fullmatch(text)
        revision = match["revision"] if match else None
        why = f"; {revision!r} is not a branch, tag or commit" if revision and not valid_revision(revision) else ""
        raise ModelNotFoundError(f"{text}: no such file or directory (nor a Hugging Face Hub id {ID_SYNTAX}{why})")
    tried = f"{text}: no such file or directory, and as a Hugging Face Hub id"
    hub = _import_hub(tried)
    reason = ""
    snapshot = _cached_snapshot(hub, hub_id)
    if snapshot is not None:
        try:
            return _select(hub_id, _cache_listing(snapshot), _cache_fetcher(snapshot))
        except _Incomplete as exc:
            reason = f"the cached snapshot {snapshot} {exc}"
        except FormatError as exc:
            reason = f"the cached snapshot {snapshot}: {exc}"
    if hub.constants.HF_HUB_OFFLINE:
        reason = reason or f"it is not in the Hub cache {hub.constants.HF_HUB_CACHE}"
        raise ModelNotFoundError(f"{tried} {hub_id}: {reason}, and HF_HUB_OFFLINE is set") from None
    try:
        _reach(hub, hub_id)
        files = _hub_call(hub.HfApi().list_repo_files, hub_id.repo, revision=hub_id.revision)
        return _select(hub_id, files, _download_fetcher(hub, hub_id))
    except (FormatError, _HubFailure) as exc:
        raise ModelNotFoundError(f"{tried} {hub_id}: {exc}") from None


def model_name(path: str | Path) -> str:
    """The name a model goes by: a file's stem, a Hub snapshot's repo name (``models--org--NAME/snapshots/
    <rev>``), else the directory's name."""
    p = Path(path).absolute()
    if p.is_file():
        return p.stem
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    return p.resolve().name


def _import_hub(tried: str) -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.constants
    except ImportError:
        raise ModelNotFoundError(f"{tried}: huggingface_hub is not installed (the hub extra: {HUB_EXTRA})") from None
    return huggingface_hub


def _hub_call(function: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``function(*args, **kwargs)`` of the hub library; whatever it raises (HTTP and network errors of its
    HTTP client, validation errors) becomes a :class:`_HubFailure` with the first line of its message (later
    lines carry request ids and help)."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        raise _HubFailure(f"{type(exc).__name__}: {lines[0] if lines else ''}") from None


def _reach(hub: ModuleType, hub_id: HubId) -> None:
    """One request for the repo's metadata, without the library's retries and with its metadata timeout
    (``HF_HUB_ETAG_TIMEOUT``): without network, the listing's retries would take half a minute and print a
    line each before failing; this fails at once, in one line saying how to use the cache alone."""
    try:
        hub.HfApi().model_info(hub_id.repo, revision=hub_id.revision, timeout=hub.constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        first = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        if getattr(exc, "response", None) is not None or isinstance(exc, ValueError):  # the Hub answered
            raise _HubFailure(first) from None
        raise _HubFailure(f"cannot reach the Hub ({first}); set HF_HUB_OFFLINE=1 to use only the Hub cache "
                          f"{hub.constants.HF_HUB_CACHE}") from None


def _cached_snapshot(hub: ModuleType, hub_id: HubId) -> Path | None:
    """The cached snapshot directory of the id's revision, read from the cache's documented layout:
    ``models--ORG--NAME/refs/<branch or tag>`` holds a commit, ``snapshots/<commit>/`` its files."""
    repo = Path(hub.constants.HF_HUB_CACHE) / ("models--" + hub_id.repo.replace("/", "--"))
    revision = hub_id.revision or hub.constants.DEFAULT_REVISION
    commit = revision
    if not _COMMIT.fullmatch(revision):
        try:
            commit = (repo / "refs" / revision).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
    snapshot = repo / "snapshots" / commit
    return snapshot if _COMMIT.fullmatch(commit) and snapshot.is_dir() else None


def _cache_listing(snapshot: Path) -> list[str]:
    """The files of a cached snapshot (``/``-separated, relative), dangling symlinks left out."""
    names = []
    for root, _, files in os.walk(snapshot):
        for name in files:
            full = Path(root, name)
            if full.is_file():
                names.append(full.relative_to(snapshot).as_posix())
    return sorted(names)


Fetcher = Callable[[Sequence[str], str | None], Path]  # (files, commit or None) -> the snapshot holding them


def _cache_fetcher(snapshot: Path) -> Fetcher:
    def fetch(names: Sequence[str], commit: str | None) -> Path:
        missing = [n for n in names if not (snapshot / n).is_file()]
        if missing:
            raise _Incomplete(f"lacks {', '.join(missing)}")
        return snapshot

    return fetch


def _download_fetcher(hub: ModuleType, hub_id: HubId) -> Fetcher:
    """Download exactly ``names`` (cached ones are not fetched again), at ``commit`` once one is known so
    that every file comes from the same commit; the first call records the branch in ``refs/``."""
    def fetch(names: Sequence[str], commit: str | None) -> Path:
        patterns = [glob.escape(n) for n in names]
        snapshot = Path(_hub_call(hub.snapshot_download, hub_id.repo, revision=commit or hub_id.revision,
                                  allow_patterns=patterns))
        missing = [n for n in names if not (snapshot / n).is_file()]
        if missing:
            raise FormatError(f"the repo at {snapshot.name} lacks {', '.join(missing)}")
        return snapshot

    return fetch


def _confined(fetch: Fetcher) -> Fetcher:
    """``fetch``, refusing (:class:`FormatError`) a file whose symlink leaves the snapshot, other than into the
    cache's own ``blobs/`` of the repo (:func:`~qwen_runtime.formats.base.contained_path`, as the readers confine
    safetensors shards): every file the resolver returns or the readers open, GGUF files included."""
    def fetch_confined(names: Sequence[str], commit: str | None) -> Path:
        snapshot = fetch(names, commit)
        for name in names:
            try:
                contained_path(snapshot, name, "file")
            except FormatError:
                raise FormatError(f"{name} leads outside the snapshot and the repo's blobs (to "
                                  f"{(snapshot / name).resolve()})") from None
        return snapshot

    return fetch_confined


def _select(hub_id: HubId, files: Sequence[str], fetch: Fetcher) -> Path:
    """The local path of what ``hub_id`` names among ``files`` (a repo's or a cached snapshot's)."""
    fetch = _confined(fetch)
    models = gguf_models(files)
    if hub_id.tag is not None:
        if not models:
            raise FormatError(f"{hub_id.repo} has no GGUF files, so no type {hub_id.tag} ({_has(files)})")
        chosen = choose_gguf(models, hub_id.tag)
    elif CONFIG_NAME in files and any(n.endswith(".safetensors") for n in files):
        return _fetch_hf_dir(files, fetch)
    elif models:
        chosen = _default_gguf(models)
    else:
        raise FormatError(f"{hub_id.repo} has neither {CONFIG_NAME} with safetensors weights nor GGUF files "
                          f"({_has(files)})")
    return fetch(chosen.parts, None) / chosen.first


def _fetch_hf_dir(files: Sequence[str], fetch: Fetcher) -> Path:
    """config, tokenizer files and the index (or single file) first, then the shards the index lists."""
    small = [n for n in (CONFIG_NAME, *TOKENIZER_FILES, INDEX_NAME, SINGLE_NAME) if n in files or n in REQUIRED]
    snapshot = fetch(small, None)
    if INDEX_NAME in files:
        shards = sorted(set(read_index(snapshot / INDEX_NAME).values()))
        for shard in shards:
            contained_path(snapshot, shard, f"{INDEX_NAME} shard")
    elif SINGLE_NAME in files:
        return snapshot
    else:  # what the reader falls back to: every top-level safetensors file
        shards = [n for n in files if n.endswith(".safetensors") and "/" not in n]
    return fetch(shards, snapshot.name)


def gguf_models(files: Sequence[str]) -> list[GGUFModel]:
    """The GGUF language models among a repo's files (split parts grouped; mmproj and imatrix files left out)."""
    models = []
    for name in sorted(files):
        base = name.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or any(word in base for word in NOT_MODELS):
            continue
        split = SPLIT_NAME.fullmatch(name)
        if split is None or int(split["index"]) == 1:  # a later part belongs to the first's model
            models.append(GGUFModel(name, tuple(split_names(name))))
    return models


def _matches(model: GGUFModel, tag: str) -> bool:
    """llama.cpp's rule (``TAG`` followed by ``.`` or ``-``, any case), with the tag starting a name part."""
    stem = tag[: -len(".gguf")] if tag.lower().endswith(".gguf") else tag
    return re.search(rf"(^|[-./]){re.escape(stem)}[-.]", model.first, re.IGNORECASE) is not None


def choose_gguf(models: Sequence[GGUFModel], tag: str) -> GGUFModel:
    """The one model of ``tag``; missing or ambiguous is a :class:`FormatError` listing the repo's models."""
    found = [m for m in models if _matches(m, tag)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise FormatError(f"no GGUF file of type {tag} among: {_describe(models)}")
    raise FormatError(f"type {tag} matches {len(found)} GGUF models: {_describe(found)}; give more of the file "
                      f"name after ':' (e.g. :{Path(found[0].first).name[: -len('.gguf')]})")


def _default_gguf(models: Sequence[GGUFModel]) -> GGUFModel:
    if len(models) == 1:
        return models[0]
    for tag in DEFAULT_TAGS:
        found = [m for m in models if _matches(m, tag)]
        if len(found) == 1:
            return found[0]
    raise FormatError(f"several GGUF models and no :QUANT to choose one among: {_describe(models)}")


def _describe(models: Sequence[GGUFModel]) -> str:
    return ", ".join(m.describe() for m in models)


def _has(files: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(files[:limit]) + (f", ... ({len(files)} files)" if len(files) > limit else "")
    return f"it has: {shown}" if files else "it has no files"
