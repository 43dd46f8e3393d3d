"""Placement rules: one YAML file (``--rules FILE``) that places a model module by module (docs/rules.md).

    - match: 'model\\.layers\\.[0-3]\\.mlp\\.experts'    # a regex over module names (re.fullmatch)
      device: cuda                                     # these layers' routed experts all resident on the GPU
    - match: 'model\\.layers\\..*\\.mlp\\.experts'
      experts_format: int4                             # the other layers' experts int4 on the CPU
    - match: lm_head
      device: cuda

An ordered list; each module takes the first rule that matches its name (and, with ``class:``, its class name);
what no rule sets comes from the engine options. ``load(path) -> Rules`` parses and checks the file (every error
names the file and the line); ``Rules.for_module(name, class_name) -> Placement`` is one module's placement, and
``Rules.assign(modules)`` places a whole model and refuses a rule that takes no module or sets a key that none of
the modules it took has. ``apply_native`` turns them into the native runner's per-MoE-layer settings (the memory
plan's ``layers``), which ``defer_layers`` (deferral chains) and ``layerwise_layers`` (the GPU prefill) read, rules
or not. Used by the native loader and by the Transformers path alike; imports no torch at import time (the command
line checks a file with it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from hetmoe.config.options import EXPERT_FORMATS, FORMATS, FP8_GROUPS

EXPERTS, DENSE = "experts", "dense"  # the two kinds of module a rule places
EXPERT_KEYS = ("experts_format", "group_size", "gpu_experts", "gpu_experts_format", "defer_experts")
DENSE_KEYS = ("dtype",)
KEYS = ("match", "class", "device") + EXPERT_KEYS + DENSE_KEYS
DTYPES = ("bf16", "fp32")
GROUPS = (0, 32, 64, 128)
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class RulesError(ValueError):
    """A rules file that cannot be used: the message starts with ``FILE:LINE:``."""

    def __init__(self, message: str, line: Optional[int] = None):
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class Placement:
    """What the rules set for one module; None: the engine options decide. ``rule``: the rule it came from."""

    device: Optional[str] = None  # cpu, cuda or cuda:N
    experts_format: Optional[str] = None  # routed experts: bf16, int8, int4
    group_size: Optional[int] = None  # routed experts: 0 (per-row scales), 32, 64, 128
    gpu_experts: Optional[int] = None  # routed experts: how many of the layer's experts stay on the GPU too
    gpu_experts_format: Optional[str] = None  # routed experts: how those are stored there: auto, bf16, int8, int4
    defer_experts: Optional[int] = None  # routed experts: Expert Deferral's d for this layer
    dtype: Optional[str] = None  # dense modules: bf16, fp32
    rule: Optional["Rule"] = field(default=None, compare=False, repr=False)

    def settings(self) -> dict:
        """The keys set, as in the file."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "rule" and getattr(self, f.name) is not None}


@dataclass(eq=False)
class Rule:
    index: int  # 1-based position in the file
    line: int  # 1-based line of the rule
    match: re.Pattern
    class_name: Optional[re.Pattern]
    placement: Placement
    lines: dict = field(default_factory=dict, compare=False)  # key -> its line

    def matches(self, name: str, class_name: Optional[str] = None) -> bool:
        if not self.match.fullmatch(name):
            return False
        return self.class_name is None or (class_name is not None and bool(self.class_name.fullmatch(class_name)))

    def describe(self) -> str:
        cls = f" class {self.class_name.pattern!r}" if self.class_name is not None else ""
        return f"rule {self.index} (match {self.match.pattern!r}{cls})"


class Rules:
    """The ordered rules of one file. ``source``: the file, for messages."""

    def __init__(self, rules: list, source: str = "<rules>"):
        self.rules, self.source = list(rules), source

    def __len__(self) -> int:
        return len(self.rules)

    def error(self, rule: Optional[Rule], message: str, key: Optional[str] = None) -> RulesError:
        """A RulesError at ``rule``'s line (or its ``key``'s)."""
        line = (rule.lines.get(key, rule.line) if key else rule.line) if rule is not None else None
        where = f"{self.source}:{line}: " if line is not None else f"{self.source}: "
        return RulesError(where + (f"{rule.describe()}: " if rule is not None else "") + message, line)

    def for_module(self, name: str, class_name: Optional[str] = None) -> Placement:
        """The placement of module ``name`` (of class ``class_name``): the first matching rule's, or an empty one."""
        for rule in self.rules:
            if rule.matches(name, class_name):
                return rule.placement
        return Placement()

    def assign(self, modules: Iterable[tuple]) -> dict:
        """``modules``: (name, class name, kind) with kind EXPERTS (a layer's routed experts) or DENSE -> {name:
        Placement} of every module a rule takes. Refuses (RulesError at the rule's line) a rule that takes no
        module (none matches, or earlier rules took them all), and a rule whose keys fit none of the modules it
        took (experts keys on dense modules only, ``dtype`` on routed experts only)."""
        taken, kinds = {}, {id(r): set() for r in self.rules}
        seen = []
        for name, class_name, kind in modules:
            seen.append((name, class_name))
            placement = self.for_module(name, class_name)
            if placement.rule is not None:
                taken[name] = placement
                kinds[id(placement.rule)].add(kind)
        for rule in self.rules:
            got = kinds[id(rule)]
            if not got:
                earlier = any(rule.matches(n, c) for n, c in seen)
                why = "every module it matches is taken by an earlier rule" if earlier else "it matches no module"
                raise self.error(rule, f"{why} (module names look like {_examples([n for n, _ in seen])})")
            for keys, kind, what in ((EXPERT_KEYS, EXPERTS, "routed experts"), (DENSE_KEYS, DENSE, "dense modules")):
                for key in keys:
                    if getattr(rule.placement, key) is not None and kind not in got:
                        raise self.error(rule, f"{key} applies to {what}, and this rule takes none", key)
        return taken


def _examples(names: list) -> str:
    picks = [n for n in names if n.endswith(".experts")][:1] + [n for n in names if "." not in n][:1]
    return ", ".join(picks or names[:2]) or "(none)"


# ---------------------------------------------------------------------------------------------- parsing


def load(path) -> Rules:
    """The rules of the YAML file ``path``; RulesError (a ValueError) naming the file and line of what is wrong."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RulesError(f"{path}: cannot read the rules file ({err})") from None
    return parse(text, str(path))


def yaml_root(text: str, source: str, error: type):
    """The YAML node tree of ``text`` (None when empty), line numbers kept; ``error(message, line)`` raised, naming
    ``source:LINE``, for text that is not YAML. Shared with the config files (config/file.py)."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        return loader.get_single_node()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        where = f"{source}:{line}" if line else source
        raise error(f"{where}: not valid YAML ({getattr(err, 'problem', None) or err})", line) from None
    finally:
        loader.dispose()


def parse(text: str, source: str = "<rules>") -> Rules:
    """The rules of YAML ``text`` (a list of rules, or a config file's mapping with its ``rules:`` list: the lines
    stay the file's); ``source`` names it in errors."""
    import yaml

    root = yaml_root(text, source, RulesError)
    if root is None:
        raise RulesError(f"{source}: the rules file is empty (expected a list of rules, each with a match:)")
    if isinstance(root, yaml.MappingNode):  # a --config file (hetmoe/config/file.py): its rules: list
        root = next((v for k, v in root.value if k.value == "rules" and isinstance(v, yaml.SequenceNode)), root)
    if not isinstance(root, yaml.SequenceNode):
        raise RulesError(f"{source}:{root.start_mark.line + 1}: expected a list of rules (lines starting with "
                         "'- match:'), got a " + _kind(root), root.start_mark.line + 1)
    rules = Rules([], source)
    for i, node in enumerate(root.value, 1):
        rules.rules.append(_rule(node, i, source, yaml))
    if not rules.rules:
        raise RulesError(f"{source}: the list of rules is empty")
    return rules


def _kind(node) -> str:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return "mapping"
    if isinstance(node, yaml.SequenceNode):
        return "list"
    return f"value {node.value!r}"


def _rule(node, index: int, source: str, yaml) -> Rule:
    line = node.start_mark.line + 1

    def fail(message: str, at=None) -> RulesError:
        at_line = at.start_mark.line + 1 if at is not None else line
        return RulesError(f"{source}:{at_line}: rule {index}: {message}", at_line)

    if not isinstance(node, yaml.MappingNode):
        raise fail(f"expected a mapping of keys (match:, device:, ...), got a {_kind(node)}")
    values, lines = {}, {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if key not in KEYS:
            raise fail(f"unknown key {key!r}; a rule has {', '.join(KEYS)}", key_node)
        if key in values:
            raise fail(f"{key} is given twice", key_node)
        if not isinstance(value_node, yaml.ScalarNode):
            raise fail(f"{key}: expected a single value, got a {_kind(value_node)}", value_node)
        value = yaml.SafeLoader("").construct_object(value_node) if value_node.tag != "tag:yaml.org,2002:str" \
            else value_node.value
        values[key], lines[key] = _value(key, value, lambda m, n=value_node: fail(m, n)), value_node.start_mark.line + 1
    if "match" not in values:
        raise fail("has no match: (a regular expression over module names)")
    match, cls = values.pop("match"), values.pop("class", None)
    placement = Placement(**values)
    fmt, group = placement.experts_format, placement.group_size
    if group is not None and fmt == "bf16":
        raise fail("group_size: bf16 experts have no scale groups", _at(node, "group_size"))
    if group is not None and fmt == "fp8" and group not in FP8_GROUPS:
        raise fail("group_size: fp8 experts take 128 (block FP8) or 32 (MXFP8)", _at(node, "group_size"))
    if placement.gpu_experts is not None and (placement.device or "cpu").startswith("cuda"):
        raise fail("gpu_experts: with device cuda every expert of the layer is on the GPU already",
                   _at(node, "gpu_experts"))
    rule = Rule(index, line, match, cls, placement, lines)
    rule.placement = dataclasses.replace(placement, rule=rule)
    return rule


def _at(node, key: str):
    return next(v for k, v in node.value if k.value == key)


def _value(key: str, value, fail):
    """``value`` of ``key`` checked (and, for match and class, compiled)."""
    if key in ("match", "class"):
        if not isinstance(value, str) or not value:
            raise fail(f"{key}: expected a regular expression, got {value!r}")
        try:
            return re.compile(value)
        except re.error as err:
            raise fail(f"{key}: {value!r} is not a valid regular expression ({err})") from None
    if key == "device":
        if not isinstance(value, str) or not _DEVICE.fullmatch(value):
            raise fail(f"device: expected cpu, cuda or cuda:N, got {value!r}")
        return value
    if key == "gpu_experts_format":
        if value not in ("auto",) + FORMATS:
            raise fail(f"gpu_experts_format: expected auto, {', '.join(FORMATS)}, got {value!r}")
        return value
    if key == "experts_format":
        if value not in EXPERT_FORMATS:
            raise fail(f"experts_format: expected {', '.join(EXPERT_FORMATS)}, got {value!r}")
        return value
    if key == "dtype":
        if value not in DTYPES:
            raise fail(f"dtype: expected {', '.join(DTYPES)}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"{key}: expected an integer, got {value!r}")
    if key == "group_size" and value not in GROUPS:
        raise fail(f"group_size: expected 32, 64 or 128 (or 0 = per-row scales), got {value}")
    if value < 0:
        raise fail(f"{key}: expected an integer >= 0, got {value}")
    return value
