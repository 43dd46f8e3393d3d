"""Rotary position embedding (default RoPE, half-split rotation as in Llama/Qwen), over whole heads or, partial RoPE
(transformers' ``partial_rotary_factor``: GLM-4.5, MiniMax-M2), over the leading dims of each head only."""

import torch


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies (computed on the CPU even while a model is built on the meta
    device: they are not loaded from the checkpoint)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple:
    """positions [B, S] -> the RoPE table of one forward call, shared by every layer: cos [B, S, 1, D] and the
    signed sin [B, S, 1, D] = [-sin, sin] (frequencies repeated over both halves; the 1 broadcasts over heads).
    Rounded to ``dtype`` as Hugging Face rounds cos and sin; negating is exact, so x rolled by half times the signed
    sin is, bit for bit, rotate_half(x) * sin. ``scale``: YaRN's attention factor, multiplied into cos and sin in fp32
    before the rounding (as Hugging Face's rotary embeddings do)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)  # [B, S, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, cos), dim=-1).unsqueeze(2).to(dtype), torch.cat((-sin, sin), dim=-1).unsqueeze(2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D] with the table of ``cos_sin``: x * cos + rotate_half(x) * sin, where rotate_half(x) * sin
    = [x2, x1] * [-sin, sin] (x = [x1, x2]): four kernels instead of five, no negation per layer.

    Partial RoPE: a table of R < D dims (``cos_sin`` of R / 2 frequencies) turns x[..., :R] as above and passes
    x[..., R:] through unchanged, as transformers' apply_rotary_pos_emb does with a smaller cos."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


# --- YaRN (DeepSeek-V2/V3, Kimi-K2): transformers' _compute_yarn_parameters and yarn_get_mscale -----------------


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    import math

    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(rope_parameters: dict, dim: int, max_position_embeddings: int) -> tuple:
    """YaRN inverse frequencies [dim / 2] fp32 and the attention factor that scales cos/sin, as transformers'
    ``_compute_yarn_parameters`` computes them from a config's ``rope_parameters`` (rope_type "yarn")."""
    import math

    p = rope_parameters
    base = float(p.get("rope_theta", 10000.0))
    dim = int(dim * p.get("partial_rotary_factor", 1.0))
    original_max = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor
