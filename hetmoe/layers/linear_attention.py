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

  so W = U - Wk M0 with U = (I + A)^-1 diag(b) V and Wk = (I + A)^-1 diag(b exp(G)) K (two triangular solves, for
  every chunk in parallel); then, chunk after chunk,

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.kv_cache import KVCache

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
    A = (kb @ k.transpose(-1, -2)) * D  # its diagonal is ignored: the solves take I + strictly lower A
    U = torch.linalg.solve_triangular(A, v * beta.unsqueeze(-1), upper=False, unitriangular=True)  # [.., C, Dv]
    Wk = torch.linalg.solve_triangular(A, kb * G.exp().unsqueeze(-1), upper=False, unitriangular=True)  # [.., C, Dk]
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
    """Give every ``GatedDeltaNet`` of ``model`` the delta rule ``delta_rule_kernels`` chooses -> the reason, or None
    when the model has no such layer."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not layers:
        return None
    kernels, why = delta_rule_kernels(device, dtype)
    for layer in layers:
        layer.delta_rule = kernels
    return why


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

        # the causal depthwise convolution over [the last W - 1 inputs, this call's S]
        conv_state = states.conv[layer][rows].masked_fill(fresh, 0)  # [B, C, W - 1]
        seq = torch.cat((conv_state.to(mixed.dtype), mixed.transpose(1, 2)), dim=-1)  # [B, C, W - 1 + S]
        weight = self.conv1d.weight  # [C, 1, W]
        mixed = F.silu(F.conv1d(seq.to(weight.dtype), weight, groups=self.conv_dim)).to(x.dtype).transpose(1, 2)
        keep = weight.shape[-1] - 1
        if valid is None:
            tail = seq[..., seq.shape[-1] - keep:]
        else:  # each row's last W - 1 inputs before its padding
            idx = step.lengths.to(x.device)[:, None] + torch.arange(keep, device=x.device)  # [B, W - 1]
            tail = seq.gather(-1, idx[:, None, :].expand(B, self.conv_dim, keep))
        states.conv[layer].index_copy_(0, rows, tail.to(states.conv.dtype))

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
