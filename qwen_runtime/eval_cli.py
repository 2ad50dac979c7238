"""``qwen-eval``: perplexity of a text file, and KL divergence from a reference model.

    qwen-eval MODEL -f text.txt                              perplexity (sliding window)
    qwen-eval MODEL-q8_0.gguf -f text.txt --reference HFDIR  + KL(ref || model), top-1 agreement, Δppl

Errors print one line on stderr and exit with the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tqdm import tqdm

from . import load
from .cli_support import run_guarded
from .evaluate import count_targets, encode_text, evaluate_ids, read_text, results_table

DEFAULT_CTX = 512
METHOD_HELP = ("Method: the text is tokenized once (BOS only if the model adds one to raw prompts) and cut into "
               "windows of --ctx tokens starting every --stride tokens; each window is run from an empty "
               "cache and scores only the tokens after the previous window's end, so each token is scored "
               "once with at least ctx-stride tokens of context (HF's strided perplexity). Log-softmax in "
               "float64. With --reference, per scored token: KL(ref || model) (mean, median, p99, max), "
               "top-1 agreement and Δppl = ppl(model) - ppl(ref), as llama-perplexity --kl-divergence.")


def configure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen-eval", description="Perplexity of a text file under one or more "
                                "models, and their divergence from a reference model.", epilog=METHOD_HELP)
    p.add_argument("models", nargs="+", metavar="MODEL", help="HF directory, npy directory or GGUF file")
    p.add_argument("-f", "--file", required=True, help="UTF-8 text file to score")
    p.add_argument("--reference", metavar="REF", help="reference model (same tokenizer) for KL divergence")
    p.add_argument("--ctx", type=int, default=None, help=f"window length in tokens (default: {DEFAULT_CTX}, "
                   "or the model's context length when smaller)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: ctx/2)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward pass inside a window; bounds "
                   "memory to a few chunk x vocab float64 arrays (default: about 4M logits, 8 to 256 tokens)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def run(args: argparse.Namespace) -> None:
    models = [load(path) for path in args.models]
    reference = load(args.reference) if args.reference else None
    ctx = args.ctx or min(DEFAULT_CTX, *(m.config.max_position_embeddings for m in models))
    stride = args.stride or max(1, ctx // 2)
    ids = encode_text(models[0], read_text(args.file), args.max_tokens)
    with tqdm(total=count_targets(len(ids), ctx, stride), desc="scoring", unit="tok", leave=False,
              dynamic_ncols=True, disable=None) as bar:
        results = evaluate_ids(models, ids, ctx, stride, reference, args.chunk, bar.update)
    if args.json:
        print(json.dumps({"file": args.file, "results": [r.to_json() for r in results]}, indent=1))
        return
    r = results[0]
    print(f"{args.file}: {r.tokens} tokens evaluated, {r.scored} scored\nmethod: {r.method}")
    print(results_table(results))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-eval``."""
    args = configure_parser().parse_args(argv)
    return run_guarded("qwen-eval", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
