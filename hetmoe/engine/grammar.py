"""Grammar-constrained decoding through xgrammar: JSON (any object, or a JSON schema, strictly) and structural tags
(forced tool calls in a model family's own syntax), as ``TokenConstraint`` factories for ``SamplingParams.
constraint``.

    grammars = Grammars(tokenizer, vocab_size)      # once per served model
    params.constraint = grammars.json_schema(schema)  # per request: compiled (or taken from the cache) now
    c = params.constraint()                         # per sequence: a fresh matcher
    c.mask(logits); ...; c.accept(token); c.is_terminated()

Compiling is bounded: a schema or tag larger than ``Caps.source_chars``, nested deeper than ``Caps.depth``, with
more than ``Caps.enum_values`` enum/const alternatives or ``Caps.properties`` properties is refused before the
compiler sees it; a compile that runs past ``Caps.compile_s`` or builds a grammar over ``Caps.grammar_bytes`` is
refused too (``GrammarError``, the server's 400). One compile runs at a time, on a thread of its own; a request
that cannot start its compile within ``Caps.compile_s`` gets ``GrammarBusy`` (503). The caps keep a compile that
outlives its deadline short, and the cache (``Caps.cache_bytes``, least recently used first out) keeps each
schema's grammar compiled once.

The grammar sees the text the engine decodes: special tokens (which the decoder skips) are not text to the
grammar, so a constrained sequence never spends a token that the text would not show; stop tokens (the
tokenizer's eos ids) end a complete grammar. ``Grammars(..., shown_special_ids=ids)`` makes those special tokens
text (a tool-call family's markers: the grammar then lets the model write ``<|tool_call_begin|>`` as the one token
it was trained on); the sequences constrained by such a grammar must show them too
(``SamplingParams.shown_special_ids``).

Per token, ``mask`` fills the matcher's bitmask (a few microseconds once the grammar's token sets are cached) and
sets the disallowed logits to -inf: numpy unpacks the bits for logits on the CPU, a few elementwise kernels do it
on a GPU (no host round trip beyond the 4 bytes per 32 tokens of the bitmask).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch


class GrammarError(ValueError):
    """The grammar cannot be built: an invalid schema, or one over the caps."""


class GrammarBusy(RuntimeError):
    """Another compile held the compiler past this request's deadline: try again later."""


@dataclass(frozen=True)
class Caps:
    source_chars: int = 256 * 1024  # JSON text of a schema or a structural tag
    depth: int = 48  # nesting of objects and arrays in that JSON
    enum_values: int = 4096  # enum / const alternatives in all
    properties: int = 2048  # object properties in all
    compile_s: float = 10.0
    grammar_bytes: int = 256 << 20  # one compiled grammar
    cache_bytes: int = 512 << 20  # all cached grammars


def available() -> bool:
    """Whether xgrammar can be imported (the ``serve`` extra)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def check_source(value: Any, caps: Caps = Caps()) -> str:
    """``value`` (a schema or a structural tag, as parsed JSON) as canonical JSON text; GrammarError when it is
    over the caps. Walks the value without recursion, so a 10^5-deep schema is refused, not a RecursionError."""
    stack, depth_of, enums, props = [(value, 1)], 0, 0, 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
            for key in ("enum", "const"):
                if key in node:
                    enums += len(node[key]) if key == "enum" and isinstance(node[key], list) else 1
            if isinstance(node.get("properties"), dict):
                props += len(node["properties"])
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth_of = max(depth_of, depth)
        if depth_of > caps.depth:
            raise GrammarError(f"nested more than {caps.depth} levels deep (this server's cap)")
        stack.extend((c, depth + 1) for c in children)
    if enums > caps.enum_values:
        raise GrammarError(f"{enums} enum/const values, more than this server's cap of {caps.enum_values}")
    if props > caps.properties:
        raise GrammarError(f"{props} object properties, more than this server's cap of {caps.properties}")
    try:
        text = json.dumps(_canonical(value), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"not JSON: {e}") from None
    if len(text) > caps.source_chars:
        raise GrammarError(f"{len(text)} characters of JSON, more than this server's cap of {caps.source_chars}")
    return text


def _canonical(value: Any, properties: bool = False) -> Any:
    """``value`` with the keys of its mappings sorted, except the members of a ``properties`` mapping: their order
    is the order the grammar writes them in (a tool's parameters, a structured output's fields). Called on a value
    whose depth ``check_source`` has bounded."""
    if isinstance(value, dict):
        keys = list(value) if properties else sorted(value, key=str)
        return {k: _canonical(value[k], not properties and k == "properties" and isinstance(value[k], dict))
                for k in keys}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _vocab_type(backend, vocab: dict):
    """xgrammar's name for how the vocabulary spells bytes: byte fallback ("<0x41>" pieces), byte level (GPT-2's
    byte-to-unicode alphabet, a ByteLevel decoder) or raw text; and whether decoding drops a leading space that
    encoding adds (sentencepiece's "▁" prefix)."""
    import xgrammar as xgr

    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        first = backend.encode("a", add_special_tokens=False).tokens
        return xgr.VocabType.BYTE_FALLBACK, bool(first) and first[0].startswith("\u2581")
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL, False
    return xgr.VocabType.RAW, False


def tokenizer_info(tokenizer, vocab_size: int, shown_special_ids: frozenset = frozenset()):
    """xgrammar's view of a hetmoe ``Tokenizer`` whose model has ``vocab_size`` logits: each id's text (special
    tokens none, as the decoder skips them, but for ``shown_special_ids``), the stop tokens (its eos ids)."""
    import xgrammar as xgr

    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for text, i in vocab.items():
        if i < vocab_size:
            encoded[i] = text
    for i, added in backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            encoded[i] = added.content if i in shown_special_ids else ""
    kind, prefix_space = _vocab_type(backend, vocab)
    stops = sorted(i for i in tokenizer.eos_ids if i < vocab_size)
    return xgr.TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=stops or None,
                             add_prefix_space=prefix_space)


def apply_bitmasks(logits: torch.Tensor, bitmasks: torch.Tensor) -> None:
    """logits [R, V] fp32, in place: -inf where row r's bitmask (``bitmasks`` int32 [R, ceil(V/32)] on the host,
    bit j of word i = token 32i + j allowed) has a 0. One set of operations for all R rows."""
    V = logits.shape[-1]
    if logits.device.type == "cpu":
        import numpy as np

        bits = np.unpackbits(bitmasks.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
        logits.masked_fill_(torch.from_numpy(bits.view(np.bool_)).logical_not_(), float("-inf"))
        return
    words = bitmasks.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :V].bool()  # [R, V]
    logits.masked_fill_(allowed.logical_not_(), float("-inf"))


def _allows_some(bitmask: torch.Tensor, V: int) -> bool:
    """Whether ``bitmask`` (int32 [ceil(V/32)] on the host) allows any of the V tokens."""
    full, rest = divmod(V, 32)
    if bool(bitmask[:full].any()):
        return True
    return bool(rest) and (int(bitmask[full]) & ((1 << rest) - 1)) != 0


class GrammarConstraint:
    """One sequence's matcher (``TokenConstraint``): ``mask`` / ``accept`` / ``is_terminated``."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=False)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)[0]
        if torch.cuda.is_available():
            self._bitmask = self._bitmask.pin_memory()
        self.vocab_size = vocab_size
        self._filled = False  # the bitmask holds the next position's mask (prepare)
        self._allows_some = True

    def prepare(self) -> None:
        """The next position's bitmask, filled on the host (and whether it allows any token)."""
        if not self._filled:
            self._matcher.fill_next_token_bitmask(self._bitmask.view(1, -1))
            self._allows_some = _allows_some(self._bitmask, self.vocab_size)
            self._filled = True

    def host_mask(self) -> torch.Tensor:
        """The next position's bitmask (int32 [ceil(V/32)] on the host), for the caller to apply (with other rows'
        at once: ``apply_bitmasks``) instead of ``mask``. ValueError when it allows no token."""
        self.prepare()
        self._filled = False
        if not self._allows_some:
            raise ValueError("the constraint allows no token at this position")
        return self._bitmask

    def mask(self, logits: torch.Tensor) -> bool:
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"the constraint expects logits [{self.vocab_size}], got {tuple(logits.shape)}")
        apply_bitmasks(logits.view(1, -1), self.host_mask().view(1, -1))
        return True  # checked on the host: some token stays allowed

    def accept(self, token: int) -> None:
        self._filled = False
        if not self._matcher.accept_token(int(token)):
            raise ValueError(f"token {token} does not follow the grammar at this position")

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class ConstraintFactory:
    """A compiled grammar: calling it gives a fresh ``GrammarConstraint`` (``SamplingParams.constraint``)."""

    def __init__(self, compiled, vocab_size: int, key: str):
        self.compiled, self.vocab_size, self.key = compiled, vocab_size, key

    def __call__(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.vocab_size)


class Grammars:
    """The grammar compiler of one served model, its caps and its cache. Thread-safe: the server compiles on its
    request threads while the engine thread runs matchers."""

    def __init__(self, tokenizer, vocab_size: int, caps: Caps = Caps(), shown_special_ids: Iterable[int] = ()):
        import xgrammar as xgr

        self.caps, self.vocab_size = caps, vocab_size
        self.shown_special_ids = frozenset(shown_special_ids)  # special tokens that are text to these grammars
        self._compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, self.shown_special_ids),
                                             max_threads=1, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()  # key -> (compiled, bytes)
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetmoe-grammar")
        self.hits = self.misses = 0

    def json_object(self) -> ConstraintFactory:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: Any, after: Optional[str] = None) -> ConstraintFactory:
        """Text that is a JSON value valid against ``schema`` (strict: no properties beyond the schema's unless it
        allows them), written compactly (``{"a": 1, "b": [2, 3]}``: no free whitespace for a small model to loop
        in). ``after``: any text up to and including this string comes first (a reasoning block's end)."""
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        if after is not None:
            return self.structural_tag({"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                                       after=after)
        text = check_source(schema, self.caps)
        return self._get("schema:" + text, lambda c: c.compile_json_schema(text, any_whitespace=False,
                                                                           strict_mode=True))

    def structural_tag(self, fmt: dict, after: Optional[str] = None) -> ConstraintFactory:
        """Text that matches xgrammar's structural-tag ``format`` (a dict: tags, sequences, JSON schemas in
        JSON or a model's XML style), optionally after any text that ends with ``after``."""
        if after is not None:
            fmt = {"type": "sequence", "elements": [
                {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": after},
                {"type": "regex", "pattern": r"[ \t\r\n]{0,8}"}, fmt]}
        tag = {"type": "structural_tag", "format": fmt}
        text = check_source(tag, self.caps)
        return self._get("tag:" + text, lambda c: c.compile_structural_tag(text))

    def _get(self, key: str, compile_fn) -> ConstraintFactory:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return ConstraintFactory(hit[0], self.vocab_size, key)
        compiled = self._compile(compile_fn)
        size = compiled.memory_size_bytes
        if size > self.caps.grammar_bytes:
            raise GrammarError(f"the compiled grammar takes {size} bytes, more than this server's cap of "
                               f"{self.caps.grammar_bytes}")
        with self._lock:
            self.misses += 1
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cached_bytes += size
            while self._cached_bytes > self.caps.cache_bytes and len(self._cache) > 1:
                _, (_, old) = self._cache.popitem(last=False)
                self._cached_bytes -= old
        return ConstraintFactory(compiled, self.vocab_size, key)

    def _compile(self, compile_fn):
        deadline = time.monotonic() + self.caps.compile_s
        started = threading.Event()

        def run():
            started.set()
            return compile_fn(self._compiler)

        future = self._worker.submit(run)
        try:
            return future.result(max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            if not started.is_set() and future.cancel():
                raise GrammarBusy(f"the grammar compiler was busy for {self.caps.compile_s:g} s") from None
            raise GrammarError(f"the grammar did not compile within {self.caps.compile_s:g} s (this server's "
                               "cap): simplify the schema") from None
        except GrammarError:
            raise
        except RecursionError:
            raise GrammarError("nested too deeply to compile") from None
        except Exception as e:  # xgrammar's own: an unsupported or invalid schema, a bad structural tag
            raise GrammarError(_compiler_message(e)) from None


def _compiler_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location prefix ("[08:34:55] /project/cpp/x.cc:5082: ...")."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if rest.startswith("/") and ": " in rest:
            text = rest.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__
