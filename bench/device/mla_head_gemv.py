"""MLA's absorbed per-head products at decode (hetmoe/ops/triton/mla.py): ``head_gemv`` against
``torch.einsum`` (cuBLAS's batched GEMM) for T rows, on DeepSeek-V3's shapes (128 heads, W_uk [h, 128, 512] and
W_uv^T [h, 512, 128] as views of kv_b_proj's weight), bf16. The A/B behind ``HEAD_GEMV_MAX_T``.

  python3 bench/device/mla_head_gemv.py [--rows 1,2,4,8] [--json FILE]
  python3 bench/device/mla_head_gemv.py --sweep [--rows 1]     # head_gemv's tiles (BK, BN, warps) at each T

Each product is timed as a CUDA graph replay (CUDA-event median) over enough copies of the weight that they do
not stay in the L2 cache between replays, as a decode step's layers would not.
"""

from __future__ import annotations

import argparse
import json

import torch
from attention_kernels import graph_replay_us  # bench/device/: the same CUDA-event medians

from hetmoe.ops.triton.mla import head_gemv

H, NOPE, V, R = 128, 128, 128, 512
COPIES = 8  # 8 x 33.5 MB of kv_b_proj: over the H200's L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="time head_gemv over tile shapes instead of against einsum")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_kv = [torch.randn(H, NOPE + V, R, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.05
            for _ in range(COPIES)]
    weights = {"W_uk": [w[:, :NOPE, :] for w in w_kv], "W_uv^T": [w[:, NOPE:, :].transpose(1, 2) for w in w_kv]}
    if args.sweep:
        sweep(weights, [int(t) for t in args.rows.split(",")], gen)
        return
    rows = []
    print(f"{'product':8} {'T':>3} {'head_gemv us':>13} {'einsum us':>10} {'ratio':>6}")
    for name, ws in weights.items():
        for T in (int(t) for t in args.rows.split(",")):
            x = torch.randn(T, H, ws[0].shape[1], generator=gen, device="cuda", dtype=torch.bfloat16)
            ours = graph_replay_us([lambda w=w: head_gemv(x, w) for w in ws]) / COPIES
            ref = graph_replay_us([lambda w=w: torch.einsum("thk,hkn->thn", x, w) for w in ws]) / COPIES
            err = (head_gemv(x, ws[0]).float() - torch.einsum("thk,hkn->thn", x, ws[0]).float()).abs().max().item()
            print(f"{name:8} {T:>3} {ours:>13.2f} {ref:>10.2f} {ours / ref:>6.2f}   max |diff| {err:.2e}")
            rows.append(dict(product=name, T=T, head_gemv_us=ours, einsum_us=ref, max_abs_diff=err))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def sweep(weights: dict, rows: list, gen) -> None:
    """head_gemv's time per (BK, BN, warps) tile, fastest first, beside the planned tile (tile=None)."""
    for name, ws in weights.items():
        contiguous_n = ws[0].stride(2) == 1
        for T in rows:
            x = torch.randn(T, H, ws[0].shape[1], generator=gen, device="cuda", dtype=torch.bfloat16)
            ref = torch.einsum("thk,hkn->thn", x, ws[0]).float()
            tiles = [None] + [(bk, bn, warps) for bk in (16, 32, 64, 128, 256, 512) for bn in (8, 16, 32, 64, 128, 256)
                              for warps in (2, 4, 8) if 1 << 10 <= bk * bn <= 1 << 15
                              and (bn >= 32 if contiguous_n else bk >= 64)]
            timed = []
            for tile in tiles:
                err = (head_gemv(x, ws[0], tile).float() - ref).abs().max().item()
                us = graph_replay_us([lambda w=w: head_gemv(x, w, tile) for w in ws]) / COPIES
                timed.append((us, tile, err))
            timed.sort(key=lambda r: r[0])
            planned = next(us for us, tile, _ in timed if tile is None)
            print(f"{name} T={T}: planned tile {planned:.2f} us; fastest:")
            for us, tile, err in timed[:8]:
                print(f"  {str(tile):16} {us:7.2f} us  max |diff| {err:.2e}")


if __name__ == "__main__":
    main()
