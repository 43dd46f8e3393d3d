"""One sequence's part of the generation loop: its sampling, stop checks, stop strings and streamed text.

``SequenceState`` follows one sequence after its prompt (logit processing and sampling, log-probabilities, a
constraint, stop checks, incremental text, finish reason, token counts). The loop that drives many sequences at once
is ``engine/scheduler.py``. Text that could still become a stop string is held back until it is resolved, so a stop
string never reaches the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hetmoe.engine.sampler import (
    LogitsProcessor,
    SamplingParams,
    TokenConstraint,
    TokenLogprob,
    sample,
    token_logprob,
)
from hetmoe.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class Timings:
    prefill_s: float = 0.0  # prefill and the first token's sampling (time to first token)
    decode_s: float = 0.0  # every later step
    prompt_tokens: int = 0
    decode_steps: int = 0  # runner.decode calls
    cached_tokens: int = 0  # prompt tokens already in the KV cache (a chat's earlier turns): not recomputed

    @property
    def new_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens computed per second (the cached ones cost nothing and are not counted)."""
        return self.new_prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class GenerationResult:
    text: str  # stop strings and whatever follows them removed
    token_ids: list[int]  # generated, without a final eos / stop token (a stop string's tokens stay)
    finish_reason: str  # "stop" (eos, stop token or stop string) | "length" (max_tokens or context full)
    prompt_tokens: int
    completion_tokens: int  # tokens the model produced, a final eos / stop token included
    timings: Timings = field(default_factory=Timings)
    # SamplingParams.logprobs set: one TokenLogprob per token sampled, a final eos / stop token included
    logprobs: Optional[list[TokenLogprob]] = None
    # SamplingParams.prompt_logprobs set: one TokenLogprob per prompt token after the first (positions 1..n-1)
    prompt_logprobs: Optional[list[TokenLogprob]] = None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is the beginning of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _special_ids(tokenizer: Tokenizer) -> frozenset:
    return frozenset(i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special)


class _TextStream:
    """Decoded text so far, cut at the first stop string, and the part of it already handed to ``on_text``.
    Special tokens are left out (``skip_special_tokens``) but for ``shown`` ones: the decoder then keeps special
    tokens and the others are never handed to it."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], on_text: Optional[Callable[[str], None]],
                 skip_special_tokens: bool = True, shown: frozenset = frozenset()):
        self.hidden = _special_ids(tokenizer) - shown if skip_special_tokens and shown else frozenset()
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens and not shown)
        self.stops, self.on_text = stops, on_text
        self.longest = max((len(s) for s in stops), default=0)
        self.text, self.emitted = "", 0
        self.stop_string: Optional[str] = None  # the stop string that cut the text

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has appeared (the text is then cut before it)."""
        if token_id in self.hidden:
            return False
        return self._add(self.decoder.push(token_id), final=False)

    def finish(self) -> bool:
        """Flush the decoder and release held-back text; True if the flushed tail completed a stop string."""
        return self._add(self.decoder.flush(), final=True)

    def _add(self, piece: str, final: bool) -> bool:
        start = max(0, len(self.text) - self.longest + 1)  # an earlier stop string would already have been found
        self.text += piece
        hits = [(i, -len(s), s) for s in self.stops if (i := self.text.find(s, start)) >= 0] if piece else []
        if hits:
            at, _, self.stop_string = min(hits)  # the first to begin; of those, the longest
            self.text = self.text[:at]
            self._emit(len(self.text))
            return True
        self._emit(len(self.text) - (0 if final else _held_back(self.text, self.stops)))
        return False

    def _emit(self, end: int) -> None:
        if end > self.emitted:
            if self.on_text is not None:
                self.on_text(self.text[self.emitted:end])
            self.emitted = end


class SequenceState:
    """What happens to one sequence after its prompt: each sampled token is added with ``add``, which runs the
    stop checks (eos / stop token ids, stop strings, ``max_tokens``, a full context) and streams the text
    that is final to ``on_text``. The scheduler (engine/scheduler.py) keeps one per running sequence.

    ``finish_reason`` is None while the sequence goes on, then "stop" (eos, stop token, stop string, or the
    constraint complete) or "length" (``max_tokens`` or the context is full).

    ``sample`` picks a token from the sequence's logits: its ``LogitsProcessor`` (logit bias, the constraint's mask,
    penalties over ``prompt_ids`` and the generated tokens) when the parameters ask for one, then ``sampler.sample``;
    with ``params.logprobs`` set, each pick's ``TokenLogprob`` is appended to ``logprobs``. The constraint
    (``params.constraint()``, made here) accepts each generated token in ``add``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: int, params: SamplingParams, max_context: int,
                 on_text: Optional[Callable[[str], None]] = None, *, prompt_ids: Optional[Sequence[int]] = None):
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty: at least one token is needed to start generation")
        if prompt_tokens >= max_context:
            raise ValueError(f"the prompt is {prompt_tokens} tokens but the context holds {max_context} "
                             f"(max_context), leaving no room to generate")
        self.params, self.prompt_tokens, self.max_context = params, prompt_tokens, max_context
        self.stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self.stop_ids |= tokenizer.eos_ids
        self.stream = _TextStream(tokenizer, params.stop, on_text, params.skip_special_tokens, params.shown_special_ids)
        self.token_ids: list[int] = []  # generated, without a final eos / stop token
        self.completion_tokens = 0  # sampled, a final eos / stop token included
        self.finish_reason: Optional[str] = None
        self._generator: Optional[torch.Generator] = None
        self.logprobs: list[TokenLogprob] = []  # one per sample() when params.logprobs is set
        self.constraint: Optional[TokenConstraint] = None
        if params.constraint is not None:
            self.constraint = params.constraint()
            if not isinstance(self.constraint, TokenConstraint):
                raise ValueError(f"constraint() must return an object with mask, accept and is_terminated, got "
                                 f"{type(self.constraint).__name__}")
        self.processor: Optional[LogitsProcessor] = None
        if params.processes_logits:
            self.processor = LogitsProcessor(params, prompt_ids or (), self.constraint)

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def stop_string(self) -> Optional[str]:
        """The stop string that ended the sequence (its text cut where it began), or None."""
        return self.stream.stop_string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def generator(self, device: torch.device) -> Optional[torch.Generator]:
        """This sequence's own RNG (None without a seed: the global one), created on the logits' device."""
        if self._generator is None and self.params.seed is not None:
            self._generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self._generator

    def prepare(self) -> None:
        """The host's share of the next ``sample`` (the constraint's mask), done now: the scheduler calls it while
        the device computes the step's logits."""
        if self.processor is not None:
            self.processor.prepare()

    def host_mask(self) -> Optional[torch.Tensor]:
        """The constraint's next mask as a host bitmask (``TokenConstraint.host_mask``) for the caller to apply,
        then ``process_in_place(..., masked=True)``; None without a constraint or where it masks on its own."""
        host_mask = getattr(self.constraint, "host_mask", None)
        return host_mask() if host_mask is not None else None

    def process_in_place(self, logits: torch.Tensor, masked: bool = False) -> None:
        """This sequence's processor on logits [V] fp32 (a row the caller owns), in place; ``masked``: its
        constraint's host mask was applied already."""
        if self.processor is not None:
            self.processor.apply(logits, masked)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """This sequence's logits [V] (left unchanged) after its processor, as a new fp32 tensor: what ``sample``
        picks from (no host round trip where the constraint checks its mask on the host). ValueError when the
        constraint allows no token."""
        logits = logits.to(torch.float32, copy=True)
        return self.processor.apply(logits) if self.processor is not None else logits

    def sample(self, logits: torch.Tensor) -> int:
        """A token from this sequence's logits [V] (left unchanged) with its own parameters, processor and
        generator; its TokenLogprob appended to ``logprobs`` when ``params.logprobs`` is set. ValueError when the
        constraint allows no token."""
        if self.processor is not None:
            logits = self.process(logits)
        token = int(sample(logits, self.params, self.generator(logits.device)))
        if self.params.logprobs is not None:
            self.logprobs.append(token_logprob(torch.log_softmax(logits.float(), -1), token, self.params.logprobs))
        return token

    def add(self, token: int) -> bool:
        """Record a sampled token; True when the sequence is finished (then it must not be decoded further).
        ValueError when the constraint refuses the token (the sequence cannot go on)."""
        if self.finished:
            raise RuntimeError("add() after the sequence finished")
        self.completion_tokens += 1
        if self.processor is not None:
            self.processor.record(token)
        if token in self.stop_ids:
            return self._finish("stop", flush=True)
        if self.constraint is not None:
            self.constraint.accept(token)
        self.token_ids.append(token)
        if self.stream.push(token):
            return self._finish("stop", flush=False)
        if self.constraint is not None and self.constraint.is_terminated():
            return self._finish("stop", flush=True)
        if (len(self.token_ids) >= self.params.max_tokens
                or self.prompt_tokens + len(self.token_ids) >= self.max_context):
            return self._finish("length", flush=True)
        return False

    def abort(self, reason: str = "length") -> None:
        """End the sequence early (e.g. the server shuts down): release held-back text, record ``reason``."""
        if not self.finished:
            self._finish(reason, flush=True)

    def _finish(self, reason: str, flush: bool) -> bool:
        if flush and self.stream.finish():  # the flushed tail completed a stop string
            reason = "stop"
        self.finish_reason = reason
        return True

