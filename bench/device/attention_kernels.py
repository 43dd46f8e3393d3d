"""Attention kernels alone on the GPU: hetmoe's paged Triton kernels against PyTorch's SDPA on the same shapes.

  python bench/device/attention_kernels.py [--contexts 512,8192,32768,131072] [--json FILE]

Decode (one query token per sequence, batch 1 and 16): the qwen3-30b-a3b layer (32 query heads, 4 kv heads, head
dim 128) and DeepSeek-V3's absorbed MLA (128 heads over a 512 + 64 latent); SDPA's side is what the engine ran before
the paged cache (the additive mask over the bucketed length, GQA folded into the query length; MLA: the two
matmuls and softmax of the absorbed form). Prefill: a prompt of each length from position 0 in chunks of 8192,
against the SDPA path over the contiguous keys (``is_causal`` for the first chunk, the mask after). Times are
CUDA-event medians, µs per layer.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hetmoe.layers.attention import Step, attend
from hetmoe.ops.triton import attention as ta

P = 64


def timed_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def graph_replay_us(fns) -> float:
    """Median µs of one replay of a CUDA graph that calls each of ``fns`` once (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return timed_us(g.replay, 30)


def graph_us(fn, n: int = 50) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph (no launch overhead: what a decode step inside the engine's
    graph pays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed_us(g.replay, n)


def pages_for(B: int, ctx: int, kv: int, d: int, dv: int):
    per = -(-ctx // P)
    k = torch.randn(B * per + 1, P, kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B * per + 1, P, kv, dv, device="cuda", dtype=torch.bfloat16)
    table = (torch.arange(B * per, device="cuda", dtype=torch.int32) + 1).view(B, per)
    return k, v, table


def gqa_decode(B: int, ctx: int, H=32, KV=4, D=128, lengths=None) -> dict:
    k, v, table = pages_for(B, ctx, KV, D, D)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((B,), ctx - 1, device="cuda") if lengths is None else torch.tensor(lengths, device="cuda") - 1
    slots = torch.arange(B, device="cuda")
    ours = graph_us(lambda: ta.decode(q, k, v, table, slots, pos, D**-0.5))
    kc = k[1:].view(B, -1, KV, D)[:, :ctx]
    vc = v[1:].view(B, -1, KV, D)[:, :ctx]
    step = Step(pos.view(B, 1), slots, kv_len=ctx)
    sdpa = graph_us(lambda: attend(q.view(B, 1, H, D), kc, vc, step, D**-0.5))
    return {"kind": "gqa decode" + (" mixed" if lengths else ""), "batch": B, "context": ctx, "triton_us": ours,
            "sdpa_us": sdpa,
            "kv_gbps": 2 * B * ctx * KV * D * 2 / ours / 1e3}


def mla_decode(B: int, ctx: int, H=128, r=512, rope=64, lengths=None) -> dict:
    c, pe, table = pages_for(B, ctx, 1, r, rope)
    q_lat = torch.randn(B, H, r, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(B, H, rope, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((B,), ctx - 1, device="cuda") if lengths is None else torch.tensor(lengths, device="cuda") - 1
    slots = torch.arange(B, device="cuda")
    ours = graph_us(lambda: ta.decode(q_lat, c, None, table, slots, pos, 0.1, q2=q_pe, k2=pe, v_is_k1=True))
    cc, pc = c[1:].view(B, -1, r)[:, :ctx], pe[1:].view(B, -1, rope)[:, :ctx]
    mask = torch.zeros(B, 1, ctx, device="cuda")

    def torch_form():
        s = (q_lat @ cc.transpose(1, 2) + q_pe @ pc.transpose(1, 2)).float() * 0.1
        return ((s + mask).softmax(-1).to(cc.dtype) @ cc)

    return {"kind": "mla decode" + (" mixed" if lengths else ""), "batch": B, "context": ctx, "triton_us": ours,
            "sdpa_us": graph_us(torch_form),
            "kv_gbps": B * ctx * (r + rope) * 2 / ours / 1e3}


def gqa_prefill(n: int, H=32, KV=4, D=128, chunk=8192) -> dict:
    k, v, table = pages_for(1, n, KV, D, D)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    kc, vc = k[1:].view(1, -1, KV, D)[:, :n], v[1:].view(1, -1, KV, D)[:, :n]
    qs = [torch.randn(1, min(chunk, n - i), H, D, device="cuda", dtype=torch.bfloat16) for i in range(0, n, chunk)]

    def ours():
        for j, i in enumerate(range(0, n, chunk)):
            pos = torch.arange(i, i + qs[j].shape[1], device="cuda")[None]
            ta.prefill(qs[j], k, v, table, slots, pos, D**-0.5)

    def sdpa():  # flash, causal per chunk over the keys so far (a chunk after the first needs the mask: see attend)
        for j, i in enumerate(range(0, n, chunk)):
            S = qs[j].shape[1]
            pos = torch.arange(i, i + S, device="cuda")[None]
            attend(qs[j], kc[:, :i + S], vc[:, :i + S], Step(pos, slots, kv_len=i + S, start=i), D**-0.5)

    t_ours = timed_us(ours, 5)
    flops = 4 * H * D * n * n / 2
    return {"kind": "gqa prefill", "context": n, "triton_us": t_ours,
            "sdpa_us": timed_us(sdpa, 5) if n <= 32768 else None,  # its masks past 32K: tens of GB
            "triton_tflops": flops / t_ours / 1e6}


def prefix_prefill(start: int, S: int = 8192, H=32, KV=4, D=128) -> dict:
    """One chunk of S tokens after a cached prefix of ``start``: the Triton kernel over the pages against SDPA with a
    lower-right causal bias over contiguous keys (GQA expanded when SDPA will not take enable_gqa with it)."""
    from torch.nn.attention.bias import causal_lower_right

    n = start + S
    k, v, table = pages_for(1, n, KV, D, D)
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(start, n, device="cuda")[None]
    ours = timed_us(lambda: ta.prefill(q, k, v, table, slots, pos, D**-0.5), 5)
    kc, vc = k[1:].view(1, -1, KV, D)[:, :n], v[1:].view(1, -1, KV, D)[:, :n]
    bias = causal_lower_right(S, n)

    def lower_right():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kc.transpose(1, 2).repeat_interleave(H // KV, 1),
            vc.transpose(1, 2).repeat_interleave(H // KV, 1), attn_mask=bias, scale=D**-0.5)

    ref = lower_right().transpose(1, 2).float()
    err = (ta.prefill(q, k, v, table, slots, pos, D**-0.5).float() - ref).abs().max().item()
    return {"kind": "gqa prefix prefill", "start": start, "chunk": S, "triton_us": ours,
            "sdpa_lower_right_us": timed_us(lower_right, 5), "max_abs_diff": err}


CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3), (128, 4, 2)]


def prefill_configs(start: int = 8192, S: int = 8192) -> list:
    """The prefill kernel's (BLOCK_M, warps, stages) choices on a chunk after a prefix: GQA (qwen3 layer) and MLA's
    expanded form (128 heads, q/k 128 + 64 shared rope, v 128)."""
    n = start + S
    slots = torch.zeros(1, dtype=torch.int64, device="cuda")
    pos = torch.arange(start, n, device="cuda")[None]
    rows = []
    k, v, table = pages_for(1, n, 4, 128, 128)
    q = torch.randn(1, S, 32, 128, device="cuda", dtype=torch.bfloat16)
    gqa_flops = 4 * 32 * 128 * S * (start + S / 2)
    kv, _, mtable = pages_for(1, n, 128, 256, 1)
    pe = torch.randn(kv.shape[0], P, 1, 64, device="cuda", dtype=torch.bfloat16).expand(-1, -1, 128, -1)
    qn, qp = (torch.randn(1, S, 128, d, device="cuda", dtype=torch.bfloat16) for d in (128, 64))
    mla_flops = 2 * 128 * (192 + 128) * S * (start + S / 2)
    for cfg in CONFIGS:
        try:
            t = timed_us(lambda: ta.prefill(q, k, v, table, slots, pos, 0.1, config=cfg), 5)
            m = timed_us(lambda: ta.prefill(qn, kv[..., :128], kv[..., 128:], mtable, slots, pos, 0.1, q2=qp, k2=pe,
                                            config=cfg), 3)
        except Exception as e:  # a config that does not fit the SM (shared memory, registers)
            rows.append({"kind": "prefill config", "config": cfg, "error": str(e)[:200]})
            continue
        rows.append({"kind": "prefill config", "config": cfg, "gqa_us": t, "gqa_tflops": gqa_flops / t / 1e6,
                     "mla_us": m, "mla_tflops": mla_flops / m / 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,8192,32768,131072")
    ap.add_argument("--json")
    ap.add_argument("--configs", action="store_true", help="only the prefill kernel's configurations (A/B)")
    ap.add_argument("--splits", action="store_true", help="only the decode kernel's split target (A/B)")
    args = ap.parse_args()
    ctxs = [int(x) for x in args.contexts.split(",")]
    rows = []
    if args.splits:  # the split target's A/B at batch 16, mixed lengths (the decode kernel's straggler rows)
        mixed = [int(512 * 64 ** (i / 15)) for i in range(16)]
        for per_sm in (2, 4, 8, 16):
            ta.DECODE_PROGRAMS_PER_SM = per_sm
            for r in (gqa_decode(16, 32768, lengths=mixed), gqa_decode(16, 512),
                      mla_decode(16, 32768, lengths=mixed), gqa_decode(1, 8192), mla_decode(1, 8192)):
                print(json.dumps({**r, "programs_per_sm": per_sm}))
        return
    if args.configs:
        rows = prefill_configs()
        for r in rows:
            print(json.dumps(r))
        return
    for cudnn in (False, True):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        rows.append({**gqa_prefill(8192), "cudnn_sdp": cudnn})
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the engine runs
    rows += [prefix_prefill(8192), prefix_prefill(24576)]
    mixed = [int(512 * 64 ** (i / 15)) for i in range(16)]  # 512 .. 32768, as bench e2e --kv-contexts
    rows += [mla_decode(16, 32768, lengths=mixed), mla_decode(16, 512), gqa_decode(16, 512)]
    for ctx in ctxs:
        for B in (1, 16):
            if B * ctx <= 16 * 32768:
                rows += [gqa_decode(B, ctx), mla_decode(B, ctx)]
        rows.append(gqa_prefill(ctx))
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
