"""Dense linears on the GPU in bf16/fp8/int8/int4 (hetmoe/layers/gpu_linear.py): one [N, K] weight times
x [M, K], decode (M = 1) and prefill (M = 2048).

  python bench/device/gpu_linear.py [--shapes 5120x2048,...] [--formats bf16,fp8,int8,int4] [--m 1,2048]
                                    [--variants] [--json FILE]

Shapes: qwen3-30b-a3b's fused q/k/v [5120, 2048], o_proj [2048, 4096] and lm_head [151936, 2048]; DeepSeek-V3's
q_b_proj [24576, 1536], o_proj [7168, 16384] and a dense layer's gate/up [36864, 7168]. Each product is timed as a
CUDA graph replay (CUDA-event median over replays, no launch overhead: what the engine's decode graph pays) over
enough copies of the weights that they do not stay in the L2 cache between replays, as a model's layers would not.
Printed: µs per product, GB/s of weights read (scales included) and its share of the device-to-device copy rate
this run measured (bytes read + written), TFLOPS, and the time against bf16 (cuBLAS) for the same shape and M.
fp8 is timed on both its kernels: the Triton GEMV/GEMM (weight-only, bf16 x) and torch._scaled_mm (x rounded to
fp8 per token and 128 columns). ``--variants`` also times a few launch configurations of the Triton kernel for the
quantized formats (the A/B behind triton_linear.plan).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json

import torch
from attention_kernels import graph_replay_us, timed_us  # bench/device/: the same CUDA-event medians
from torch import nn

from hetmoe.layers.gpu_linear import GPULinear, _scaled_mm_fp8, blockwise_scaled_mm
from hetmoe.ops.triton import linear as triton_linear

SHAPES = {"qwen3 qkv": (5120, 2048), "qwen3 o": (2048, 4096), "qwen3 lm_head": (151936, 2048),
          "dsv3 q_b": (24576, 1536), "dsv3 o": (7168, 16384), "dsv3 gate_up": (36864, 7168)}
L2_FLUSH_BYTES = 512 << 20  # weights per replay: several times the H200's 60 MB L2


def graph_us(fns) -> float:
    """Median µs of one replay of a graph that calls each of ``fns`` once, divided by their number."""
    return graph_replay_us(fns) / len(fns)


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed_us(lambda: dst.copy_(src), 10) / 1e3


def copies(lin: GPULinear) -> list:
    n = max(1, min(64, -(-L2_FLUSH_BYTES // lin.nbytes)))
    return [lin] + [copy.deepcopy(lin) for _ in range(n - 1)]


def row(name, N, K, fmt, M, kernel, us, nbytes, bf16_us, copy_rate) -> dict:
    gbps = nbytes / us / 1e3
    r = {"shape": name, "N": N, "K": K, "format": fmt, "M": M, "kernel": kernel, "us": round(us, 2),
         "weight_gbps": round(gbps, 1), "of_copy_rate": round(gbps / copy_rate, 3),
         "tflops": round(2 * M * N * K / us / 1e6, 1), "vs_bf16": round(bf16_us / us, 2) if bf16_us else None}
    print(f"{name:14s} [{N:6d},{K:5d}] {fmt:4s} M={M:<5d} {kernel:34s} {us:9.1f} us {gbps:7.0f} GB/s "
          f"({100 * gbps / copy_rate:3.0f}%) {r['tflops']:6.1f} TFLOPS  x{r['vs_bf16'] or 1:.2f} vs bf16", flush=True)
    return r


def variants(M: int, N: int, K: int, fmt: str) -> list:
    """Launch configurations of the Triton kernels to A/B for this product (the planned one among them)."""
    tl = triton_linear
    n_sm = tl.sm_count(torch.device("cuda"))
    group = tl.GROUP[fmt]
    kp = -(-K // group) * group
    out = []
    if M <= tl.DECODE_M:
        if M <= tl.GEMV_M:  # tile rows x K, warps, programs per SM, deferred reduction
            for bn, bk, warps, pps, defer in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (4, 8),
                                                               (True, False)):
                splits, per = tl.split_k(-(-N // bn), -(-kp // bk), n_sm, pps)
                out.append(tl.Launch("gemv", 1 << (M - 1).bit_length(), bn, bk, splits, per, warps, 3, defer=defer))
        else:  # 4 < M <= 16: the CUDA-core GEMV's rows of x per weight tile against the tensor-core tiles below
            for bn, bk, warps, pps in itertools.product((8, 16), (256, 512), (4, 8), (4, 8)):
                splits, per = tl.split_k(-(-N // bn), -(-kp // bk), n_sm, pps)
                out.append(tl.Launch("gemv", 1 << (M - 1).bit_length(), bn, bk, splits, per, warps, 3, defer=False))
        for bn, stages, pps, after in ((64, 4, 4, False), (128, 4, 4, False), (64, 4, 8, False), (32, 4, 8, False),
                                       (64, 4, 8, True), (128, 3, 8, False)):
            splits, per = tl.split_k(-(-M // 16) * -(-N // bn), kp // group, n_sm, pps)
            out.append(tl.Launch("dot", 16, bn, group, splits, per, 4, stages, after))
        return out
    for bm, bn, warps, stages, after in ((128, 128, 8, 3, False), (128, 128, 4, 4, False), (128, 256, 8, 3, False),
                                         (64, 128, 4, 4, False), (128, 128, 8, 3, True)):
        splits, per = tl.split_k(-(-M // bm) * -(-N // bn), kp // group, n_sm)
        out.append(tl.Launch("dot", bm, bn, group, splits, per, warps, stages, after))
    for elements in (1 << 24, 1 << 25, 1 << 27):
        out.append(tl.Launch("dequant", M, max(group, elements // kp // group * group), kp, 1, 1, 4, 1))
    return out


def bench_shape(name, N, K, formats, ms, with_variants, copy_rate) -> list:
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        src.weight.copy_(torch.randn(N, K, device="cuda", generator=gen) * 0.02)
    rows = []
    for fmt in formats:
        lins = copies(GPULinear.from_linears([src], fmt, "cuda"))
        lin = lins[0]
        for M in ms:
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in lins]
            if fmt == "bf16":
                bf16_us = None
            else:
                bf16_us = next((r["us"] for r in rows_bf16 if r["shape"] == name and r["M"] == M), None)
            us = graph_us([lambda lin=lin, x=x: lin(x) for lin, x in zip(lins, xs)])
            label = lin.kernel
            if lin.kernel == "triton" or (lin.kernel == "scaled_mm" and M <= triton_linear.DECODE_M):
                label = "triton " + triton_linear.plan(M, N, K, fmt, triton_linear.sm_count(xs[0].device)).kernel
            r = row(name, N, K, fmt, M, label, us, lin.nbytes, bf16_us, copy_rate)
            rows.append(r)
            if fmt == "bf16":
                rows_bf16.append(r)
            if fmt == "fp8" and blockwise_scaled_mm(torch.device("cuda")):
                if label.startswith("triton"):
                    other = [lambda lin=lin, x=x: _scaled_mm_fp8(x, lin.weight, lin.scale, None)
                             for lin, x in zip(lins, xs)]
                    label = "scaled_mm"
                else:
                    other = [lambda lin=lin, x=x: triton_linear.linear(x, lin.weight, lin.scale, None, "fp8", N)
                             for lin, x in zip(lins, xs)]
                    label = "triton"
                rows.append(row(name, N, K, fmt, M, label, graph_us(other), lin.nbytes, bf16_us, copy_rate))
            if with_variants and fmt != "bf16":
                for launch in variants(M, N, K, fmt):
                    fns = [lambda lin=lin, x=x, launch=launch: triton_linear.linear(x, lin.weight, lin.scale, None, fmt,
                                                                                    N, launch=launch)
                           for lin, x in zip(lins, xs)]
                    label = (f"{launch.kernel} {launch.bm}x{launch.bn}x{launch.bk} w{launch.num_warps} "
                             f"{f'p{launch.splits * -(-N // launch.bn)} ' if launch.kernel == 'gemv' else ''}"
                             f"s{launch.num_stages} k/{launch.splits}{' after' if launch.scale_after else ''}"
                             f"{' nodefer' if launch.kernel == 'gemv' and not launch.defer else ''}")
                    rows.append(row(name, N, K, fmt, M, label, graph_us(fns), lin.nbytes, bf16_us, copy_rate))
        del lins, lin
        torch.cuda.empty_cache()
    return rows


rows_bf16: list = []


def errors(formats) -> None:
    """||y - ref|| / ||ref|| of each format's kernels on this GPU, N(0, 0.02) weights [1536, 2048] (fused
    1024 + 512, bias), N(0, 1) inputs: against the fp32 product with the dequantized weights (the kernel) and with
    the bf16 weights (the format); the numbers tests/layers/test_gpu_linear.py bounds."""
    from hetmoe.layers.gpu_linear import dequantize

    gen = torch.Generator(device="cuda").manual_seed(1)
    srcs = []
    for n in (1024, 512):
        lin = nn.Linear(2048, n, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 2048, device="cuda", generator=gen) * 0.02)
            lin.bias.copy_(torch.randn(n, device="cuda", generator=gen) * 0.02)
        srcs.append(lin)
    w16 = torch.cat([lin.weight.float() for lin in srcs])
    bias = torch.cat([lin.bias.float() for lin in srcs])

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for fmt in formats:
        kernels = ["torch"] if fmt == "bf16" else ["triton"] + (["scaled_mm"] if fmt == "fp8" else [])
        for kernel in kernels:
            lin = GPULinear.from_linears(srcs, fmt, "cuda", kernel=kernel)
            w = dequantize(fmt, lin.weight, lin.scale, 2048)
            for M in (1, 3, 16, 64, 300, 2048):
                x = torch.randn(M, 2048, device="cuda", generator=gen).bfloat16()
                y = lin(x)
                path = "gemv/dot/dequant" if kernel == "triton" else kernel
                print(f"errors {fmt:4s} {path:16s} M={M:<5d} vs dequantized {rel(y, x.float() @ w.t() + lin.bias):.2e}"
                      f"  vs bf16 {rel(y, x.float() @ w16.t() + bias):.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES.values()))
    ap.add_argument("--formats", default="bf16,fp8,int8,int4")
    ap.add_argument("--m", default="1,2048")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--errors", action="store_true", help="print each format's measured error and stop")
    args = ap.parse_args()
    if args.errors:
        return errors(args.formats.split(","))
    names = {v: k for k, v in SHAPES.items()}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    formats = args.formats.split(",")
    if "bf16" in formats:  # the baseline first, so each format's line has its ratio
        formats = ["bf16"] + [f for f in formats if f != "bf16"]
    ms = [int(m) for m in args.m.split(",")]
    rate = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {rate:.0f} GB/s (read + written); "
          f"fp8 block scales through _scaled_mm: {blockwise_scaled_mm(torch.device('cuda'))}")
    rows = []
    for N, K in shapes:
        rows += bench_shape(names.get((N, K), f"{N}x{K}"), N, K, formats, ms, args.variants, rate)
        if args.json:  # after each shape, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": rate, "torch": torch.__version__,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
