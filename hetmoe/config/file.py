"""A ``--config FILE``: engine options in one YAML mapping, the next run's settings (``hetmoe tune`` writes one).

    threads: 14              # the EngineOptions field names (hetmoe/plan/placement.py)
    defer_experts: 1         # each value as its flag takes it: the same text as --defer-experts 1
    gpu_prefill: 512         # auto, off or a count, as --gpu-prefill
    dense_format: int8
    cuda_graph: false        # a switch (--no-cuda-graph) is its field, true or false
    rules:                   # optional: placement rules (docs/rules.md), inline or the path of a rules file
      - match: 'model\\.layers\\.[0-3]\\.mlp\\.experts'
        device: cuda

Every field that is a command-line flag can be set. Each value is parsed by that flag's own argument type and then
checked by EngineOptions, so a file accepts what the command line accepts; what is wrong is a ConfigError (a
ValueError) naming ``FILE:LINE`` and the key. Inline rules keep their lines: ``rules.load(FILE)`` reads the
``rules:`` list of a config file, so ``EngineOptions.rules`` is the config file itself. Command-line flags win
over the file (hetmoe/config/flags.py), the file over the defaults. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Mapping, Optional

from hetmoe.config.options import EngineOptions
from hetmoe.config.rules import yaml_root

RULES = "rules"
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


class ConfigError(ValueError):
    """A config file that cannot be used: the message starts with ``FILE:LINE:`` (``FILE:`` for the whole file)."""

    def __init__(self, message: str, line: Optional[int] = None):
        super().__init__(message)
        self.line = line


def option_fields() -> dict:
    """The EngineOptions fields a config file may set (those that are flags), by name."""
    return {f.name: f for f in dataclasses.fields(EngineOptions) if "flag" in f.metadata}


def read(path, types: Mapping[str, Callable] = None) -> dict:
    """The options of the config file ``path``: {field name: value}, each value parsed as its flag parses its text
    (``types``: the argument types of the flags by their ``type`` name, hetmoe/config/flags.py TYPES; default:
    those) and accepted by EngineOptions on its own. ``rules`` is a path: the file's own when its rules are
    inline. ConfigError at the line of what is wrong."""
    import yaml

    if types is None:
        from hetmoe.config.flags import TYPES as types  # the command line's own parsers of flag text
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}: cannot read the config file ({err})") from None
    root = yaml_root(text, source, ConfigError)
    if root is None:
        raise ConfigError(f"{source}: the config file is empty (expected a mapping of engine options, e.g. "
                          "'threads: 8')")
    if not isinstance(root, yaml.MappingNode):
        line = root.start_mark.line + 1
        raise ConfigError(f"{source}:{line}: expected a mapping of engine options (lines like 'threads: 8'), got a "
                          f"{_kind(root, yaml)}", line)
    fields, out, lines = option_fields(), {}, {}
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None

        def fail(message: str, at: int = line, key=key) -> ConfigError:
            return ConfigError(f"{source}:{at}: {key}: {message}", at)

        if key != RULES and key not in fields:
            hint = _flag_hint(key, fields)
            raise ConfigError(f"{source}:{line}: unknown key {key!r}{hint}; a config file has "
                              f"{', '.join(fields)}", line)
        if key in lines:
            raise fail(f"given twice (first at line {lines[key]})")
        lines[key] = line
        if key == RULES:
            out[RULES] = _rules(path, value_node, fail, yaml)
            continue
        if not isinstance(value_node, yaml.ScalarNode):
            raise fail(f"expected a single value, got a {_kind(value_node, yaml)}", value_node.start_mark.line + 1)
        if value_node.tag == "tag:yaml.org,2002:null":
            raise fail("expected a value (leave the key out for the default)")
        out[key] = _value(fields[key], value_node.value, types, fail)
    try:
        EngineOptions(**out)  # what only the combination refuses, e.g. int4 experts with per-row scales
    except (ValueError, TypeError) as err:
        at = next((k for k in reversed(list(lines)) if k.replace("_", " ") in str(err).replace("-", " ")), None)
        where = f"{source}:{lines[at]}: {at}" if at else source
        raise ConfigError(f"{where}: {err}", lines.get(at)) from None
    return out


def _value(f: dataclasses.Field, text: str, types: Mapping[str, Callable], fail):
    """The value of field ``f`` from its YAML ``text``, parsed as the flag parses it, then checked alone."""
    meta = f.metadata
    if meta.get("negate"):
        if text.lower() not in _BOOLS:
            raise fail(f"expected true or false, got {text}")
        value = _BOOLS[text.lower()]
    elif "type" in meta:
        try:
            value = types[meta["type"]](text)
        except Exception as err:  # argparse.ArgumentTypeError (its message: "expected ..., got ...") or int's
            raise fail("expected an integer, got " + text if meta["type"] == "int" else str(err)) from None
    else:
        value = text
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise fail(f"expected one of {', '.join(map(str, choices))}, got {text}")
    if meta.get("min") is not None and isinstance(value, int) and value < meta["min"]:
        raise fail(f"expected an integer >= {meta['min']}, got {text}")
    try:
        EngineOptions(**{f.name: value})
    except (ValueError, TypeError) as err:
        raise fail(str(err)) from None
    return value


def _rules(path: Path, node, fail, yaml) -> str:
    """The ``rules:`` value: an inline list (checked here, read again by rules.load from this file) or the path of a
    rules file, relative to the config file's folder. Returns the path EngineOptions.rules takes."""
    from hetmoe.config.rules import RulesError, load

    if isinstance(node, yaml.SequenceNode):
        target = path
    elif isinstance(node, yaml.ScalarNode) and node.tag != "tag:yaml.org,2002:null" and node.value:
        target = Path(node.value).expanduser()
        target = target if target.is_absolute() else path.parent / target
    else:
        raise fail(f"expected a list of rules (docs/rules.md) or the path of a rules file, got a {_kind(node, yaml)}",
                   node.start_mark.line + 1)
    try:
        load(target)
    except RulesError as err:  # inline: the message names this file and the rule's line already
        raise (ConfigError(str(err), err.line) if target == path else fail(str(err))) from None
    return str(target)


def _kind(node, yaml) -> str:
    if isinstance(node, yaml.MappingNode):
        return "mapping"
    if isinstance(node, yaml.SequenceNode):
        return "list"
    return "empty value" if node.tag == "tag:yaml.org,2002:null" else f"value {node.value!r}"


def _flag_hint(key, fields: dict) -> str:
    """' (the field of --no-cuda-graph is cuda_graph)' where ``key`` is written as a flag's name."""
    if not isinstance(key, str):
        return ""
    flag = "--" + key.lstrip("-").replace("_", "-")
    for name, f in fields.items():
        if f.metadata["flag"] == flag:
            return f" (the option of {flag} is {name})"
    return ""


# ---------------------------------------------------------------------------------------------- writing


def format_value(value) -> str:
    """One option's value as the file writes it (the text its flag takes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    import yaml

    return yaml.safe_dump(str(value), default_style=None).splitlines()[0]  # quoted only where YAML needs it


def render(values: Mapping, header: tuple = ()) -> str:
    """The text of a config file setting ``values`` ({field name: value}; ``rules``: a path), each ``header`` line
    written as a comment first."""
    import textwrap

    fields = option_fields()
    lines = [f"# {part}".rstrip() for h in header for part in textwrap.wrap(h, 114, subsequent_indent="  ") or [""]]
    for name, value in values.items():
        if name != RULES and name not in fields:
            raise ValueError(f"{name!r} is not an engine option a config file sets")
        lines.append(f"{name}: {format_value(value)}")
    return "\n".join(lines) + "\n"


def options_values(options: EngineOptions, keep: tuple = ()) -> dict:
    """The fields of ``options`` that a config file must set to give them back: those that differ from the
    defaults, and those named in ``keep`` (in the dataclass's order)."""
    default = EngineOptions()
    fields = option_fields()
    return {name: getattr(options, name) for name in fields
            if name in keep or getattr(options, name) != getattr(default, name)
            if getattr(options, name) is not None}
