"""GPU-resident experts stored in int8/int4 against bf16 (hetmoe/moe/gpu_resident/format.py, the routed kernels of
hetmoe/ops/triton/experts.py: routed and routed_int), on the qwen3-30b-a3b expert shape.

  python bench/device/gpu_experts_int.py [--n 29,105] [--storage bf16,int8,int4] [--group 64] [--t 1,4,8]
                                         [--layers 16] [--coverage auto] [--variants] [--json FILE]

Each (N, storage) builds ``--layers`` layers of N resident experts from the same random bf16 weights, and times the
routed path as one CUDA graph over the layers (bench/device/gpu_experts.py's method and routing: each of a token's
k slots on a resident expert with probability --coverage, default N/E), CUDA-event median. Printed per layer: us,
MB of expert weights read (each distinct resident expert routed to, once, at its stored bytes), the rate that makes,
and the relative error against the bf16 copy of the same weights (the quantization's, ~1e-2 for int8 and ~1e-1 for
int4 of Gaussian weights). The default N: what --gpu-experts auto keeps under a 24 GiB budget with bf16 (29) and
int4 (105) resident experts (hetmoe plan --shape qwen3-30b-a3b --gpu-memory 24GiB --experts-format int4).
``--variants``: tile configurations of the int kernels (the A/B behind their use of gpu_experts_triton.plan).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from attention_kernels import graph_replay_us  # bench/device/: the same CUDA-event median
from gpu_experts import VARIANTS, routing  # bench/device/gpu_experts.py

from hetmoe.moe.gpu_resident import format as rf
from hetmoe.moe.gpu_resident.experts import GpuExperts
from hetmoe.ops.triton import experts as kern

H, I, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b


def bytes_read(ids: torch.Tensor, g: GpuExperts) -> float:
    distinct = kern.weight_bytes_read(ids, g.slot_of, H, I, 1) / (3 * H * I)
    return distinct * rf.expert_bytes(g.storage, H, I)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="29,105", help="resident experts per layer (comma list)")
    ap.add_argument("--storage", default="bf16,int8,int4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--t", default="1,4,8", help="tokens per step (comma list)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--coverage", default="auto", help="share of a token's slots on resident experts (auto: N/E)")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}: qwen3-30b-a3b experts H={H} I={I} E={E} k={K}, {args.layers} layers "
          f"per graph, group {args.group}")
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        cov = n / E if args.coverage == "auto" else float(args.coverage)
        cuda_gen = torch.Generator(device="cuda").manual_seed(n)
        weights = [tuple(torch.randn(*shape, device="cuda", generator=cuda_gen).bfloat16() * 0.02
                         for shape in ((n, I, H), (n, I, H), (n, H, I))) for _ in range(args.layers)]
        gen = torch.Generator().manual_seed(n)
        routes = {T: [routing(T, n, cov, gen) for _ in weights] for T in (int(v) for v in args.t.split(","))}
        xs = {T: (torch.randn(T, H, generator=gen) * 0.5).bfloat16().cuda() for T in routes}
        ref = {}  # T -> the first storage's outputs
        for fmt in args.storage.split(","):
            st = rf.Storage.of(fmt, args.group)
            layers = [GpuExperts(list(range(n)), *ws, E, torch.bfloat16, "cuda", storage=st, decode="routed")
                      for ws in weights]
            for T, rs in routes.items():
                x = xs[T]
                outs = [ge(x, *r) for ge, r in zip(layers, rs)]
                base = ref.setdefault(T, outs)
                err = max(((a - b).norm() / b.norm()).item() for a, b in zip(outs, base))
                read = statistics.mean(bytes_read(ids, ge) for ge, (ids, _) in zip(layers, rs))
                us = graph_replay_us([lambda ge=ge, r=r: ge(x, *r) for ge, r in zip(layers, rs)]) / len(layers)
                res = {"n": n, "T": T, "storage": st.name, "coverage": cov, "us": us, "bytes_read": read,
                       "resident_bytes": layers[0].nbytes, "rel_err_vs_first": err}
                print(f"N={n:3d} {st.name:5s} T={T:2d}: {us:6.1f} us/layer ({read / 1e6:5.1f} MB read, "
                      f"{read / us / 1e3:5.0f} GB/s; {layers[0].nbytes / 2**20:6.1f} MiB resident per layer)  "
                      f"rel err vs {args.storage.split(',')[0]} {err:.1e}")
                if args.variants and st.quantized:
                    res["variants"] = {}
                    for name, launch in VARIANTS.items():
                        if launch.gemv != (T <= kern.GEMV_ROWS):
                            continue
                        fns = [lambda ge=ge, r=r, launch=launch: kern.routed_int(
                            x, *r, (ge.w_gate_up, ge.s_gate_up), (ge.w_down, ge.s_down), ge.storage, ge.slot_of,
                            None, E, I, launch=launch) for ge, r in zip(layers, rs)]
                        vus = graph_replay_us(fns) / len(layers)
                        res["variants"][name] = vus
                        print(f"    {name:24s} {vus:6.1f} us/layer  {read / vus / 1e3:5.0f} GB/s")
                rows.append(res)
            del layers
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
