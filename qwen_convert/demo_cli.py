"""``qwen-demo``: convert the bundled model to six outputs, then show their size, quality and speed.

    qwen-demo                                   bundled qwen3-stdlib model -> ./qwen-demo-out/
    qwen-demo --model ~/models/Qwen3-0.6B -f some.txt -o /tmp/q

Errors print one line on stderr and exit with the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from qwen_runtime.backend.limits import format_bytes
from qwen_runtime.cli_support import ArgumentParser, add_machine_options, positive_int, run_guarded, window
from qwen_runtime.generation.evaluate import METHOD, EvalResult, count_targets, read_text

from .cli import TqdmProgress
from .demo import (
    DEFAULT_OUT,
    KQUANT_MIXES,
    LOWBIT_MIXES,
    Completion,
    DemoOutput,
    bundled_model_path,
    calibration_text,
    complete_in_fresh_process,
    heldout_text_path,
    measure_quality,
    prepare_kquant_outputs,
    prepare_outputs,
)

# The bundled 4M-parameter model needs context: after a bare "def " (a lone space token, followed by a digit
# in most of its training data) greedy decoding prints zeros; mid-signature it writes Python-looking code.
DEFAULT_PROMPT = "class Reader:\n    def __init__(self"


def configure_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-demo", description="Convert a model (default: the bundled "
                                "qwen3-stdlib) to npy and GGUF in fp32, fp16 and q8_0; print each output's "
                                "size and error vs the source, its perplexity and KL divergence from the "
                                "source on held-out text, and a greedy completion with speed and peak RSS.")
    p.add_argument("-o", "--output", "--out", dest="out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                   help="output directory (default: ./qwen-demo-out; complete outputs of the same source are reused)")
    p.add_argument("--model", type=Path, default=None, metavar="MODEL",
                   help="HF model directory to use instead of the bundled one (default: the bundled qwen3-stdlib)")
    p.add_argument("-f", "--file", "--text", dest="text", type=Path, default=None, metavar="FILE",
                   help="text to evaluate on (default: the model's heldout.txt, else the bundled model's)")
    p.add_argument("--kquants", action="store_true",
                   help=f"also score a GGUF per K-quant/IQ4 mix ({', '.join(KQUANT_MIXES)}), without and with "
                   "an importance matrix computed on standard-library modules absent from the text, in the quality "
                   "table (default: off: 14 more outputs to convert and score; completions stay the six above)")
    p.add_argument("--lowbit", action="store_true",
                   help=f"also score llama.cpp's 1.5-3.5-bit mixes ({', '.join(LOWBIT_MIXES)}) with that importance "
                   "matrix, and without it where llama-quantize writes the mix without one (default: off)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT,
                   help=f"prompt completed by every output (default: {DEFAULT_PROMPT!r})")
    p.add_argument("-n", "--max-new-tokens", type=positive_int, default=32, metavar="N",
                   help="tokens each output generates (default 32)")
    p.add_argument("--eval-tokens", type=positive_int, default=2048, help="tokens of the text to score (default: 2048)")
    p.add_argument("-c", "--ctx", type=window, default=256, help="perplexity window (default 256, the bundled model's "
                   "training context)")
    p.add_argument("--stride", type=positive_int, default=128, help="tokens between perplexity windows (default 128)")
    add_machine_options(p)
    return p


def outputs_table(outputs: Sequence[DemoOutput]) -> str:
    """Output, status, size, bytes/parameter and the whole-model weight error vs the source."""
    width = max(len(o.path.name) for o in outputs)
    lines = [f"{'output':<{width}}  {'status':<9}  {'size':>9}  {'bytes/param':>11}  {'rmse':>9}  {'snr dB':>7}  "
             f"{'min cosine':>10}"]
    for o in outputs:
        lines.append(f"{o.path.name:<{width}}  {o.status:<9}  {format_bytes(o.nbytes):>9}  "
                     f"{o.bytes_per_parameter:>11.3f}  {o.rmse:>9.2e}  {o.snr_db:>7.1f}  {o.min_cosine:>10.7f}")
    return "\n".join(lines)


def quality_table(outputs: Sequence[DemoOutput], results: Sequence[EvalResult]) -> str:
    """Perplexity, Δppl, KL(source || output) mean/p99/max and top-1 agreement per output."""
    ref = results[0].vs_reference
    width = max([10] + [len(o.label) for o in outputs])
    lines = [f"{'output':<{width}}  {'size':>9}  {'bpw':>5}  {'ppl':>9}  {'Δppl':>9}  {'KL mean':>9}  {'KL p99':>9}  "
             f"{'KL max':>9}  {'top-1':>7}",
             f"{'source':<{width}}  {'':>9}  {'':>5}  {ref.reference_perplexity:>9.4f}  {'(ref)':>9}"]
    for o, r in zip(outputs, results, strict=True):
        v = r.vs_reference
        lines.append(f"{o.label:<{width}}  {format_bytes(o.nbytes):>9}  {8 * o.bytes_per_parameter:>5.2f}  "
                     f"{r.perplexity:>9.4f}  {v.delta_perplexity:>+9.4f}  {v.kl_mean:>9.2e}  {v.kl_p99:>9.2e}  "
                     f"{v.kl_max:>9.2e}  {100 * v.top1_agreement:>6.2f}%")
    return "\n".join(lines)


def completion_line(output: DemoOutput, c: Completion) -> str:
    return (f"{output.label:<10}  {c.tokens_per_second:>7.1f} tok/s decode  peak RSS {c.peak_rss_kb / 1024:>6.1f} MiB  "
            f"load {c.load_seconds:.2f} s  {c.new_tokens} tokens: {c.text!r}")


def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    src = args.model or bundled_model_path()
    text_path = heldout_text_path(src, args.text)
    text = read_text(text_path)
    print(f"qwen-demo: source {src}\n\n1. Outputs in {args.out} (written by qwen_convert, compared with "
          "qwen_convert.inspect.compare against the source)")
    outputs = prepare_outputs(src, args.out, TqdmProgress())
    scored = list(outputs)
    mixes = (KQUANT_MIXES if args.kquants else ()) + (LOWBIT_MIXES if args.lowbit else ())
    if mixes:
        scored += prepare_kquant_outputs(src, args.out, calibration_text(text), TqdmProgress(), mixes)
    print(outputs_table(scored))
    print(f"\n2. Quality on {text_path}: first {args.eval_tokens} tokens, "
          f"{METHOD.format(ctx=args.ctx, stride=args.stride)}; KL(source || output) per token")
    with tqdm(total=count_targets(args.eval_tokens, args.ctx, args.stride), desc="scoring", unit="tok",
              leave=False, dynamic_ncols=True, disable=None) as bar:
        results = measure_quality(src, scored, text, args.eval_tokens, args.ctx, args.stride, bar.update,
                                  args.threads, args.kernels)
    print(quality_table(scored, results))
    print(f"\n3. Greedy completion of {args.prompt!r}, {args.max_new_tokens} new tokens; each output runs in a "
          "fresh subprocess (peak RSS = its VmHWM, memory-mapped weights included)")
    for output in outputs:
        completion = complete_in_fresh_process(output.path, args.prompt, args.max_new_tokens, args.threads,
                                               args.kernels)
        print(completion_line(output, completion), flush=True)
    print(f"\nqwen-demo: done in {time.perf_counter() - started:.1f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``qwen-demo``."""
    parser = configure_parser()
    args = parser.parse_args(argv)
    if args.stride > args.ctx:
        parser.error(f"--stride {args.stride} is more than the window --ctx {args.ctx}: tokens between windows "
                     "would never be scored")
    return run_guarded("qwen-demo", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
