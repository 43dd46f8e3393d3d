"""Naive references for the CPU expert engine, written from the math, not from the engine's code.

``moe_reference`` is the exact (float64) routed-experts layer. ``moe_reference_emulated`` runs the same math on
the engine's dequantized weights and rounds the activations exactly as the engine's activation quantization
does (csrc/formats/activation.h), so it differs from the engine only by fp32 summation order.
"""

from __future__ import annotations

from typing import Optional

import torch

# Elements per activation scale group when the weights have per-row scales (int8/int4; info() reports group 0).
PER_ROW_ACTIVATION_GROUP = 128
ACTIVATION_QMAX = {"int16": 32767, "int8": 127}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def _routed_pairs(topk_ids: torch.Tensor, num_experts: int, skip_mask: Optional[torch.Tensor]):
    """{expert: (token indices, slot indices)} for every expert that receives at least one (token, slot)."""
    ids = topk_ids.long()
    pairs = {}
    for e in range(num_experts):
        if skip_mask is not None and bool(skip_mask[e]):
            continue
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            pairs[e] = (t, j)
    return pairs


def _moe(x64, weights_of, num_experts, topk_ids, topk_weights, skip_mask, quant_x, quant_h):
    out = torch.zeros_like(x64)
    xq = quant_x(x64)
    for e, (t, j) in _routed_pairs(topk_ids, num_experts, skip_mask).items():
        gate, up, down = weights_of(e)
        xe = xq[t]
        h = silu(xe @ gate.T) * (xe @ up.T)
        y = quant_h(h) @ down.T
        out.index_add_(0, t, topk_weights[t, j].double()[:, None] * y)
    return out.float()


def moe_reference(x, gate, up, down, topk_ids, topk_weights, skip_mask=None) -> torch.Tensor:
    """fp32 [T, H]: out[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, j].

    gate, up [E, I, H] and down [E, H, I] (any float dtype); ids == -1 and experts in ``skip_mask`` are skipped.
    Computed in float64.
    """
    weights_of = lambda e: (gate[e].double(), up[e].double(), down[e].double())  # noqa: E731
    same = lambda v: v  # noqa: E731
    return _moe(x.double(), weights_of, gate.shape[0], topk_ids, topk_weights, skip_mask, same, same)


def amx_row_group(intermediate: int) -> int:
    """csrc/formats/layout.h amx_row_group: the AMX activation group of h for per-row int8/int4 weights."""
    kp = -(-intermediate // 128) * 128
    return next((g for g in (1024, 512, 256) if kp % g == 0 and kp // g >= 2), 128)


def fake_quantize(v: torch.Tensor, group: int, qmax: int) -> torch.Tensor:
    """Round each row of ``v`` in groups of ``group`` elements like the engine quantizes activations.

    In fp32: amax = max |v| over the group; inv = qmax / amax; q = round_half_even(v * inv) clamped to
    [-qmax, qmax]; value = q * (amax / qmax). A group with amax == 0 stays zero. The last group of a row may be
    partial; zero padding does not change its amax.
    """
    v = v.float()
    rows, n = v.shape
    n_pad = -(-n // group) * group
    g = torch.nn.functional.pad(v, (0, n_pad - n)).view(rows, n_pad // group, group)
    amax = g.abs().amax(dim=2, keepdim=True)
    qmax_f = torch.tensor(float(qmax), dtype=torch.float32)
    nonzero = amax > 0
    inv = torch.where(nonzero, qmax_f / torch.where(nonzero, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.round(g * inv).clamp(-qmax, qmax)
    deq = q * (amax / qmax_f)
    return deq.view(rows, n_pad)[:, :n]


def moe_reference_emulated(x, gate_dq, up_dq, down_dq, topk_ids, topk_weights, activation, group,
                           skip_mask=None) -> torch.Tensor:
    """``moe_reference`` on dequantized weights, with the engine's activation rounding.

    gate_dq, up_dq, down_dq: sequences (or stacked tensors) of per-expert fp32 weights as returned by
    ``CPUExperts.dequantized(e)``; an entry may be None for an expert that is never routed to.
    activation: ``info()["activation"]`` ("fp32", "int16" or "int8"; "bf16" for AMX experts); group:
    ``info()["group_size"]``
    (0 = int8/int4 weights with per-row scales, whose activations use groups of 128; "row": the AMX activations of
    those weights, x in one group per token and h in groups of ``amx_row_group(I)``). x is quantized per token
    before gate/up, and h = silu(gate x) * (up x) per (token, expert) before down, both along their rows.
    """
    if activation == "fp32":
        quant = lambda v: v.float().double()  # noqa: E731  (the engine keeps h in fp32)
    elif activation == "bf16":  # AMX experts of bf16 weights: x and h rounded to bf16 (nearest even)
        quant = lambda v: v.float().bfloat16().double()  # noqa: E731
    else:
        qmax = ACTIVATION_QMAX[activation]
        g = group if group != "row" and group > 0 else PER_ROW_ACTIVATION_GROUP
        quant = lambda v: fake_quantize(v, g, qmax).double()  # noqa: E731
    quant_x = quant
    if group == "row":  # AMX experts of per-row int8/int4 weights: x in one group per token, h in amx_row_group(I)
        qmax = ACTIVATION_QMAX[activation]
        quant_x = lambda v: fake_quantize(v, v.shape[-1], qmax).double()  # noqa: E731
        quant = lambda v: fake_quantize(v, amx_row_group(v.shape[-1]), qmax).double()  # noqa: E731
    weights_of = lambda e: (gate_dq[e].double(), up_dq[e].double(), down_dq[e].double())  # noqa: E731
    return _moe(x.float().double(), weights_of, len(gate_dq), topk_ids, topk_weights, skip_mask, quant_x, quant)


def sink_attention_reference(q, k, v, positions, scale, sinks=None, window=None) -> torch.Tensor:
    """Decode attention with gpt-oss's sinks and sliding window, from Transformers' eager_attention_forward: q [N, H,
    D] at ``positions`` [N], each row over its own keys k [N, L, KV, D] / values v [N, L, KV, Dv] (query head h reads
    kv head h // (H / KV)) -> [N, H, Dv] in fp32. Scores of the positions j <= p (and p - window < j with a window),
    the head's sink logit appended as one more column, softmax over the row, the sink's column dropped."""
    N, H, _ = q.shape
    L, KV = k.shape[1], k.shape[2]
    kk = k.float().repeat_interleave(H // KV, dim=2)  # [N, L, H, D]
    vv = v.float().repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("nhd,nlhd->nhl", q.float(), kk) * scale  # [N, H, L]
    j = torch.arange(L, device=q.device).view(1, 1, L)
    p = positions.to(q.device).view(N, 1, 1)
    seen = j <= p
    if window is not None:
        seen = seen & (j > p - window)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().to(q.device).view(1, H, 1).expand(N, H, 1)), dim=-1)
    probs = scores.softmax(dim=-1)[..., :L]
    return torch.einsum("nhl,nlhd->nhd", probs, vv)
