"""Log-probabilities in OpenAI's two shapes, from the engine's ``TokenLogprob`` entries (engine/sampler.py).

Chat (``logprobs: true``, ``top_logprobs: N``), per choice and per streamed chunk::

    {"content": [{"token": "Hel", "logprob": -0.31, "bytes": [72, 101, 108],
                  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}

Completions (``logprobs: N``, the legacy shape), with ``echo`` the prompt's tokens first (the first one has no
logprob: nothing precedes it)::

    {"tokens": ["Hel", ...], "token_logprobs": [null, -0.31, ...], "top_logprobs": [null, {"lo": -0.2}, ...],
     "text_offset": [0, 3, ...]}

A token's text is its bytes decoded as UTF-8; a token that holds part of a character (byte-level vocabularies
split them) is written ``bytes:\\xe6\\x97`` as OpenAI does, and ``bytes`` gives the exact bytes, which join into the
text. ``text_offset`` is where each token starts in the choice's text: the length of the text its earlier tokens
decode to (a character split over tokens counts at its last one). A log-probability of -inf (a token a grammar
ruled out) is written -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from hetmoe.tokenizer import IncrementalDecoder, Tokenizer

FLOOR = -9999.0  # what -inf is written as


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class TokenText:
    """token id -> (text, bytes) as logprobs show them, memoized (a server sees the same tokens again and again)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._memo: dict = {}

    def __call__(self, token_id: int) -> tuple:
        hit = self._memo.get(token_id)
        if hit is None:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if len(self._memo) < 1 << 16:
                self._memo[token_id] = hit = (text, list(raw))
            else:
                hit = (text, list(raw))
        return hit


def chat_content(entries: Sequence, text_of: TokenText) -> list:
    """``logprobs.content`` of a chat choice (or of one chunk) for ``entries`` [TokenLogprob]."""
    out = []
    for e in entries:
        token, raw = text_of(e.token_id)
        top = []
        for token_id, logprob in e.top:
            t, b = text_of(token_id)
            top.append({"token": t, "logprob": _number(logprob), "bytes": b})
        out.append({"token": token, "logprob": _number(e.logprob), "bytes": raw, "top_logprobs": top})
    return out


def chat_logprobs(entries: Sequence, text_of: TokenText) -> dict:
    return {"content": chat_content(entries, text_of), "refusal": None}


class LegacyLogprobs:
    """The completions shape, built as tokens arrive (``add``); ``take()`` returns what was added since the last
    call (a streamed chunk's part) with offsets that go on from the earlier parts. ``skip_special_tokens``: as the
    choice's text was decoded (``SamplingParams.skip_special_tokens``)."""

    def __init__(self, text_of: TokenText, offset: int = 0, skip_special_tokens: bool = True):
        self.text_of = text_of
        self.decoder = IncrementalDecoder(text_of.tokenizer, skip_special_tokens)
        self.offset = offset  # characters of the choice's text before the next token
        self.tokens: list = []
        self.token_logprobs: list = []
        self.top_logprobs: list = []
        self.text_offset: list = []

    def add(self, token_id: int, logprob: Optional[float], top: Optional[Sequence]) -> None:
        """One token: its logprob (None: the prompt's first token) and its alternatives [(id, logprob)] (the
        token itself is listed among them too, as OpenAI does)."""
        self.tokens.append(self.text_of(token_id)[0])
        self.token_logprobs.append(None if logprob is None else _number(logprob))
        if logprob is None:
            self.top_logprobs.append(None)
        else:
            alternatives = {}
            for i, lp in list(top or ()) + [(token_id, logprob)]:
                alternatives.setdefault(self.text_of(i)[0], _number(lp))
            self.top_logprobs.append(alternatives)
        self.text_offset.append(self.offset)
        self.offset += len(self.decoder.push(token_id))

    def add_prompt(self, prompt_ids: Sequence[int], entries: Sequence) -> None:
        """The prompt's tokens: the first without a logprob, then ``entries`` [TokenLogprob] for positions 1.."""
        self.add(prompt_ids[0], None, None)
        for token_id, e in zip(prompt_ids[1:], entries):
            self.add(token_id, e.logprob, e.top)

    def add_entries(self, entries: Sequence, shown: int) -> None:
        for e in entries:
            self.add(e.token_id, e.logprob, e.top[:shown])

    def take(self) -> dict:
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
