"""What ``hetmoe generate`` and ``hetmoe chat`` do (the argument parsing is in cli.py)."""

from __future__ import annotations

import argparse
import json
import sys

from hetmoe.engine.generation import SamplingParams
from hetmoe.engine.llm import LLM
from hetmoe.engine.placement import EngineOptions

DEFAULT_PROMPT = "Write a Python function `read_lines`: Return the lines of a text file as a list."


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(device=args.device, experts_format=args.experts_format, group_size=args.group_size,
                         threads=args.threads, numa=args.numa, max_context=args.max_context, dtype=args.dtype,
                         defer_experts=args.defer_experts, gpu_experts=args.gpu_experts,
                         calibration_file=args.calibration_file, cuda_graph=not args.no_cuda_graph, isa=args.isa)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))


def open_llm(args: argparse.Namespace) -> LLM:
    params = sampling_params(args)  # validate before the (possibly long) load
    llm = LLM(args.model, engine_options(args), expert_cache=None if args.expert_cache == "off" else args.expert_cache,
              progress=sys.stderr.isatty())
    llm.default_params = params
    return llm


def _stream(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _timing(result) -> str:
    t = result.timings
    return (f"hetmoe: {result.prompt_tokens} prompt tokens in {t.prefill_s:.2f} s ({t.prefill_tok_s:.1f} tok/s), "
            f"{result.completion_tokens} generated in {t.decode_s:.2f} s ({t.decode_tok_s:.1f} tok/s), "
            f"finish: {result.finish_reason}")


def run_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    elif prompt is None:
        prompt = DEFAULT_PROMPT
    if not prompt:
        raise ValueError("the prompt is empty")
    llm = open_llm(args)
    if args.json:
        result = llm.generate(prompt, llm.default_params, chat=not args.raw)
        t = result.timings
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                          "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                          "prefill_s": t.prefill_s, "decode_s": t.decode_s, "decode_tok_s": t.decode_tok_s}))
    else:
        result = llm.generate(prompt, llm.default_params, chat=not args.raw, on_text=_stream)
        sys.stdout.write("\n")
        print(_timing(result), file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = open_llm(args)
    if not llm.tokenizer.has_chat_template:
        raise ValueError("this model's tokenizer has no chat template; use `hetmoe generate --raw` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    print("hetmoe chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        try:
            result = llm.generate(messages, llm.default_params, on_text=_stream)
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
            messages.pop()
            continue
        except ValueError as err:  # e.g. the conversation no longer fits the context
            print(f"\nhetmoe chat: {err}", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_timing(result), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0
