"""The sampler: ``SamplingParams`` says how to pick tokens and when to stop; ``sample`` picks them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Below this temperature sampling is greedy: logits / T would only sharpen the distribution onto its argmax (at
# 1e-5 a logit gap of 1e-3 is already e^100), and a smaller T overflows fp32 (1e-300: inf - inf = NaN).
GREEDY_TEMPERATURE = 1e-5


@dataclass(init=False)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM / OpenAI. ``temperature=0`` is greedy (so is any temperature
    below ``GREEDY_TEMPERATURE``, 1e-5, and ``top_k=1``); ``seed`` makes sampling reproducible; ``max_tokens``
    bounds the tokens generated (``max_new_tokens=`` is accepted too)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False

    def __init__(self, max_tokens: Optional[int] = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (),
                 stop_token_ids: Optional[Sequence[int]] = None, ignore_eos: bool = False, *,
                 max_new_tokens: Optional[int] = None):
        name = "max_tokens"
        if max_new_tokens is not None:
            if max_tokens is not None:
                raise TypeError("give max_tokens or max_new_tokens (its other name), not both")
            max_tokens, name = max_new_tokens, "max_new_tokens"
        self.max_tokens = 128 if max_tokens is None else max_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.stop, self.stop_token_ids, self.ignore_eos = stop, stop_token_ids, ignore_eos
        self._check(name)

    @property
    def max_new_tokens(self) -> int:
        """The other name of ``max_tokens`` (the CLI's ``--max-new-tokens``)."""
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        """Whether ``sample`` takes the argmax: temperature below 1e-5 (0 included) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Token ids [] from logits [V], or [B] from [B, V]: greedy when ``params.greedy`` (temperature below 1e-5, or
    top_k 1), else temperature, then top-k, then top-p (the smallest set of tokens whose probability reaches top_p,
    the most likely token always kept), then a draw from ``generator`` (the global RNG when None). Runs in fp32 on
    the logits' device; total over the documented ranges (any finite temperature >= 0, top_p in (0, 1])."""
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
    flat = probs.reshape(-1, probs.shape[-1])  # multinomial renormalizes
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
