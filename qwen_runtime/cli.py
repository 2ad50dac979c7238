"""``qwen-run``: generate text with a Qwen model from the command line.

    qwen-run MODEL -p "Once upon a time"            raw prompt, streamed
    qwen-run MODEL --chat -p "Hi" -p "Bonjour"      chat template applied, a batch of two
    qwen-run MODEL --chat                           interactive multi-turn chat (also: no -p on a terminal)

Errors print one line on stderr and exit with the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from . import Generation, Model, SamplingParams, chat_format, load, stream
from .cli_support import add_machine_options, run_guarded
from .limits import parse_memory_size


def configure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen-run", description="Generate text with a Qwen model (numpy only).")
    p.add_argument("model", help="HF model directory, npy model directory or GGUF file")
    p.add_argument("-p", "--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument("--no-think", action="store_true", help="Qwen3 chat: pass enable_thinking=false")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-memory", type=parse_memory_size, default=None, metavar="SIZE",
                   help="memory allowed for cache and activations, e.g. 2G (default: 80%% of MemAvailable)")
    p.add_argument("--stats", action="store_true", help="print speed, memory, threads and kernels on stderr")
    add_machine_options(p)
    return p


def memory_status() -> dict[str, int]:
    """VmHWM (peak RSS) and RssAnon (anonymous memory) from /proc/self/status, in kB."""
    values: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values


def print_stats(gen: Generation, out: TextIO) -> None:
    s, mem, ws = gen.stats, memory_status(), gen.model.workspace
    out.write(f"prefill: {s.prompt_tokens} tokens in {s.prefill_seconds:.2f} s "
              f"({s.prefill_tokens_per_second:.1f} tok/s)\n")
    out.write(f"decode: {s.decoded_tokens} tokens in {s.decode_seconds:.2f} s "
              f"({s.decode_tokens_per_second:.1f} tok/s)\n")
    out.write(f"memory: peak RSS {mem.get('VmHWM', 0) / 1024:.1f} MiB, "
              f"anonymous RSS {mem.get('RssAnon', 0) / 1024:.1f} MiB\n")
    out.write(f"kernels: {ws.kernels}, {ws.threads} thread(s)\n")


def run_prompts(model: Model, args: argparse.Namespace, sampling: SamplingParams) -> None:
    """Generate for the ``-p`` prompts: one is streamed as it comes, a batch is printed row by row."""
    gen = stream(model, args.prompt, chat=args.chat, system=args.system, enable_thinking=_thinking(args),
                 max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, max_memory=args.max_memory)
    if len(args.prompt) == 1:
        for texts in gen:
            sys.stdout.write(texts[0])
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        gen.run()
        for i, result in enumerate(gen.results):
            sys.stdout.write(f"--- [{i}] ({result.finish_reason}) ---\n{result.text}\n")
    if args.stats:
        print_stats(gen, sys.stderr)


CHAT_HELP = "commands: /reset clears the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply"


def interactive_chat(model: Model, args: argparse.Namespace, sampling: SamplingParams, stdin: TextIO = sys.stdin,
                     out: TextIO = sys.stdout) -> None:
    """A multi-turn chat: the history goes back through the chat template each turn, replies stream.

    ``/reset`` starts a new conversation (the system message stays), ``/exit`` or end of input quits, and
    Ctrl-C stops the reply being written (what was written stays in the history), not the program.
    """
    fmt = chat_format(model)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    out.write(CHAT_HELP + "\n")
    while True:
        out.write("> ")
        out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # at the prompt: a fresh prompt, as shells do
            out.write("\n")
            continue
        if not line:
            out.write("\n")
            return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(system)
            out.write("(conversation cleared)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        ids = fmt.encode_chat(messages, enable_thinking=_thinking(args))
        gen = stream(model, [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                     use_tokenizer=True, max_memory=args.max_memory)
        reply = []
        try:
            for texts in gen:
                reply.append(texts[0])
                out.write(texts[0])
                out.flush()
        except KeyboardInterrupt:
            out.write(" [stopped]")
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        if args.stats:
            print_stats(gen, sys.stderr)


def _thinking(args: argparse.Namespace) -> bool | None:
    return False if args.no_think else None


def run(args: argparse.Namespace) -> None:
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty,
                              args.presence_penalty, args.frequency_penalty)
    model = load(args.model, threads=args.threads, kernels=args.kernels)
    if args.prompt:
        run_prompts(model, args, sampling)
    elif args.chat or sys.stdin.isatty():
        interactive_chat(model, args, sampling)
    else:
        args.prompt = [sys.stdin.read()]
        run_prompts(model, args, sampling)


def main(argv: Sequence[str] | None = None) -> int:
    args = configure_parser().parse_args(argv)
    return run_guarded("qwen-run", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
