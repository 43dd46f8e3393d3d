"""What a configuration costs in accuracy: perplexity of a model on a text, and how far its next-token
distributions move from the same model's reference configuration (bf16 experts, nothing dropped or deferred).

The text's tokens are cut into consecutive, non-overlapping windows of ``window`` tokens; each window is scored
from an empty cache, so token i of a window is predicted from tokens 0..i-1 of that window only and the first
token of every window is context, never scored (a window of 1 token scores nothing and is skipped). Both
configurations see exactly the same windows, and their logits are compared position by position as each
window is computed (two runners side by side: nothing vocab-sized is kept beyond one window).

    nll_i            = -log softmax(test_logits_i)[target_i]         perplexity = exp(mean_i nll_i)
    KL_i(ref || test) = sum_v p_ref(v) * (log p_ref(v) - log p_test(v))   reported: mean_i KL_i
    top-1 agreement  = mean_i [argmax ref_logits_i == argmax test_logits_i]

Shapes: N scored positions, V vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from hetmoe.config.units import show_progress


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: logits [N, V], targets [N] int -> fp64 [N]."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V] and targets [N]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    logp = torch.log_softmax(logits.double(), dim=-1)  # [N, V]
    return -logp.gather(1, targets.long().view(-1, 1).to(logp.device)).squeeze(1)


def perplexity(nll: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood (nll [N], N >= 1)."""
    if nll.numel() == 0:
        raise ValueError("perplexity of zero tokens")
    return math.exp(float(nll.double().mean()))


def kl_and_agreement(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> tuple:
    """Per position KL(ref || test) (fp64 [N], >= 0 up to rounding) and whether both argmaxes agree (bool [N]),
    from ref_logits and test_logits [N, V]."""
    if ref_logits.shape != test_logits.shape or ref_logits.dim() != 2:
        raise ValueError(f"expected two [N, V] logits of one shape; got {tuple(ref_logits.shape)} and "
                         f"{tuple(test_logits.shape)}")
    test_logits = test_logits.to(ref_logits.device)
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)  # [N, V]
    log_q = torch.log_softmax(test_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)  # [N]
    return kl, ref_logits.argmax(dim=-1) == test_logits.argmax(dim=-1)


def split_windows(ids: Sequence[int], window: int) -> list:
    """Consecutive non-overlapping windows of ``window`` tokens (the last may be shorter); windows of a single
    token (nothing to score) are left out."""
    if window < 2:
        raise ValueError(f"the window must hold at least 2 tokens, got {window}")
    return [list(ids[i:i + window]) for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


@dataclass
class EvalResult:
    tokens: int = 0  # scored positions
    windows: int = 0
    nll_sum: float = 0.0
    ref_nll_sum: float = 0.0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    agree: int = 0
    has_reference: bool = False
    seconds: float = 0.0

    def against_itself(self) -> "EvalResult":
        """This result as its own reference (a configuration that is the reference, scored once): the reference
        perplexity is its own, KL 0, every position agrees."""
        return replace(self, has_reference=True, ref_nll_sum=self.nll_sum, kl_sum=0.0, kl_max=0.0, agree=self.tokens)

    def summary(self) -> dict:
        """The numbers as plain floats (JSON-ready); reference entries are None without a reference."""
        n = max(self.tokens, 1)
        ppl = math.exp(self.nll_sum / n)
        out = {"tokens": self.tokens, "windows": self.windows, "nll": self.nll_sum / n, "perplexity": ppl,
               "reference_perplexity": None, "perplexity_change": None, "kl": None, "kl_max": None,
               "top1_agreement": None, "seconds": self.seconds}
        if self.has_reference:
            ref_ppl = math.exp(self.ref_nll_sum / n)
            out.update(reference_perplexity=ref_ppl, perplexity_change=ppl / ref_ppl - 1, kl=self.kl_sum / n,
                       kl_max=self.kl_max, top1_agreement=self.agree / n)
        return out


def evaluate(runner, ids: Sequence[int], window: int, reference=None, progress: bool = False) -> EvalResult:
    """Score ``ids`` with ``runner`` (a ``Runner``) window by window, and compare with ``reference`` (another
    ``Runner`` of the same vocabulary, or None) on the same windows."""
    chunks = split_windows(ids, window)
    if not chunks:
        raise ValueError(f"the text is {len(ids)} token(s): nothing to score (at least 2 tokens are needed)")
    if reference is not None and reference.vocab_size != runner.vocab_size:
        raise ValueError(f"the reference has {reference.vocab_size} logits per token, the model {runner.vocab_size}")
    res = EvalResult(has_reference=reference is not None)
    t0 = time.perf_counter()
    with show_progress(sum(len(c) - 1 for c in chunks), "eval", "token", progress) as bar:
        for chunk in chunks:
            targets = torch.tensor(chunk[1:])
            logits = runner.score(chunk)[:-1]  # [N, V]: row i predicts chunk[i + 1]
            res.nll_sum += float(token_nll(logits, targets).sum())
            if reference is not None:
                ref_logits = reference.score(chunk)[:-1]
                res.ref_nll_sum += float(token_nll(ref_logits, targets).sum())
                kl, agree = kl_and_agreement(ref_logits, logits)
                res.kl_sum += float(kl.sum())
                res.kl_max = max(res.kl_max, float(kl.max()))
                res.agree += int(agree.sum())
            res.tokens += len(targets)
            res.windows += 1
            bar.update(len(targets))
    res.seconds = time.perf_counter() - t0
    if not math.isfinite(res.nll_sum):
        raise RuntimeError("the model's log-likelihood is not finite (NaN/Inf in its logits)")
    return res
