"""Rotary position embedding (default RoPE, half-split rotation as in Llama/Qwen)."""

import torch


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple:
    """positions [B, S] -> cos, sin [B, S, head_dim] (frequencies repeated over both halves)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D]; cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + _rotate_half(x) * sin
