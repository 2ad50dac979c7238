"""The prefill/decode loop over a left-padded batch, streaming text as it is produced.

Prefill runs the prompts in chunks of ``prefill_chunk`` columns (bounding activation memory); decoding
feeds one token per live row.  Each row's tokens, text and end are its :class:`~qwen_runtime.stepper.RowStepper`'s
(rows stop on a stop id or after ``max_new_tokens``); finished rows are dropped from the cache so the rest of
the batch runs on.  Each row sees exactly what it would see alone: its repetition-penalty history holds only
its own prompt and output (never padding).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .cache import Cache
from .errors import ContextOverflowError
from .limits import activation_bytes, check_memory
from .models import Model
from .sampling import SamplingParams
from .stepper import RowStepper
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationConfig:
    """How much to generate and how to pick tokens (one SamplingParams for all rows, or one per row)."""

    max_new_tokens: int = 256
    sampling: SamplingParams | tuple[SamplingParams, ...] = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    prefill_chunk: int = 256
    max_memory: int | None = None  # bytes for cache + activations (None: qwen_runtime.limits default)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {self.prefill_chunk!r}")

    def params_for(self, batch: int) -> list[SamplingParams]:
        if isinstance(self.sampling, SamplingParams):
            return [self.sampling] * batch
        if len(self.sampling) != batch:
            raise ValueError(f"{len(self.sampling)} SamplingParams given for a batch of {batch}")
        return list(self.sampling)


@dataclass
class GenerationResult:
    """One row's outcome.  ``token_ids`` include the stop token when there was one; ``text`` does not."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # real (unpadded) prompt tokens over the batch
    prefill_seconds: float = 0.0
    generated_tokens: int = 0  # every sampled token (the first one per row comes from the prefill logits)
    decoded_tokens: int = 0  # tokens fed through decode forward passes
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds else 0.0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-align prompts.  # -> ids int64 [B, T], valid bool [B, T]"""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    valid = np.zeros((len(prompts), width), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt):] = prompt
            valid[row, width - len(prompt):] = True
    return ids, valid


def check_prompt_fits(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > limit:
        raise ContextOverflowError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                                   f"model's context length of {limit}")


class Generation:
    """A running generation: iterate for each step's new text per row; then read ``results``/``stats``."""

    def __init__(self, model: Model, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 tokenizer: Tokenizer | None = None) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        check_prompt_fits(model, prompts, config.max_new_tokens)
        longest = max(len(p) for p in prompts) + config.max_new_tokens
        rows = len(prompts)
        need = model.cache_bytes(rows, longest) + activation_bytes(model.config, rows, longest, config.prefill_chunk)
        check_memory(need, config.max_memory, f"generating {rows} rows of up to {longest} tokens")
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.results = [GenerationResult([int(t) for t in p]) for p in prompts]
        self.stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        rng = np.random.default_rng(config.seed)  # shared: rows draw in row order, as they always did
        self._rows = [RowStepper(r.prompt_ids, params, rng, config.max_new_tokens, config.stop_ids, tokenizer)
                      for r, params in zip(self.results, config.params_for(len(prompts)), strict=True)]
        self._iterator = self._run()

    def __iter__(self) -> Iterator[list[str]]:
        return self._iterator

    def close(self) -> None:
        """Stop early (the caller was interrupted between steps): the prefill and decode times are recorded."""
        self._iterator.close()

    def run(self) -> list[GenerationResult]:
        """Generate to the end and return every row's result."""
        for _ in self:
            pass
        return self.results

    def _run(self) -> Iterator[list[str]]:
        cfg, model = self.config, self.model
        ids, valid = left_pad([r.prompt_ids for r in self.results])
        t0, t1 = time.perf_counter(), None
        try:  # the times are kept even when the caller stops early (Ctrl-C in a chat)
            cache = model.make_cache(ids.shape[0], ids.shape[1] + cfg.max_new_tokens, cfg.max_memory)
            with model.workspace.keep_scratch():  # between chunks; dropped before the decode steps
                for c0 in range(0, ids.shape[1], cfg.prefill_chunk):
                    c1 = c0 + cfg.prefill_chunk
                    logits = model.forward(ids[:, c0:c1], cache, valid[:, c0:c1], last_only=True)  # [B, V]
            self.stats.prefill_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            yield from self._decode(model, cache, logits)
        finally:
            if t1 is None:
                self.stats.prefill_seconds = time.perf_counter() - t0
            else:
                self.stats.decode_seconds = time.perf_counter() - t1

    def _decode(self, model: Model, cache: Cache, logits: np.ndarray) -> Iterator[list[str]]:
        cfg = self.config
        live = list(range(len(self.results)))  # original row of each cache row
        for _ in range(cfg.max_new_tokens):
            tokens, texts, keep = self._step(live, logits)  # [B_live]
            yield texts
            if not keep:
                break
            if len(keep) < len(live):
                cache.select(np.asarray(keep))
                tokens = tokens[keep]
                live = [live[i] for i in keep]
            logits = model.forward(tokens[:, None], cache, last_only=True)  # [B_live, V]
            self.stats.decoded_tokens += len(live)

    def _step(self, live: list[int], logits: np.ndarray) -> tuple[np.ndarray, list[str], list[int]]:
        """Each live row's next token from its logits [B_live, V]: the tokens, the new text per original row
        and the cache rows to keep."""
        texts = [""] * len(self.results)
        tokens, keep = np.empty(len(live), np.int64), []
        for i, row in enumerate(live):
            step = self._rows[row].step(logits[i])
            result = self.results[row]
            result.token_ids.append(step.token)
            self.stats.generated_tokens += 1
            tokens[i], texts[row] = step.token, step.text
            result.text += step.text
            if step.finish is None:
                keep.append(i)
            else:
                result.finish_reason = step.finish
        return tokens, texts, keep
