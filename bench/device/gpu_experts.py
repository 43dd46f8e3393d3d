"""GPU-resident experts' decode paths (hetmoe/moe/gpu_resident/experts.py): the torch dense path (every resident expert
over every token) against the routed Triton path (only the routed resident experts' weights:
hetmoe/ops/triton/experts.py).

  python bench/device/gpu_experts.py [--n 38] [--t 1,8] [--layers 16] [--coverage auto] [--variants] [--json FILE]

Shape: qwen3-30b-a3b's experts (H 2048, I 768, E 128, k 8), bf16, N resident experts per layer. Each path is timed as
one CUDA graph that runs ``--layers`` layers' resident experts (different weights and routing per layer, so the
weights do not stay in the 60 MB L2 between layers, as in the model), replayed; CUDA-event median. Routing: each of a
token's k slots goes to a resident expert with probability ``--coverage`` (default N/E: uniform routing; the
calibration's most-routed experts cover more). Printed per layer: µs, MB of expert weights read (dense: all N experts;
routed: each distinct resident expert routed to, once), the rate that makes, and the speed-up of routed over dense.
``--variants`` also times a few tile configurations of the routed kernels (the A/B behind
hetmoe.ops.triton.experts.plan).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from attention_kernels import graph_replay_us  # bench/device/: the same CUDA-event median

from hetmoe.moe.gpu_resident.experts import GpuExperts
from hetmoe.ops.triton import experts as kern

H, I, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b
VARIANTS = {  # name -> Launch (gemv, bi, bk_gu, bh, bk_down, warps, stages); defer applies at T = 1 only
    "gemv 8x512/16x256": kern.Launch(True, 8, 512, 16, 256),
    "gemv 4x512/8x256": kern.Launch(True, 4, 512, 8, 256),
    "gemv 16x512/16x256": kern.Launch(True, 16, 512, 16, 256),
    "gemv 8x256/16x128": kern.Launch(True, 8, 256, 16, 128),
    "gemv 8x1024/32x256 w8": kern.Launch(True, 8, 1024, 32, 256, 8),
    "gemv 8x512/16x256 defer": kern.Launch(True, 8, 512, 16, 256, defer=True),
    "gemv 4x512/8x256 defer": kern.Launch(True, 4, 512, 8, 256, defer=True),
    "dot 32x64/32x64": kern.Launch(False, 32, 64, 32, 64),
    "dot 16x128/16x128": kern.Launch(False, 16, 128, 16, 128),
    "dot 64x64/64x64": kern.Launch(False, 64, 64, 64, 64),
    "dot 32x128/32x128 s4": kern.Launch(False, 32, 128, 32, 128, 4, 4),
}


def routing(T: int, n: int, coverage: float, gen: torch.Generator):
    """topk_ids [T, K]: per token, Binomial(K, coverage) slots on the resident experts 0..n-1, the rest elsewhere."""
    rows = []
    for _ in range(T):
        m = int((torch.rand(K, generator=gen) < coverage).sum())
        m = max(min(m, n), K - (E - n))  # at most n resident, at most E - n elsewhere
        hot = torch.randperm(n, generator=gen)[:m]
        cold = n + torch.randperm(E - n, generator=gen)[:K - m]
        rows.append(torch.cat([hot, cold])[torch.randperm(K, generator=gen)])
    ids = torch.stack(rows)
    w = torch.rand(T, K, generator=gen) + 0.05
    return ids.cuda(), (w / w.sum(1, keepdim=True)).cuda()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="38", help="resident experts per layer (comma list)")
    ap.add_argument("--t", default="1,8", help="tokens per step (comma list)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--coverage", default="auto", help="share of a token's slots on resident experts (auto: N/E)")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: qwen3-30b-a3b experts H={H} I={I} E={E} k={K}, bf16, "
          f"{args.layers} layers per graph")
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        cov = n / E if args.coverage == "auto" else float(args.coverage)
        gen = torch.Generator().manual_seed(n)
        layers = []
        for _ in range(args.layers):
            g = torch.randn(n, I, H, device="cuda", dtype=torch.bfloat16) * 0.02
            d = torch.randn(n, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
            layers.append(GpuExperts(list(range(n)), g, g * 0.5, d, E, torch.bfloat16, "cuda"))
            del g, d
        for T in (int(v) for v in args.t.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            routes = [routing(T, n, cov, gen) for _ in layers]
            read = statistics.mean(kern.weight_bytes_read(ids, ge.slot_of, H, I, 2) for ge, (ids, _) in
                                   zip(layers, routes))
            hits = statistics.mean(float((ids < n).sum()) for ids, _ in routes) / T
            res = {"n": n, "T": T, "coverage": cov, "resident_hits_per_token": hits, "dense_bytes": layers[0].nbytes,
                   "routed_bytes": read}
            for path in ("dense", "routed"):
                for ge in layers:
                    ge.decode = path
                fns = [lambda ge=ge, r=r: ge(x, *r) for ge, r in zip(layers, routes)]
                res[f"{path}_us"] = graph_replay_us(fns) / len(layers)
            ref = [ge(x, *r) for ge, r in zip(layers, routes)]
            for ge in layers:
                ge.decode = "dense"
            err = max(((a - ge(x, *r)).norm() / ge(x, *r).norm()).item() for a, ge, r in zip(ref, layers, routes))
            res["routed_vs_dense_rel_err"] = err
            print(f"N={n:3d} T={T:2d} hits/token {hits:4.2f}: dense {res['dense_us']:7.1f} us/layer "
                  f"({res['dense_bytes'] / 1e6:6.1f} MB, {res['dense_bytes'] / res['dense_us'] / 1e3:5.0f} GB/s)  "
                  f"routed {res['routed_us']:6.1f} us/layer ({read / 1e6:6.1f} MB, "
                  f"{read / res['routed_us'] / 1e3:5.0f} GB/s)  x{res['dense_us'] / res['routed_us']:.1f}  "
                  f"rel err {err:.1e}")
            if args.variants:
                res["variants"] = {}
                for name, launch in VARIANTS.items():
                    if launch.gemv != (T <= kern.GEMV_ROWS):
                        continue
                    fns = [lambda ge=ge, r=r, launch=launch: kern.routed(
                        x, *r, ge.w_gate_up, ge.w_down, ge.slot_of, None, E, I, launch=launch)
                        for ge, r in zip(layers, routes)]
                    verr = max(((fn() - a).norm() / a.norm()).item() for fn, a in zip(fns, ref))
                    us = graph_replay_us(fns) / len(layers)
                    res["variants"][name] = {"us": us, "rel_err_vs_routed": verr}
                    print(f"    {name:24s} {us:6.1f} us/layer  {read / us / 1e3:5.0f} GB/s  rel err {verr:.1e}")
            rows.append(res)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
