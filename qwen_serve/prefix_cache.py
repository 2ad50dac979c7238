"""The prefix cache: what a row's cache holds after each block of prompt tokens, reused by later prompts.

Prompts are cut into blocks of ``block`` tokens (the engine's prefill chunk, so a prompt resumed after a
cached prefix is chunked exactly as it would be from the start, and computes the same bits).  A block is
stored right after the prefill chunk that ends it, keyed by a hash of every token up to its end, as:

* for full-attention layers, the keys and values of its own tokens (the earlier blocks hold the rest);
* for every other layer (Qwen3.5's Gated DeltaNet: the convolution inputs and the recurrent state), the
  whole row state at the block's end: a recurrent state cannot be cut back to an earlier token, so it is
  checkpointed at every block boundary.

A new prompt takes the longest chain of cached blocks that is a prefix of it and leaves at least one token
to prefill (the logits of the last token are needed).  The cache holds at most ``capacity`` bytes; the least
recently used block without cached children goes first, also when the engine needs the memory for a
request.  With a :class:`~qwen_serve.prefix_store.PrefixStore` (``--cache-dir``) the cache starts with the blocks
stored on disk and writes each new block there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from qwen_runtime.cache import KVCache

from .slots import SlotCache

ROOT = b""


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block: a hash of its parent's key and its tokens (so of every token up to its end)."""
    return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


@dataclass
class Block:
    parent: bytes
    kv: list[tuple[np.ndarray, np.ndarray]]  # per full-attention layer: keys, values [kv_heads, block, hd]
    state: list[dict[str, np.ndarray]]  # per other layer: each state array's row at the block's end
    nbytes: int
    used: int = 0  # the cache's clock when last used
    children: int = 0
    key: bytes = field(default=b"")
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64 [block]: its own tokens


class BlockStore(Protocol):
    """Where blocks outlive the process (:class:`~qwen_serve.prefix_store.PrefixStore`)."""

    def load(self, room: int) -> list[Block]: ...  # stored blocks, parents first, at most ``room`` bytes
    def start(self) -> None: ...
    def put(self, block: Block) -> None: ...  # a new block (never waits)
    def touch(self, keys: Sequence[bytes]) -> None: ...  # blocks just restored
    def close(self) -> None: ...  # write what is queued
    def status(self) -> dict[str, object]: ...  # directory, bytes, files, loaded, skipped, written, dropped


class PrefixCache:
    """Blocks of ``block`` tokens of the rows of ``slots``, at most ``capacity`` bytes."""

    def __init__(self, slots: SlotCache, block: int, capacity: int) -> None:
        self.slots, self.block, self.capacity = slots, block, capacity
        self.blocks: dict[bytes, Block] = {}
        self.nbytes = 0
        self.clock = 0
        self.hits = self.hit_tokens = self.lookups = 0
        self.disk: BlockStore | None = None

    def persist(self, disk: BlockStore) -> None:
        """Start with the blocks ``disk`` holds (as many as fit) and write every new block there."""
        for block in disk.load(self.capacity - self.nbytes):  # parents first
            self._insert(block)
        disk.start()
        self.disk = disk

    def close(self) -> None:
        """Finish writing to disk (a no-op without one)."""
        if self.disk is not None:
            self.disk.close()

    def lookup(self, prompt: Sequence[int]) -> list[Block]:
        """The longest chain of cached blocks that is a prefix of ``prompt`` (at least one token left over)."""
        chain, key = [], ROOT
        self.lookups += 1
        for end in range(self.block, len(prompt), self.block):  # end < len(prompt): one token is left
            key = block_key(key, prompt[end - self.block:end])
            found = self.blocks.get(key)
            if found is None:
                break
            chain.append(found)
        self.clock += 1
        for b in chain:
            b.used = self.clock
        if chain:
            self.hits += 1
            self.hit_tokens += len(chain) * self.block
            if self.disk is not None:
                self.disk.touch([b.key for b in chain])
        return chain

    def restore(self, row: int, chain: list[Block]) -> int:
        """Write a chain of blocks into ``row`` of the slots (reset before); returns the tokens it holds."""
        length = len(chain) * self.block
        for i, b in enumerate(chain):
            kv = iter(b.kv)
            for layer in self.slots.layers:
                if isinstance(layer, KVCache):
                    keys, values = next(kv)
                    layer.keys[row, :, i * self.block:(i + 1) * self.block] = keys
                    layer.values[row, :, i * self.block:(i + 1) * self.block] = values
        states = iter(chain[-1].state) if chain else iter(())
        for layer in self.slots.layers:
            if not isinstance(layer, KVCache):
                for name, value in next(states).items():
                    getattr(layer, name)[row] = value
        self.slots.lengths[row] = length
        return length

    def store(self, row: int, prompt: Sequence[int], end: int) -> None:
        """Keep the block of ``prompt`` ending at ``end`` (a multiple of ``block``) as ``row`` holds it now, if its
        parent is cached (or it is the first) and it fits."""
        start = end - self.block
        parent = ROOT
        for s in range(0, start, self.block):
            parent = block_key(parent, prompt[s:s + self.block])
        key = block_key(parent, prompt[start:end])
        if key in self.blocks or (parent != ROOT and parent not in self.blocks):
            return
        kv, state = [], []
        for layer in self.slots.layers:
            if isinstance(layer, KVCache):
                kv.append((layer.keys[row, :, start:end].copy(), layer.values[row, :, start:end].copy()))
            else:
                state.append({name: value[row].copy() for name, value in vars(layer).items()
                              if isinstance(value, np.ndarray)})
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + sum(a.nbytes for s in state for a in s.values())
        if nbytes > self.capacity or not self.evict(self.nbytes + nbytes - self.capacity, keep=parent):
            return
        block = Block(parent, kv, state, nbytes, key=key, tokens=np.asarray(prompt[start:end], np.int64))
        self._insert(block)
        if self.disk is not None:
            self.disk.put(block)

    def _insert(self, block: Block) -> None:
        self.clock += 1
        block.used = self.clock
        self.blocks[block.key] = block
        self.nbytes += block.nbytes
        if block.parent != ROOT:
            self.blocks[block.parent].children += 1

    def evict(self, need: int, keep: bytes = ROOT) -> bool:
        """Free at least ``need`` bytes, least recently used leaves first (never ``keep``); False if that is not
        possible."""
        while need > 0:
            leaves = [b for b in self.blocks.values() if b.children == 0 and b.key != keep]
            if not leaves:
                return False
            victim = min(leaves, key=lambda b: b.used)
            del self.blocks[victim.key]
            self.nbytes -= victim.nbytes
            need -= victim.nbytes
            if victim.parent != ROOT:
                self.blocks[victim.parent].children -= 1
        return True


__all__ = ["Block", "BlockStore", "PrefixCache"]
