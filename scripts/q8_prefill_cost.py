"""What 8-bit activations cost a prompt (issue #46): each GGUF file's prefill with ``activations="q8"`` against the
same file with float activations, on a text, as qwen-eval's divergence statistics.

    python scripts/q8_prefill_cost.py FILE.gguf [FILE.gguf ...] [-f TEXT] [--base MODEL] [-c 256]

Every window is one forward pass of ``--ctx`` tokens (a prompt: where the CPU has AMX its products of 16 rows or
more go through the tile kernels, :mod:`qwen_runtime.backend.kernels.amx` / :mod:`~qwen_runtime.backend.kernels.amx_k`;
the count is printed).  Prints, per file, KL(float || q8) per scored token (mean, p99, max), the fraction of
tokens whose greedy (argmax) next token agrees, and the perplexity change; for scale, the same statistics of the
file's float prefill against ``--base`` (default: the bundled model's bf16 weights, the file's own quantization
cost).  ``-f`` defaults to the bundled model's held-out text.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import qwen_runtime
from qwen_convert.demo import bundled_model_path
from qwen_runtime.backend.kernels import amx as jit_amx
from qwen_runtime.backend.kernels import amx_k as jit_amx_k
from qwen_runtime.generation.evaluate import ReferenceStats, evaluate


def counted(module: object, name: str, counts: Counter) -> None:
    """Count the calls of ``module.name`` (the kernel classes look it up at call time)."""
    real = getattr(module, name)

    def wrapper(*args: object) -> None:
        counts[name] += 1
        real(*args)

    setattr(module, name, wrapper)


def row(label: str, stats: ReferenceStats) -> str:
    return (f"| {label} | {stats.kl_mean:.2e} | {stats.kl_p99:.2e} | {stats.kl_max:.2e} | "
            f"{stats.top1_agreement:.2%} | {stats.delta_perplexity:+.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("-f", "--file", help="text to score (default: the bundled model's heldout.txt)")
    parser.add_argument("--base", help="unquantized model for the files' own cost (default: the bundled model)")
    parser.add_argument("-c", "--ctx", type=int, default=256, help="tokens per window (one prompt)")
    args = parser.parse_args()
    base_path = Path(args.base) if args.base else bundled_model_path()
    text = Path(args.file or bundled_model_path() / "heldout.txt").read_text(encoding="utf-8")
    counts: Counter = Counter()
    counted(jit_amx, "q8_0_amx_product", counts)
    counted(jit_amx_k, "kquant_amx_product", counts)
    base = qwen_runtime.load(base_path, kernels="numba", **qwen_runtime.EXACT_CACHE)
    print(f"AMX available: {jit_amx.amx_available()}; windows of {args.ctx} tokens, stride {args.ctx // 2}")
    print("| file, compared | KL mean | KL p99 | KL max | greedy agreement | delta ppl |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        exact = qwen_runtime.load(path, kernels="numba", activations="float", **qwen_runtime.EXACT_CACHE)
        q8 = qwen_runtime.load(path, kernels="numba", activations="q8", **qwen_runtime.EXACT_CACHE)
        counts.clear()
        [result] = evaluate([q8], text, ctx=args.ctx, stride=args.ctx // 2, reference=exact, chunk=args.ctx)
        amx_calls = sum(counts.values())
        print(row(f"{Path(path).name}: q8 vs float activations ({amx_calls} AMX products)", result.vs_reference))
        [own] = evaluate([exact], text, ctx=args.ctx, stride=args.ctx // 2, reference=base, chunk=args.ctx)
        print(row(f"{Path(path).name}: float activations vs {base_path.name} bf16", own.vs_reference))


if __name__ == "__main__":
    main()
