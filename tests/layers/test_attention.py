"""Attention layers against naive references: ``attend`` (GQA folded into the query length, additive mask from
``Step``) against an explicit float64 softmax over masked scores with kv heads repeated per query head; RoPE against
Hugging Face's rotate_half formula (bit for bit); fused q/k/v and gate/up projections against the separate linears.

Tolerances (relative error ||out - ref|| / ||ref||, on the CPU): fp32 inputs measured <= 1.0e-7 (bound 1e-5); bf16
inputs, compared with the reference on the same bf16-rounded values, measured <= 1.8e-3 (bound 1e-2: bf16 rounding of
the probabilities and of the output).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cases import generator
from hetmoe.layers.attention import GQAAttention, Step, attend
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.rope import apply_rope, cos_sin, inv_frequencies
from hetmoe.models.common import SwiGLUMLP
from reference import rel_err


def attend_reference(q, k, v, positions, scale) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, ctx, K, D(v)], positions [B, S] -> [B, S, H, Dv] in float64: query head h reads kv
    head h // (H / K) and every cached position <= its own."""
    B, S, H, _ = q.shape
    ctx, K = k.shape[1], k.shape[2]
    k64 = k.double().repeat_interleave(H // K, dim=2)  # [B, ctx, H, D]
    v64 = v.double().repeat_interleave(H // K, dim=2)
    scores = torch.einsum("bshd,bchd->bshc", q.double(), k64) * scale  # [B, S, H, ctx]
    allowed = torch.arange(ctx).view(1, 1, 1, ctx) <= positions.view(B, S, 1, 1)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("bshc,bchd->bshd", probs, v64)


# (heads, kv_heads): GQA groups of 4 and 3, MQA, MHA
HEADS = [(8, 2), (6, 2), (4, 1), (4, 4)]


@pytest.mark.parametrize("heads, kv_heads", HEADS)
@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_attend_matches_reference(heads, kv_heads, S, dtype, tol):
    gen = generator("attend", heads, kv_heads, S, str(dtype))
    B, D, ctx = 3, 16, 40
    starts = torch.tensor([0, 11, 29])  # row 0 prefills from 0; rows 1 and 2 continue cached sequences
    positions = starts.unsqueeze(1) + torch.arange(S)  # [B, S]; row 0 is "right-padded" past its real tokens
    q = torch.randn(B, S, heads, D, generator=gen).to(dtype)
    k = torch.randn(B, ctx, kv_heads, D, generator=gen).to(dtype)
    v = torch.randn(B, ctx, kv_heads, D, generator=gen).to(dtype)
    out = attend(q, k, v, Step(positions, torch.arange(B), kv_len=ctx), D**-0.5)
    assert out.shape == (B, S, heads, D) and out.dtype == dtype
    err = rel_err(out, attend_reference(q, k, v, positions, D**-0.5))
    print(f"rel. error {err:.1e}")
    assert err < tol


def test_attend_value_head_dim_differs():
    """MLA's expanded form: q/k head dim 24, v head dim 8."""
    gen = generator("attend-dv")
    B, S, H, ctx = 2, 5, 4, 16
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    q, k = torch.randn(B, S, H, 24, generator=gen), torch.randn(B, ctx, H, 24, generator=gen)
    v = torch.randn(B, ctx, H, 8, generator=gen)
    out = attend(q, k, v, Step(positions, torch.arange(B)), 0.3)
    assert out.shape == (B, S, H, 8)
    assert rel_err(out, attend_reference(q, k, v, positions, 0.3)) < 1e-5


def test_attn_mask_is_built_once_per_step():
    step = Step(torch.tensor([[2], [0]]), torch.arange(2))
    m1 = step.attn_mask(4, torch.float32, group=3)
    assert m1.shape == (2, 1, 3, 4) and m1 is step.attn_mask(4, torch.float32, group=3)
    assert m1[0, 0].eq(torch.tensor([0.0, 0.0, 0.0, float("-inf")])).all()
    assert m1[1, 0].eq(torch.tensor([0.0, float("-inf"), float("-inf"), float("-inf")])).all()
    prefill = Step(torch.arange(2)[None], torch.arange(1)).attn_mask(2, torch.bfloat16, group=2)  # rows s * 2 + j
    assert prefill.dtype == torch.bfloat16 and prefill[0, 0].isinf().tolist() == [[0, 1], [0, 1], [0, 0], [0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_rotate_half_formula(dtype):
    gen = generator("rope", str(dtype))
    positions = torch.tensor([[0, 5, 17], [900, 901, 4000]])
    inv_freq = inv_frequencies(32, 1e6)
    x = torch.randn(2, 3, 5, 32, generator=gen).to(dtype)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)
    rotated = torch.cat((-x[..., 16:], x[..., :16]), dim=-1)
    assert torch.equal(apply_rope(x, *cos_sin(positions, inv_freq, dtype)), x * cos + rotated * sin)


def _attention(seed, qk_norm, bias):
    torch.manual_seed(seed)
    attn = GQAAttention(48, 6, 2, 16, 0, qkv_bias=bias, qk_norm_eps=1e-6 if qk_norm else None).eval()
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.normal_(1, 0.1), attn.k_norm.weight.normal_(1, 0.1)
    return attn


def _prefill_decode(attn):
    gen = generator("gqa-forward")
    cache = KVCache(1, 2, 16, 2, 16)
    inv_freq = inv_frequencies(16, 1e4)
    outs = []
    for positions in (torch.arange(5).expand(2, 5), torch.tensor([[5], [5]])):
        x = torch.randn(*positions.shape, 48, generator=gen)
        step = Step(positions, torch.arange(2), kv_len=16, first_slot=0)
        outs.append(attn(x, cos_sin(positions, inv_freq, x.dtype), step, cache))
    return outs


@pytest.mark.parametrize("qk_norm, bias", [(True, False), (False, True)], ids=["qwen3", "qwen2"])
def test_fused_qkv_equals_separate_projections(qk_norm, bias):
    separate, fused = _attention(3, qk_norm, bias), _attention(3, qk_norm, bias)
    state = {k: v.clone() for k, v in separate.state_dict().items()}
    fused.fuse_projections()
    assert fused.qkv.intact() and fused.qkv.weight.shape == (10 * 16, 48)
    assert fused.state_dict().keys() == state.keys()
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        for a, b in zip(_prefill_decode(separate), _prefill_decode(fused)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    # load_state_dict writes through the views into the fused weight
    other = _attention(4, qk_norm, bias)
    fused.load_state_dict(other.state_dict())
    assert fused.qkv.intact() and torch.equal(fused.qkv.weight[6 * 16:8 * 16], other.k_proj.weight)
    with torch.no_grad():
        for a, b in zip(_prefill_decode(other), _prefill_decode(fused)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    # a replaced parameter (here: a dtype change) is noticed: the separate linears run again
    fused.to(torch.float64)
    assert not fused.qkv.intact()
    x = torch.randn(1, 2, 48, dtype=torch.float64)
    assert torch.equal(fused.qkv(x), torch.cat((fused.q_proj(x), fused.k_proj(x), fused.v_proj(x)), dim=-1))


def test_fused_gate_up_equals_separate():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(24, 40)
    x = torch.randn(3, 24)
    with torch.no_grad():
        ref = mlp(x)
        mlp.fuse_projections()
        assert mlp.gate_up.intact() and torch.allclose(mlp(x), ref, rtol=1e-6, atol=1e-6)


def test_fused_linears_refuse_mixed_shapes():
    with pytest.raises(ValueError, match="one size"):
        FusedLinears(nn.Linear(4, 2), nn.Linear(5, 2))
    with pytest.raises(ValueError, match="bias"):
        FusedLinears(nn.Linear(4, 2), nn.Linear(4, 2, bias=False))
