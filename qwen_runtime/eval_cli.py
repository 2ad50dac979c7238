"""``qwen-eval``: perplexity of a text file, and KL divergence from a reference model.

    qwen-eval MODEL -f text.txt                              perplexity (sliding window)
    qwen-eval MODEL-q8_0.gguf -f text.txt --reference HFDIR  + KL(ref || model), top-1 agreement, Δppl
    qwen-eval A B C -f text.txt --executor ray               one Ray task per model (same numbers)

Errors print one line on stderr and exit with the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from tqdm import tqdm

from . import EXACT_CACHE, load
from .backend.limits import activation_bytes
from .backend.weights import weight_overhead
from .cli_support import (
    ArgumentParser,
    add_activations_option,
    add_cache_type_options,
    add_machine_options,
    add_rope_scaling_options,
    cache_types,
    clamp_context,
    positive_int,
    rope_scaling_arg,
    run_guarded,
    window,
)
from .errors import UsageError
from .executor import EXECUTORS, LOCAL, RAY, ExecutorError, RemoteJob, Throttle, connect, run_on_ray
from .formats.rope import RopeScaling
from .generation.evaluate import (
    EvalResult,
    check_models,
    count_targets,
    default_chunk,
    encode_text,
    evaluate_ids,
    read_text,
    results_table,
)
from .models import Model

DEFAULT_CTX = 512
METHOD_HELP = ("Method: the text is tokenized once (BOS only if the model adds one to raw prompts) and cut into "
               "windows of --ctx tokens starting every --stride tokens; each window is run from an empty "
               "cache and scores only the tokens after the previous window's end, so each token is scored "
               "once with at least ctx-stride tokens of context (HF's strided perplexity). Log-softmax in "
               "float64. With --reference, per scored token: KL(ref || model) (mean, median, p99, max), "
               "top-1 agreement and Δppl = ppl(model) - ppl(ref), as llama-perplexity --kl-divergence.")


def configure_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-eval", description="Perplexity of a text file under one or more models, and "
                       "their divergence from a reference model.", epilog=METHOD_HELP)
    p.add_argument("models", nargs="+", metavar="MODEL", help="HF directory, npy directory, GGUF file "
                   "or Hub id ORG/NAME[:QUANT][@REVISION]")
    p.add_argument("-f", "--file", required=True, help="UTF-8 text file to score (required, no default)")
    p.add_argument("--reference", metavar="REF", help="reference model (same tokenizer) for KL divergence, run "
                   "with an exact f32 KV cache whatever -ctk/-ctv say (default: none)")
    p.add_argument("-c", "--ctx", type=window, default=None, help=f"window length in tokens, at least 2; more than "
                   f"a model's context length is cut to it, with a note (default: {DEFAULT_CTX}, or the model's "
                   "context length when smaller)")
    p.add_argument("--stride", type=positive_int, default=None, help="tokens between window starts, at most --ctx "
                   "(default: ctx/2)")
    p.add_argument("--eval-tokens", "--max-tokens", dest="max_tokens", type=positive_int, default=None, metavar="N",
                   help="score only the first N tokens of the text (default: all of it)")
    p.add_argument("--chunk", type=positive_int, default=None, help="tokens per forward pass inside a window; bounds "
                   "memory to a few chunk x vocab float64 arrays (default: about 4M logits, 8 to 256 tokens)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--executor", choices=EXECUTORS, default=LOCAL, help="score the models together in this "
                   "process (local) or as one Ray task per model over the same tokens (ray; needs the ray extra; "
                   "the reference then runs in every task)")
    p.add_argument("--address", metavar="ADDR", help="with --executor ray: the Ray cluster to use (auto, "
                   "HOST:6379 or ray://HOST:10001; default: the RAY_ADDRESS variable, else a local instance)")
    add_machine_options(p)
    add_activations_option(p, default="float")  # a measurement: the exact numbers unless asked otherwise
    add_cache_type_options(p)
    add_rope_scaling_options(p)
    return p


# Memory of one model's evaluation (a Ray task's declared need), on top of the memory-mapped weights, which
# live in the page cache and are not counted (as in :mod:`qwen_runtime.backend.limits`):
EVAL_BASE_BYTES = 300 << 20  # interpreter, numpy, tokenizers and both models' tokenizers, with margin
LOGIT_COPIES = 8  # float64 [chunk, V] arrays alive at once: logits, log-softmax and its exp temporary for the
# model and the reference, the reference's probabilities and the KL difference


def eval_memory(model: Model, reference: Model | None, ctx: int, chunk: int | None) -> int:
    """Bytes one model's evaluation task needs at its peak (see the constants above)."""
    need = EVAL_BASE_BYTES
    for m in (model, *([reference] if reference is not None else [])):
        c = m.config
        step = chunk or default_chunk(c.vocab_size)
        need += m.cache_bytes(1, ctx) + activation_bytes(c, 1, ctx, step) + LOGIT_COPIES * step * c.vocab_size * 8
        need += weight_overhead(m.files.tensors.values(), m.workspace.kernels)
    return need


def evaluate_task(path: str, ids: object, ctx: int, stride: int, reference: str | None, chunk: int | None,
                  threads: int, kernels: str, activations: str, cache: dict[str, str],
                  rope_scaling: RopeScaling | None, report: Callable[[int], None]) -> EvalResult:
    """One model's evaluation as a Ray task: the local lockstep run with this model alone, on the driver's
    thread count, kernels, activations, RoPE scaling and cache types (``cache``: :func:`load`'s keywords, for the
    models: the reference keeps an exact f32 cache; float32 sums are split by thread and kernel, so both are part of the
    result)."""
    progress = Throttle(report)
    model = load(path, threads=threads, kernels=kernels, activations=activations, rope_scaling=rope_scaling, **cache)
    ref = load(reference, threads=threads, kernels=kernels, activations=activations, rope_scaling=rope_scaling,
               **EXACT_CACHE) if reference else None
    [result] = evaluate_ids([model], ids, ctx, stride, ref, chunk, progress.add)
    progress.flush()
    return result


def evaluate_on_ray(args: argparse.Namespace, models: list[Model], reference: Model | None, ids: object, ctx: int,
                    stride: int, progress: Callable[[int], None]) -> list[EvalResult]:
    """One Ray task per model over the same token ids; the driver has checked the models (vocabulary, ctx)."""
    check_models(models, reference, ctx)
    connect(args.address)
    threads, kernels = models[0].workspace.threads, models[0].workspace.kernels
    jobs = [RemoteJob((path, ids, ctx, stride, args.reference, args.chunk, threads, kernels, args.activations,
                       cache_types(args), rope_scaling_arg(args)),
                      eval_memory(model, reference, ctx, args.chunk), num_cpus=threads, name=f"qwen-eval {path}")
            for path, model in zip(args.models, models, strict=True)]
    def lost(i: int, exc: BaseException) -> EvalResult:
        raise ExecutorError(f"{args.models[i]}: the Ray task failed: {type(exc).__name__}: {exc}") from None

    return run_on_ray(evaluate_task, jobs, on_event=lambda _, n: progress(n), on_lost=lost)


def run(args: argparse.Namespace) -> None:
    rope = rope_scaling_arg(args)
    models = [load(path, threads=args.threads, kernels=args.kernels, activations=args.activations, rope_scaling=rope,
                   **cache_types(args)) for path in args.models]
    reference = (load(args.reference, threads=args.threads, kernels=args.kernels, activations=args.activations,
                      rope_scaling=rope, **EXACT_CACHE)
                 if args.reference else None)  # an exact f32 cache: --reference MODEL -ctk f16 measures the cache
    limit = min(m.config.context_window for m in (*models, *([reference] if reference else [])))
    ctx = clamp_context("qwen-eval", args.ctx, limit, sys.stderr) if args.ctx else min(DEFAULT_CTX, limit)
    if args.stride is not None and args.stride > ctx:
        raise UsageError(f"--stride {args.stride} is more than the window of {ctx} tokens (--ctx): tokens between "
                         "windows would never be scored")
    stride = args.stride or max(1, ctx // 2)
    ids = encode_text(models[0], read_text(args.file), args.max_tokens)
    remote = args.executor == RAY
    with tqdm(total=count_targets(len(ids), ctx, stride) * (len(models) if remote else 1), desc="scoring",
              unit="tok", leave=False, dynamic_ncols=True, disable=None) as bar:
        if remote:
            results = evaluate_on_ray(args, models, reference, ids, ctx, stride, bar.update)
        else:
            results = evaluate_ids(models, ids, ctx, stride, reference, args.chunk, bar.update)
    if args.json:
        print(json.dumps({"file": args.file, "results": [r.to_json() for r in results]}, indent=1))
        return
    r = results[0]
    print(f"{args.file}: {r.tokens} tokens evaluated, {r.scored} scored\nmethod: {r.method}")
    print(results_table(results))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-eval``."""
    parser = configure_parser()
    args = parser.parse_args(argv)
    if args.address is not None and args.executor != RAY:
        parser.error("--address needs --executor ray")
    return run_guarded("qwen-eval", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
