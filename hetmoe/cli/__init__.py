"""The ``hetmoe`` command: ``generate``, ``chat``, ``serve``, ``eval``, ``plan``, ``tune``, ``doctor``,
``bench kernel|overhead|e2e|serve``.

One module per command, each with its ``add_parser(subparsers)`` and its ``run(args)``; the option groups they
share are in options.py. Parsing imports only the standard library and EngineOptions (whose fields make the
engine flags), so ``hetmoe --help`` is instant; torch and ``hetmoe._C`` are imported when a command runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from hetmoe import __version__, envs
from hetmoe.cli import bench, chat, doctor, eval, generate, plan, serve, tune
from hetmoe.config.flags import ISAS, MODEL_SHAPES, SHAPE_NAMES, engine_usage_error

__all__ = ["Parser", "build_parser", "main", "ISAS", "MODEL_SHAPES", "SHAPE_NAMES"]

COMMANDS = (generate, chat, serve, eval, plan, tune, doctor, bench)  # in the order `hetmoe --help` lists them

_KINDS = {"int": "an integer", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """argparse with hetmoe's one error style: the usage, then ``hetmoe CMD: error: --option: what`` (exit 2)
    with the values as typed (no Python quotes or reprs); runtime errors are ``hetmoe CMD: error: what`` (exit 1,
    in ``main``)."""

    def error(self, message: str):
        message = re.sub(r"^argument ", "", message)
        message = re.sub(r"invalid choice: '([^']*)' \(choose from (.*)\)$",
                         lambda m: f"invalid choice: {m[1]} (choose from {m[2].replace(chr(39), '')})", message)
        message = re.sub(r"invalid (\w+) value: '([^']*)'$",
                         lambda m: f"expected {_KINDS.get(m[1], 'a valid value')}, got {m[2]}", message)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hetmoe", description="Giant MoE models on one GPU plus CPU DRAM.")
    parser.add_argument("--version", action="version", version=f"hetmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # none: main prints the help
    for command in COMMANDS:
        command.add_parser(sub)
    # each parser by the words that name it, for its usage errors: "", "generate", ..., "bench", "bench kernel"
    parser.commands = {"": parser, **sub.choices,
                       **{f"bench {n}": p for n, p in sub.choices["bench"].benches.items()}}
    return parser


def _usage_errors(args: argparse.Namespace) -> Optional[str]:
    """Option checks that argparse's per-option types cannot make (kept out of the types so that
    ``build_parser().parse_args`` stays lenient for code that builds EngineOptions from it)."""
    return engine_usage_error(args) or bench.usage_error(args) or eval.usage_error(args)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    name = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    command = parser.commands[name]
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:  # bare `hetmoe`: the help, as git and pip do
        parser.print_help()
        parser.exit(0)
    if args.command == "bench" and args.bench is None:
        command.print_help(sys.stderr)
        command.exit(2, f"\nhetmoe bench: error: choose a benchmark: {', '.join(bench.BENCHES)}\n")
    problem = _usage_errors(args)
    if problem:
        command.error(problem)
    return args


def _quiet_closed_pipe() -> int:
    """stdout (or stderr) is a pipe whose reader has gone (``hetmoe ... | head -1``): stop quietly, as ``cat``
    does, with the status a shell reports for a command SIGPIPE ended (128 + 13). Python ignores SIGPIPE, so
    the write raised BrokenPipeError; both streams go to /dev/null so the final flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a replaced stream (tests) without a file descriptor
            pass
    return 141


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Idle OpenMP threads of torch otherwise spin on the cores the expert engine's pinned threads compute on and
    # slow every hybrid decode step (BENCHMARKS.md#omp-wait-policy).
    # OpenMP reads it when torch loads, which parsing already does (--numa's type imports hetmoe.cpu), so it is
    # set before anything else.
    envs.set_default("OMP_WAIT_POLICY", "PASSIVE")
    try:
        args = _parse(argv)
    except BrokenPipeError:  # --help into a closed pipe
        return _quiet_closed_pipe()
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, MemoryError, OSError) as e:
        name = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
        print(f"hetmoe {name}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
