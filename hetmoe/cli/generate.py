"""``hetmoe generate``: one completion of a prompt, streamed to stdout (progress and timing on stderr), or one
JSON object with the text, the token counts and the timings."""

from __future__ import annotations

import argparse
import json
import sys

from hetmoe.cli.options import add_sampling_options, open_llm
from hetmoe.config.flags import add_engine_options

DEFAULT_PROMPT = "Write a Python function `read_lines`: Return the lines of a text file as a list."


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate a completion (text to stdout, progress and timing to stderr)")
    p.add_argument("--prompt", "-p", default=None,
                   help="the prompt ('-' reads stdin; default: a short built-in prompt)")
    p.add_argument("--raw", action="store_true",
                   help="use the prompt as is (default: wrap it in the model's chat template when it has one)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, timings) instead")
    add_engine_options(p)
    add_sampling_options(p)
    p.set_defaults(handler=run)
    return p


def _stream(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _timing(result) -> str:
    t = result.timings
    return (f"hetmoe: {result.prompt_tokens} prompt tokens in {t.prefill_s:.2f} s ({t.prefill_tok_s:.1f} tok/s), "
            f"{result.completion_tokens} generated in {t.decode_s:.2f} s ({t.decode_tok_s:.1f} tok/s), "
            f"finish: {result.finish_reason}")


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    elif prompt is None:
        prompt = DEFAULT_PROMPT
    if not prompt:
        raise ValueError("the prompt is empty")
    llm = open_llm(args)
    if args.json:
        result = llm.generate(prompt, chat=not args.raw)
        t = result.timings
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "prefill_s": t.prefill_s, "decode_s": t.decode_s, "decode_tok_s": t.decode_tok_s}))
    else:
        result = llm.generate(prompt, chat=not args.raw, on_text=_stream)
        sys.stdout.write("\n")
        print(_timing(result), file=sys.stderr)
    return 0
