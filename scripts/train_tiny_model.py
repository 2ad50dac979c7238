#!/usr/bin/env python3
"""Train a tiny Qwen3-architecture causal LM on the Python standard library's own source.

The result is shipped inside the package (``qwen_runtime/assets/qwen3-stdlib/``) so that the numpy
runtime, the converters and the evaluation tool have a real, *trained* Qwen3 checkpoint to work on
without network access. Everything is deterministic given ``--seed`` (same interpreter, same library
versions, same machine type).

Steps: collect stdlib ``.py`` files -> split by file into train / held-out -> train a Qwen-style
byte-level BPE tokenizer -> train ``Qwen3ForCausalLM`` with AdamW + cosine schedule -> evaluate
held-out perplexity -> save config, bf16 safetensors, tokenizer files, generation config, model card
and a held-out text sample.

Needs the ``oracle`` extra (torch, transformers). Example::

    nice -n 10 python scripts/train_tiny_model.py > train.log 2>&1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports happen lazily inside the functions that need them
    from tokenizers import Tokenizer
    from torch import Generator, Tensor
    from torch.optim import AdamW
    from transformers import Qwen3Config, Qwen3ForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "qwen_runtime" / "assets" / "qwen3-stdlib"
QWEN3_TOKENIZER_CONFIG = REPO_ROOT / "tests" / "data" / "model-configs" / "qwen3-0.6b" / "tokenizer_config.json"

# Qwen2/Qwen3 pre-tokenizer split regex (the one in Qwen's tokenizer.json).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
NON_SPECIAL_ADDED = ("<think>", "</think>")
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})
MAX_FILE_BYTES = 200_000
# Machine-generated codec tables (encodings/cp1252.py etc., ~1.2 MB, ~20% of all tokens): 256-entry hex
# tables that swamp a compute-starved run (greedy output degenerated to "x000x000...").
GENERATED_MARKER = "with gencodec.py"
SAMPLE_PROMPTS = ("def ", "import ")
# Default step count: chosen so the whole script takes about 20 minutes on the shared 2-core build machine.
# Step time there swung between 0.45 s (idle) and 1.5 s (load average ~11 from other jobs) at batch 4 x 256
# tokens, 2 threads, `nice -n 10`; the committed run averaged 0.78 s/step (load ~8): 19.5 min of training,
# 20.1 min wall in total. See MODEL_CARD.md.
DEFAULT_STEPS = 1500

# Fallback ChatML template (the real Qwen3 template is copied from QWEN3_TOKENIZER_CONFIG when present).
FALLBACK_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class Corpus:
    """Stdlib source files split by file."""

    stdlib: str
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]

    @property
    def n_files(self) -> int:
        return len(self.train) + len(self.heldout)


@dataclass
class TrainLog:
    """Per-step training losses plus periodic held-out probes."""

    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    probes: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="asset folder to (over)write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--heldout-frac", type=float, default=0.03, help="fraction of files held out")
    p.add_argument("--heldout-bytes", type=int, default=50_000, help="size of the shipped heldout.txt")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab (bytes + merges), before specials")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--max-positions", type=int, default=512, help="max_position_embeddings in config.json")
    p.add_argument("--context", type=int, default=256, help="training window length (tokens)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--probe-windows", type=int, default=8, help="held-out windows scored at each log step")
    p.add_argument(
        "--split-eval-windows", type=int, default=96, help="evenly spaced windows of all held-out files to score"
    )
    p.add_argument("--gen-tokens", type=int, default=48, help="greedy tokens per sample prompt")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- data


def is_included(rel: Path, size: int) -> bool:
    return not (EXCLUDED_DIRS.intersection(rel.parts[:-1]) or size > MAX_FILE_BYTES)


def collect_stdlib_sources(stdlib: Path) -> list[tuple[str, str]]:
    """All included stdlib ``.py`` files as (relative path, text), sorted by path.

    Besides the directory/size exclusions, machine-generated codec tables are skipped.
    """
    files: list[tuple[str, str]] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if not path.is_file() or not is_included(rel, path.stat().st_size):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if GENERATED_MARKER not in text[:500]:
            files.append((rel.as_posix(), text))
    return files


def split_by_file(files: list[tuple[str, str]], frac: float, seed: int) -> tuple[list, list]:
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(len(files) * frac))
    heldout = [files[i] for i in order[:n_heldout]]
    train = [files[i] for i in sorted(order[n_heldout:])]
    return train, heldout


def load_corpus(frac: float, seed: int) -> Corpus:
    stdlib = sysconfig.get_paths()["stdlib"]
    train, heldout = split_by_file(collect_stdlib_sources(Path(stdlib)), frac, seed)
    return Corpus(stdlib=stdlib, train=train, heldout=heldout)


def heldout_sample(heldout: list[tuple[str, str]], target_bytes: int) -> str:
    """Concatenate held-out files (split order) and cut at the last line break before target_bytes."""
    text = "\n\n".join(src for _, src in heldout)
    data = text.encode("utf-8")[:target_bytes]
    cut = data.rfind(b"\n")
    return data[: cut + 1].decode("utf-8", errors="ignore")


# ---------------------------------------------------------------------------------------- tokenizer


def build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])
    return tok


def encode_documents(tok: Tokenizer, texts: list[str]) -> Tensor:
    """Token ids of all documents joined (and terminated) with <|endoftext|>."""
    import torch

    eot = tok.token_to_id(ENDOFTEXT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def token_id(tok: Tokenizer, text: str) -> int:
    tid = tok.token_to_id(text)
    if tid is None:
        raise ValueError(f"token {text!r} missing from the vocabulary")
    return tid


# -------------------------------------------------------------------------------------------- model


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def build_config(args: argparse.Namespace, tok: Tokenizer) -> Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=round_up(tok.get_vocab_size(with_added_tokens=True), 64),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_positions,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=args.layers,
        attention_dropout=0.0,
        bos_token_id=token_id(tok, ENDOFTEXT),
        eos_token_id=token_id(tok, IM_END),
    )


def check_row_lengths(model: Qwen3ForCausalLM) -> None:
    """Every weight's row length (last dim) must be a multiple of 32 (needed for Q8_0/Q4_0 blocks)."""
    bad = {n: tuple(p.shape) for n, p in model.named_parameters() if p.shape[-1] % 32}
    if bad:
        raise ValueError(f"row lengths not multiples of 32: {bad}")


def build_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.tie_weights()
    check_row_lengths(model)
    return model


def n_params(model: Qwen3ForCausalLM) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


# ----------------------------------------------------------------------------------------- training


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: Qwen3ForCausalLM, args: argparse.Namespace) -> AdamW:
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(data: Tensor, context: int, batch_size: int, gen: Generator) -> tuple[Tensor, Tensor]:
    import torch

    starts = torch.randint(0, data.numel() - context - 1, (batch_size,), generator=gen)
    rows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def lm_loss(model: Qwen3ForCausalLM, x: Tensor, y: Tensor) -> Tensor:
    import torch.nn.functional as F

    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def train(model: Qwen3ForCausalLM, data: Tensor, probe: Tensor, args: argparse.Namespace) -> TrainLog:
    import torch

    gen = torch.Generator().manual_seed(args.seed + 1)
    opt = make_optimizer(model, args)
    log = TrainLog()
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sample_batch(data, args.context, args.batch_size, gen)
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        log.losses.append(loss.item())
        log.lrs.append(lr)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            log.probes[step + 1] = evaluate(model, probe)[0]
            model.train()
            report_progress(step + 1, args.steps, log, args.log_every, time.perf_counter() - t0)
    log.seconds = time.perf_counter() - t0
    return log


def report_progress(step: int, total: int, log: TrainLog, every: int, elapsed: float) -> None:
    recent = log.losses[-every:]
    print(
        f"step {step:5d}/{total}  loss {sum(recent) / len(recent):.4f}  heldout-probe {log.probes[step]:.4f}"
        f"  lr {log.lrs[-1]:.2e}  {elapsed / step:.3f} s/step  elapsed {elapsed:.0f}s",
        flush=True,
    )


# --------------------------------------------------------------------------------------- evaluation


def eval_windows(ids: Tensor, context: int) -> Tensor:
    """Non-overlapping windows of ``context`` tokens (the remainder is dropped)."""
    n = ids.numel() // context
    return ids[: n * context].reshape(n, context)


def probe_windows(windows: Tensor, n: int) -> Tensor:
    """``n`` windows spread evenly over heldout.txt (cheap held-out loss probe during training)."""
    step = max(1, windows.shape[0] // n)
    return windows[::step][:n]


def evaluate(model: Qwen3ForCausalLM, windows: Tensor, batch: int = 16) -> tuple[float, int]:
    """Mean next-token NLL (nats) over all windows, each scored independently; and the token count."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            w = windows[i : i + batch]
            logits = model(input_ids=w, use_cache=False).logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
            total += nll.item()
            count += w[:, 1:].numel()
    return total / max(1, count), count


def round_to_bf16(model: Qwen3ForCausalLM) -> None:
    """Round every parameter to bf16 in place (kept in fp32), i.e. exactly the shipped weights."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def lone_space_digit_share(tok: Tokenizer, ids: Tensor) -> float:
    """Fraction of lone-space tokens ("Ġ") in ``ids`` that are followed by a digit token."""
    import torch

    digits = torch.tensor([tok.token_to_id(str(d)) for d in range(10)])
    follow = ids[1:][ids[:-1] == token_id(tok, "Ġ")]
    return torch.isin(follow, digits).float().mean().item() if follow.numel() else 0.0


def greedy_ids(model: Qwen3ForCausalLM, ids: list[int], n_tokens: int, stop: list[int]) -> list[int]:
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        gen = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop[1],
        )
    return gen[0].tolist()


def space_healed_ids(model: Qwen3ForCausalLM, tok: Tokenizer, prompt: str) -> list[int]:
    """Token healing for a trailing space: drop it and force the first new token to start with a space.

    The Qwen split regex makes a trailing space its own token ("Ġ"); in code that token almost only occurs
    before digits (``x = 0`` -> ``x``, `` =``, `` ``, ``0``), so plain greedy decoding of ``"def "`` starts
    with a digit. Here the prompt is scored without the space and the argmax is taken over space-prefixed
    tokens only, which is the continuation a user typing ``"def "`` means.
    """
    import torch

    ids = tok.encode(prompt.rstrip(" "), add_special_tokens=False).ids
    allowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    for text, i in tok.get_vocab(with_added_tokens=False).items():
        allowed[i] = text.startswith("Ġ") and len(text) > 1
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    return [*ids, int(torch.where(allowed, logits, float("-inf")).argmax())]


def greedy_samples(model: Qwen3ForCausalLM, tok: Tokenizer, n_tokens: int) -> dict[str, str]:
    """Plain greedy continuations of SAMPLE_PROMPTS (a runtime must reproduce these), then space-healed ones."""
    stop = [token_id(tok, IM_END), token_id(tok, ENDOFTEXT)]
    model.eval()
    out: dict[str, str] = {}
    for prompt in SAMPLE_PROMPTS:
        ids = greedy_ids(model, tok.encode(prompt, add_special_tokens=False).ids, n_tokens, stop)
        out[f"{prompt!r}, plain greedy"] = tok.decode(ids, skip_special_tokens=False)
    for prompt in SAMPLE_PROMPTS:
        ids = greedy_ids(model, space_healed_ids(model, tok, prompt), n_tokens - 1, stop)
        out[f"{prompt!r}, space-healed greedy"] = tok.decode(ids, skip_special_tokens=False)
    return out


# ------------------------------------------------------------------------------------------ writing


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_weights(model: Qwen3ForCausalLM, path: Path) -> None:
    """bf16 safetensors in HF layout; ``lm_head.weight`` is omitted because embeddings are tied."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        name: t.detach().to(torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "pt"})


CONFIG_KEYS = (
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "max_window_layers",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_parameters",
    "sliding_window",
    "tie_word_embeddings",
    "transformers_version",
    "use_cache",
    "use_sliding_window",
    "vocab_size",
)


def save_config(config: Qwen3Config, path: Path) -> None:
    """A clean Qwen3-style config.json: the fields of the published Qwen3 files plus ``rope_parameters``.

    ``rope_theta`` is written both at top level (pre-transformers-5 readers) and in ``rope_parameters``.
    """
    d = {k: v for k, v in config.to_dict().items() if k in CONFIG_KEYS}
    d["architectures"] = ["Qwen3ForCausalLM"]
    d["rope_theta"] = config.rope_parameters["rope_theta"]
    d["rope_scaling"] = None
    d["torch_dtype"] = "bfloat16"
    write_json(path, dict(sorted(d.items())))


def chat_template() -> str:
    if QWEN3_TOKENIZER_CONFIG.is_file():
        return json.loads(QWEN3_TOKENIZER_CONFIG.read_text(encoding="utf-8"))["chat_template"]
    return FALLBACK_CHAT_TEMPLATE


def tokenizer_config(tok: Tokenizer, context: int) -> dict:
    added = {}
    for text in (*SPECIAL_TOKENS, *NON_SPECIAL_ADDED):
        added[str(token_id(tok, text))] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": context,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(tok: Tokenizer) -> dict:
    eot, im_end = token_id(tok, ENDOFTEXT), token_id(tok, IM_END)
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def write_tokenizer_files(tok: Tokenizer, out: Path, context: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, context))
    write_json(out / "generation_config.json", generation_config(tok))


# --------------------------------------------------------------------------------------- model card


def loss_table(log: TrainLog, every: int) -> str:
    rows = [
        f"| step | lr | train loss (mean of last {every} steps) | held-out probe loss |",
        "|---:|---:|---:|---:|",
    ]
    for step in sorted(log.probes):
        window = log.losses[max(0, step - every) : step]
        rows.append(f"| {step} | {log.lrs[step - 1]:.2e} | {sum(window) / len(window):.4f} | {log.probes[step]:.4f} |")
    return "\n".join(rows)


@dataclass
class RunSummary:
    args: argparse.Namespace
    corpus: Corpus
    train_tokens: int
    vocab_used: int
    config: Qwen3Config
    params: int
    log: TrainLog
    heldout_bytes: int
    heldout_tokens: int
    eval_fp32: tuple[float, int]
    eval_bf16: tuple[float, int]
    eval_split_bf16: tuple[float, int]
    samples: dict[str, str]
    lone_space_digit_share: float
    wall_seconds: float


def ppl_line(name: str, ev: tuple[float, int]) -> str:
    nll, count = ev
    return f"| {name} | {count} | {nll:.4f} | {math.exp(nll):.2f} |"


def model_card(s: RunSummary) -> str:
    a, c, cfg = s.args, s.corpus, s.config
    split_bytes = sum(len(t.encode("utf-8")) for _, t in c.heldout)
    train_bytes = sum(len(t.encode("utf-8")) for _, t in c.train)
    held_names = ", ".join(f"`{p}`" for p, _ in c.heldout)
    samples = "\n\n".join(f"Prompt {label}:\n\n```python\n{t}\n```" for label, t in s.samples.items())
    return f"""# qwen3-stdlib — a tiny Qwen3 trained on the Python standard library

A {s.params / 1e6:.2f}M-parameter `Qwen3ForCausalLM` trained from scratch on CPU by
`scripts/train_tiny_model.py` (seed {a.seed}). It exists so that qwen-numpy's runtime, converters and
evaluation tool have a real trained Qwen3 checkpoint to test against offline. With ~20 CPU-minutes of
training its output is only loosely Python-shaped (see the samples) and it is useless for anything else;
it has never seen chat data, so the ChatML template is only there for format tests.

## Data

* Source: every `.py` file under the interpreter's stdlib directory (`{c.stdlib}`, CPython
  {sysconfig.get_python_version()}), excluding `test/`, `tests/`, `idlelib/`, `site-packages` and files over
  {MAX_FILE_BYTES // 1000} KB, and the machine-generated codec tables (files whose header says
  "{GENERATED_MARKER}", i.e. `encodings/cp*.py` and friends); sorted by path. {c.n_files} files.
* Split by file with `random.Random({a.seed}).shuffle`: {len(c.train)} train files
  ({train_bytes / 1e6:.2f} MB), {len(c.heldout)} held-out files ({split_bytes / 1e3:.0f} KB): {held_names}.
* Training stream: train files joined and terminated with `<|endoftext|>`, {s.train_tokens:,} tokens.
  Windows of {a.context} tokens are drawn at uniformly random offsets (seeded generator).
* `heldout.txt`: the held-out files in split order joined with a blank line, cut at the last line break
  before {a.heldout_bytes} bytes ({s.heldout_bytes} bytes). Only held-out files — never seen in training.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the train files only, Qwen2/Qwen3-style: NFC normalizer,
pre-tokenizer = Split(Qwen regex, isolated) then ByteLevel(add_prefix_space=false, use_regex=false),
ByteLevel decoder and post-processor. {s.vocab_used - 5} BPE tokens (256 bytes + merges), then
`<|endoftext|>`={s.vocab_used - 5}, `<|im_start|>`={s.vocab_used - 4}, `<|im_end|>`={s.vocab_used - 3}
(special) and `<think>`={s.vocab_used - 2}, `</think>`={s.vocab_used - 1} (added, not special).
Embedding rows are padded to `vocab_size` = {cfg.vocab_size} (multiple of 64);
the padding rows are never produced by the tokenizer.
`tokenizer_config.json`: eos `<|im_end|>`, pad `<|endoftext|>`, no bos, the real Qwen3 chat template.

## Shape

| field | value |
|---|---|
| hidden_size | {cfg.hidden_size} |
| num_hidden_layers | {cfg.num_hidden_layers} |
| num_attention_heads / num_key_value_heads | {cfg.num_attention_heads} / {cfg.num_key_value_heads} |
| head_dim | {cfg.head_dim} |
| intermediate_size | {cfg.intermediate_size} |
| vocab_size | {cfg.vocab_size} |
| rope_theta | {cfg.rope_parameters["rope_theta"]:.0f} |
| rms_norm_eps | {cfg.rms_norm_eps} |
| tie_word_embeddings | true (no `lm_head.weight` in the file) |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on {a.context}-token windows only) |
| parameters | {s.params:,} |
| weights | `model.safetensors`, bf16, every row length a multiple of 32 |

## Training

AdamW (betas 0.9/0.95, eps 1e-8, weight decay {a.weight_decay} on matrices only), peak lr {a.lr},
{a.warmup} warmup steps then cosine to {a.lr * a.min_lr_ratio:.1e}, gradient clip {a.grad_clip}, batch
{a.batch_size} x {a.context} tokens, {a.steps} steps ({a.steps * a.batch_size * a.context:,} tokens,
{a.steps * a.batch_size * a.context / s.train_tokens:.2f} epochs), fp32, torch {_torch_version()} on
{a.threads} threads, `torch.use_deterministic_algorithms(True)`. Training time {s.log.seconds / 60:.1f} min;
whole script wall time {s.wall_seconds / 60:.1f} min.

Loss (nats/token). "held-out probe" = {a.probe_windows} evenly spaced {a.context}-token windows of `heldout.txt`:

{loss_table(s.log, a.log_every)}

## Held-out perplexity

Token-level: `heldout.txt` tokenized without special tokens, cut into non-overlapping {a.context}-token
windows (remainder dropped), each window scored independently, perplexity = exp(mean NLL over every
predicted token, i.e. positions 1..{a.context - 1} of each window). Uniform over the real vocabulary would be
{s.vocab_used}. `heldout.txt` is {s.heldout_bytes} bytes = {s.heldout_tokens} tokens
({s.heldout_bytes / s.heldout_tokens:.2f} bytes/token), so the shipped weights reach about
{s.eval_bf16[0] * s.heldout_tokens / s.heldout_bytes / math.log(2):.3f} bits per byte.

| evaluation | predicted tokens | mean NLL (nats) | perplexity |
|---|---:|---:|---:|
{ppl_line("heldout.txt, fp32 weights (before rounding)", s.eval_fp32)}
{ppl_line("heldout.txt, bf16 weights (as shipped)", s.eval_bf16)}
{ppl_line(f"all held-out files ({a.split_eval_windows} evenly spaced windows), bf16 weights", s.eval_split_bf16)}

## Greedy samples (bf16 weights, transformers `generate`, {a.gen_tokens} new tokens)

"plain greedy" = the prompt tokenized as is (`'def '` -> `def`, `Ġ`) and `generate(do_sample=False)`; a
runtime must reproduce these token for token. Because Qwen's split regex turns a trailing space into a
lone `Ġ` token, which in the training data is followed by a digit {s.lone_space_digit_share:.0%} of the time
(`x = 0` -> `x`, `Ġ=`, `Ġ`, `0`), plain greedy starts with a digit. "space-healed greedy" drops the
trailing space and restricts the first new token to space-prefixed tokens (simple token healing), then
continues greedily.

{samples}
"""


def _torch_version() -> str:
    import torch

    return torch.__version__


# --------------------------------------------------------------------------------------------- main


def setup_torch(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    torch.use_deterministic_algorithms(True)


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # Must be set before torch loads OpenMP: on a shared, oversubscribed machine the default spin-waiting
    # made training steps 3-4x slower in measurements here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch  # noqa: F401  (heavy import kept out of module scope)

    setup_torch(args.threads)
    corpus = load_corpus(args.heldout_frac, args.seed)
    n_train, n_held = len(corpus.train), len(corpus.heldout)
    print(f"{n_train} train / {n_held} held-out files from {corpus.stdlib}", flush=True)

    tok = build_tokenizer([t for _, t in corpus.train], args.vocab_size)
    train_ids = encode_documents(tok, [t for _, t in corpus.train])
    heldout_text = heldout_sample(corpus.heldout, args.heldout_bytes)
    heldout_ids = torch.tensor(tok.encode(heldout_text, add_special_tokens=False).ids)
    windows = eval_windows(heldout_ids, args.context)
    split_ids = encode_documents(tok, [t for _, t in corpus.heldout])
    print(
        f"tokenizer: {tok.get_vocab_size()} tokens; train stream {train_ids.numel():,} tokens; "
        f"heldout.txt {len(heldout_text.encode())} bytes -> {heldout_ids.numel()} tokens "
        f"({time.perf_counter() - t_start:.0f}s)",
        flush=True,
    )

    config = build_config(args, tok)
    model = build_model(config, args.seed)
    print(f"model: {n_params(model):,} parameters, vocab_size {config.vocab_size}", flush=True)
    log = train(model, train_ids, probe_windows(windows, args.probe_windows), args)

    eval_fp32 = evaluate(model, windows)
    round_to_bf16(model)
    eval_bf16 = evaluate(model, windows)
    split_windows = probe_windows(eval_windows(split_ids, args.context), args.split_eval_windows)
    eval_split = evaluate(model, split_windows)
    print(f"held-out ppl: fp32 {math.exp(eval_fp32[0]):.3f}  bf16 {math.exp(eval_bf16[0]):.3f}", flush=True)
    samples = greedy_samples(model, tok, args.gen_tokens)
    for label, text in samples.items():
        print(f"--- {label}:\n{text}\n", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out / "config.json")
    save_weights(model, out / "model.safetensors")
    write_tokenizer_files(tok, out, args.max_positions)
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    summary = RunSummary(
        args=args,
        corpus=corpus,
        train_tokens=train_ids.numel(),
        vocab_used=tok.get_vocab_size(),
        config=config,
        params=n_params(model),
        log=log,
        heldout_bytes=len(heldout_text.encode("utf-8")),
        heldout_tokens=heldout_ids.numel(),
        eval_fp32=eval_fp32,
        eval_bf16=eval_bf16,
        eval_split_bf16=eval_split,
        samples=samples,
        lone_space_digit_share=lone_space_digit_share(tok, train_ids),
        wall_seconds=time.perf_counter() - t_start,
    )
    (out / "MODEL_CARD.md").write_text(model_card(summary), encoding="utf-8")
    print(f"wrote {out} ({summary.wall_seconds / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
