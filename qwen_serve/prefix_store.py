"""The prefix cache on disk (``--cache-dir``): blocks written as they are cached, read back when a server starts.

A restarted server with the same model files, kernels and cache layout starts with the blocks its predecessor
cached.  The directory holds one subdirectory per *identity*: a hash of every weight file's resolved path,
size and modification time, the tensor table (name, stored type, shape), the kernels, products and threads
(the rows of a product's tiles depend on them), the block size and the cache layout (each layer's arrays:
name, dtype, shape per row).  A server reads only its own identity's subdirectory, so another model's (or
another layout's) blocks are never used, and every file repeats the identity, which is checked too.  One
file per block, ``<key>.npz``, holds the block's tokens, its parent's key and its arrays; it is accepted only
if the key is the hash of the parent key and the tokens, the arrays have exactly the layout's names, dtypes
and shapes, and zip's CRC of every array checks.  Anything else (a truncated or corrupt file, a foreign one)
is skipped with a warning and deleted; it never reaches a request.

**When it writes.**  Each block is written once, right after the engine caches it, by a writer thread of this
module (the engine thread only queues it: the block's arrays are copies nobody changes afterwards), to a
temporary file renamed into place, so readers see whole files or none; a crash loses at most the queued
blocks, where a snapshot at shutdown or every few minutes would lose everything since the last one, and a
shutdown does not have to write the whole cache at once.  Without fsync a power cut can leave a renamed but
empty or partial file: the checks above skip it.  Blocks restored by a request are touched (their
modification time is the on-disk recency).  The queue holds at most the budget's bytes (its blocks are mostly
the cache's own arrays, not copies): beyond that blocks are not written (the disk is far behind the prefill).

**Budget.**  A subdirectory holds at most ``capacity`` bytes of arrays (``--cache-memory``, the in-memory
bound), so everything on disk can be loaded at start; beyond it the least recently used block that no stored
block follows is deleted first, as in memory.  Other identities' subdirectories are neither read, counted nor
deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qwen_runtime.cache import KVCache
from qwen_runtime.errors import OutputError
from qwen_runtime.models import Model

from .prefix_cache import ROOT, Block, block_key
from .slots import SlotCache

log = logging.getLogger("qwen_serve")

FORMAT = 1  # of the files; part of the identity
SUFFIX = ".npz"
STALE_TMP_SECONDS = 600  # temporary files older than this are a dead writer's and are deleted at start


class CacheEntryError(ValueError):
    """A block file that cannot be used (truncated, corrupt, another identity's, another layout's)."""


def file_signature(path: str | Path) -> list[Any]:
    """A weight file's resolved path, size and modification time (ns): changes when the file is replaced."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return [str(resolved), stat.st_size, stat.st_mtime_ns]


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
        self.root = Path(directory).expanduser() / self.identity[:32]  # 128 bits: no collisions in practice
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"cannot use {directory} as the prefix cache directory: {exc.strerror or exc}") from None
        self.index: dict[bytes, Entry] = {}
        self.nbytes = 0
        self.loaded = self.skipped = self.written = self.dropped = 0
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._pending = 0  # bytes of blocks queued, not yet written
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- start: what is on disk ---------------------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}{SUFFIX}"

    def load(self, room: int) -> list[Block]:
        """Read the stored blocks, most recently used chains first, up to ``room`` bytes: parents before children,
        each with its parent among them.  Unusable files are skipped (a warning) and deleted, and so are the
        blocks that follow them."""
        self._clear_stale_tmp()
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                key = self._key_of(path)
                parent, nbytes = self._header(path, key)
                self.index[key] = Entry(parent, nbytes, path.stat().st_mtime)
                self.nbytes += nbytes
            except Exception as exc:  # whatever a damaged file does, it is skipped, never fatal
                self._skip(path, exc)
        self._drop_broken_chains()
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
            except Exception as exc:
                self._skip(self.path(key), exc)
                self._forget(key)
        self._drop_broken_chains()
        self.loaded = len(blocks)
        return list(blocks.values())

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
                    self._forget(k)
                    self.path(k).unlink(missing_ok=True)
                    log.warning("prefix cache: deleting %s: a block it follows is missing", self.path(k))
        for entry in self.index.values():
            entry.children = 0
        for entry in self.index.values():
            if entry.parent != ROOT:
                self.index[entry.parent].children += 1

    def _key_of(self, path: Path) -> bytes:
        try:
            key = bytes.fromhex(path.name[:-len(SUFFIX)])
        except ValueError:
            raise CacheEntryError("not a block file name") from None
        if len(key) != hashlib.sha256().digest_size:
            raise CacheEntryError("not a block file name")
        return key

    def _header(self, path: Path, key: bytes) -> tuple[bytes, int]:
        """A file's parent key and array bytes (only its small members are read)."""
        with np.load(path, allow_pickle=False) as npz:
            meta = self._meta(npz, key)
        parent = bytes.fromhex(meta["parent"])
        if parent != ROOT and len(parent) != len(key):
            raise CacheEntryError("its parent key is malformed")
        return parent, int(meta["nbytes"])

    def _meta(self, npz: Any, key: bytes) -> dict[str, Any]:
        meta = json.loads(npz["meta"].tobytes().decode())
        if meta.get("identity") != self.identity:
            raise CacheEntryError("written for another model, kernels or cache layout")
        if meta.get("key") != key.hex():
            raise CacheEntryError("its key does not match its file name")
        return meta

    def _read(self, key: bytes) -> Block:
        """The block stored for ``key``, every check of the module docstring passed."""
        path = self.path(key)
        with np.load(path, allow_pickle=False) as npz:
            meta = self._meta(npz, key)
            parent = bytes.fromhex(meta["parent"])
            tokens = npz["tokens"]
            if tokens.dtype != np.int64 or tokens.shape != (self.block,) or block_key(parent, tokens) != key:
                raise CacheEntryError("its tokens do not hash to its key")
            kv, state = [], []
            for i, (arrays, layer) in enumerate(zip(self.layout, self.slots.layers, strict=True)):
                got = {}
                for name, dtype, shape in arrays:
                    value = npz[f"{i}.{name}"]
                    if value.dtype.str != dtype or value.shape != tuple(shape):
                        raise CacheEntryError(f"layer {i}'s {name} has dtype {value.dtype} and shape {value.shape}, "
                                              f"the cache holds {np.dtype(dtype)} {tuple(shape)}")
                    got[name] = value
                if isinstance(layer, KVCache):
                    kv.append((got["keys"], got["values"]))
                else:
                    state.append(got)
            if len(npz.files) != 2 + sum(len(a) for a in self.layout):
                raise CacheEntryError("it holds arrays the cache layout does not have")
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + sum(a.nbytes for s in state for a in s.values())
        if nbytes != meta["nbytes"]:
            raise CacheEntryError(f"it holds {nbytes} bytes of arrays, its header says {meta['nbytes']}")
        return Block(parent, kv, state, nbytes, key=key, tokens=tokens)

    def _ancestry(self, key: bytes) -> list[bytes]:
        """``key`` and its stored ancestors, root first."""
        chain = []
        while key != ROOT:
            chain.append(key)
            key = self.index[key].parent
        return chain[::-1]

    def _skip(self, path: Path, exc: BaseException) -> None:
        log.warning("prefix cache: skipping %s: %s", path, exc)
        self.skipped += 1
        path.unlink(missing_ok=True)

    def _clear_stale_tmp(self) -> None:
        now = time.time()
        for tmp in self.root.glob(".tmp-*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > STALE_TMP_SECONDS:
                    tmp.unlink()

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
        """Write what is queued, then end the writer thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, value = item
            try:
                if kind == "put":
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
        if block.key in self.index or (block.parent != ROOT and block.parent not in self.index):
            return
        if block.nbytes > self.capacity or not self._evict(self.nbytes + block.nbytes - self.capacity, block.parent):
            return
        arrays = {"meta": np.frombuffer(json.dumps({
            "identity": self.identity, "key": block.key.hex(), "parent": block.parent.hex(), "format": FORMAT,
            "nbytes": block.nbytes}).encode(), np.uint8), "tokens": np.asarray(block.tokens, np.int64)}
        kv, state = iter(block.kv), iter(block.state)
        for i, (names, layer) in enumerate(zip(self.layout, self.slots.layers, strict=True)):
            values = dict(zip(("keys", "values"), next(kv), strict=True)) if isinstance(layer, KVCache) else next(state)
            arrays.update({f"{i}.{name}": values[name] for name, _, _ in names})
        path = self.path(block.key)
        tmp = self.root / f".tmp-{os.getpid()}-{threading.get_ident()}-{path.name}"
        try:
            with open(tmp, "wb") as handle:
                np.savez(handle, **arrays)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
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
                    os.utime(self.path(key))

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
        self._forget(key)
        self.path(key).unlink(missing_ok=True)

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
