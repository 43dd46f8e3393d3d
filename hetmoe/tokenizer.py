"""A Hugging Face checkpoint's tokenizer and chat template, without transformers.

``Tokenizer.from_dir(path)`` reads ``tokenizer.json`` (through the ``tokenizers`` library) or, without one, a
tiktoken BPE ``tiktoken.model`` as Kimi's checkpoints ship it (``tiktoken_backend``), ``tokenizer_config.json``
(special tokens, ``add_bos_token``, ``chat_template``), ``chat_template.jinja`` (newer layout; takes priority, as in
transformers), ``generation_config.json`` and ``config.json`` (eos / bos ids). Chat templates are rendered the way
transformers renders them: a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``raise_exception`` / ``strftime_now`` globals, a non-escaping ``tojson`` and the loop-control extension.

``IncrementalDecoder`` turns a stream of token ids into text pieces without ever cutting a UTF-8 character in two.

Bounded work for untrusted text (the server): ``min_tokens(text)`` is a lower bound on the token count from the
text's length alone (every token of the vocabulary covers at most ``chars_per_token`` characters of the input);
``encode_capped(text, cap)`` returns the same ids as ``encode`` when there are at most ``cap`` of them, and
otherwise raises ``PromptTooLong`` after tokenizing only a prefix of roughly ``cap`` tokens. It encodes through
the backend's batch call, which releases the GIL, so other Python threads keep running meanwhile.

Special tokens written inside message text: ``encode_chat(messages, split_special_tokens=True)`` keeps the chat
template's own special tokens (``<|im_start|>`` ...) and tokenizes the same text inside a message's content as
plain text, so a message cannot forge a turn. The tokenizers library has no such mode for part of a text
(``add_special_tokens`` only adds a bos/eos; its ``encode_special_tokens`` switch applies to the whole text), so
the rendered prompt is cut at the template's special tokens, found outside the spans that ``render_chat`` marks as
message text, and the pieces between are encoded with a copy of the backend that matches no special token. A
prompt whose messages hold no special-token text is encoded whole, as ``encode`` does.
"""

from __future__ import annotations

import bisect
import copy
import json
import math
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional, Union

_REPLACEMENT = "\ufffd"  # what a byte-level decoder emits for an incomplete UTF-8 sequence
CAPPED_FIRST_PIECE = 1 << 16  # characters encode_capped tokenizes first; each further prefix is twice as long
_MAX_DECOMPOSITION = 4  # code points in the longest canonical decomposition (Unicode 14; tested against unicodedata)
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_MARKS = range(0xE000, 0xF8FF, 2)  # private-use pairs; render_chat marks message text with one absent from the input


class PromptTooLong(ValueError):
    """``encode_capped``: the text has more than ``cap`` tokens; it has at least ``at_least`` (> cap), exactly that
    many when ``exact`` (it was tokenized whole)."""

    def __init__(self, at_least: int, cap: int, chars: int, exact: bool = False):
        super().__init__(f"the text ({chars} characters) has {'' if exact else 'at least '}{at_least} tokens, "
                         f"more than {cap}")
        self.at_least, self.cap, self.chars, self.exact = at_least, cap, chars, exact


def _normalizer_shrink(spec: Optional[dict]) -> Optional[float]:
    """By how much a tokenizer.json normalizer can shorten a text (len(text) <= factor * len(normalized)); None
    when it can delete characters without bound (BertNormalizer's cleaning, Strip, StripAccents, Precompiled,
    regex Replace)."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for inner in spec.get("normalizers", []):
            f = _normalizer_shrink(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _UNICODE_FORMS:  # composition merges at most a full canonical decomposition into one character
        return float(_MAX_DECOMPOSITION)
    if kind in ("Lowercase", "Prepend"):  # a character lowercases to one or more; prepending only adds
        return 1.0
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content")
        if isinstance(pattern, str) and pattern and isinstance(content, str) and content:
            return max(1.0, len(pattern) / len(content))
    return None


def _keeps_every_character(spec: Optional[dict]) -> bool:
    """Whether a pre-tokenizer passes every character on (Whitespace, WhitespaceSplit, Bert and Split "Removed"
    drop some, so a text of spaces alone could have no tokens at all)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _chars_per_token(backend) -> Optional[int]:
    """The most input characters one token can stand for, or None when no such bound holds for this tokenizer.

    Every token covers a contiguous piece of the normalized text, at most as many characters as its vocabulary
    string has (byte-level strings have one character per byte, and a character is at least one byte;
    "<0x41>" byte-fallback tokens cover less than one). That needs a BPE model that maps every character to
    tokens (the whole byte alphabet present, or byte fallback with all 256 byte tokens, or an unk token per
    character), a pre-tokenizer that drops nothing, added tokens that swallow no whitespace (lstrip/rstrip),
    and the normalizer's shrink factor on top."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    vocab = backend.get_vocab(with_added_tokens=True)
    if model.get("type") != "BPE" or not _keeps_every_character(spec.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    from tokenizers import pre_tokenizers

    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    if byte_level and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet()):
        pass  # every byte of any text has a token
    elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        pass
    elif model.get("unk_token") in vocab and not model.get("fuse_unk"):
        pass  # an unknown character is one unk token
    else:
        return None  # unknown characters are dropped, or fused into one unk however many there are
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not vocab:
        return None
    return int(math.ceil(max(len(t) for t in vocab) * shrink))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> Optional[str]:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any, source: Path) -> Optional[str]:
    """``chat_template`` is a string, or a list of {"name", "template"} dicts of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        if len(named) == 1:
            return next(iter(named.values()))
        raise ValueError(f"{source}: several chat templates {sorted(map(str, named))} and none named 'default'")
    raise ValueError(f"{source}: chat_template must be a string or a list of {{name, template}}, got {type(value)}")


def compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import SandboxedEnvironment

    class GenerationTag(Extension):
        # transformers' {% generation %} ... {% endgeneration %} marks assistant text for training masks; render as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which transformers' (and so every template's author's) does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # sandboxed (no attribute of Python's internals reachable), but lists and dicts the template builds may grow
    # (``ns.ids.append(x)``): templates written for llama.cpp's renderer do so (Kimi-K2's), which transformers'
    # immutable sandbox refuses; the messages handed in are copies (apply_chat_template)
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role': str, 'content': str}} dicts, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}] needs a non-empty string 'role', got {m.get('role')!r}")
        if m["role"] == "assistant" and m.get("content") is None:
            continue  # an assistant turn of tool calls only (content None or absent): the template renders it
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] needs a string 'content', got {type(m.get('content')).__name__}")


# Kimi's pre-tokenization split, as its tokenization_kimi.py gives it to tiktoken (Rust regex syntax). Oniguruma,
# the tokenizers library's regex engine, reads the same text alike: `&&` intersects character classes there too,
# and it knows the Han script. Runs of Han characters split apart from other letters; cased words as in cl100k.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
KIMI_SPECIAL_TOKENS = 256 + 2  # the ids after the ranks: tokenization_kimi.py's num_reserved_special_tokens + 2
TIKTOKEN_FILE = "tiktoken.model"


def read_tiktoken(file: Path) -> list[bytes]:
    """The tokens of a tiktoken BPE file (one ``base64(token) rank`` line each, blank lines skipped), indexed by
    rank. The ranks must be 0..n-1, each token once, and every single byte a token (so any text can be encoded);
    anything else is a ValueError naming the file and the line."""
    import base64
    import binascii

    try:
        lines = file.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e}") from e
    by_rank: dict[int, bytes] = {}
    line_of: dict[bytes, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        shown = [f[:80].decode("utf-8", "replace") for f in fields]
        if len(fields) != 2:
            raise ValueError(f"{file} line {n}: expected 'base64-token rank', got {' '.join(shown)!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{file} line {n}: {shown[0]!r} is not base64") from None
        if not fields[1].isdigit():
            raise ValueError(f"{file} line {n}: the rank {shown[1]!r} is not a non-negative integer")
        rank = int(fields[1])
        if token in line_of:
            raise ValueError(f"{file} line {n}: token {token!r} again (first on line {line_of[token]})")
        if rank in by_rank:
            raise ValueError(f"{file} line {n}: rank {rank} again (first on line {line_of[by_rank[rank]]})")
        by_rank[rank] = token
        line_of[token] = n
    if not by_rank:
        raise ValueError(f"{file} holds no tokens")
    if len(by_rank) != max(by_rank) + 1:
        missing = next(r for r in range(len(by_rank)) if r not in by_rank)
        raise ValueError(f"{file}: ranks must run 0..{len(by_rank) - 1} without gaps; rank {missing} is missing")
    single = [b for b in range(256) if bytes([b]) not in line_of]
    if single:
        raise ValueError(f"{file}: the single bytes {single[:8]}{' ...' if len(single) > 8 else ''} are not tokens "
                         "(a byte-level BPE needs all 256 to encode any text)")
    return [by_rank[r] for r in range(len(by_rank))]


def tiktoken_backend(file: Path, config: dict, pattern: str = KIMI_PATTERN, n_special: int = KIMI_SPECIAL_TOKENS):
    """A ``tokenizers.Tokenizer`` that encodes as tiktoken does with the ranks of ``file``, the split ``pattern`` and
    ``n_special`` special tokens at the ids after the ranks (named by tokenizer_config.json's
    ``added_tokens_decoder``, ``<|reserved_token_{id}|>`` otherwise, as tokenization_kimi.py names them).

    tiktoken merges, again and again, the adjacent pair whose concatenation has the lowest rank, and takes a piece
    that is a token whole. A byte-level BPE does the same given, for every token in rank order, a merge for each
    way to cut it into two tokens, and ``ignore_merges`` for whole pieces. (Where two cuts of one token could apply
    in one piece at once, tiktoken takes the leftmost and the BPE the cut listed first; a vocabulary learned by BPE
    does not make such pairs in practice, and the tests compare with tiktoken on a learned one.) Kimi's code also
    encodes a text past 400,000 characters, or with a run over 25,000 (non-)whitespace characters, in pieces; this
    tokenizer does not cut. The conversion is written here rather
    than taken from transformers' ``TikTokenConverter``: transformers is no dependency of hetmoe, that converter
    needs the ``tiktoken`` package too just to read the file, and reading it here names the line of a bad entry.
    """
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    tokens = read_tiktoken(file)
    table = {b: c for c, b in _byte_level_table().items()}
    names = ["".join(table[b] for b in t) for t in tokens]
    rank = {t: r for r, t in enumerate(tokens)}
    merges = []
    for t in tokens:  # in rank order: a lower-ranked token's merges come first
        cuts = sorted((rank[t[:i]], rank[t[i:]]) for i in range(1, len(t)) if t[:i] in rank and t[i:] in rank)
        merges += [(names[a], names[b]) for a, b in cuts]
    backend = Backend(BPE({name: r for r, name in enumerate(names)}, merges, ignore_merges=True, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()

    source = file.parent / "tokenizer_config.json"
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError(f"{source}: added_tokens_decoder must be an object of id -> token")
    n = len(tokens)
    special = {i: f"<|reserved_token_{i}|>" for i in range(n, n + n_special)}
    for key, value in declared.items():
        content = _token_content(value)
        if not (isinstance(key, str) and key.isdigit()) or content is None:
            raise ValueError(f"{source}: added_tokens_decoder entry {key!r}: {value!r} is not id -> token")
        if int(key) not in special:
            raise ValueError(f"{source}: added token {content!r} has id {key}; {file.name} leaves ids {n}.."
                             f"{n + n_special - 1} to special tokens")
        special[int(key)] = content
    backend.add_special_tokens([AddedToken(special[i], special=True, normalized=False) for i in sorted(special)])
    wrong = [(i, t) for i, t in special.items() if backend.token_to_id(t) != i]
    if wrong:  # a name given twice, or one that is also the text of a rank's token
        raise ValueError(f"{source}: special token {wrong[0][1]!r} cannot have id {wrong[0][0]}: its text is "
                         "another token's too")
    return backend


class Tokenizer:
    """Text <-> token ids, the end-of-sequence ids, and the chat template of one checkpoint."""

    def __init__(self, backend, config: Optional[dict] = None, *, eos_token_ids: Iterable[int] = (),
                 bos_token_id: Optional[int] = None, chat_template: Optional[str] = None):
        config = config or {}
        self._tok = backend
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_id = self.token_to_id(self.bos_token)
        if self.bos_id is None:  # only an id is known (config.json): it identifies the bos, templates don't see it
            self.bos_id = bos_token_id
        self.eos_id = self.token_to_id(self.eos_token)
        self.pad_id = self.token_to_id(self.pad_token)
        # Present in tokenizer_config.json it decides the bos (transformers then rebuilds the post-processor);
        # absent, tokenizer.json's own post-processor does.
        self.add_bos_token: Optional[bool] = config.get("add_bos_token")
        ids = set(eos_token_ids)
        if self.eos_id is not None:
            ids.add(self.eos_id)
        self.eos_ids: set[int] = ids
        self.chat_template = chat_template
        self._compiled = None
        self._bound: Optional[tuple] = None  # (chars_per_token, longest added token), computed on first use
        self._specials: Optional[tuple] = None  # (regex of the special tokens' texts or None, {text: id})
        self._plain_backend = None  # a copy of the backend that matches no special token (encode_chat)
        self._byte_values: Optional[dict] = None  # byte-level vocabulary character -> byte (token_bytes)
        self._added: dict = {}

    @classmethod
    def from_dir(cls, path: Union[str, Path]) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        config = _read_json(path / "tokenizer_config.json")
        if file.is_file():
            try:
                backend = Backend.from_file(str(file))
            except Exception as e:  # the Rust side raises a bare Exception on malformed files
                raise ValueError(f"cannot read {file}: {e}") from e
        elif (path / TIKTOKEN_FILE).is_file():  # Kimi's layout: tiktoken ranks, specials in tokenizer_config.json
            backend = tiktoken_backend(path / TIKTOKEN_FILE, config)
        else:
            raise FileNotFoundError(f"no tokenizer.json in {path} (nor Kimi's {TIKTOKEN_FILE}): a Hugging Face "
                                    "'fast' tokenizer file is required")
        generation = _read_json(path / "generation_config.json")
        model = _read_json(path / "config.json")
        template = _pick_template(config.get("chat_template"), path / "tokenizer_config.json")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        bos = generation.get("bos_token_id", model.get("bos_token_id"))
        return cls(
            backend, config,
            eos_token_ids=_id_list(generation.get("eos_token_id")) + _id_list(model.get("eos_token_id")),
            bos_token_id=bos if isinstance(bos, int) else None,
            chat_template=template,
        )

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath: its vocabulary, added tokens and decoder (grammars read them)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` exactly one bos leads (when the tokenizer uses one),
        whether it comes from ``add_bos_token``, tokenizer.json's post-processor or the text itself."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._fix_bos(text, self._tok.encode(text, add_special_tokens=add_special_tokens).ids,
                             add_special_tokens)

    def _fix_bos(self, text: str, ids: list, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens or self.bos_id is None:
            return ids
        bos_text = self._tok.id_to_token(self.bos_id) or ""
        in_text = 0  # bos tokens written in the text itself are kept as written
        while bos_text and text.startswith(bos_text * (in_text + 1)):
            in_text += 1
        leading = 0
        while leading < len(ids) and ids[leading] == self.bos_id:
            leading += 1
        added = leading > in_text if self.add_bos_token is None else self.add_bos_token
        want = max(in_text, 1) if added else in_text
        return [self.bos_id] * want + ids[leading:]

    def _bounds(self) -> tuple:
        if self._bound is None:
            added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
            self._bound = (_chars_per_token(self._tok), max(map(len, added), default=0))
        return self._bound

    @property
    def chars_per_token(self) -> Optional[int]:
        """The most input characters one token can cover (None: this tokenizer admits no such bound)."""
        return self._bounds()[0]

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` (either ``add_special_tokens``) without tokenizing: 0 when the
        tokenizer admits no bound."""
        per_token = self.chars_per_token
        return 0 if not per_token else -(-len(text) // per_token)

    def encode_capped(self, text: str, cap: int, add_special_tokens: bool = True) -> list[int]:
        """``encode(text, add_special_tokens)`` when that has at most ``cap`` ids; otherwise ``PromptTooLong``,
        decided without tokenizing all of a long text.

        Refuses at once when ``min_tokens`` exceeds ``cap``. Else tokenizes prefixes of ``CAPPED_FIRST_PIECE``,
        then twice, four times ... as many characters, until a prefix is the whole text or proves more than ``cap``
        tokens — so the work is a few times that of ``cap`` tokens, whatever the text's length. A prefix proves
        the tokens of its pre-tokenized words except the last ones: normalizers and pre-tokenizers look at a
        bounded neighbourhood (a lookahead character, an added token straddling the cut), words are tokenized
        one by one, so every word ending far enough before the cut is a word of the whole text, with the same
        tokens. The last ``longest added token + 16`` words are not counted (each word is at least one
        character, so they hold every word within that many characters of the cut)."""
        if not isinstance(text, str):
            raise TypeError(f"encode_capped() takes a str, got {type(text).__name__}")
        return self._encode_capped(self._tok, text, cap, add_special_tokens)

    def _encode_capped(self, backend, text: str, cap: int, add_special_tokens: bool) -> list[int]:
        bound = self.min_tokens(text)
        if bound > cap:
            raise PromptTooLong(bound, cap, len(text))
        margin_words = self._bounds()[1] + 16
        k = CAPPED_FIRST_PIECE
        while k < len(text):
            word_ids = self._encode_unlocked(text[:k], False, backend).word_ids
            proven = len(word_ids)
            last = next((w for w in reversed(word_ids) if w is not None), None)
            if last is not None:
                while proven and (word_ids[proven - 1] is None or word_ids[proven - 1] > last - margin_words):
                    proven -= 1
            if proven > cap:
                raise PromptTooLong(proven, cap, len(text))
            k *= 2
        ids = self._fix_bos(text, self._encode_unlocked(text, add_special_tokens, backend).ids, add_special_tokens)
        if len(ids) > cap:
            raise PromptTooLong(len(ids), cap, len(text), exact=True)
        return ids

    def _encode_unlocked(self, text: str, add_special_tokens: bool, backend=None):
        # the batch call runs in Rust with the GIL released (encode() keeps it for the whole tokenization)
        return (backend or self._tok).encode_batch([text], add_special_tokens=add_special_tokens)[0]

    # ------------------------------------------------------------------ special tokens inside message text

    def _special_tokens(self) -> tuple:
        """(a regex matching the text of any special token, longest first, or None when there are none;
        {text: id})."""
        if self._specials is None:
            by_text = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special and t.content}
            texts = sorted(by_text, key=len, reverse=True)
            self._specials = (re.compile("|".join(map(re.escape, texts))) if texts else None, by_text)
        return self._specials

    def has_special_text(self, text: str) -> bool:
        """Whether ``text`` contains the text of one of the tokenizer's special tokens (``<|im_end|>`` ...)."""
        pattern = self._special_tokens()[0]
        return pattern is not None and pattern.search(text) is not None

    def _plain(self):
        """The backend with special-token matching off (tokenizers' ``encode_special_tokens``): a copy, because
        the switch belongs to the whole backend and other threads encode with the original meanwhile."""
        if self._plain_backend is None:
            from tokenizers import Tokenizer as Backend

            plain = Backend.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> tuple:
        """``apply_chat_template``'s text and the spans ``[(start, end), ...]`` of it that are the messages' own
        text (every string field but ``role``), in order.

        The template is rendered a second time with each such string wrapped in two private-use characters that
        appear nowhere in the input; where the marks land are the spans. When that rendering, marks removed, is
        not the plain one (a template that trims or splits the content), each string is looked up in order in
        the plain text instead; a string with special-token text that cannot be found so is a ValueError (its
        tokens could not be told from the template's)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return text, self._spans(messages, text, add_generation_prompt, kwargs)

    def _spans(self, messages: list[dict], text: str, add_generation_prompt: bool, kwargs: dict) -> list:
        values = [v for m in messages for k, v in m.items() if k != "role" and isinstance(v, str) and v]
        if not values:
            return []
        taken = values + [self.chat_template or ""]
        open_, close = next((chr(c), chr(c + 1)) for c in _MARKS
                            if not any(chr(c) in t or chr(c + 1) in t for t in taken))
        marked = [{k: open_ + v + close if k != "role" and isinstance(v, str) and v else v for k, v in m.items()}
                  for m in messages]
        try:
            found = _unmark(self.apply_chat_template(marked, add_generation_prompt, **kwargs), open_, close)
        except ValueError:
            found = None
        if found is not None and found[0] == text:
            return found[1]
        spans, pos = [], 0
        for v in values:
            at = text.find(v, pos)
            if at < 0 and v.strip():
                v = v.strip()
                at = text.find(v, pos)
            if at >= 0:
                spans.append((at, at + len(v)))
                pos = at + len(v)
            elif self.has_special_text(v):
                raise ValueError("the chat template rewrites a message's text, so special-token text inside it "
                                 "cannot be told from the template's own tokens; remove it from the message")
        return spans

    def encode_chat(self, messages: list[dict], cap: Optional[int] = None, *, split_special_tokens: bool = False,
                    add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The ids of ``messages`` rendered by the chat template (``encode(apply_chat_template(...),
        add_special_tokens=False)``), through ``encode_capped`` when ``cap`` is given.

        ``split_special_tokens``: special-token text inside the messages' own text (``hi<|im_end|>``) is
        tokenized as plain text, the template's own special tokens stay tokens; messages without such text get
        exactly the ids of a plain encode."""
        cap = sys.maxsize if cap is None else cap
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        bound = self.min_tokens(text)
        if bound > cap:  # refused from the length alone, before any second rendering
            raise PromptTooLong(bound, cap, len(text))
        if not split_special_tokens or not any(
                self.has_special_text(v) for m in messages for k, v in m.items() if k != "role" and isinstance(v, str)):
            return self._encode_capped(self._tok, text, cap, False)
        return self._encode_split(text, self._spans(messages, text, add_generation_prompt, kwargs), cap)

    def _encode_split(self, text: str, spans: list, cap: int) -> list[int]:
        """``text``'s ids with the special tokens outside ``spans`` as tokens and everything else, special-token
        text inside the spans included, as plain text; ``PromptTooLong`` past ``cap``."""
        pattern, by_text = self._special_tokens()
        starts = [s for s, _ in spans]
        ids: list[int] = []
        pos = 0

        def inside(start: int, end: int) -> bool:  # does [start, end) overlap a span?
            i = bisect.bisect_right(starts, end - 1) - 1
            return i >= 0 and spans[i][1] > start

        def plain(piece: str) -> None:
            try:
                ids.extend(self._encode_capped(self._plain(), piece, cap - len(ids), False))
            except PromptTooLong as e:
                raise PromptTooLong(len(ids) + e.at_least, cap, len(text)) from None

        for m in pattern.finditer(text):
            if inside(m.start(), m.end()):
                continue  # written in a message: plain text
            if m.start() > pos:
                plain(text[pos:m.start()])
            ids.append(by_text[m.group()])
            pos = m.end()
        if pos < len(text):
            plain(text[pos:])
        if len(ids) > cap:
            raise PromptTooLong(len(ids), cap, len(text), exact=True)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, alone: for a byte-level or byte-fallback vocabulary it may be part of
        a UTF-8 character (which ``decode([token_id])`` would show as U+FFFD); an added token's text as UTF-8."""
        if self._byte_values is None:
            self._byte_values = _byte_level_table() if _uses_byte_level(self._tok) else {}
            self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_values and all(c in self._byte_values for c in piece):
            return bytes(self._byte_values[c] for c in piece)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``messages`` ([{"role", "content"}, ...]); encode it with ``add_special_tokens``
        left on: a bos the template wrote is not doubled. Extra ``kwargs`` (tools, enable_thinking, ...) reach
        the template as variables."""
        import jinja2

        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (neither chat_template in tokenizer_config.json "
                             "nor chat_template.jinja); pass a raw prompt instead")
        _check_messages(messages)
        try:
            if self._compiled is None:
                self._compiled = compile_template(self.chat_template)
            specials = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                        "pad_token": self.pad_token, "unk_token": self.unk_token}
            variables = {k: v for k, v in specials.items() if v is not None}  # unset ones stay undefined, as in HF
            variables.update(tools=None, documents=None)
            variables.update(kwargs)
            # keys set to None are dropped, as transformers does (templates test presence, not None)
            # (copies all the way down: the template may grow lists it is given)
            messages = copy.deepcopy([{k: v for k, v in m.items() if v is not None} for m in messages])
            variables = {k: copy.deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in variables.items()}
            return self._compiled.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e


def _byte_level_table() -> dict:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def _uses_byte_level(backend) -> bool:
    """Whether the tokenizer's decoder maps vocabulary characters back to bytes (GPT-2 style byte-level BPE)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)


def _unmark(marked: str, open_: str, close: str) -> Optional[tuple]:
    """(the text without the marks, the spans the mark pairs enclosed) or None when the marks do not pair up."""
    pieces, spans, pos, length = [], [], 0, 0
    while True:
        start = marked.find(open_, pos)
        stray = marked.find(close, pos)
        if start < 0:
            if stray >= 0:
                return None
            pieces.append(marked[pos:])
            return "".join(pieces), spans
        end = marked.find(close, start + 1)
        if end < 0 or 0 <= stray < start or marked.find(open_, start + 1, end) >= 0:
            return None
        pieces.append(marked[pos:start])
        length += start - pos
        pieces.append(marked[start + 1:end])
        spans.append((length, length + end - start - 1))
        length += end - start - 1
        pos = end + 1


class IncrementalDecoder:
    """Streaming detokenization: ``push(id)`` returns the text that id completes ("" while a multi-byte character
    is still partial); ``flush()`` returns whatever is left. The pieces concatenate to ``decode(ids)``.

    Decodes a short window — the tokens of the last emitted piece plus the new ones — and emits the difference,
    so decoders that depend on context (leading-space rules, byte fallback) agree with a whole decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: first token of the last emitted piece
        self._read = 0  # tokens before this are emitted

    def _window_text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._window_text(self._prefix, self._read)
        text = self._window_text(self._prefix, len(self.ids))
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """The held-back tail (it may end in U+FFFD if generation stopped inside a character)."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self._window_text(self._prefix, self._read)
        text = self._window_text(self._prefix, len(self.ids))
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]
