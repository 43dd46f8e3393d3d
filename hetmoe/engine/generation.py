"""Sampling and the generation loop: prefill → (sample → stop checks → decode)*, with stop strings and streaming.

``generate`` drives any runner with ``prefill(ids) -> logits [V]``, ``decode(id) -> logits [V]`` and
``max_context``; the tokenizer turns tokens into text pieces for ``on_text`` as they complete. Text that could
still become a stop string is held back until it is resolved, so a stop string never reaches the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hetmoe.engine.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` is greedy; ``seed`` makes sampling reproducible."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Token ids [] from logits [V], or [B] from [B, V]: greedy at temperature 0 (or top_k 1), else temperature,
    then top-k, then top-p (the smallest set of tokens whose probability reaches top_p), then a draw from
    ``generator`` (the global RNG when None). Runs in fp32 on the logits' device."""
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [B, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.temperature == 0 or params.top_k == 1:
        return logits.argmax(-1)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the ones more likely than it already reach top_p; the most likely one always stays.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    flat = probs.reshape(-1, probs.shape[-1])  # multinomial renormalizes
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass
class Timings:
    prefill_s: float = 0.0  # prefill and the first token's sampling (time to first token)
    decode_s: float = 0.0  # every later step
    prompt_tokens: int = 0
    decode_steps: int = 0  # runner.decode calls

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    text: str  # stop strings and whatever follows them removed
    token_ids: list[int]  # generated, without a final eos / stop token (a stop string's tokens stay)
    finish_reason: str  # "stop" (eos, stop token or stop string) | "length" (max_new_tokens or context full)
    prompt_tokens: int
    completion_tokens: int  # tokens the model produced, a final eos / stop token included
    timings: Timings = field(default_factory=Timings)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class _TextStream:
    """Decoded text so far, cut at the first stop string, and the part of it already handed to ``on_text``."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], on_text: Optional[Callable[[str], None]]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops, self.on_text = stops, on_text
        self.longest = max((len(s) for s in stops), default=0)
        self.text, self.emitted = "", 0

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has appeared (the text is then cut before it)."""
        return self._add(self.decoder.push(token_id), final=False)

    def finish(self) -> bool:
        """Flush the decoder and release held-back text; True if the flushed tail completed a stop string."""
        return self._add(self.decoder.flush(), final=True)

    def _add(self, piece: str, final: bool) -> bool:
        start = max(0, len(self.text) - self.longest + 1)  # an earlier stop string would already have been found
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0] if piece else []
        if hits:
            self.text = self.text[:min(hits)]
            self._emit(len(self.text))
            return True
        self._emit(len(self.text) - (0 if final else _held_back(self.text, self.stops)))
        return False

    def _emit(self, end: int) -> None:
        if end > self.emitted:
            if self.on_text is not None:
                self.on_text(self.text[self.emitted:end])
            self.emitted = end


def generate(runner, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None,
             on_text: Optional[Callable[[str], None]] = None) -> GenerationResult:
    """Generate from ``prompt_ids`` until eos, a stop token or string, ``max_new_tokens`` or a full context.

    ``runner``: ``prefill(ids) -> logits [V]`` (starts the sequence at position 0), ``decode(id) -> logits [V]``,
    ``max_context`` (most tokens, prompt and generated, a sequence may hold). ``on_text(piece)`` receives the text
    as it completes; the pieces concatenate to ``result.text``.
    """
    params = params or SamplingParams()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed to start generation")
    if len(prompt) >= runner.max_context:
        raise ValueError(f"the prompt is {len(prompt)} tokens but the context holds {runner.max_context} "
                         f"(max_context), leaving no room to generate")
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids |= tokenizer.eos_ids
    stream = _TextStream(tokenizer, params.stop, on_text)
    generator = None
    ids: list[int] = []
    finish, stopped_by_text, n_sampled = "length", False, 0

    t0 = time.perf_counter()
    logits = runner.prefill(prompt)
    t_first = None
    while True:
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=logits.device).manual_seed(params.seed)
        token = int(sample(logits, params, generator))  # .item() also waits for the device: timings are real
        n_sampled += 1
        if t_first is None:
            t_first = time.perf_counter()
        if token in stop_ids:
            finish = "stop"
            break
        ids.append(token)
        if stream.push(token):
            finish, stopped_by_text = "stop", True
            break
        if len(ids) >= params.max_new_tokens or len(prompt) + len(ids) >= runner.max_context:
            break
        logits = runner.decode(token)
    if not stopped_by_text and stream.finish():
        finish = "stop"
    t_end = time.perf_counter()

    timings = Timings(prefill_s=t_first - t0, decode_s=t_end - t_first, prompt_tokens=len(prompt),
                      decode_steps=n_sampled - 1)
    return GenerationResult(text=stream.text, token_ids=ids, finish_reason=finish, prompt_tokens=len(prompt),
                            completion_tokens=n_sampled, timings=timings)
