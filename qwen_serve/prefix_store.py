"""The prefix cache on disk (``--cache-dir``): blocks written as they are cached, read back when a server starts.

A restarted server with the same model files, kernels and cache layout starts with the blocks its predecessor
cached.  The directory holds one subdirectory per *identity*: a hash of every weight file's resolved path,
size and modification time, the tensor table (name, stored type, shape), the kernels, products and threads
(the rows of a product's tiles depend on them), the block size and the cache layout (each layer's arrays:
name, dtype, shape per row).  A server reads only its own identity's subdirectory, so another model's (or
another layout's) blocks are never used, and every file repeats the identity, which is checked too.

**Only its own files.**  The directory is the cache's only if it holds this module's ``CACHEDIR.TAG`` (the
cache-directory tag backup tools know, with a line of ours): a new or empty directory is tagged, and so is one
holding only an earlier version's cache (identity subdirectories of block files); any other is refused, so a
mistyped ``--cache-dir`` never costs a user's files.  Inside, the module reads, writes and deletes
only regular files named as it names them (``<64 hex>.npz`` blocks, ``.tmp-*`` files being written) in
identity subdirectories named as it names them; anything else is never touched, links are never followed (a
linked identity subdirectory is refused, a linked file ignored), and files of another user are ignored.  The
directory the user names may itself be a link: it is the user's choice, the tag is what is checked.  Files are
created 0600 and directories 0700 whatever the umask (blocks hold prompts' token ids).

**What a file must pass.**  One file per block, ``<key>.npz``, holds the block's tokens, its parent's key, its
arrays and a BLAKE2b checksum over the identity, the key, the parent key, the tokens and every array.  Before
anything is decompressed or allocated, the file's size, the zip's member names, their declared sizes (stored,
never compressed) and each array's npy header (dtype, shape) must be what a block of this layout is, so a
small file cannot make the server allocate more than one block.  Then the key must be the hash of the parent
key and the tokens, zip's CRCs and the checksum must match.  A file failing any check is skipped with a
warning and deleted (it is one of the module's own files); it never reaches a request.

**When it writes.**  Each block is written once, right after the engine caches it, by a writer thread of this
module (the engine thread only queues it: the block's arrays are copies nobody changes afterwards), to a
temporary file renamed into place, so readers see whole files or none; a crash loses at most the queued
blocks, where a snapshot at shutdown or every few minutes would lose everything since the last one, and a
shutdown does not have to write the whole cache at once.  Without fsync a power cut can leave a renamed but
empty or partial file: the checks above skip it.  Blocks restored by a request are touched (their
modification time is the on-disk recency).  The queue holds at most the budget's bytes (its blocks are mostly
the cache's own arrays, not copies): beyond that blocks are not written (the disk is far behind the prefill).

**Budget.**  An identity subdirectory holds at most ``capacity`` bytes of arrays (``--cache-memory``, the
in-memory bound), so everything on disk can be loaded at start; beyond it the least recently used block that no
stored block follows is deleted first, as in memory.  Servers sharing the directory share that budget: every
start and every write holds an exclusive ``flock`` on the tag and first rescans the subdirectory, so eviction
weighs every server's blocks (their recency is the files' modification times).  Other identities'
subdirectories are neither read, counted nor deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import stat
import threading
import time
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qwen_runtime.backend.cache import KVCache
from qwen_runtime.errors import OutputError
from qwen_runtime.models import Model

from .prefix_cache import ROOT, Block, block_key
from .slots import SlotCache

log = logging.getLogger("qwen_serve")

FORMAT = 2  # of the files; part of the identity (2: checksummed, bounded before reading)
SUFFIX = ".npz"
STALE_TMP_SECONDS = 600  # temporary files older than this are a dead writer's and are deleted at start
TAG = "CACHEDIR.TAG"
TAG_TEXT = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
            b"# This directory is a qwen-serve prefix cache (--cache-dir): qwen-serve reads, writes and deletes only\n"
            b"# its own files here.  About cache directory tags: https://bford.info/cachedir/\n")
BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.npz")
TMP_NAME = re.compile(r"\.tmp-[0-9]+-[0-9]+-[0-9a-f]{64}\.npz")
IDENTITY_NAME = re.compile(r"[0-9a-f]{32}")
HEADER_ROOM = 1024  # bytes an npy header may take (numpy writes 128 for a block's arrays)
META_ROOM = 4096  # bytes of a file's JSON header
ZIP_ROOM = 512  # bytes of zip headers per member (local, central, zip64 extras)
FILES, DIRECTORIES = 0o600, 0o700
CLAIM_WAIT = 1.0  # seconds to wait for a tag another server is writing


class CacheEntryError(ValueError):
    """A block file that cannot be used (truncated, corrupt, altered, another identity's, another layout's)."""


class ForeignFileError(OSError):
    """A file in the cache's directory this module did not write (a link, not a regular file, another user's):
    left alone, never read or deleted."""


def _open_directory(name: str, mode: int, dir_fd: int | None = None) -> int:
    """A directory's descriptor, the directory made (``DIRECTORIES``) if missing; a link is refused when
    ``dir_fd`` is given (inside the cache), followed otherwise (the directory the user named)."""
    nofollow = os.O_NOFOLLOW if dir_fd is not None else 0
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=dir_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and dir_fd is not None:
            raise ForeignFileError(exc.errno, "it is a symbolic link or not a directory (never followed)") from None
        raise
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise ForeignFileError(errno.EPERM, "it belongs to another user")
    return fd


def _close_directory(fd: int, mode: int) -> None:
    os.fchmod(fd, mode)
    os.close(fd)


def _earlier_cache(fd: int, names: list[str]) -> bool:
    """Whether an untagged directory holds only what an earlier version's cache wrote: identity subdirectories
    (not links) of block and temporary files.  Such a directory is tagged and used."""
    for name in names:
        if not IDENTITY_NAME.fullmatch(name):
            return False
        try:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            return False
        try:
            if not all(BLOCK_NAME.fullmatch(n) or TMP_NAME.fullmatch(n) for n in os.listdir(sub)):
                return False
        finally:
            os.close(sub)
    return True


def _claim(fd: int, directory: Path) -> None:
    """Check that ``directory`` (open as ``fd``) is a cache of ours, tagging it if it is empty; else refuse."""
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        try:
            tag = os.open(TAG, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except FileNotFoundError:
            text = None
        except OSError:
            text = b"?"  # a link or something unreadable: not our tag
        else:
            with os.fdopen(tag, "rb") as handle:
                text = handle.read(len(TAG_TEXT) + 1) if stat.S_ISREG(os.fstat(tag).st_mode) else b"?"
        if text == TAG_TEXT:
            return
        names = os.listdir(fd)
        if text is None and (not names or _earlier_cache(fd, names)):
            try:
                tag = os.open(TAG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILES, dir_fd=fd)
            except FileExistsError:
                continue  # another server is tagging it
            with os.fdopen(tag, "wb") as handle:
                os.fchmod(tag, FILES)
                handle.write(TAG_TEXT)
            os.fchmod(fd, DIRECTORIES)  # it is the cache's now
            for name in names:  # an earlier version's identity subdirectories were 0755
                _close_directory(_open_directory(name, DIRECTORIES, dir_fd=fd), DIRECTORIES)
            return
        if names == [TAG] and text == b"" and time.monotonic() < deadline:
            time.sleep(0.02)  # another server is writing the tag (in one write)
            continue
        raise OutputError(f"{directory} is not empty and is not a qwen-serve prefix cache (no {TAG} of ours): "
                          "give --cache-dir a new or empty directory")


def file_signature(path: str | Path) -> list[Any]:
    """A weight file's resolved path, size and modification time (ns): changes when the file is replaced."""
    resolved = Path(path).resolve()
    info = resolved.stat()
    return [str(resolved), info.st_size, info.st_mtime_ns]


def cache_layout(slots: SlotCache, block: int) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Per layer, the arrays one block stores: (name, dtype, shape); keys and values are ``block`` tokens long."""
    layout = []
    for layer in slots.layers:
        if isinstance(layer, KVCache):
            shape = (layer.keys.shape[1], block, layer.keys.shape[3])  # [kv_heads, block, head_dim]
            layout.append([("keys", layer.keys.dtype.str, shape), ("values", layer.values.dtype.str, shape)])
        else:
            layout.append([(name, value.dtype.str, value.shape[1:]) for name, value in vars(layer).items()
                           if isinstance(value, np.ndarray)])
    return layout


def identity(model: Model, slots: SlotCache, block: int) -> str:
    """The hex digest naming what a cached block's numbers depend on (see the module docstring)."""
    files = sorted({t.path for t in model.files.tensors.values()} | ({str(model.path)} if model.path.is_file()
                                                                       else set()))
    ws = model.workspace
    description = {
        "format": FORMAT, "block": block, "arch": model.config.arch,
        "files": [file_signature(f) for f in files],
        "tensors": sorted((name, t.qtype.name, list(t.shape)) for name, t in model.files.tensors.items()),
        "kernels": ws.kernels, "blas_products": bool(ws.blas_products),
        "threads": ws.threads,  # tiles of rows per thread: BLAS may sum a tile's edge differently
        "layout": cache_layout(slots, block),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=list).encode()).hexdigest()


@dataclass
class Entry:
    """A block file as the index knows it."""

    parent: bytes
    nbytes: int
    used: float  # modification time: the on-disk recency
    children: int = 0


class PrefixStore:
    """The blocks of one identity in ``directory/<identity[:32]>``, at most ``capacity`` bytes of arrays."""

    def __init__(self, directory: str | Path, model: Model, slots: SlotCache, block: int, capacity: int) -> None:
        self.slots, self.block, self.capacity = slots, block, capacity
        self.identity = identity(model, slots, block)
        self.layout = cache_layout(slots, block)
        directory = Path(directory).expanduser()
        self.root = directory / self.identity[:32]  # 128 bits: no collisions in practice
        # the data bytes each member of a block's file holds (meta: at most); a file is at most their sum and
        # the headers' room
        self.members: dict[str, tuple[str, tuple[int, ...] | None, int]] = {
            "meta.npy": ("|u1", None, META_ROOM), "tokens.npy": (np.dtype(np.int64).str, (block,), 8 * block)}
        for i, arrays in enumerate(self.layout):
            for name, dtype, shape in arrays:
                self.members[f"{i}.{name}.npy"] = (dtype, tuple(shape), np.dtype(dtype).itemsize * int(np.prod(shape)))
        self.block_bytes = sum(size for name, (_, _, size) in self.members.items() if name[0].isdigit())
        self.file_limit = sum(size + HEADER_ROOM + ZIP_ROOM for _, _, size in self.members.values()) + ZIP_ROOM
        self._tag = self._dir = -1
        where = directory
        try:
            directory.mkdir(DIRECTORIES, parents=True, exist_ok=True)  # the parents as the umask says
            top = _open_directory(str(directory), DIRECTORIES)
            try:
                _claim(top, directory)
                self._tag = os.open(TAG, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=top)
                where = self.root
                self._dir = _open_directory(self.root.name, DIRECTORIES, dir_fd=top)
                os.fchmod(self._dir, DIRECTORIES)
            finally:
                os.close(top)
        except ForeignFileError as exc:
            self._close_fds()
            raise OutputError(f"cannot use {where} as the prefix cache directory: {exc.strerror}") from None
        except OSError as exc:
            self._close_fds()
            raise OutputError(f"cannot use {directory} as the prefix cache directory: {exc.strerror or exc}") from None
        except OutputError:
            self._close_fds()
            raise
        self.index: dict[bytes, Entry] = {}
        self.nbytes = 0
        self.loaded = self.skipped = self.written = self.dropped = 0
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._pending = 0  # bytes of blocks queued, not yet written
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ignored: set[bytes] = set()  # files named as blocks that are not ours: warned about once

    def _close_fds(self) -> None:
        for fd in (self._tag, self._dir):
            if fd >= 0:
                os.close(fd)
        self._tag = self._dir = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the directory's lock (every server on it takes it to scan, write or evict)."""
        fcntl.flock(self._tag, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._tag, fcntl.LOCK_UN)

    # --- start: what is on disk ---------------------------------------------------------------------------

    @staticmethod
    def name(key: bytes) -> str:
        return f"{key.hex()}{SUFFIX}"

    def path(self, key: bytes) -> Path:
        return self.root / self.name(key)

    def load(self, room: int) -> list[Block]:
        """Read the stored blocks, most recently used chains first, up to ``room`` bytes: parents before children,
        each with its parent among them.  Unusable files are skipped (a warning) and deleted, and so are the
        blocks that follow them."""
        with self._locked():
            self._clear_stale_tmp()
            self._rescan()
            chosen: dict[bytes, int] = {}  # key -> depth (1: its parent is the root)
            size = 0
            for key in sorted(self.index, key=lambda k: self.index[k].used, reverse=True):
                chain = [k for k in self._ancestry(key) if k not in chosen]
                extra = sum(self.index[k].nbytes for k in chain)
                if size + extra <= room:
                    size += extra
                    for k in chain:  # root first
                        chosen[k] = chosen.get(self.index[k].parent, 0) + 1
            blocks: dict[bytes, Block] = {}
            for key in sorted(chosen, key=lambda k: (chosen[k], self.index[k].used)):  # parents first
                parent = self.index[key].parent
                if parent != ROOT and parent not in blocks:
                    continue  # its parent was unreadable after all (and is deleted)
                try:
                    blocks[key] = self._read(key)
                except ForeignFileError as exc:
                    self._ignore(key, exc)
                except Exception as exc:
                    self._skip(key, exc)
            self._drop_broken_chains()
        self.loaded = len(blocks)
        return list(blocks.values())

    def _rescan(self) -> None:
        """Bring the index up to the directory: blocks other servers wrote, touched or deleted (under the lock)."""
        seen: dict[bytes, float] = {}
        with os.scandir(self._dir) as entries:
            for entry in entries:
                if BLOCK_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    seen[bytes.fromhex(entry.name[:-len(SUFFIX)])] = entry.stat(follow_symlinks=False).st_mtime
        for key in [k for k in self.index if k not in seen]:
            self._forget(key)
        for key, used in seen.items():
            if key in self._ignored:
                continue
            entry = self.index.get(key)
            if entry is not None:
                entry.used = used
                continue
            try:
                parent = self._header(key)
            except ForeignFileError as exc:
                self._ignore(key, exc)
                continue
            except Exception as exc:  # whatever a damaged file does, it is skipped, never fatal
                self._skip(key, exc)
                continue
            self.index[key] = Entry(parent, self.block_bytes, used)
            self.nbytes += self.block_bytes
        self._drop_broken_chains()

    def _drop_broken_chains(self) -> None:
        """Delete blocks whose chain of parents is not all stored (they can never be restored); count children."""
        complete: dict[bytes, bool] = {ROOT: True}
        for key in list(self.index):
            path, seen, walk = [], set(), key  # follow parents to a known answer, a missing block or a loop
            while walk not in complete and walk in self.index and walk not in seen:
                path.append(walk)
                seen.add(walk)
                walk = self.index[walk].parent
            ok = complete.get(walk, False)
            for k in path:
                complete[k] = ok
            if not ok:
                for k in path:
                    self._delete(k)
                    log.warning("prefix cache: deleting %s: a block it follows is missing", self.path(k))
        for entry in self.index.values():
            entry.children = 0
        for entry in self.index.values():
            if entry.parent != ROOT:
                self.index[entry.parent].children += 1

    @contextlib.contextmanager
    def _archive(self, key: bytes) -> Iterator[zipfile.ZipFile]:
        """A block file open as a zip whose size and members (names, declared sizes, stored) are a block's:
        nothing in it is decompressed or read yet."""
        try:
            fd = os.open(self.name(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self._dir)
        except OSError as exc:
            raise ForeignFileError(exc.errno, f"not opened ({exc.strerror}): links are never followed") from None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ForeignFileError(errno.EPERM, "not a regular file of this user")
            if info.st_size > self.file_limit:
                raise CacheEntryError(f"it has {info.st_size} bytes, a block's file at most {self.file_limit}")
            with zipfile.ZipFile(handle) as archive:
                members = archive.infolist()
                names = [m.filename for m in members]
                if len(names) != len(set(names)) or set(names) != set(self.members):
                    raise CacheEntryError("its members are not a block's arrays")
                for member in members:
                    limit = self.members[member.filename][2] + HEADER_ROOM
                    if member.compress_type != zipfile.ZIP_STORED or member.flag_bits & 0x1:
                        raise CacheEntryError(f"its {member.filename} is compressed or encrypted")
                    if member.file_size > limit or member.compress_size != member.file_size:
                        raise CacheEntryError(f"its {member.filename} declares {member.file_size} bytes, "
                                              f"a block's holds at most {limit}")
                yield archive

    def _array(self, archive: zipfile.ZipFile, member: str) -> np.ndarray:
        """A member's array, its npy header checked against the layout before its data is read."""
        dtype, shape, size = self.members[member]
        with archive.open(member) as handle:
            version = np.lib.format.read_magic(handle)
            if version not in ((1, 0), (2, 0)):
                raise CacheEntryError(f"its {member} has npy version {version}")
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            got_shape, fortran, got_dtype = read_header(handle, max_header_size=HEADER_ROOM)
            fits = shape == got_shape if shape is not None else len(got_shape) == 1 and got_shape[0] <= size
            if fortran or got_dtype.str != dtype or not fits:
                raise CacheEntryError(f"its {member} is {got_dtype} {got_shape}, a block's is {np.dtype(dtype)} "
                                      f"{shape or f'(at most {size},)'}")
            size = got_dtype.itemsize * int(np.prod(got_shape))
            data = handle.read(size)
            if len(data) != size or handle.read(1):  # reading to the end checks zip's CRC
                raise CacheEntryError(f"its {member} does not hold {size} bytes")
        return np.frombuffer(data, got_dtype).reshape(got_shape)

    def _meta(self, archive: zipfile.ZipFile, key: bytes) -> dict[str, Any]:
        meta = json.loads(self._array(archive, "meta.npy").tobytes().decode())
        if meta.get("identity") != self.identity or meta.get("format") != FORMAT:
            raise CacheEntryError("written for another model, kernels, cache layout or format")
        if meta.get("key") != key.hex():
            raise CacheEntryError("its key does not match its file name")
        if meta.get("nbytes") != self.block_bytes:
            raise CacheEntryError(f"its header says {meta.get('nbytes')} bytes of arrays, a block has "
                                  f"{self.block_bytes}")
        parent = bytes.fromhex(meta["parent"])
        if parent != ROOT and len(parent) != len(key):
            raise CacheEntryError("its parent key is malformed")
        return meta

    def _header(self, key: bytes) -> bytes:
        """A file's parent key (only its small JSON header is read)."""
        with self._archive(key) as archive:
            return bytes.fromhex(self._meta(archive, key)["parent"])

    def _digest(self, key: bytes, parent: bytes, arrays: Iterable[tuple[str, np.ndarray]]) -> str:
        """The checksum a block's file carries: of the identity, the key, the parent and every array."""
        digest = hashlib.blake2b(digest_size=32, person=b"qwen-serve-block")
        for part in (self.identity.encode(), key, parent):
            digest.update(len(part).to_bytes(8, "little") + part)
        for name, value in arrays:
            digest.update(name.encode() + b"\0")
            digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
        return digest.hexdigest()

    def _read(self, key: bytes) -> Block:
        """The block stored for ``key``, every check of the module docstring passed."""
        with self._archive(key) as archive:
            meta = self._meta(archive, key)
            parent = bytes.fromhex(meta["parent"])
            arrays = {member[:-len(".npy")]: self._array(archive, member) for member in self.members
                      if member != "meta.npy"}
        tokens = arrays.pop("tokens")
        if block_key(parent, tokens) != key:
            raise CacheEntryError("its tokens do not hash to its key")
        if self._digest(key, parent, [("tokens", tokens), *arrays.items()]) != meta.get("checksum"):
            raise CacheEntryError("its checksum does not match its contents (altered or damaged)")
        kv, state = [], []
        for i, (names, layer) in enumerate(zip(self.layout, self.slots.layers, strict=True)):
            got = {name: arrays[f"{i}.{name}"] for name, _, _ in names}
            if isinstance(layer, KVCache):
                kv.append((got["keys"], got["values"]))
            else:
                state.append(got)
        return Block(parent, kv, state, self.block_bytes, key=key, tokens=tokens)

    def _ancestry(self, key: bytes) -> list[bytes]:
        """``key`` and its stored ancestors, root first."""
        chain = []
        while key != ROOT:
            chain.append(key)
            key = self.index[key].parent
        return chain[::-1]

    def _skip(self, key: bytes, exc: BaseException) -> None:
        """Delete an unusable block file (one of ours: its name and a regular file of this user)."""
        log.warning("prefix cache: skipping %s: %s", self.path(key), exc)
        self.skipped += 1
        self._delete(key)

    def _ignore(self, key: bytes, exc: ForeignFileError) -> None:
        log.warning("prefix cache: ignoring %s: %s", self.path(key), exc.strerror)
        self._ignored.add(key)
        self._forget(key)

    def _clear_stale_tmp(self) -> None:
        now = time.time()
        with os.scandir(self._dir) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if (TMP_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)
                            and now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS):
                        os.unlink(entry.name, dir_fd=self._dir)

    # --- while serving: the writer thread -----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._write_loop, name="qwen-serve-cache-writer", daemon=True)
        self._thread.start()

    def put(self, block: Block) -> None:
        """Queue a newly cached block for writing (on the engine thread: never waits)."""
        if self._thread is None:
            return
        with self._lock:
            if self._pending + block.nbytes > self.capacity:
                self.dropped += 1
                return
            self._pending += block.nbytes
        self._queue.put(("put", block))

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks just restored as recently used."""
        if self._thread is not None:
            self._queue.put(("touch", list(keys)))

    def close(self) -> None:
        """Write what is queued, then end the writer thread and let go of the directory."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._close_fds()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, value = item
            try:
                if kind == "put":
                    with self._locked():
                        self._write(value)
                else:
                    self._touch(value)
            except Exception:  # a full disk or a removed directory costs the cache, never a request
                log.exception("prefix cache: writing %s failed", self.root)
            finally:
                if kind == "put":
                    with self._lock:
                        self._pending -= value.nbytes

    def _write(self, block: Block) -> None:
        """Write ``block`` (under the lock), first evicting what the budget needs among every server's blocks."""
        self._rescan()
        if block.key in self.index or (block.parent != ROOT and block.parent not in self.index):
            return
        if block.nbytes > self.capacity or not self._evict(self.nbytes + block.nbytes - self.capacity, block.parent):
            return
        name = self.name(block.key)
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=self._dir, follow_symlinks=False)
            return  # something not ours has the name: left alone
        arrays = [("tokens", np.asarray(block.tokens, np.int64))]
        kv, state = iter(block.kv), iter(block.state)
        for i, (names, layer) in enumerate(zip(self.layout, self.slots.layers, strict=True)):
            values = dict(zip(("keys", "values"), next(kv), strict=True)) if isinstance(layer, KVCache) else next(state)
            arrays += [(f"{i}.{name}", values[name]) for name, _, _ in names]
        meta = json.dumps({"identity": self.identity, "key": block.key.hex(), "parent": block.parent.hex(),
                           "format": FORMAT, "nbytes": block.nbytes,
                           "checksum": self._digest(block.key, block.parent, arrays)}).encode()
        tmp = f".tmp-{os.getpid()}-{threading.get_ident()}-{name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILES, dir_fd=self._dir)
        try:
            with os.fdopen(fd, "wb") as handle:
                os.fchmod(fd, FILES)  # whatever the umask
                np.savez(handle, meta=np.frombuffer(meta, np.uint8), **dict(arrays))
            os.replace(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self._dir)
        self.index[block.key] = Entry(block.parent, block.nbytes, time.time())
        self.nbytes += block.nbytes
        if block.parent != ROOT:
            self.index[block.parent].children += 1
        self.written += 1

    def _touch(self, keys: Sequence[bytes]) -> None:
        now = time.time()
        for key in keys:
            entry = self.index.get(key)
            if entry is not None:
                entry.used = now
                with contextlib.suppress(OSError):
                    os.utime(self.name(key), dir_fd=self._dir, follow_symlinks=False)

    def _evict(self, need: int, keep: bytes) -> bool:
        """Delete at least ``need`` bytes of files, least recently used leaves first (never ``keep``)."""
        while need > 0:
            leaves = [k for k, e in self.index.items() if e.children == 0 and k != keep]
            if not leaves:
                return False
            victim = min(leaves, key=lambda k: self.index[k].used)
            need -= self.index[victim].nbytes
            self._delete(victim)
        return True

    def _delete(self, key: bytes) -> None:
        """Forget a block and delete its file (a regular file of this module's naming: links are never indexed)."""
        self._forget(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name(key), dir_fd=self._dir)

    def _forget(self, key: bytes) -> None:
        entry = self.index.pop(key, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        if entry.parent in self.index:
            self.index[entry.parent].children -= 1

    def status(self) -> dict[str, object]:
        return {"directory": str(self.root), "bytes": self.nbytes, "files": len(self.index), "loaded": self.loaded,
                "skipped": self.skipped, "written": self.written, "dropped": self.dropped}


__all__ = ["CacheEntryError", "PrefixStore", "cache_layout", "identity"]
