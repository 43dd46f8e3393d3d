"""The sampler: ``SamplingParams`` says how to pick tokens and when to stop; ``LogitsProcessor`` applies one
sequence's logit bias, constraint and penalties; ``sample`` picks the tokens; ``token_logprob`` and
``prompt_logprobs`` report log-probabilities.

The order of work on one sequence's logits [V] (``SequenceState.sample`` in engine/sequence.py runs it):

    logit_bias -> constraint mask -> repetition, presence, frequency penalties      (LogitsProcessor)
      -> log-probabilities reported here: log_softmax of these "processed" logits
    -> greedy argmax, or temperature -> top-k -> top-p -> min_p -> a draw           (sample)

So reported log-probabilities see the bias, the constraint and the penalties but not the temperature or the
truncations (top-k, top-p, min_p): they are the model's distribution as the request shaped it, the same at any
temperature (vLLM's two choices are "raw", before any processing, and "processed", after all of it; this one is
between them). Prompt log-probabilities (``prompt_logprobs``) are the model's own, with nothing applied.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

# Below this temperature sampling is greedy: logits / T would only sharpen the distribution onto its argmax (at
# 1e-5 a logit gap of 1e-3 is already e^100), and a smaller T overflows fp32 (1e-300: inf - inf = NaN).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI's


@runtime_checkable
class TokenConstraint(Protocol):
    """A grammar that one sequence's tokens must follow (structured output, forced tool calls). ``SamplingParams.
    constraint`` is a zero-argument factory of these; ``SequenceState`` makes one per sequence and calls, each step:

        mask(logits)      logits [V] fp32 on the logits' device, modified in place: tokens the grammar does not
                          allow next set to -inf (called before the penalties; the sampler then picks among the rest)
        accept(token)     the sampled token advances the grammar; ValueError if it is not allowed (the request fails)
        is_terminated()   the grammar is complete: the sequence ends there, finish reason "stop"

    A stop token (eos, ``stop_token_ids``) that the mask leaves allowed ends the sequence too, without ``accept``.
    A mask that allows no token at all fails the request (ValueError from the sampler). Optionally:

        prepare()         work out the next mask on the host now (the scheduler calls it while the GPU computes the
                          step's logits, so that ``mask`` only applies it)

        host_mask()       the next mask as a host bitmask (int32 [ceil(V/32)], bit j of word i = token 32i + j
                          allowed; ValueError when none is), which the scheduler applies to all its rows' logits at
                          once instead of calling ``mask``

    and ``mask`` may return True to say it checked on the host that some token stays allowed (raising ValueError
    otherwise); any other return lets the sampler check the masked logits itself (a device round trip)."""

    def mask(self, logits: torch.Tensor) -> None: ...

    def accept(self, token: int) -> None: ...

    def is_terminated(self) -> bool: ...


@dataclass
class TokenLogprob:
    """One position's log-probabilities: ``token_id`` (the token generated or, for a prompt, the one written
    there), its ``logprob`` (natural log, <= 0), and ``top``: the most likely tokens at that position as
    ``(token_id, logprob)`` pairs, most likely first (as many as asked; tokens of probability 0 are left out).
    For a generated token, a tie is broken in its favour: at temperature 0 it is ``top[0]``."""

    token_id: int
    logprob: float
    top: list = field(default_factory=list)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS


@dataclass(init=False)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM / OpenAI. ``temperature=0`` is greedy (so is any temperature
    below ``GREEDY_TEMPERATURE``, 1e-5, and ``top_k=1``); ``seed`` makes sampling reproducible; ``max_tokens``
    bounds the tokens generated (``max_new_tokens=`` is accepted too).

    Keyword-only, each off by default:

    - ``min_p`` in [0, 1] (0: off): drop tokens whose probability is below ``min_p`` times the most likely one's.
    - ``repetition_penalty`` > 0 (1: off), as Hugging Face / vLLM: the logit of every token seen in the prompt or
      generated so far is divided by it when positive, multiplied by it when negative.
    - ``presence_penalty``, ``frequency_penalty`` in [-2, 2] (0: off), as OpenAI, over the generated tokens only:
      ``logit -= presence * (count > 0) + frequency * count``.
    - ``logit_bias``: {token id: bias in [-100, 100]} added to the logits (ids checked against the model's
      vocabulary when the request is queued; keys may be decimal strings, as in JSON).
    - ``logprobs``: None, or 0..20 alternatives: each generated token's log-probability (``TokenLogprob``) with the
      ``logprobs`` most likely tokens at its position; 0 gives the token's own only.
    - ``prompt_logprobs``: None, or 0..20: the log-probability of every prompt token after the first (the model's
      own, as ``echo`` needs), with that many alternatives. Such a prompt is computed whole (no prefix reuse).
    - ``constraint``: None, or a zero-argument callable returning a fresh ``TokenConstraint`` (one per sequence).
    - ``skip_special_tokens`` (True: on): the streamed text leaves out special tokens (a tokenizer's added tokens
      marked special: ``<|im_end|>``, ``<|tool_calls_section_begin|>`` ...), as Hugging Face's ``decode`` does;
      ``shown_special_ids``: ids of special tokens the text shows all the same (the markers a tool-call or
      reasoning parser reads, while the other special tokens stay out). A stop token never reaches the text.

    The order in which they apply and which logits the log-probabilities come from: this module's docstring."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None  # {token id: bias}
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    constraint: Optional[Callable[[], TokenConstraint]] = None
    skip_special_tokens: bool = True
    shown_special_ids: frozenset = frozenset()  # special tokens shown even with skip_special_tokens

    def __init__(self, max_tokens: Optional[int] = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                 stop_token_ids: Optional[Sequence[int]] = None, ignore_eos: bool = False, *,
                 max_new_tokens: Optional[int] = None, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: Optional[dict] = None,
                 logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None,
                 constraint: Optional[Callable[[], TokenConstraint]] = None, skip_special_tokens: bool = True,
                 shown_special_ids: Iterable[int] = ()):
        name = "max_tokens"
        if max_new_tokens is not None:
            if max_tokens is not None:
                raise TypeError("give max_tokens or max_new_tokens (its other name), not both")
            max_tokens, name = max_new_tokens, "max_new_tokens"
        self.max_tokens = 128 if max_tokens is None else max_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.stop, self.stop_token_ids, self.ignore_eos = stop, stop_token_ids, ignore_eos
        self.min_p, self.repetition_penalty = min_p, repetition_penalty
        self.presence_penalty, self.frequency_penalty = presence_penalty, frequency_penalty
        self.logit_bias, self.logprobs, self.prompt_logprobs = logit_bias, logprobs, prompt_logprobs
        self.constraint = constraint
        self.skip_special_tokens, self.shown_special_ids = skip_special_tokens, shown_special_ids
        self._check(name)

    @property
    def max_new_tokens(self) -> int:
        """The other name of ``max_tokens`` (the CLI's ``--max-new-tokens``)."""
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether ``sample`` takes the argmax: temperature below 1e-5 (0 included) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the pick: a logit bias, a constraint or a penalty (min_p counts
        too, though it never changes a greedy pick)."""
        return bool(self.logit_bias or self.constraint is not None or self.repetition_penalty != 1
                    or self.presence_penalty or self.frequency_penalty or self.min_p)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to do per row: the scheduler takes one batched argmax for all such rows."""
        return self.greedy and not self.processes_logits and self.logprobs is None

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice ``index`` of a request for ``n`` choices (each submitted as its own request):
        the same, with seed ``seed + index`` when a seed is given (so choices differ, and the same request gives
        the same choices again)."""
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"the choice index must be an integer >= 0, got {index!r}")
        params = copy.copy(self)
        if self.seed is not None:
            params.seed = self.seed + index
        return params

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError when ``logit_bias`` names a token outside [0, vocab_size)."""
        bad = sorted(t for t in self.logit_bias or {} if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")

    def _check(self, max_tokens_name: str) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"{max_tokens_name} must be an integer >= 1, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or not self.temperature >= 0
                or not math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
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
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}")
        if not _number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}")
        self.logit_bias = self._bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _count(value):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}")
        shown = self.shown_special_ids
        try:
            ids = None if isinstance(shown, (str, bytes, dict)) else frozenset(shown)
        except TypeError:  # not iterable, or unhashable items
            ids = None
        if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"shown_special_ids must be a collection of token ids (integers >= 0), got {shown!r}")
        self.shown_special_ids = ids
        if self.constraint is not None and not callable(self.constraint):
            raise ValueError(f"constraint must be None or a callable that returns a new TokenConstraint, got "
                             f"{type(self.constraint).__name__}")

    @staticmethod
    def _bias(bias) -> Optional[dict]:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if not _number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}")
            out[token] = float(value)
        return out or None


class LogitsProcessor:
    """One sequence's logit bias, constraint mask and penalties, in that order (``apply``); ``record`` each token
    the sequence generates. The penalty state lives on the logits' device as dense [V] tensors built at the first
    ``apply`` (tokens seen in the prompt or generated: repetition; counts of generated tokens: presence and
    frequency), so a step costs a few elementwise operations over the vocabulary and no host round trip."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 constraint: Optional[TokenConstraint] = None):
        self.params, self.constraint = params, constraint
        self.prompt_ids, self.generated = list(prompt_ids), []
        self._seen: Optional[torch.Tensor] = None  # [V] bool: in the prompt or generated (repetition)
        self._counts: Optional[torch.Tensor] = None  # [V] fp32: times generated (presence, frequency)
        self._bias: Optional[tuple] = None  # (ids [n], values [n]) on the logits' device
        self._device: Optional[torch.device] = None  # where the tensors above are (None: not built yet)

    def record(self, token: int) -> None:
        self.generated.append(token)
        if self._seen is not None and token < len(self._seen):
            self._seen[token] = True
            self._counts[token] += 1

    def _build(self, vocab: int, device: torch.device) -> None:
        p = self.params
        self._seen = self._counts = self._bias = None
        self._device = device
        if p.logit_bias:
            p.check_vocab(vocab)
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            self._bias = (ids.to(device), torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).to(device))
        if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty:
            seen = torch.zeros(vocab, dtype=torch.bool)
            counts = torch.zeros(vocab, dtype=torch.float32)
            prompt = torch.tensor([t for t in self.prompt_ids if 0 <= t < vocab], dtype=torch.int64)
            gen = torch.tensor([t for t in self.generated if 0 <= t < vocab], dtype=torch.int64)
            seen[prompt] = True
            seen[gen] = True
            counts.index_add_(0, gen, torch.ones(len(gen)))
            self._seen, self._counts = seen.to(device), counts.to(device)

    def prepare(self) -> None:
        """The host's share of the next ``apply`` (the constraint's next mask), done now: called while the device
        computes the logits."""
        prepare = getattr(self.constraint, "prepare", None)
        if prepare is not None:
            prepare()

    def apply(self, logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """logits [V] fp32, modified in place and returned. ``masked``: the constraint's mask was applied already
        (``host_mask``; it commutes with the bias and the penalties: -inf stays -inf). ValueError when the
        constraint allows no token, or the logit bias names one beyond V."""
        p = self.params
        if self._device != logits.device:  # the first call (or the logits moved)
            self._build(logits.shape[-1], logits.device)
        if self._bias is not None:
            logits.index_add_(0, *self._bias)
        if self.constraint is not None and not masked:
            if self.constraint.mask(logits) is not True and not bool((logits > float("-inf")).any()):
                raise ValueError("the constraint allows no token at this position")
        if self._seen is not None:
            if p.repetition_penalty != 1:
                r = p.repetition_penalty
                logits.copy_(torch.where(self._seen, torch.where(logits > 0, logits / r, logits * r), logits))
            if p.presence_penalty or p.frequency_penalty:
                logits -= p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0).float()
        return logits


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s entry from logprobs [V] (a log_softmax), with the ``top`` most likely tokens (ties broken in
    favour of ``token``; tokens of probability 0 left out)."""
    chosen = float(logprobs[token])
    pairs: list = []
    if top > 0:
        values, ids = logprobs.topk(min(top + 1, logprobs.shape[-1]))
        pairs = [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if i != token and v > float("-inf")]
        at = next((j for j, (_, v) in enumerate(pairs) if v <= chosen), len(pairs))
        pairs.insert(at, (token, chosen))
        pairs = pairs[:top]
    return TokenLogprob(token, chosen, pairs)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list:
    """logits [m, V] after m consecutive prompt positions, targets [m] the tokens that follow each -> one
    ``TokenLogprob`` per row: log_softmax in fp32 (the model's own distribution), with ``top`` alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = logp.gather(1, targets.to(logp.device).long()[:, None])[:, 0].tolist()
    out = [TokenLogprob(int(t), v, []) for t, v in zip(targets.tolist(), chosen)]
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        for entry, row_ids, row_values in zip(out, ids.tolist(), values.tolist()):
            entry.top = [(i, v) for i, v in zip(row_ids, row_values) if v > float("-inf")]
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Token ids [] from logits [V], or [B] from [B, V]: greedy when ``params.greedy`` (temperature below 1e-5, or
    top_k 1), else temperature, then top-k, then top-p (the smallest set of tokens whose probability reaches top_p,
    the most likely token always kept), then min_p (tokens less likely than min_p times the most likely one
    dropped), then a draw from ``generator`` (the global RNG when None). Runs in fp32 on the logits' device; total
    over the documented ranges (any finite temperature >= 0, top_p in (0, 1], min_p in [0, 1]). The logits are
    taken as they are: a sequence's bias, constraint and penalties are ``LogitsProcessor``'s, applied before."""
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [V] or [B, V], got shape {tuple(logits.shape)}")
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1)
    # Scale (logits - max) <= 0 by 1 / T: a product that overflows becomes -inf (probability 0) rather than inf - inf,
    # and -inf logits stay -inf where a huge T would make -inf * 0 = NaN.
    logits = logits - logits.amax(-1, keepdim=True)
    logits = torch.where(logits == float("-inf"), logits, logits * (1.0 / params.temperature))
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the ones more likely than it already reach top_p. top_p is compared in fp32 too, where
        # 1e-300 is 0: the most likely token is kept explicitly, so the distribution is never empty.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop_sorted[..., 0] = False
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if params.min_p > 0:  # relative to the most likely token, which always stays (p >= min_p * p for min_p <= 1)
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    flat = probs.reshape(-1, probs.shape[-1])  # multinomial renormalizes
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
