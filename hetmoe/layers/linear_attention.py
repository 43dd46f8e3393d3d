"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE): a fixed-size recurrent state per sequence instead of a
KV cache that grows with it.

The math. Per value head, a state S (Dv x Dk) is carried from token to token; with the key k_t and query q_t
L2-normalised (x / sqrt(sum x^2 + 1e-6), in fp32) and the query scaled by Dk^-1/2:

    S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T        o_t = S_t q_t

where g_t = exp(-exp(A_log) * softplus(a_t + dt_bias)) in (0, 1] is the decay and b_t = sigmoid(b_t') in (0, 1) the
write strength ("beta"), both per token and value head (a_t, b_t' are projections of the token). Written out, the
state first decays (g_t S_{t-1}), reads what it holds for k_t (S k_t), and replaces a b_t share of that by v_t (the
delta rule). Heads: Hv value heads, Hk <= Hv key/query heads; value head h reads key head h // (Hv / Hk).

Stored transposed, M = S^T (Dk x Dv, the layout of flash-linear-attention and transformers: ``[B, Hv, Dk, Dv]``),
the step is M_t = g_t (I - b_t k_t k_t^T) M_{t-1} + b_t k_t v_t^T and o_t = M_t^T q_t.

* ``recurrent_delta_rule``: that step, token by token (decode: one token per sequence).
* ``chunk_delta_rule``: the same result C = 64 tokens at a time (prefill). Inside a chunk starting from state M0,
  let G_t = sum_{s<=t} log g_s (the cumulative log decay inside the chunk) and w_t = b_t (v_t - g_t M_{t-1}^T k_t)
  what token t writes. Unrolling M_t = exp(G_t) M0 + sum_{s<=t} exp(G_t - G_s) k_s w_s^T gives, for the chunk's
  rows at once, the unit lower triangular system

      (I + A) W = diag(b) V - diag(b exp(G)) K M0,     A[t, s] = b_t exp(G_t - G_s) (k_t . k_s)  for s < t

  so W = U - Wk M0 with U = (I + A)^-1 diag(b) V and Wk = (I + A)^-1 diag(b exp(G)) K (one inverse of a unit
  lower triangular matrix, ``unit_lower_inverse``, and two products, for every chunk in parallel); then, chunk after
  chunk,

      O  = diag(exp(G)) Q M0 + ((Q K^T) o D) W,     D[t, s] = exp(G_t - G_s) for s <= t, else 0
      M_C = exp(G_C) M0 + (diag(exp(G_C - G)) K)^T W

  Every exponent is <= 0 (decays only), so nothing overflows. A token with b_t = 0 and log g_t = 0 leaves the state
  as it was: padding (the tail of a short chunk, the right-padding of a batch of prompts) is masked so.

Both run in fp32 (state, inputs and products) whatever the model dtype; they are the reference everywhere and the
path on the CPU. On a GPU with flash-linear-attention installed (``fla``: chunk_gated_delta_rule and
fused_recurrent_gated_delta_rule, maintained Triton kernels of the same rule, bf16/fp16 inputs, fp32 state), its
kernels run instead: ``delta_rule_kernels`` chooses once, at load, and says why.

The layer (``GatedDeltaNet``): the token's projections give q/k/v (one "mixed" vector of 2 Hk Dk + Hv Dv channels),
the output gate z, and b, a; q/k/v pass a causal depthwise convolution (kernel W, typically 4) then SiLU; the delta
rule above; its output is RMS-normalised per head and gated (``GatedRMSNorm``: w * norm(o) * silu(z)); out_proj.
Per sequence it keeps the convolution's last W - 1 inputs and the state M: ``RecurrentStates`` in the cache
(layers/kv_cache.py). A row whose first position is 0 starts from zero states (a new sequence: whatever its slot
held before is ignored), any other row continues from its slot's.

Kimi Delta Attention (KDA: Kimi-Linear, GLM-5.3-Flash) is the same delta rule with a decay per key channel instead
of per head: g_t is a vector of Dk log decays and the state decays row by row, M_t = (I - b_t k_t k_t^T)
diag(exp(g_t)) M_{t-1} + b_t k_t v_t^T (as stored, Dk x Dv), o_t = M_t^T q_t; as many key heads as value heads.
``recurrent_kda`` steps it token by token; ``chunk_kda`` solves a chunk at once as above, with the scalar
exp(G_t - G_s) inside each product replaced by the channel-wise one, A[t, s] = b_t sum_c k_t[c] k_s[c]
exp(G_t[c] - G_s[c]) (s < t) and likewise the intra-chunk Q K^T (``channel_decayed_products``: pairwise
exponents inside blocks of 16 rows, a product of two decays through the block's first row across blocks), so again
no exponent is positive. ``kda_kernels`` chooses flash-linear-attention's
chunk_kda / fused_recurrent_kda (``fla.ops.kda``, recent versions) on a GPU in bf16/fp16 where they import, the torch
forms otherwise, and says why. ``KimiDeltaAttention`` is the layer: q/k/v projections, the same causal convolution
and states (``short_conv``), the channel-wise forget gate (lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) +
dt_bias)), or -exp(A_log) * softplus(.) without a bound), beta = sigmoid(b_proj(x)), the rule, then an RMSNorm per
head gated by sigmoid(g_b(g_a(x))) (``SigmoidGatedRMSNorm``) and o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears

CHUNK = 64  # tokens per chunk of the chunked form


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' L2 norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta) -> tuple:
    """fp32 [B, Hv, S, .] inputs of the rule: q and k L2-normalised, q scaled by Dk^-1/2, key heads repeated for
    the value heads that read them."""
    r = v.shape[2] // q.shape[2]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return tuple(x.transpose(1, 2).float() for x in (q, k, v, g, beta))


def recurrent_delta_rule(q, k, v, g, beta, state) -> tuple:
    """The gated delta rule token by token. q, k [B, S, Hk, Dk], v [B, S, Hv, Dv] (any float dtype: normalised and
    computed in fp32), g [B, S, Hv] log decay (<= 0), beta [B, S, Hv], state [B, Hv, Dk, Dv] fp32 (not written)
    -> (o [B, S, Hv, Dv] fp32, the state after the last token [B, Hv, Dk, Dv] fp32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, S, .]
    M = state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        M = M * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]  # [B, Hv, Dk]
        read = (kt.unsqueeze(-2) @ M).squeeze(-2)  # M^T k [B, Hv, Dv]
        write = (v[:, :, t] - read) * beta[:, :, t, None]
        M = M + kt.unsqueeze(-1) * write.unsqueeze(-2)
        out[:, :, t] = (q[:, :, t].unsqueeze(-2) @ M).squeeze(-2)  # M^T q
    return out.transpose(1, 2), M


def unit_lower_inverse(A: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + L)^-1 for L the strictly lower triangle of A [.., C, C] (the diagonal and above are not read), for every
    leading index at once. Each diagonal block of ``block`` rows is inverted by forward substitution, a row at a
    time (row i of the inverse: -L[i] times the rows above it, plus e_i); the blocks below the diagonal then follow
    from T[b, :b] = -T[b, b] L[b, :b] T[:b, :b]. The batched triangular solve of the LAPACK in PyTorch's CPU build
    runs each small matrix alone: 690 ms for the 256 solves of 64 x 64 by 64 x 128 of one 512-token Qwen3-Next
    layer on a 2-core AMD EPYC, against 10 ms for this inverse and its products."""
    C = A.shape[-1]
    L = A.tril(-1)
    T = torch.zeros_like(L)
    for b0 in range(0, C, block):
        b1 = min(b0 + block, C)
        Td = -L[..., b0:b1, b0:b1]  # becomes the inverse of I + this diagonal block, less its identity
        for i in range(1, b1 - b0):
            row = Td[..., i, :i].clone()
            Td[..., i, :i] = row + (row.unsqueeze(-1) * Td[..., :i, :i]).sum(-2)
        Td = Td + torch.eye(b1 - b0, dtype=A.dtype, device=A.device)
        T[..., b0:b1, b0:b1] = Td
        if b0:
            T[..., b0:b1, :b0] = -Td @ (L[..., b0:b1, :b0] @ T[..., :b0, :b0])
    return T


def chunk_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple:
    """The gated delta rule ``chunk`` tokens at a time (module docstring); the same arguments and results as
    ``recurrent_delta_rule``."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, S, .]
    B, H, S, Dk = k.shape
    pad = -S % chunk
    if pad:  # b = 0, log g = 0: the padding leaves the state as it is
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (S + pad) // chunk
    q, k, v = (x.reshape(B, H, N, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)
    G = g.cumsum(-1)  # [B, H, N, C]
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # [.., t, s] = G_t - G_s
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    D = diff.masked_fill(~lower, float("-inf")).exp()  # exp(G_t - G_s), s <= t
    kb = k * beta.unsqueeze(-1)
    A = (kb @ k.transpose(-1, -2)) * D  # its diagonal is ignored: the inverse takes I + strictly lower A
    T = unit_lower_inverse(A)
    U = T @ (v * beta.unsqueeze(-1))  # [.., C, Dv]
    Wk = T @ (kb * G.exp().unsqueeze(-1))  # [.., C, Dk]
    QK = (q @ k.transpose(-1, -2)) * D  # [.., C, C]
    qg = q * G.exp().unsqueeze(-1)
    kd = k * (G[..., -1:] - G).exp().unsqueeze(-1)  # keys decayed to the chunk's end
    end = G[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    M = state.float()
    out = torch.empty_like(v)  # [B, H, N, C, Dv]
    for n in range(N):
        W = U[:, :, n] - Wk[:, :, n] @ M  # [B, H, C, Dv]
        out[:, :, n] = qg[:, :, n] @ M + QK[:, :, n] @ W
        M = M * end[:, :, n] + kd[:, :, n].transpose(-1, -2) @ W
    return out.reshape(B, H, N * chunk, -1)[:, :, :S].transpose(1, 2), M


class TorchDeltaRule:
    """The plain PyTorch forms: chunked for several tokens per sequence, recurrent for one."""

    name = "torch"

    def __call__(self, q, k, v, g, beta, state) -> tuple:
        if q.shape[1] == 1:
            return recurrent_delta_rule(q, k, v, g, beta, state)
        return chunk_delta_rule(q, k, v, g, beta, state)


class FlaDeltaRule:
    """flash-linear-attention's kernels behind the same call (q/k L2 norm inside them, scale Dk^-1/2, fp32 state):
    chunk_gated_delta_rule for several tokens per sequence, fused_recurrent_gated_delta_rule for one. They take
    bf16/fp16 q/k/v (the torch form runs fp32 models) and as many key heads as value heads (repeated here)."""

    name = "fla"

    def __init__(self):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self.chunk, self.recurrent = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def __call__(self, q, k, v, g, beta, state) -> tuple:
        r = v.shape[2] // q.shape[2]
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        fn = self.recurrent if q.shape[1] == 1 else self.chunk
        o, final = fn(q.contiguous(), k.contiguous(), v.contiguous(), g=g.float(), beta=beta.to(v.dtype),
                      initial_state=state.float().contiguous(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        return o.float(), final.float()


TORCH = TorchDeltaRule()


def delta_rule_kernels(device, dtype: torch.dtype) -> tuple:
    """(the delta rule to run on ``device`` in ``dtype``, why): flash-linear-attention's kernels on a GPU with
    bf16/fp16 weights where ``fla`` imports, else the torch form."""
    if torch.device(device).type != "cuda":
        return TORCH, "the PyTorch chunked/recurrent form (CPU)"
    if dtype not in (torch.bfloat16, torch.float16):
        return TORCH, f"the PyTorch chunked/recurrent form ({dtype} weights: flash-linear-attention needs bf16/fp16)"
    try:
        kernels = FlaDeltaRule()
    except ImportError as err:
        return TORCH, f"the PyTorch chunked/recurrent form (flash-linear-attention is not importable: {err})"
    return kernels, "flash-linear-attention's chunk_gated_delta_rule / fused_recurrent_gated_delta_rule"


def use_kernels(model: nn.Module, device, dtype: torch.dtype):
    """Give every ``GatedDeltaNet`` of ``model`` the delta rule ``delta_rule_kernels`` chooses, and every
    ``KimiDeltaAttention`` the one ``kda_kernels`` chooses -> the reason, or None when the model has no such layer."""
    whys = []
    for cls, choose in ((GatedDeltaNet, delta_rule_kernels), (KimiDeltaAttention, kda_kernels)):
        layers = [m for m in model.modules() if isinstance(m, cls)]
        if layers:
            kernels, why = choose(device, dtype)
            for layer in layers:
                layer.delta_rule = kernels
            whys.append(why)
    return "; ".join(whys) or None


def depthwise_conv(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The valid depthwise convolution of seq [B, C, W - 1 + S] with weight [C, 1, W] -> [B, C, S] in the weight's
    dtype: W multiply-adds of shifted views, summed in fp32 in tap order and rounded once. ``F.conv1d`` with
    ``groups=C`` computes the same (bitwise for bf16 weights, summation order for fp32), but on the CPU it runs one
    small convolution per channel: 270 ms for Qwen3-Next's 8,192 channels and one token in bf16, against 3 ms here."""
    S = seq.shape[-1] - weight.shape[-1] + 1
    w = weight[:, 0, :].float()  # [C, W]
    seq = seq.to(weight.dtype)
    acc = seq[..., :S].float() * w[:, :1]
    for k in range(1, weight.shape[-1]):
        acc += seq[..., k:k + S].float() * w[:, k:k + 1]
    return acc.to(weight.dtype)


def short_conv(mixed: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, step,
               fresh: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of a linear-attention layer, then SiLU: mixed [B, S, C] over [the last W - 1
    inputs of each row's slot (``conv`` [rows, C, W - 1], zero for a ``fresh`` row), this call's S] with ``weight``
    [C, 1, W], computed in the weight's dtype and rounded to mixed's -> [B, S, C]. Each slot's last W - 1 inputs
    (before its padding, with ``step.lengths``) are written back."""
    B, _, C = mixed.shape
    rows = step.slots
    conv_state = conv[rows].masked_fill(fresh, 0)  # [B, C, W - 1]
    seq = torch.cat((conv_state.to(mixed.dtype), mixed.transpose(1, 2)), dim=-1)  # [B, C, W - 1 + S]
    out = F.silu(depthwise_conv(seq, weight)).to(mixed.dtype).transpose(1, 2)
    keep = weight.shape[-1] - 1
    if step.lengths is None:
        tail = seq[..., seq.shape[-1] - keep:]
    else:  # each row's last W - 1 inputs before its padding
        idx = step.lengths.to(mixed.device)[:, None] + torch.arange(keep, device=mixed.device)  # [B, W - 1]
        tail = seq.gather(-1, idx[:, None, :].expand(B, C, keep))
    conv.index_copy_(0, rows, tail.to(conv.dtype))
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then the gate: weight * norm(x) (rounded to x's dtype) * silu(z) in fp32,
    rounded to x's dtype (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer under transformers' parameter names (``conv1d``, ``dt_bias``, ``A_log``,
    ``norm``, ``out_proj``); a model's subclass adds its input projections and ``project``. ``state_index``: this
    layer's row in the cache's RecurrentStates (its rank among the model's linear-attention layers).

    forward(x [B, S, H], step, cache) -> [B, S, H]; reads and writes the states of ``step.slots``; with
    ``step.lengths`` (a right-padded batch) a row's tokens past its length change neither of its states."""

    def __init__(self, hidden: int, n_k_heads: int, n_v_heads: int, k_dim: int, v_dim: int, conv_width: int,
                 eps: float, state_index: int):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"{n_v_heads} value heads are not a multiple of {n_k_heads} key heads")
        self.n_k, self.n_v, self.k_dim, self.v_dim = n_k_heads, n_v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = n_k_heads * k_dim, n_v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.state_index = state_index
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim, bias=False,
                                padding=conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.delta_rule = TORCH  # use_kernels may choose flash-linear-attention's

    def project(self, x: torch.Tensor) -> tuple:
        """x [B, S, H] -> (mixed q|k|v [B, S, conv_dim], z [B, S, Hv, Dv], b [B, S, Hv], a [B, S, Hv])."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        mixed, z, b, a = self.project(x)
        states, layer, rows = cache.states, self.state_index, step.slots
        fresh = (step.positions[:, 0] == 0)[:, None, None]  # [B, 1, 1]: a sequence that starts with this call
        valid = None
        if step.lengths is not None:  # [B, S]: the real tokens of right-padded rows
            valid = torch.arange(S, device=x.device) < step.lengths.to(x.device)[:, None]

        mixed = short_conv(mixed, self.conv1d.weight, states.conv[layer], step, fresh)

        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q, k = q.reshape(B, S, self.n_k, self.k_dim), k.reshape(B, S, self.n_k, self.k_dim)
        v = v.reshape(B, S, self.n_v, self.v_dim)
        beta = b.sigmoid()  # (in the model dtype, as transformers rounds it)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [B, S, Hv] log decay
        if valid is not None:
            beta, g = beta * valid[..., None], g * valid[..., None]
        state = states.recurrent[layer][rows].masked_fill(fresh[..., None], 0)  # [B, Hv, Dk, Dv] fp32
        out, state = self.delta_rule(q, k, v, g, beta, state)  # [B, S, Hv, Dv] fp32
        states.recurrent[layer].index_copy_(0, rows, state)
        out = self.norm(out.to(x.dtype), z)  # [B, S, Hv, Dv]
        return self.out_proj(out.reshape(B, S, self.value_dim))


# ------------------------------------------------------------------------------------------ Kimi Delta Attention


def _prepare_kda(q, k, v, g, beta) -> tuple:
    """fp32 [B, H, S, .] inputs of KDA: q and k L2-normalised, q scaled by Dk^-1/2."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    return tuple(x.transpose(1, 2).float() for x in (q, k, v, g, beta))


def recurrent_kda(q, k, v, g, beta, state) -> tuple:
    """KDA token by token. q, k [B, S, H, Dk], v [B, S, H, Dv] (any float dtype: normalised and computed in fp32),
    g [B, S, H, Dk] log decay per key channel (<= 0), beta [B, S, H], state [B, H, Dk, Dv] fp32 (not written)
    -> (o [B, S, H, Dv] fp32, the state after the last token [B, H, Dk, Dv] fp32)."""
    q, k, v, g, beta = _prepare_kda(q, k, v, g, beta)  # [B, H, S, .]
    M = state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        M = M * g[:, :, t].exp().unsqueeze(-1)  # each key channel's row decays by its own gate
        kt = k[:, :, t]  # [B, H, Dk]
        write = (v[:, :, t] - (kt.unsqueeze(-2) @ M).squeeze(-2)) * beta[:, :, t, None]
        M = M + kt.unsqueeze(-1) * write.unsqueeze(-2)
        out[:, :, t] = (q[:, :, t].unsqueeze(-2) @ M).squeeze(-2)
    return out.transpose(1, 2), M


def channel_decayed_products(G: torch.Tensor, b: torch.Tensor, *rows: torch.Tensor, block: int = 16) -> tuple:
    """For each a of ``rows``: P[.., t, s] = sum_c a[t, c] b[s, c] exp(G[t, c] - G[s, c]) for s <= t, 0 above the
    diagonal -> [.., C, C]. G [.., C, Dk] is a cumulative log decay (non-increasing along C); a, b [.., C, Dk].

    By blocks of ``block`` rows: within a diagonal block the exponents are formed pairwise ([block, block, Dk] per
    block); for s in an earlier block than t, with R the first row of t's block, exp(G_t - G_s) = exp(G_t - R)
    exp(R - G_s), both exponents <= 0, so that part is one matrix product per block pair. Forming every pair's
    exponents ([C, C, Dk]) costs C / block times the element-wise work."""
    *lead, C, Dk = G.shape
    if C % block:
        block = C
    n = C // block
    Gb = G.view(*lead, n, block, Dk)
    ref = Gb[..., :1, :]  # [.., n, 1, Dk]: R of each block
    i = torch.arange(n, device=G.device)
    before = (i.view(n, 1) > i.view(1, n))[:, :, None, None]  # [i, j, 1, 1]: block j wholly before block i
    from_t = (Gb - ref).exp()  # [.., n, block, Dk]
    to_s = (ref.unsqueeze(-3) - Gb.unsqueeze(-4)).masked_fill(~before, float("-inf")).exp()  # [.., i, j, block, Dk]
    lower = torch.ones(block, block, dtype=torch.bool, device=G.device).tril()[:, :, None]
    D = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~lower, float("-inf")).exp()  # [.., n, t, s, Dk]
    bb = b.reshape(*lead, n, block, Dk)
    bs = (bb.unsqueeze(-4) * to_s).transpose(-1, -2)  # [.., i, j, Dk, block]
    out = []
    for a in rows:
        ab = a.reshape(*lead, n, block, Dk)
        P = (ab * from_t).unsqueeze(-3) @ bs  # [.., i, j, t, s]: 0 where j >= i
        P[..., i, i, :, :] = (ab.unsqueeze(-2) * D * bb.unsqueeze(-3)).sum(-1)  # the diagonal blocks
        out.append(P.transpose(-3, -2).reshape(*lead, C, C))  # [.., i, t, j, s] -> [.., C, C]
    return tuple(out)


def chunk_kda(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple:
    """KDA ``chunk`` tokens at a time (module docstring); the same arguments and results as ``recurrent_kda``."""
    q, k, v, g, beta = _prepare_kda(q, k, v, g, beta)  # [B, H, S, .]
    B, H, S, Dk = k.shape
    pad = -S % chunk
    if pad:  # b = 0, log g = 0: the padding leaves the state as it is
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    M = state.float()
    out = torch.empty_like(v)
    for c0 in range(0, S + pad, chunk):
        part = slice(c0, c0 + chunk)
        qc, kc, vc, bc = q[:, :, part], k[:, :, part], v[:, :, part], beta[:, :, part]
        G = g[:, :, part].cumsum(2)  # [B, H, C, Dk]
        A, QK = channel_decayed_products(G, kc, kc * bc.unsqueeze(-1), qc)  # [B, H, C, C] each, 0 above the diagonal
        T = unit_lower_inverse(A.masked_fill(~strict, 0))
        U = T @ (vc * bc.unsqueeze(-1))
        Wk = T @ (kc * bc.unsqueeze(-1) * G.exp())
        W = U - Wk @ M  # [B, H, C, Dv]: what each token writes
        out[:, :, part] = (qc * G.exp()) @ M + QK @ W
        end = G[:, :, -1:]  # [B, H, 1, Dk]
        M = M * end.squeeze(2).exp().unsqueeze(-1) + (kc * (end - G).exp()).transpose(-1, -2) @ W
    return out[:, :, :S].transpose(1, 2), M


class TorchKdaRule:
    """The plain PyTorch forms of KDA: chunked for several tokens per sequence, recurrent for one."""

    name = "torch"

    def __call__(self, q, k, v, g, beta, state) -> tuple:
        if q.shape[1] == 1:
            return recurrent_kda(q, k, v, g, beta, state)
        return chunk_kda(q, k, v, g, beta, state)


class FlaKdaRule:
    """flash-linear-attention's KDA kernels behind the same call (q/k L2 norm inside them, scale Dk^-1/2, fp32
    state, g the per-channel log decay): chunk_kda for several tokens per sequence, fused_recurrent_kda for one."""

    name = "fla"

    def __init__(self):
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        self.chunk, self.recurrent = chunk_kda, fused_recurrent_kda

    def __call__(self, q, k, v, g, beta, state) -> tuple:
        fn = self.recurrent if q.shape[1] == 1 else self.chunk
        o, final = fn(q.contiguous(), k.contiguous(), v.contiguous(), g=g.float().contiguous(),
                      beta=beta.to(v.dtype), initial_state=state.float().contiguous(), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        return o.float(), final.float()


TORCH_KDA = TorchKdaRule()


def kda_kernels(device, dtype: torch.dtype) -> tuple:
    """(the KDA rule to run on ``device`` in ``dtype``, why): flash-linear-attention's chunk_kda /
    fused_recurrent_kda on a GPU with bf16/fp16 weights where ``fla.ops.kda`` imports, else the torch forms."""
    if torch.device(device).type != "cuda":
        return TORCH_KDA, "KDA in the PyTorch chunked/recurrent form (CPU)"
    if dtype not in (torch.bfloat16, torch.float16):
        return TORCH_KDA, f"KDA in the PyTorch chunked/recurrent form ({dtype} weights: flash-linear-attention needs " \
                          "bf16/fp16)"
    try:
        kernels = FlaKdaRule()
    except ImportError as err:
        return TORCH_KDA, f"KDA in the PyTorch chunked/recurrent form (flash-linear-attention's fla.ops.kda is not " \
                          f"importable: {err})"
    return kernels, "KDA in flash-linear-attention's chunk_kda / fused_recurrent_kda"


class SigmoidGatedRMSNorm(nn.Module):
    """KDA's output norm: weight * norm(x) * sigmoid(gate), all in fp32, rounded to x's dtype at the end
    (transformers' KimiLinear / Glm5Next RMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)


class ConvWeight(nn.Module):
    """The fp32 weight [C, 1, W] of one depthwise convolution (a buffer: the loader keeps its dtype)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(channels, 1, width, dtype=torch.float32))


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer (module docstring) under the parameter names its checkpoints store (Transformers'
    save_pretrained writes them back so): q_proj, k_proj, v_proj, q_conv1d / k_conv1d / v_conv1d (one depthwise
    convolution over q|k|v, stored per part), f_a_proj / f_b_proj, dt_bias [H Dk], A_log [H] (the forget gate),
    b_proj, g_a_proj / g_b_proj, o_norm, o_proj. ``state_index``: this layer's row in the cache's RecurrentStates.
    ``lower_bound``: the forget gate's (None: the unbounded softplus form).

    forward(x [B, S, H], step, cache) -> [B, S, H], as GatedDeltaNet's."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, conv_width: int, eps: float, lower_bound,
                 state_index: int):
        super().__init__()
        self.n_heads, self.head_dim, self.state_index = n_heads, head_dim, state_index
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        dim = n_heads * head_dim
        self.dim = dim
        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ConvWeight(dim, conv_width) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.register_buffer("dt_bias", torch.zeros(dim, dtype=torch.float32))
        self.register_buffer("A_log", torch.zeros(n_heads, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, n_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(dim, hidden, bias=False)
        self.delta_rule = TORCH_KDA  # use_kernels may choose flash-linear-attention's
        self.in_proj = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.in_proj is None:
            self.in_proj = FusedLinears(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                        self.g_a_proj)

    def forget_gate(self, f: torch.Tensor) -> torch.Tensor:
        """f_b_proj's output [B, S, H Dk] -> the log decay per key channel [B, S, H, Dk] fp32."""
        B, S = f.shape[:2]
        g = (f.float() + self.dt_bias.float()).view(B, S, self.n_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, 1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * F.softplus(g)

    def forward(self, x: torch.Tensor, step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, D = self.n_heads, self.head_dim
        if self.in_proj is not None:
            q, k, v, fa, b, ga = self.in_proj.parts(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            fa, b, ga = self.f_a_proj(x), self.b_proj(x), self.g_a_proj(x)
        states, layer = cache.states, self.state_index
        fresh = (step.positions[:, 0] == 0)[:, None, None]  # [B, 1, 1]: a sequence that starts with this call
        weight = torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))  # [3 H Dk, 1, W]
        mixed = short_conv(torch.cat((q, k, v), dim=-1), weight, states.conv[layer], step, fresh)
        q, k, v = (t.reshape(B, S, H, D) for t in mixed.split(self.dim, dim=-1))
        g = self.forget_gate(self.f_b_proj(fa))  # [B, S, H, Dk]
        beta = b.sigmoid()  # (in the model dtype, as transformers rounds it)
        if step.lengths is not None:  # the padding of a right-padded row changes no state
            valid = torch.arange(S, device=x.device) < step.lengths.to(x.device)[:, None]  # [B, S]
            beta, g = beta * valid[..., None], g * valid[..., None, None]
        state = states.recurrent[layer][step.slots].masked_fill(fresh[..., None], 0)  # [B, H, Dk, Dv] fp32
        out, state = self.delta_rule(q, k, v, g, beta, state)  # [B, S, H, Dv] fp32
        states.recurrent[layer].index_copy_(0, step.slots, state)
        out = self.o_norm(out.to(x.dtype), self.g_b_proj(ga).view(B, S, H, D))
        return self.o_proj(out.reshape(B, S, self.dim))
