"""Decode attention on the CPU: the engine's op (hetmoe/cpu/attention.py) against the torch path it replaces
(hetmoe/layers/attention.py ``attend``: SDPA over the cache rows with the additive mask; MLA: the absorbed form's
plain torch ops), one sequence at its last position, for the qwen3-30b-a3b layer (Hq 32, Hkv 4, D 128) and
DeepSeek's MLA (Hq 16 or 128, latent 512 + rope 64, the latent as value), fp32 and bf16 caches.

Prints ms (best of the repeats: the machine is shared) and the GB/s of cache read.

    python3 bench/cpu_attention.py [--ctx 512 4096 32768] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from hetmoe import cpu
from hetmoe.cpu.attention import attention_kernel, decode_attention
from hetmoe.layers.attention import Step, attend


def best_ms(fn, repeats: int, budget_s: float = 3.0) -> float:
    """The best of ``repeats`` timed calls after one warm-up (at least 3 once ``budget_s`` is spent)."""
    fn()
    best, start = float("inf"), time.perf_counter()
    for i in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return best * 1e3


def mla_torch(q_lat, q_pe, c, pe, step, scale):
    """The absorbed form's torch ops of hetmoe/models/deepseek_v2.py (without the w_uk / w_uv products)."""
    B, S, h, r = q_lat.shape
    ctx, rope = c.shape[1], pe.shape[-1]
    c, pe = c.to(q_lat.dtype).view(B, ctx, r), pe.to(q_lat.dtype).view(B, ctx, rope)
    scores = q_lat.reshape(B, S * h, r) @ c.transpose(1, 2) + q_pe.reshape(B, S * h, rope) @ pe.transpose(1, 2)
    scores = scores.view(B, S, h, ctx).float() * scale
    probs = (scores + step.attn_mask(ctx, scores.dtype).view(B, S, 1, ctx)).softmax(dim=-1).to(c.dtype)
    return (probs.view(B, S * h, ctx) @ c).view(B, S, h, r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mla-heads", type=int, nargs="+", default=[16, 128])
    args = ap.parse_args()
    pool = cpu.shared_pool(args.threads)
    torch.set_num_threads(pool.threads)
    print(f"loops: {attention_kernel()}, pool threads {pool.threads}, torch threads {torch.get_num_threads()}")
    print(f"{'layer':<14}{'cache':<6}{'ctx':>7}{'ours ms':>10}{'GB/s':>7}{'torch ms':>10}{'GB/s':>7}{'speedup':>9}")
    g = torch.Generator().manual_seed(0)
    shapes = [("gqa 32/4x128", 32, 4, 128, 0, 128)] + [(f"mla {h}x512+64", h, 1, 512, 64, 512)
                                                        for h in args.mla_heads]
    for name, Hq, Hkv, D1, D2, Dv in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for ctx in args.ctx:
                k = torch.randn(1, ctx, Hkv, D1, generator=g).to(dtype)
                k2 = torch.randn(1, ctx, Hkv, D2, generator=g).to(dtype) if D2 else None
                v = None if D2 else torch.randn(1, ctx, Hkv, Dv, generator=g).to(dtype)
                q = torch.randn(1, Hq, D1, generator=g).to(dtype)
                q2 = torch.randn(1, Hq, D2, generator=g).to(dtype) if D2 else None
                rows, lens = torch.zeros(1, dtype=torch.int64), torch.full((1,), ctx, dtype=torch.int64)
                step = Step(positions=torch.full((1, 1), ctx - 1), slots=rows, kv_len=ctx, first_slot=0)
                scale = (D1 + D2) ** -0.5
                out = torch.empty(1, Hq, Dv, dtype=dtype)
                ours = best_ms(lambda: decode_attention(q, k, v, rows, lens, scale, q2=q2, k2=k2, v_is_k1=v is None,
                                                        out=out, pool=pool), args.repeats)
                if D2:
                    theirs = best_ms(lambda: mla_torch(q.unsqueeze(1), q2.unsqueeze(1), k, k2, step, scale),
                                     args.repeats)
                else:
                    theirs = best_ms(lambda: attend(q.unsqueeze(1), k, v, step, scale), args.repeats)
                nbytes = sum(t.numel() * t.element_size() for t in (k, k2, v) if t is not None)
                print(f"{name:<14}{str(dtype)[6:]:<6}{ctx:>7}{ours:>10.3f}{nbytes / ours / 1e6:>7.1f}"
                      f"{theirs:>10.3f}{nbytes / theirs / 1e6:>7.1f}{theirs / ours:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
