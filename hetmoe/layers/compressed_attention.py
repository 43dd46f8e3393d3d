"""DeepSeek-V4 attention: one shared key/value head, a sliding window with per-head sinks, and compressed entries
of the whole past (CSA with a lightning indexer, or HCA), with its own cache (``CompressedKVCache``).

Every layer (Transformers' DeepseekV4Attention, under its parameter names):

    q_res = q_a_norm(q_a_proj(x))                          [B, S, q_lora_rank]
    q     = rms(q_b_proj(q_res)) per head, RoPE'd           [B, S, h, D]     (rms: unweighted RMSNorm)
    kv    = kv_norm(kv_proj(x)), RoPE'd                     [B, S, D]        one head, key and value at once
    RoPE turns the *last* rope_dim dims of a head, interleaved pairs, at the token's position: the "main" table in
    sliding-window layers, the "compress" one (its own theta, maybe YaRN) in the compressed ones.

    A query at position p attends to the keys of positions p - W < t <= p (the window, W = sliding_window) and, in a
    compressed layer, to compressed entries of whole windows of m past tokens that ended at or before p: every entry
    in an HCA layer ("heavily compressed", m = 128), the indexer's top-k in a CSA layer ("compressed sparse", m = 4).
    softmax over those logits and one sink logit per head (which takes probability but adds no value);
    out = probs @ values; then the output's rope dims are turned back by -p (the values carried their key's RoPE);
    the grouped output projection: heads in o_groups groups, each group [h D / g] -> [o_lora_rank] by its own block
    of o_a_proj, then o_b_proj [g o_lora_rank] -> [hidden].

A compressor (``Compressor``) turns each closed window w (positions w m .. w m + m - 1) into one entry:
per token kv_t = kv_proj(x_t), gate_t = gate_proj(x_t) + position_bias[t mod m]; entry = kv_norm(sum_t
softmax_t(gate_t) * kv_t) (softmax per channel over the window's tokens, in fp32), RoPE'd at position w m. CSA's
compressor ("overlap") projects two series a|b of D each; entry w mixes window w-1's a-series with window w's
b-series over 2m slots (window 0: the missing half has weight 0). The indexer of a CSA layer runs the same kind of
compressor at its own size Di, and scores each query against its entries:

    score(s, e) = sum_i w_i(s) relu(qi(s) . ke(e)) / sqrt(Di),   qi = q_b_proj(q_res) per indexer head, RoPE'd,
                  w = weights_proj(x) / sqrt(n_heads)            (fp32)

keeping the index_topk best entries of the query's past (fewer when fewer exist).

The cache (``CompressedKVCache``), per slot and layer: the last W keys (a ring indexed by position mod W), the
compressed entries so far (and the indexer's), and what the compressors have not closed yet: the current window's
projections (at most m - 1 tokens) and, for CSA, the last closed window's a-series. These fold a whole sequence in
and cannot be cut back to a shorter prefix (prefix reuse is off for these models; ``states`` says so to the runner):
a slot is continued from its end, or written again from position 0 (a row whose first position is 0 starts over).
A row's padding tokens (``Step.lengths``) change none of it.

Everything is plain PyTorch (CPU or GPU, eager). The cache's bookkeeping runs for all rows at once in a decode step
(one token per row) and when no row is padded (the window), per row otherwise (a prefill's rows, whose windows close
at different tokens). The window keys and HCA's entries, one head shared by every query head, are multiplied with a
row's queries and heads as the rows of one product. Scores are made per block of queries so that their fp32
intermediates stay bounded (``BLOCK_ELEMS``).

Shape letters: h attention heads, D head size (key = value), W window, m compression rate, Di / ni the indexer's
head size / heads, k entries kept per query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step
from hetmoe.layers.hyper_connection import unweighted_rms_norm
from hetmoe.layers.widen import WIDEN_ROWS, matmul

BLOCK_ELEMS = 1 << 24  # fp32 elements of one block of scores: 64 MiB
GROW_ALIGN = 64  # the compressed entries' storage grows in multiples of this many positions


# ------------------------------------------------------------------------------------------------ small pieces


class Fp32RMSNorm(nn.Module):
    """RMSNorm computed in fp32 with an fp32 weight (a buffer: loaded as fp32 whatever the model dtype), the result
    rounded to the input's dtype, as Transformers keeps DeepSeek-V4's norms."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.register_buffer("weight", torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> tuple:
    """positions [...] -> (cos, sin) [..., rope_dim / 2] (one angle per interleaved pair), times ``scaling``, in
    ``dtype``."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of the last 2 * cos.shape[-1] dims of x (pairs (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)),
    computed in fp32, the rest passed through; cos/sin broadcast against x's leading dims."""
    R = 2 * cos.shape[-1]
    c, s = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    nope, rope = x[..., :-R], x[..., -R:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((nope, (rope.float() * c + turned.float() * s).to(x.dtype)), dim=-1)


class GroupedLinear(nn.Module):
    """A block-diagonal linear (Transformers' DeepseekV4GroupedLinear, ``o_a_proj``): weight [g * out, in], group i
    maps its slice x[..., i, :] [in] through rows i * out ... (i + 1) * out - 1.
    forward(x [..., g, in]) -> [..., g, out].

    Where a dense format packs the linears (hetmoe/load/dense.py ``pack_dense``, on the CPU), ``split_linears``
    hands the groups' blocks over as linears of their own (``groups``), packed one by one and then run each on its
    group's slice; the weight is then gone (``weight`` None)."""

    def __init__(self, in_per_group: int, out_features: int, n_groups: int):
        super().__init__()
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))
        self.groups = None  # an nn.ModuleList of the groups' linears once split_linears ran

    def split_linears(self) -> None:
        """The groups' blocks as ``groups``: an nn.Linear [out, in] each, views of the weight, which this module no
        longer holds (the packer frees the blocks as it packs them). Once."""
        if self.weight is None:
            return
        w = self.weight.detach()
        out, width = w.shape[0] // self.n_groups, w.shape[1]
        groups = nn.ModuleList()
        for block in w.view(self.n_groups, out, width).unbind(0):
            lin = nn.Linear(width, out, bias=False, device="meta", dtype=w.dtype)
            lin.weight = nn.Parameter(block, requires_grad=False)
            groups.append(lin)
        self.weight, self.groups = None, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, width = x.shape[:-2], x.shape[-1]
        xg = x.reshape(-1, self.n_groups, width)
        if self.weight is None:  # split (and packed): each group's linear on its slice
            y = torch.cat([lin(xg[:, i]) for i, lin in enumerate(self.groups)], dim=-1)
            return y.view(*lead, self.n_groups, -1)
        w = self.weight.view(self.n_groups, -1, width).transpose(1, 2)  # [g, in, out]
        xg = xg.transpose(0, 1)  # [g, rows, in]
        # a prefill's rows widened on the CPU (layers/widen.py); a decode step reads the weight as it is
        y = matmul(xg, w) if xg.shape[1] >= WIDEN_ROWS else torch.bmm(xg, w)
        return y.transpose(0, 1).reshape(*lead, self.n_groups, -1)


def _blocks(S: int, per_row: int):
    n = max(1, BLOCK_ELEMS // max(1, per_row))
    return ((s0, min(S, s0 + n)) for s0 in range(0, S, n))


# ------------------------------------------------------------------------------------------------ the cache


@dataclass(frozen=True)
class CompressorShape:
    rate: int  # m: tokens per compressed entry
    dim: int  # D (or Di): the entry's size
    overlap: bool  # CSA: two series of dim each, entry w over windows w - 1 and w


class CompressorState:
    """One compressor's state for ``rows`` slots: ``entries`` [rows, capacity // m + 1, dim] (model dtype), the
    current window's projections ``kv`` [rows, m, c dim] (model dtype) and ``gate`` [rows, m, c dim] (fp32, before
    the position bias), and for CSA the last closed window's a-series ``prev_kv`` / ``prev_gate`` [rows, m, dim]
    (gate -inf: no such window yet). c = 2 with overlap, else 1."""

    def __init__(self, shape: CompressorShape, rows: int, capacity: int, dtype, device):
        self.shape = shape
        m, d, c = shape.rate, shape.dim, 2 if shape.overlap else 1
        self.entries = torch.zeros(rows, capacity // m + 1, d, dtype=dtype, device=device)
        self.kv = torch.zeros(rows, m, c * d, dtype=dtype, device=device)
        self.gate = torch.zeros(rows, m, c * d, dtype=torch.float32, device=device)
        self.prev_kv = self.prev_gate = None
        if shape.overlap:
            self.prev_kv = torch.zeros(rows, m, d, dtype=dtype, device=device)
            self.prev_gate = torch.full((rows, m, d), float("-inf"), dtype=torch.float32, device=device)

    def tensors(self) -> list:
        return [t for t in (self.entries, self.kv, self.gate, self.prev_kv, self.prev_gate) if t is not None]

    def grow(self, capacity: int) -> None:
        n = capacity // self.shape.rate + 1
        if n > self.entries.shape[1]:
            grown = self.entries.new_zeros(self.entries.shape[0], n, self.entries.shape[2])
            grown[:, :self.entries.shape[1]] = self.entries
            self.entries = grown

    def reset(self, row: int) -> None:
        """Slot ``row`` holds no sequence: nothing buffered, no previous window."""
        self.kv[row].zero_()
        self.gate[row].zero_()
        if self.prev_gate is not None:
            self.prev_kv[row].zero_()
            self.prev_gate[row].fill_(float("-inf"))


class LayerState:
    """One layer's part of the cache: the window ring ``window`` [rows, W, D], its compressor's state (None in a
    sliding-window layer) and its indexer's (CSA only)."""

    def __init__(self, window: int, dim: int, compressor: Optional[CompressorShape], indexer: Optional[CompressorShape],
                 rows: int, capacity: int, dtype, device):
        self.window = torch.zeros(rows, window, dim, dtype=dtype, device=device)
        self.compressor = CompressorState(compressor, rows, capacity, dtype, device) if compressor else None
        self.indexer = CompressorState(indexer, rows, capacity, dtype, device) if indexer else None

    def parts(self) -> list:
        return [p for p in (self.compressor, self.indexer) if p is not None]


class CompressedKVCache:
    """DeepSeek-V4's cache (module docstring): one ``LayerState`` per layer, ``layers[i]``. ``kinds``: per layer
    (window W, head size D, compressor shape or None, indexer shape or None).

    The runner's interface of layers/kv_cache.py: ``reserve`` grows the compressed entries' storage (every row
    shares one capacity in positions, as the contiguous KVCache does), ``release(row, 0)`` empties a slot (a shorter
    ``keep`` cannot be honoured: the runner never asks, ``states`` being set). ``elems_per_token``: the compressed
    entries' elements per position (the windows and the partial windows are a fixed size per slot)."""

    paged = False
    index_layers = 0  # (no DeepSeek Sparse Attention indexer keys per position)
    state_owner = "compressed-attention layers"  # (the runner's and scheduler's messages)
    state_what = "sliding windows and compressor states"

    def __init__(self, kinds: list, rows: int, max_context: int, dtype: torch.dtype = torch.float32, device="cpu",
                 initial_tokens: Optional[int] = None):
        self.n_rows, self.max_context, self.dtype, self.device = rows, max_context, dtype, torch.device(device)
        self.kinds = list(kinds)
        self.capacity = min(max_context, initial_tokens or max_context)
        self.version = 0
        try:
            self.layers = [LayerState(w, d, c, i, rows, self.capacity, dtype, self.device) for w, d, c, i in kinds]
        except torch.OutOfMemoryError as e:
            from hetmoe.layers.kv_cache import KVCacheFull

            raise KVCacheFull(f"the DeepSeek-V4 cache of {rows} slots does not fit the {self.device.type} memory; "
                              "use a smaller --max-batch or --max-context") from e

    @property
    def states(self) -> "FixedStates":
        """Not None: the runner treats the slots as recurrent (no rewinding, no prefix reuse); the memory plan reads
        their fixed size per slot from it."""
        return FixedStates(self)

    @property
    def elems_per_token(self) -> float:
        return sum(s.dim / s.rate for _, _, c, i in self.kinds for s in (c, i) if s is not None)

    def _tensors(self) -> list:
        return [t for layer in self.layers for t in [layer.window] + [x for p in layer.parts() for x in p.tensors()]]

    @property
    def bytes_allocated(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def tokens_held(self) -> int:
        return self.n_rows * self.capacity

    def reserve(self, row: int, length: int) -> None:
        if length > self.max_context:
            raise ValueError(f"position {length - 1} is beyond max_context={self.max_context}")
        if length > self.capacity:
            grown = max(length, min(self.max_context, 2 * self.capacity))
            self.capacity = min(self.max_context, -(-grown // GROW_ALIGN) * GROW_ALIGN)
            for layer in self.layers:
                for part in layer.parts():
                    part.grow(self.capacity)
            self.version += 1

    def release(self, row: int, keep: int = 0) -> None:
        if keep == 0:
            self.reset(row)

    def reset(self, row: int) -> None:
        for layer in self.layers:
            for part in layer.parts():
                part.reset(row)


class FixedStates:
    """The sizes of a ``CompressedKVCache``'s fixed part per slot (the windows and the compressors' partial windows
    of every layer), as the memory plan reads RecurrentStates (layers/kv_cache.py): ``conv`` [1, rows, elements in
    the cache dtype] and ``recurrent`` [1, rows, fp32 elements], meta tensors (sizes only)."""

    def __init__(self, cache: CompressedKVCache):
        model, fp32 = 0, 0
        for layer in cache.layers:
            model += layer.window[0].numel()
            for part in layer.parts():
                model += part.kv[0].numel() + (part.prev_kv[0].numel() if part.prev_kv is not None else 0)
                fp32 += part.gate[0].numel() + (part.prev_gate[0].numel() if part.prev_gate is not None else 0)
        self.n_rows = cache.n_rows
        self.conv = torch.empty(1, cache.n_rows, model, device="meta")
        self.recurrent = torch.empty(1, cache.n_rows, fp32, device="meta")

    def reset(self, row: int) -> None:  # (the cache resets its own slots: CompressedKVCache.release)
        pass


# ------------------------------------------------------------------------------------------------ compressors


class RowSpans:
    """Each row of a call: its first position and its real tokens (``Step.lengths``, else all S), on the host."""

    def __init__(self, step: Step, S: int):
        self.first = step.positions[:, 0].tolist()
        self.lengths = step.lengths.tolist() if step.lengths is not None else [S] * len(self.first)
        self.slots = step.slots.tolist()

    def counts(self, m: int) -> list:
        """Entries of compressed windows of m each row has after this call."""
        return [(p + n) // m for p, n in zip(self.first, self.lengths)]

    @property
    def one_each(self) -> bool:
        """Whether every row appends one token to a sequence it continues (a decode step): the state's bookkeeping
        is then the same for all rows, done for them at once."""
        return all(n == 1 for n in self.lengths) and all(p > 0 for p in self.first)


class Compressor(nn.Module):
    """One compressor (module docstring), Transformers' names: kv_proj / gate_proj [c dim, hidden], position_bias
    [m, c dim] (fp32), kv_norm (dim). ``update`` folds a call's tokens into the cache state and writes the entries of
    the windows they close."""

    def __init__(self, hidden: int, shape: CompressorShape, eps: float):
        super().__init__()
        self.shape = shape
        width = (2 if shape.overlap else 1) * shape.dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.register_buffer("position_bias", torch.zeros(shape.rate, width, dtype=torch.float32))
        self.kv_norm = Fp32RMSNorm(shape.dim, eps)

    def update(self, x: torch.Tensor, rows: RowSpans, state: CompressorState, inv_freq: torch.Tensor,
               scaling: float) -> None:
        """x [B, S, hidden]: each row's real tokens appended to its slot's windows; closed windows become entries."""
        kv, gate = self.kv_proj(x), self.gate_proj(x).float()  # [B, S, c dim]
        if x.shape[1] == 1 and rows.one_each:
            return self._append_one(kv[:, 0], gate[:, 0], rows, state, inv_freq, scaling)
        m, d = self.shape.rate, self.shape.dim
        for b, (slot, p0, n) in enumerate(zip(rows.slots, rows.first, rows.lengths)):
            if n == 0:
                continue
            if p0 == 0:
                state.reset(slot)
            r = p0 % m  # tokens of the current window already buffered
            kv_all = torch.cat((state.kv[slot, :r].to(kv.dtype), kv[b, :n]))  # from the window's first position
            gate_all = torch.cat((state.gate[slot, :r], gate[b, :n]))
            closed, rest = divmod(r + n, m)
            state.kv[slot, :rest] = kv_all[closed * m:]
            state.gate[slot, :rest] = gate_all[closed * m:]
            if not closed:
                continue
            ckv = kv_all[:closed * m].view(closed, m, -1)
            cgate = gate_all[:closed * m].view(closed, m, -1) + self.position_bias  # [closed, m, c dim] fp32
            if self.shape.overlap:  # slots [a-series of window w - 1 | b-series of window w]
                wkv = ckv.new_zeros(closed, 2 * m, d)
                wgate = cgate.new_full((closed, 2 * m, d), float("-inf"))
                wkv[:, m:], wgate[:, m:] = ckv[..., d:], cgate[..., d:]
                wkv[1:, :m], wgate[1:, :m] = ckv[:-1, :, :d], cgate[:-1, :, :d]
                wkv[0, :m], wgate[0, :m] = state.prev_kv[slot], state.prev_gate[slot]
                state.prev_kv[slot], state.prev_gate[slot] = ckv[-1, :, :d], cgate[-1, :, :d]
                ckv, cgate = wkv, wgate
            entries = self.kv_norm((ckv * cgate.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)).sum(dim=1))
            w0 = p0 // m
            cos, sin = rope_table(torch.arange(w0, w0 + closed, device=x.device) * m, inv_freq, scaling,
                                  entries.dtype)
            state.entries[slot, w0:w0 + closed] = rope_tail(entries, cos, sin)

    def _append_one(self, kv: torch.Tensor, gate: torch.Tensor, rows: RowSpans, state: CompressorState,
                    inv_freq: torch.Tensor, scaling: float) -> None:
        """``update`` of a decode step (``RowSpans.one_each``), every row at once: kv [B, c dim], gate [B, c dim] fp32
        into the slots' current windows at position mod m (a closing token's lands in the window's last place, where
        nothing reads it: the next window starts over), then the entries of the windows this step closes."""
        m, d = self.shape.rate, self.shape.dim
        slots = torch.tensor(rows.slots, device=kv.device)
        at = torch.tensor([p % m for p in rows.first], device=kv.device)
        state.kv[slots, at] = kv.to(state.kv.dtype)
        state.gate[slots, at] = gate
        closing = [b for b, p in enumerate(rows.first) if p % m == m - 1]
        if not closing:
            return
        cs = slots[closing] if len(closing) < len(rows.first) else slots
        ckv = state.kv[cs].to(kv.dtype)  # [C, m, c dim]
        cgate = state.gate[cs] + self.position_bias
        if self.shape.overlap:  # [a-series of the previous window | b-series of this one]
            wkv = torch.cat((state.prev_kv[cs].to(kv.dtype), ckv[..., d:]), dim=1)  # [C, 2 m, dim]
            wgate = torch.cat((state.prev_gate[cs], cgate[..., d:]), dim=1)
            state.prev_kv[cs], state.prev_gate[cs] = ckv[..., :d], cgate[..., :d]
            ckv, cgate = wkv, wgate
        entries = self.kv_norm((ckv * cgate.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)).sum(dim=1))
        windows = torch.tensor([rows.first[b] // m for b in closing], device=kv.device)
        cos, sin = rope_table(windows * m, inv_freq, scaling, entries.dtype)
        state.entries[cs, windows] = rope_tail(entries, cos, sin)


class Indexer(Compressor):
    """The lightning indexer of a CSA layer (Transformers' DeepseekV4Indexer, under its names): a compressor of its own
    at index_head_dim (kv_proj, gate_proj, position_bias, kv_norm), q_b_proj [ni Di, q_lora_rank] and
    scorer.weights_proj [ni, hidden]. ``select`` -> each query's kept entries [B, S, k] (-1: none)."""

    def __init__(self, hidden: int, q_lora_rank: int, shape: CompressorShape, n_heads: int, topk: int, eps: float):
        super().__init__(hidden, shape, eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * shape.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(hidden, n_heads, bias=False)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, rope: tuple, positions: torch.Tensor,
               entries: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden], q_res [B, S, q_lora_rank], the queries' (cos, sin) [B, S, rope/2], positions [B, S], the
        indexer's entries [B, n, Di] of which row b holds counts[b] -> indices [B, S, min(topk, n)], -1 where a
        query has fewer entries in its past."""
        B, S, _ = x.shape
        Di, m, n = self.shape.dim, self.shape.rate, entries.shape[1]
        k = min(self.topk, n)
        q = rope_tail(self.q_b_proj(q_res).view(B, S, self.n_heads, Di), rope[0].unsqueeze(2), rope[1].unsqueeze(2))
        w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [B, S, ni]
        kt = entries.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, Di, n]
        seen = torch.minimum((positions + 1) // m, counts.view(B, 1))  # [B, S]: entries in each query's past
        cols = torch.arange(n, device=x.device)
        out = torch.empty(B, S, k, dtype=torch.int64, device=x.device)
        for s0, s1 in _blocks(S, B * self.n_heads * n):
            scores = F.relu(torch.matmul(q[:, s0:s1].float(), kt)) * Di**-0.5  # [B, s, ni, n]
            total = (scores * w[:, s0:s1].unsqueeze(-1)).sum(dim=2)  # [B, s, n]
            future = cols.view(1, 1, -1) >= seen[:, s0:s1].unsqueeze(-1)
            top = total.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
            out[:, s0:s1] = torch.where(top >= seen[:, s0:s1].unsqueeze(-1), -1, top)
        return out


# ------------------------------------------------------------------------------------------------ the layer


@dataclass(frozen=True)
class V4AttentionShape:
    hidden: int
    n_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    eps: float
    compressor: Optional[CompressorShape] = None  # None: sliding window only
    indexer: Optional[CompressorShape] = None  # CSA's
    index_heads: int = 0
    index_topk: int = 0


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer (module docstring). forward(x [B, S, hidden], rope: (cos, sin, inv_freq,
    scaling) of its RoPE table, step, cache) -> [B, S, hidden]."""

    def __init__(self, shape: V4AttentionShape, layer_idx: int):
        super().__init__()
        self.shape, self.layer_idx = shape, layer_idx
        h, D = shape.n_heads, shape.head_dim
        self.scaling = D**-0.5
        self.q_a_proj = nn.Linear(shape.hidden, shape.q_lora_rank, bias=False)
        self.q_a_norm = Fp32RMSNorm(shape.q_lora_rank, shape.eps)
        self.q_b_proj = nn.Linear(shape.q_lora_rank, h * D, bias=False)
        self.kv_proj = nn.Linear(shape.hidden, D, bias=False)
        self.kv_norm = Fp32RMSNorm(D, shape.eps)
        self.o_a_proj = GroupedLinear(h * D // shape.o_groups, shape.o_groups * shape.o_lora_rank, shape.o_groups)
        self.o_b_proj = nn.Linear(shape.o_groups * shape.o_lora_rank, shape.hidden, bias=False)
        self.register_buffer("sinks", torch.zeros(h, dtype=torch.float32))
        self.compressor = None
        if shape.compressor is not None:
            self.compressor = Compressor(shape.hidden, shape.compressor, shape.eps)
            if shape.indexer is not None:
                self.compressor.indexer = Indexer(shape.hidden, shape.q_lora_rank, shape.indexer, shape.index_heads,
                                                  shape.index_topk, shape.eps)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: CompressedKVCache) -> torch.Tensor:
        B, S, _ = x.shape
        h, D, W = self.shape.n_heads, self.shape.head_dim, self.shape.window
        cos, sin, inv_freq, scaling = rope
        state = cache.layers[self.layer_idx]
        rows = RowSpans(step, S)
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(B, S, h, D), self.shape.eps)
        q = rope_tail(q, cos.unsqueeze(2), sin.unsqueeze(2))  # [B, S, h, D]
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # [B, S, D]

        # the window: the W - 1 positions before each row's first, from the ring, then this call's keys
        first = step.positions[:, :1]  # [B, 1]
        old_pos = first - (W - 1) + torch.arange(W - 1, device=x.device)  # [B, W - 1]
        slots = step.slots.view(B, 1)
        keys = torch.cat((state.window[slots, old_pos % W].to(kv.dtype), kv), dim=1)  # [B, W - 1 + S, D]
        key_pos = torch.cat((old_pos, step.positions), dim=1)
        self._write_window(state.window, kv, step, rows)

        entries, visible = None, None
        if self.compressor is not None:
            m = self.compressor.shape.rate
            self.compressor.update(x, rows, state.compressor, inv_freq, scaling)
            counts = torch.tensor(rows.counts(m), device=x.device)
            n = max(1, max(rows.counts(m)))
            entries = state.compressor.entries[step.slots, :n].to(kv.dtype)  # [B, n, D]
            indexer = getattr(self.compressor, "indexer", None)
            if indexer is None:  # HCA: every entry of a closed window in the query's past
                seen = torch.minimum((step.positions + 1) // m, counts.view(B, 1))  # [B, S]
                visible = torch.arange(n, device=x.device).view(1, 1, n) < seen.unsqueeze(-1)  # [B, S, n]
            else:
                indexer.update(x, rows, state.indexer, inv_freq, scaling)
                index_entries = state.indexer.entries[step.slots, :n].to(kv.dtype)
                picks = indexer.select(x, q_res, (cos, sin), step.positions, index_entries, counts)  # [B, S, k]
                visible = picks >= 0
                flat = picks.clamp(min=0) + torch.arange(B, device=x.device).view(B, 1, 1) * n
                entries = entries.reshape(B * n, D)[flat.reshape(-1)].view(B, S, -1, D)  # [B, S, k, D]
        out = self._attend(q, keys, key_pos, step.positions, entries, visible)  # [B, S, h, D]
        out = rope_tail(out, cos.unsqueeze(2), -sin.unsqueeze(2))
        grouped = self.o_a_proj(out.reshape(B, S, self.shape.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped)

    @staticmethod
    def _write_window(ring: torch.Tensor, kv: torch.Tensor, step: Step, rows: RowSpans) -> None:
        """Each row's last W real keys into its slot's ring, at position mod W."""
        W = ring.shape[1]
        if step.lengths is None:  # every row's last min(S, W) keys, at once
            lo = max(0, kv.shape[1] - W)
            ring[step.slots.view(-1, 1), step.positions[:, lo:] % W] = kv[:, lo:].to(ring.dtype)
            return
        for b, (slot, n) in enumerate(zip(rows.slots, rows.lengths)):
            lo = max(0, n - W)
            if n > lo:
                ring[slot, step.positions[b, lo:n] % W] = kv[b, lo:n].to(ring.dtype)

    def _attend(self, q, keys, key_pos, positions, entries, visible) -> torch.Tensor:
        """q [B, S, h, D] over the window keys [B, L, D] at key_pos [B, L] and, when given, compressed entries
        (HCA: [B, n, D] shared by the queries; CSA: [B, S, k, D] per query) with ``visible`` [B, S, n | k]; one sink
        logit per head -> [B, S, h, D].

        The keys (and HCA's entries) are one head shared by every query head, so a row's queries and heads are the
        rows of one product with them ([s h, D] x [D, L]) rather than h products against the keys broadcast over
        the heads (which PyTorch would copy h times); CSA's entries, one set per query, are one product per query
        ([h, D] x [D, k])."""
        B, S, h, D = q.shape
        W, L = self.shape.window, keys.shape[1]
        out = torch.empty_like(q)
        sinks = self.sinks.view(1, 1, h, 1)
        per_query = entries is not None and entries.dim() == 4
        n = 0 if entries is None else entries.shape[-2]
        kp = key_pos.unsqueeze(1)  # [B, 1, L]
        keys_t = keys.transpose(1, 2)  # [B, D, L]
        for s0, s1 in _blocks(S, B * h * (L + n)):
            s = s1 - s0
            qb = q[:, s0:s1]  # [B, s, h, D]
            qp = positions[:, s0:s1].unsqueeze(-1)  # [B, s, 1]
            window = (kp >= 0) & (kp <= qp) & (kp > qp - W)  # [B, s, L]
            logits = matmul(qb.reshape(B, s * h, D), keys_t).view(B, s, h, L) * self.scaling
            parts = [logits.masked_fill(~window.unsqueeze(2), float("-inf"))]
            if entries is not None:
                if per_query:  # [B, s, k, D]: each query's own entries
                    c = matmul(qb, entries[:, s0:s1].transpose(-1, -2)) * self.scaling  # [B, s, h, k]
                else:
                    c = matmul(qb.reshape(B, s * h, D), entries.transpose(1, 2)).view(B, s, h, n) * self.scaling
                parts.append(c.masked_fill(~visible[:, s0:s1].unsqueeze(2), float("-inf")))
            parts.append(sinks.expand(B, s, h, 1))  # fp32: the logits are promoted, as Transformers'
            combined = torch.cat(parts, dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = combined.softmax(dim=-1)[..., :-1].to(keys.dtype)  # the sink's share dropped
            o = matmul(probs[..., :L].reshape(B, s * h, L), keys).view(B, s, h, D)
            if entries is not None:
                if per_query:
                    o = o + matmul(probs[..., L:], entries[:, s0:s1])
                else:
                    o = o + matmul(probs[..., L:].reshape(B, s * h, n), entries).view(B, s, h, D)
            out[:, s0:s1] = o
        return out
