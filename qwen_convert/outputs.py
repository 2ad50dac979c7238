"""Where the tools write: checked before any work, written under a temporary name, replaced only when safe.

Every command that writes a model or an importance matrix (``qwen-convert``, its batches, ``qwen-imatrix``,
``qwen-demo``) goes through :func:`check_output` before it reads a tensor and through :func:`atomic_output`
to write.  ``--force`` is a promise about *our* files only: it replaces an output this project recognises as
its own kind (a GGUF file by its magic, an npy directory by its manifest and nothing but the files a converter
writes, or an empty directory), never a directory holding anything else, never an input of the same run
(paths resolved, symlinks followed), never the working directory, the home directory, the root or a folder
above an input.  Anything else is a one-line :class:`OutputExistsError` naming what is in the way: a user who
typed the wrong ``-o`` loses nothing.

The output is written under a temporary name beside the target (``.OUT.tmp-<pid>``, or ``.OUT.tmp-<tag>``
when the caller names the attempt) and renamed only once complete (and verified, when asked); on any error or
interrupt the temporary is removed and an existing output is left untouched.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gguf import GGUF_MAGIC

from qwen_runtime.errors import OutputError, OutputExistsError
from qwen_runtime.formats.base import TOKENIZER_FILES
from qwen_runtime.formats.npy_dir import FORMAT_NAME, MANIFEST_NAME, read_manifest

NPY_SIDE_FILES = frozenset((MANIFEST_NAME, "config.json", *TOKENIZER_FILES))  # what NpyDirWriter writes besides tensors


def remove_path(path: Path) -> None:
    """Delete a file or directory tree if it exists (only ever called on paths this project created or
    :func:`check_replaceable` accepted)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return int.from_bytes(f.read(4), "little") == GGUF_MAGIC
    except OSError:
        return False


def _foreign_entry(directory: Path) -> str | None:
    """The first entry of ``directory`` that no converter of ours wrote there (None: all ours, or empty)."""
    entries = sorted(os.listdir(directory))
    if not entries:
        return None
    if MANIFEST_NAME not in entries:
        return entries[0]
    try:
        manifest = read_manifest(directory)
    except (ValueError, OSError):
        return MANIFEST_NAME
    if manifest.get("format") != FORMAT_NAME:
        return MANIFEST_NAME
    ours = NPY_SIDE_FILES | {str(info.get("file")) for info in manifest["tensors"].values() if isinstance(info, dict)}
    for name in entries:
        entry = directory / name
        if name not in ours or entry.is_symlink() or not entry.is_file():
            return name
    return None


def check_replaceable(target: Path) -> None:
    """:class:`OutputExistsError` unless the existing ``target`` is an output ``--force`` may replace: a GGUF
    file, an empty directory, or an npy model directory holding only what a converter writes."""
    resolved = target.resolve()
    if resolved.is_dir():
        foreign = _foreign_entry(resolved)
        if foreign is not None:
            raise OutputExistsError(f"{target}: will not replace this folder: it holds {foreign!r}, which is not "
                                    f"part of an npy output of ours (choose another -o)")
    elif resolved.exists() and not _is_gguf_file(resolved):
        raise OutputExistsError(f"{target}: will not replace this file: it is not a GGUF file (choose another -o)")


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_not_input(target: Path, inputs: Iterable[str | Path]) -> None:
    """:class:`OutputExistsError` when ``target`` (resolved) is an input of this run, a folder above one, or
    the working directory, the home directory or the root, or a folder above the working directory."""
    resolved = target.resolve()
    for item in inputs:
        source = Path(item).resolve()
        if resolved == source:
            raise OutputExistsError(f"{target}: is an input of this run ({item}); choose another output")
        if _is_within(source, resolved):
            raise OutputExistsError(f"{target}: holds an input of this run ({item}); choose another output")
    if resolved in (Path.home().resolve(), Path(resolved.anchor)) or _is_within(Path.cwd().resolve(), resolved):
        raise OutputExistsError(f"{target}: will not write over the working, home or root directory; "
                                f"choose another output")


def check_output(target: Path, force: bool, inputs: Iterable[str | Path] = (), need_folder: bool = True) -> None:
    """Check ``target`` before any work: never an input (:func:`check_not_input`); an existing one only with
    ``force`` (else :class:`OutputExistsError`) and only when :func:`check_replaceable`; with ``need_folder``
    its folder must exist (:class:`OutputError`), so a run does not fail after hours of work."""
    check_not_input(target, inputs)
    if target.exists() or target.is_symlink():
        if not force:
            raise OutputExistsError(f"{target}: output already exists (use --force to overwrite)")
        check_replaceable(target)
    folder = target.absolute().parent
    if need_folder and not folder.is_dir():
        raise OutputError(f"{target}: cannot write: folder {folder} does not exist")


def _replace(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``; an existing directory is moved aside first and restored on failure."""
    if not (target.is_dir() and not target.is_symlink()):
        os.replace(tmp, target)
        return
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.replace(target, aside)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(aside, target)
        raise
    remove_path(aside)


def temp_path(target: Path, tag: str | None = None) -> Path:
    """The temporary path a write to ``target`` uses: ``.NAME.tmp-<tag>`` (default tag: the pid)."""
    return target.with_name(f".{target.name}.tmp-{tag or os.getpid()}")


@contextmanager
def atomic_output(target: Path, force: bool, tag: str | None = None,
                  inputs: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield a temporary path beside ``target`` (:func:`temp_path`); rename it to ``target`` when the block
    succeeds.  ``target`` is checked (:func:`check_output`) before and again right before the rename, since
    something may have appeared there meanwhile.  A leftover temporary of the same tag (an attempt that was
    killed) is removed first."""
    inputs = tuple(inputs)
    check_output(target, force, inputs)
    tmp = temp_path(target, tag)
    remove_path(tmp)
    try:
        yield tmp
        check_output(target, force, inputs)
        try:
            _replace(tmp, target)
        except OSError as exc:
            raise OutputError(f"{target}: cannot move the finished output into place ({exc.strerror})") from None
    except BaseException:
        remove_path(tmp)
        raise
