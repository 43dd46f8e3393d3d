"""The sampling flags (``add_sampling_options``), the LLM a command's flags ask for (``open_llm``) and the synthetic
model flags of the benchmarks. The argument types and the engine flags are hetmoe/config/flags.py's."""

from __future__ import annotations

import argparse
import sys

from hetmoe.config.flags import (
    MODEL_SHAPES,
    engine_options,
    expert_cache,
    min_p,
    nonneg_float,
    nonneg_int,
    penalty,
    positive_float,
    positive_int,
    stop,
    top_p,
)

# ---------------------------------------------------------------------------------------------- sampling, shapes


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=positive_int, default=max_tokens,
                   help=f"most tokens per reply, as max_tokens in Python and the API (--max-new-tokens: the same; "
                   f"default: {max_tokens})")
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling mass, (0, 1] (default: 1 = off)")
    g.add_argument("--top-k", type=nonneg_int, default=0,
                   help="sample among the k most likely tokens (default: 0 = off)")
    g.add_argument("--min-p", type=min_p, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one, [0, 1] (default: 0 = off)")
    g.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                   help="divide the positive logits (multiply the negative ones) of tokens already in the prompt or "
                   "the reply by this, > 0 (default: 1 = off)")
    g.add_argument("--presence-penalty", type=penalty, default=0.0,
                   help="subtract this from the logits of tokens already in the reply, [-2, 2] (default: 0 = off)")
    g.add_argument("--frequency-penalty", type=penalty, default=0.0,
                   help="subtract this times its count in the reply from a token's logit, [-2, 2] (default: 0 = off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", type=stop, action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    """The SamplingParams that ``args`` (parsed with add_sampling_options) ask for."""
    from hetmoe.engine.sampler import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty)


def open_llm(args: argparse.Namespace):
    """The LLM of the engine options in ``args``, its default sampling from the sampling options."""
    from hetmoe.engine.llm import LLM

    params = sampling_params(args)  # validate before the (possibly long) load
    llm = LLM(args.model, engine_options(args), expert_cache=expert_cache(args), progress=sys.stderr.isatty())
    llm.default_params = params
    return llm


def add_shape_options(p: argparse.ArgumentParser) -> None:
    """Serve a real model shape with random weights built in memory instead of a checkpoint (benchmarks)."""
    g = p.add_argument_group("synthetic model (instead of --model)")
    g.add_argument("--shape", choices=MODEL_SHAPES, default=None,
                   help="a real model shape with random weights and a word-per-token tokenizer")
    g.add_argument("--layers", type=positive_int, default=None, help="decoder layers of --shape (default: all)")
