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

**Turns** (``turns=True``, opt-in): the cache also keeps a *tail* where each request stopped: at the end of its
prompt (for a model with recurrent state, a new prompt's before its last token: the engine prefills that token
alone, so that a next prompt whose text tokenizes differently where this prompt met its answer still finds a
whole tail) and,
once it finishes, at the end of its answer (the tokens its row holds after the longest cached chain
of blocks: their keys and values, and the whole row state there).  A chat's next turn, whose prompt is the
history, then resumes exactly where the last turn stopped and prefills only the new tokens, instead of everything
after the last whole block.  A tail restores only whole for a model with recurrent state; with attention only, any
prefix of it.  Not exact: the answer's tokens were decoded one at a time and the prompt's last tokens prefilled in
a shorter chunk, where a prompt without the cache prefills them in one chunk, so the numbers after a tail can
differ from the cache-off numbers in their last bits.  Blocks are never stored from a row resumed from a tail, so
the blocks stay exact; tails live in memory only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from qwen_runtime.backend.cache import KVCache

from .slots import SlotCache

ROOT = b""
TAIL_SALT = b"tail"  # a tail's key never equals a block's of the same tokens


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


@dataclass
class Hit:
    """What a lookup found: a chain of blocks, then maybe the first ``tail_tokens`` tokens of a tail after it."""

    blocks: list[Block]
    length: int  # tokens restored: whole blocks plus tail_tokens
    tail: Block | None = None
    tail_tokens: int = 0


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

    def __init__(self, slots: SlotCache, block: int, capacity: int, turns: bool = False) -> None:
        self.slots, self.block, self.capacity, self.turns = slots, block, capacity, turns
        self.blocks: dict[bytes, Block] = {}
        self.tails: dict[bytes, Block] = {}  # with turns: where requests stopped, after a chain of blocks
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

    def lookup(self, prompt: Sequence[int]) -> Hit:
        """The longest chain of cached blocks that is a prefix of ``prompt`` (at least one token left over),
        continued by the tail that restores most of the rest (with ``turns``)."""
        chain, key = [], ROOT
        self.lookups += 1
        for end in range(self.block, len(prompt), self.block):  # end < len(prompt): one token is left
            key = block_key(key, prompt[end - self.block:end])
            found = self.blocks.get(key)
            if found is None:
                break
            chain.append(found)
        hit = self._longest_tail(prompt, chain) if self.tails else Hit(chain, len(chain) * self.block)
        self.clock += 1
        for b in hit.blocks + ([hit.tail] if hit.tail else []):
            b.used = self.clock
        if hit.length:
            self.hits += 1
            self.hit_tokens += hit.length
            if self.disk is not None and hit.blocks:
                self.disk.touch([b.key for b in hit.blocks])
        return hit

    def _longest_tail(self, prompt: Sequence[int], chain: list[Block]) -> Hit:
        """The chain, or a prefix of it and a tail after that, whichever restores more of ``prompt``."""
        depth = {ROOT: 0, **{b.key: i + 1 for i, b in enumerate(chain)}}
        ids = np.asarray(prompt, np.int64)
        best = Hit(chain, len(chain) * self.block)
        for tail in self.tails.values():
            if tail.parent not in depth:
                continue
            start = depth[tail.parent] * self.block
            rest = ids[start:len(ids) - 1]  # one token is left
            n = min(len(tail.tokens), len(rest))
            same = int(np.argmin(np.append(tail.tokens[:n] == rest[:n], False)))  # the common prefix's length
            if tail.state and same < len(tail.tokens):
                continue  # a recurrent state is the tail's end's only
            if same and start + same > best.length:
                best = Hit(chain[:depth[tail.parent]], start + same, tail, same)
        return best

    def restore(self, row: int, hit: Hit) -> int:
        """Write what a lookup found into ``row`` of the slots (reset before); returns the tokens it holds."""
        self._write_blocks(row, hit.blocks)
        if hit.tail is not None:
            start, stop = len(hit.blocks) * self.block, hit.length
            kv = iter(hit.tail.kv)
            for layer in self.slots.layers:
                if isinstance(layer, KVCache):
                    keys, values = next(kv)
                    layer.keys[row, :, start:stop] = keys[:, :hit.tail_tokens]
                    layer.values[row, :, start:stop] = values[:, :hit.tail_tokens]
            self._write_state(row, hit.tail)
        elif hit.blocks:
            self._write_state(row, hit.blocks[-1])
        self.slots.lengths[row] = hit.length
        return hit.length

    def _write_blocks(self, row: int, chain: list[Block]) -> None:
        for i, b in enumerate(chain):
            kv = iter(b.kv)
            for layer in self.slots.layers:
                if isinstance(layer, KVCache):
                    keys, values = next(kv)
                    layer.keys[row, :, i * self.block:(i + 1) * self.block] = keys
                    layer.values[row, :, i * self.block:(i + 1) * self.block] = values

    def _write_state(self, row: int, source: Block) -> None:
        states = iter(source.state)
        for layer in self.slots.layers:
            if not isinstance(layer, KVCache):
                for name, value in next(states).items():
                    getattr(layer, name)[row] = value

    def store_tail(self, row: int, tokens: Sequence[int]) -> None:
        """Keep where ``row`` stopped (with ``turns``): ``tokens`` are all it holds; the tail is what follows
        their longest chain of cached blocks.  Stored if it fits (a tail is evicted like a leaf block)."""
        if not self.turns or len(tokens) != self.slots.lengths[row]:
            return
        parent, start = ROOT, 0
        while start + self.block <= len(tokens):
            key = block_key(parent, tokens[start:start + self.block])
            if key not in self.blocks:
                break
            parent, start = key, start + self.block
        if start == len(tokens):
            return  # whole blocks: nothing to add
        own = np.asarray(tokens[start:], np.int64)
        key = block_key(parent + TAIL_SALT, own)
        if key in self.tails:
            self.clock += 1
            self.tails[key].used = self.clock
            return
        kv, state = self._copy_row(row, start, len(tokens))
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + sum(a.nbytes for s in state for a in s.values())
        if nbytes > self.capacity or not self.evict(self.nbytes + nbytes - self.capacity, keep=parent):
            return
        tail = Block(parent, kv, state, nbytes, key=key, tokens=own)
        self.clock += 1
        tail.used = self.clock
        self.tails[key] = tail
        self.nbytes += nbytes
        if parent != ROOT:
            self.blocks[parent].children += 1

    def _copy_row(self, row: int, start: int, end: int) -> tuple[list[tuple[np.ndarray, np.ndarray]],
                                                                 list[dict[str, np.ndarray]]]:
        """Copies of ``row``'s keys and values of tokens ``start .. end-1`` and its whole other state."""
        kv, state = [], []
        for layer in self.slots.layers:
            if isinstance(layer, KVCache):
                kv.append((layer.keys[row, :, start:end].copy(), layer.values[row, :, start:end].copy()))
            else:
                state.append({name: value[row].copy() for name, value in vars(layer).items()
                              if isinstance(value, np.ndarray)})
        return kv, state

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
        kv, state = self._copy_row(row, start, end)
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
        """Free at least ``need`` bytes, least recently used leaves (tails and blocks without cached children)
        first, never ``keep``; False if that is not possible."""
        while need > 0:
            leaves = [b for b in self.blocks.values() if b.children == 0 and b.key != keep]
            victim = min([*leaves, *self.tails.values()], key=lambda b: b.used, default=None)
            if victim is None:
                return False
            del (self.tails if victim.key in self.tails else self.blocks)[victim.key]
            self.nbytes -= victim.nbytes
            need -= victim.nbytes
            if victim.parent != ROOT:
                self.blocks[victim.parent].children -= 1
        return True


__all__ = ["Block", "BlockStore", "Hit", "PrefixCache"]
