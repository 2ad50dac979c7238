"""``qwen-run``: generate text with a Qwen model from the command line.

    qwen-run MODEL -p "Once upon a time"            raw prompt, streamed
    qwen-run MODEL -f prompt.txt -n 64              the prompt read from a file (- for stdin)
    qwen-run MODEL --chat -p "Hi" -p "Bonjour"      chat template applied, a batch of two
    qwen-run MODEL --chat                           interactive multi-turn chat (also: no -p on a terminal)

Errors print one line on stderr and exit with the code of :func:`qwen_runtime.errors.exit_code`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from . import Generation, Model, SamplingParams, chat_format, encode_prompts, load, stream
from .backend.limits import format_bytes
from .cli_support import (
    ArgumentParser,
    add_activations_option,
    add_cache_type_options,
    add_draft_option,
    add_machine_options,
    add_rope_scaling_options,
    cache_note,
    cache_types,
    clamp_context,
    memory_size,
    positive_int,
    rope_scaling_arg,
    run_guarded,
)
from .errors import ContextOverflowError, UsageError
from .text.chat import fit_chat, reply_budget

EPILOG = """\
Where the prompt comes from: each -p and each -f FILE is one prompt (several make a batch, printed row by
row); with neither, standard input is read to its end when it is not a terminal (printf 'def f(' | qwen-run
MODEL); with --chat and no prompt, or on a terminal, an interactive chat starts, one line per message (piped
lines work too). A reply stops at the model's stop tokens, at -n tokens, or where the context is full: -n is
cut to what the context leaves after the prompt (a note on stderr says so), and a chat drops its oldest turns
(the system message stays) to keep room for a reply of -n tokens or half the context, whichever is less.

Sampling: qwen-run is greedy by default (--temperature 0: the same text every run) and ignores the model's
generation_config.json; qwen-serve instead samples with the model's generation_config.json defaults
(temperature, top-p, top-k, ...) for every field a request leaves out."""


def configure_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="qwen-run", description="Generate text with a Qwen model (numpy only).", epilog=EPILOG)
    p.add_argument("model", metavar="MODEL", help="HF model directory, npy model directory, GGUF file or Hub id "
                   "ORG/NAME[:QUANT][@REVISION]")
    p.add_argument("-p", "--prompt", action="append", default=[],
                   help="prompt text (repeat for a batch; default: none, see below)")
    p.add_argument("-f", "--file", action="append", default=[], type=Path, metavar="FILE",
                   help="read a prompt from FILE, '-' for standard input (repeat for a batch; default: none)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt; without a "
                   "prompt, an interactive chat")
    p.add_argument("--system", default=None, help="system message (needs --chat; default: none)")
    p.add_argument("--no-think", action="store_true", help="Qwen3 chat: pass enable_thinking=false")
    p.add_argument("-n", "--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens to generate per reply, cut to what the context leaves")
    p.add_argument("-c", "--ctx", type=positive_int, default=None, metavar="TOKENS", help="context length to use, "
                   "prompt + reply; more than the model's is cut to it, with a note (default: the model's context "
                   "length)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="sample in the smallest set of probability >= p; 1 = all")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF's, over prompt and output (> 1 penalizes repeats); 1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2); 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2); 0 = off")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampler (default: a fresh one each "
                   "run; greedy decoding needs none)")
    p.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory allowed for cache and activations, e.g. 2G (default: 80%% of MemAvailable)")
    p.add_argument("--stats", action="store_true", help="print speed, memory, threads and kernels on stderr")
    add_draft_option(p, "; several prompts at once decode plainly")
    add_machine_options(p)
    add_rope_scaling_options(p)
    add_activations_option(p)
    add_cache_type_options(p)
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
    out.write(f"memory: peak RSS {format_bytes(mem.get('VmHWM', 0) << 10)}, "
              f"anonymous RSS {format_bytes(mem.get('RssAnon', 0) << 10)}\n")
    q8 = "" if ws.activations == "float" else f", activations {ws.activations}"
    out.write(f"kernels: {ws.kernels}{q8}, {ws.threads} thread(s)\n")
    if ws.kernels == "numba":
        refusal = gen.model.step_refusal
        out.write(f"decode step: {'compiled' if refusal is None else 'op by op, ' + refusal}\n")
    out.write(f"{cache_note(gen.model)}\n{gen.plan.summary()}\n")
    if s.draft_proposed:
        out.write(f"drafts: {s.draft_accepted} of {s.draft_proposed} accepted "
                  f"({s.draft_accepted / s.draft_proposed:.0%})\n")


def context_length(model: Model, args: argparse.Namespace, err: TextIO | None = None) -> int:
    """The context a prompt and its reply share: ``--ctx``, cut to the model's with a note (as qwen-serve does)."""
    return clamp_context("qwen-run", args.ctx, model.config.context_window, err or sys.stderr)


def draft_note(args: argparse.Namespace, prompts: int) -> str | None:
    """Why ``--draft`` cannot apply to this run (a note for stderr), or None when it applies or was not asked."""
    if not args.draft:
        return None
    if args.temperature > 0:
        why = "sampled replies (--temperature > 0) decode plainly"
    elif prompts > 1:
        why = "several prompts at once decode plainly"
    else:
        return None
    return f"qwen-run: note: --draft is off: {why}\n"


def budget_note(asked: int, allowed: int, prompt_tokens: int, context: int) -> str:
    return (f"qwen-run: note: --max-new-tokens cut from {asked} to {allowed}: the prompt of {prompt_tokens} tokens "
            f"leaves {allowed} of the context of {context}\n")


def run_prompts(model: Model, args: argparse.Namespace, sampling: SamplingParams, err: TextIO | None = None) -> None:
    """Generate for the prompts: one is streamed as it comes, a batch is printed row by row.

    ``--max-new-tokens`` is cut to what the context leaves after the longest prompt, with a note on stderr.
    """
    err = err or sys.stderr
    ids = encode_prompts(model, args.prompt, args.chat, args.system, _thinking(args))
    context, longest = context_length(model, args, err), max(len(i) for i in ids)
    note = draft_note(args, len(ids))
    if note:
        err.write(note)
    max_new = reply_budget(longest, args.max_new_tokens, context)
    if max_new < args.max_new_tokens:
        err.write(budget_note(args.max_new_tokens, max_new, longest, context))
    gen = stream(model, ids, max_new_tokens=max_new, sampling=sampling, seed=args.seed, use_tokenizer=True,
                 max_memory=args.max_memory, draft_tokens=args.draft)
    if len(ids) == 1:
        for texts in gen:
            sys.stdout.write(texts[0])
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        gen.run()
        for i, result in enumerate(gen.results):
            sys.stdout.write(f"--- [{i}] ({result.finish_reason}) ---\n{result.text}\n")
    if args.stats:
        print_stats(gen, err)


CHAT_HELP = ("commands: /help shows this, /reset clears the conversation, /exit (or Ctrl-D) quits; "
             "Ctrl-C stops a reply")


def interactive_chat(model: Model, args: argparse.Namespace, sampling: SamplingParams, stdin: TextIO = sys.stdin,
                     out: TextIO = sys.stdout, err: TextIO | None = None) -> None:
    """A multi-turn chat: the history goes back through the chat template each turn, replies stream.

    ``/help`` lists the commands, ``/reset`` starts a new conversation (the system message stays), ``/exit``
    or end of input quits, and Ctrl-C stops the reply being written (what was written stays in the history),
    not the program.  When the history and the reply would not fit the context, the oldest turns are dropped
    (:func:`qwen_runtime.text.chat.fit_chat`) and stderr says so; a message that cannot fit is refused, not sent.
    """
    err = err or sys.stderr
    chat = _Chat(model, args, sampling, out, err)
    note = draft_note(args, 1)
    if note:
        err.write(note)
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
        if line.startswith("/") and " " not in line:
            chat.command(line)
        elif line:
            chat.turn(line)


class _Chat:
    """The conversation of :func:`interactive_chat`: its messages, the commands that change them, and one turn."""

    def __init__(self, model: Model, args: argparse.Namespace, sampling: SamplingParams, out: TextIO,
                 err: TextIO) -> None:
        self.model, self.args, self.sampling, self.out, self.err = model, args, sampling, out, err
        self.fmt, self.context = chat_format(model), context_length(model, args, err)
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages = list(self.system)

    def command(self, line: str) -> None:
        """``/reset`` or ``/help``; any other single word starting with ``/`` is named as unknown."""
        if line == "/reset":
            self.messages = list(self.system)
            self.out.write("(conversation cleared)\n")
        elif line == "/help":
            self.out.write(CHAT_HELP + "\n")
        else:
            self.out.write(f"(unknown command {line}; /help lists them)\n")

    def turn(self, line: str) -> None:
        """Fit the history and the user's ``line`` into the context, then stream the reply into the history."""
        args, err = self.args, self.err
        try:
            fitted = fit_chat(self.fmt, [*self.messages, {"role": "user", "content": line}], self.context,
                              args.max_new_tokens, _thinking(args))
        except ContextOverflowError as exc:
            err.write(f"qwen-run: {exc}; the message was not sent\n")
            return
        if fitted.dropped_turns:
            err.write(f"qwen-run: note: dropped the oldest {fitted.dropped_turns} turn(s) to fit the context of "
                      f"{self.context} tokens\n")
        if fitted.max_new_tokens < args.max_new_tokens:
            err.write(budget_note(args.max_new_tokens, fitted.max_new_tokens, len(fitted.ids), self.context))
        self.messages = fitted.messages
        gen = stream(self.model, [fitted.ids], max_new_tokens=fitted.max_new_tokens, sampling=self.sampling,
                     seed=args.seed, use_tokenizer=True, max_memory=args.max_memory, draft_tokens=args.draft)
        reply = []
        try:
            for texts in gen:
                reply.append(texts[0])
                self.out.write(texts[0])
                self.out.flush()
        except KeyboardInterrupt:
            gen.close()
            self.out.write(" [stopped]")
        self.out.write("\n")
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        if args.stats:
            print_stats(gen, err)


def _thinking(args: argparse.Namespace) -> bool | None:
    return False if args.no_think else None


def read_prompt_file(path: Path) -> str:
    if str(path) == "-":
        return sys.stdin.read()
    return path.read_text(encoding="utf-8")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling options as :class:`SamplingParams`; a value out of range is a :class:`UsageError` naming its
    flag (``--top-p``), not the field (``top_p``)."""
    fields = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    try:
        return SamplingParams(*(getattr(args, f) for f in fields))
    except ValueError as exc:
        message = str(exc).removeprefix("sampling: ")
        for field in fields:
            message = re.sub(rf"^{field}\b", "--" + field.replace("_", "-"), message)
        raise UsageError(message) from None


def run(args: argparse.Namespace, sampling: SamplingParams) -> None:
    model = load(args.model, threads=args.threads, kernels=args.kernels, activations=args.activations,
                 rope_scaling=rope_scaling_arg(args), **cache_types(args))
    args.prompt = [*args.prompt, *(read_prompt_file(f) for f in args.file)]
    if args.prompt:
        run_prompts(model, args, sampling)
    elif args.chat or sys.stdin.isatty():
        interactive_chat(model, args, sampling)
    else:
        args.prompt = [sys.stdin.read()]
        run_prompts(model, args, sampling)


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser()
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat (a raw prompt has no system message)")
    if args.no_think and not args.chat:
        parser.error("--no-think needs --chat (it is passed to the chat template)")
    return run_guarded("qwen-run", lambda: run(args, sampling_params(args)))


if __name__ == "__main__":
    sys.exit(main())
