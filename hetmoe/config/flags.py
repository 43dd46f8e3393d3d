"""Argument types, and the engine flags every command that runs a model shares.

The engine flags are generated from EngineOptions' field metadata (``cli_flag`` in hetmoe/config/options.py):
each field with a flag is added by ``add_engine_options`` and read back by ``engine_options``, so an engine
option is written once, in the dataclass. Like the rest of the command line, this imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from hetmoe.config.options import ISA_CHOICES, EngineOptions, parse_cpu_share, parse_gpu_prefill, parse_numa
from hetmoe.config.units import parse_size

SHAPE_NAMES = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")  # defined in hetmoe.bench.kernel.SHAPES
ISAS = ISA_CHOICES  # "auto" and hetmoe.cpu.ISAS
# hetmoe.load.random_weights.SHAPES
MODEL_SHAPES = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "deepseek-v2-lite", "deepseek-v4-flash",
                "minimax-m3", "glm-5.3-flash", "deepseek-v3.2", "glm-5", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b",
                "gpt-oss-120b", "glm-4.5-air", "minimax-m2.5")


# ---------------------------------------------------------------------------------------------- argument types


def int_list(text: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text}")
    return values


def choice_list(choices: Sequence[str]):
    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
        return values

    return parse


def _number(text: str, kind, ok, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def nonneg_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def port(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v <= 65535, "a port in 0..65535")


def nonneg_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def top_p(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def min_p(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < float("inf"), "a finite number > 0")


def penalty(text: str) -> float:
    """--presence-penalty / --frequency-penalty: OpenAI's range."""
    return _number(text, float, lambda v: -2 <= v <= 2, "a number in [-2, 2]")


def stop(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return text


def numa(text: str):
    try:
        return parse_numa(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number of subpools >= 1, got {text}") from None


def gpu_prefill(text: str):
    try:
        return parse_gpu_prefill(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a token count >= 1, got {text}") from None


def cpu_share(text: str):
    try:
        return parse_cpu_share(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number of experts >= 0, got {text}") from None


def size(text: str) -> int:
    """--gpu-memory / --cpu-memory: 24GiB, 24G, 500MiB, 1.5TB or bytes (hetmoe/config/units.py parse_size)."""
    try:
        return parse_size(text, "")
    except ValueError as err:  # its message without the name: argparse names the flag
        raise argparse.ArgumentTypeError(str(err).removeprefix(": ")) from None


def auto_or_int(text: str):
    """--gpu-experts: auto or an integer (its bound is checked after parsing: engine_usage_error)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _number(text, int, lambda v: True, "auto or an integer")


def context(text: str):
    """--max-context: auto (None, the default) or a positive integer."""
    if text.strip().lower() == "auto":
        return None
    return _number(text, int, lambda v: v >= 1, "auto or a positive integer")


# the names cli_flag's ``type`` may give
TYPES = {"int": int, "positive_int": positive_int, "numa": numa, "gpu_prefill": gpu_prefill, "cpu_share": cpu_share,
         "size": size, "gpu_experts": auto_or_int, "context": context}


# ---------------------------------------------------------------------------------------------- engine


def engine_fields() -> list:
    """The EngineOptions fields that are command-line flags, in the dataclass's order."""
    return [f for f in dataclasses.fields(EngineOptions) if "flag" in f.metadata]


def _dest(f: dataclasses.Field) -> str:
    """The argparse attribute of a field's flag: ``--no-cuda-graph`` -> ``no_cuda_graph``."""
    return f.metadata["flag"][2:].replace("-", "_")


class _Given(argparse.Action):
    """Stores a flag's value and notes that it was given, so that a --config file fills only the others."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        namespace.engine_flags_given = getattr(namespace, "engine_flags_given", set()) | {self.dest}


def add_engine_options(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The engine options, named the same in every command that runs a model: --model (unless ``model`` is
    False), --config, the EngineOptions flags, --expert-cache."""
    g = p.add_argument_group("engine")
    if model:
        g.add_argument("--model", metavar="DIR|FILE.gguf", default=None,
                       help="Hugging Face checkpoint directory, or a GGUF file (the first part of a split set; "
                       "docs/running.md#gguf-files) (default: the small model built into hetmoe)")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="engine options from a YAML file (option: value, e.g. threads: 8; what `hetmoe tune` "
                   "writes; docs/running.md#config-files); the flags given here win over it")
    for f in engine_fields():
        m = f.metadata
        if m.get("negate"):
            g.add_argument(m["flag"], action=_Given, nargs=0, const=True, default=False, help=m["help"])
        else:
            g.add_argument(m["flag"], action=_Given, type=TYPES[m["type"]] if "type" in m else None,
                           default=f.default, choices=m.get("choices"), metavar=m.get("metavar"), help=m["help"])
    g.add_argument("--expert-cache", metavar="DIR", default="auto",
                   help="where converted experts are kept for the next load ('off' disables; "
                        "default: $XDG_CACHE_HOME/hetmoe/experts)")


def apply_config(args: argparse.Namespace) -> None:
    """Set the engine flags of ``args`` that were not given from its --config file, if any (once; ConfigError,
    a ValueError naming FILE:LINE, for a file that cannot be used)."""
    path = getattr(args, "config", None)
    if path is None or getattr(args, "config_applied", False):
        return
    from hetmoe.config.file import read  # the file reader takes this module's TYPES

    values, given = read(path, TYPES), getattr(args, "engine_flags_given", set())
    for f in engine_fields():
        if f.name in values and _dest(f) not in given:
            setattr(args, _dest(f), not values[f.name] if f.metadata.get("negate") else values[f.name])
    args.config_applied = True


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The EngineOptions that ``args`` (parsed with add_engine_options) ask for: the flags given, else the --config
    file's values, else the defaults."""
    apply_config(args)
    values = {}
    for f in engine_fields():
        value = getattr(args, _dest(f))
        values[f.name] = not value if f.metadata.get("negate") else value
    return EngineOptions(**values)


def engine_usage_error(args: argparse.Namespace) -> Optional[str]:
    """What the engine flags in ``args`` (and its --config file, applied here) cannot be, beyond each flag's type
    (None: nothing)."""
    from hetmoe.config.file import ConfigError

    try:
        apply_config(args)
    except ConfigError as err:
        return f"--config: {err}"
    for f in engine_fields():
        bound, value = f.metadata.get("min"), getattr(args, _dest(f), None)
        if bound is not None and isinstance(value, int) and value < bound:
            return f"{f.metadata['flag']}: expected an integer >= {bound}, got {value}"
    if getattr(args, "rules", None) is not None:  # the file's own errors now; what it matches, at load
        from hetmoe.config.rules import RulesError, load

        try:
            load(args.rules)
        except RulesError as err:
            return f"--rules: {err}"
    return None


def expert_cache(args: argparse.Namespace) -> Optional[str]:
    """--expert-cache as LLM and load_model take it (None: off)."""
    return None if args.expert_cache == "off" else args.expert_cache
