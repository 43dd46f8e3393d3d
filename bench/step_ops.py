"""The aten ops of one batch-1 decode step per decoder layer, on the CPU: a proxy for the CUDA kernels of the GPU step
(bench/device/gpu_step_profile.py measures those on the GPU machine). The qwen3-30b-a3b shape (GQA 32/4 heads of 128,
q/k norm, hidden 2048, softmax top-8 of 128) with a small vocabulary and small experts, in bf16, decoding as the graph
decoder does (attended length bucketed, cache rows gathered by slot). Ops per layer = the difference between a 3-layer
and a 1-layer model, halved. "Kernels" are the ops that compute (not views, allocations or no-op casts) and call no
other op that computes, except that an op which is one kernel on CUDA but composite on the CPU (rms_norm, softmax with
a dtype) counts once; _to_copy (real dtype conversions) is counted apart. The CPU runs attention with its flash
kernel either way, so the GPU's math fallback (before the folded GQA of layers/attention.attend) does not show here.
Run from the repo root:

    python3 bench/step_ops.py
"""

import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile

from hetmoe.config.options import EngineOptions
from hetmoe.layers.attention import Step
from hetmoe.load.random_weights import SHAPES, build_random_model

SHAPE = dict(copy.deepcopy(SHAPES["qwen3-30b-a3b"]), vocab_size=512, moe_intermediate_size=64)
PROMPT, KV_BUCKET = 40, 64
METADATA = set("""view as_strided _unsafe_view reshape expand expand_as slice select transpose t permute unsqueeze
squeeze split split_with_sizes narrow detach alias empty empty_strided empty_like resize_ result_type resolve_conj
resolve_neg to lift_fresh unbind view_as flatten contiguous chunk _reshape_alias unflatten""".split())  # no kernel
ONE_CUDA_KERNEL = {"_fused_rms_norm", "softmax"}


def leaf_ops(layers: int) -> collections.Counter:
    loaded = build_random_model(SHAPE, layers, EngineOptions(device="cpu", dtype="bf16", experts_format="bf16",
                                                             max_context=256), log=lambda m: None)
    model = loaded.model
    cache = model.make_cache(2, 256, torch.bfloat16)
    slots = torch.tensor([1])
    with torch.inference_mode():
        model(torch.arange(1, PROMPT + 1)[None], Step(torch.arange(PROMPT)[None], slots, kv_len=KV_BUCKET), cache)

        def step():
            model(torch.tensor([[7]]), Step(torch.tensor([[PROMPT]]), slots, kv_len=KV_BUCKET), cache)

        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]

    def computes(e) -> bool:
        return e.name[6:] not in METADATA

    def calls_compute(e) -> bool:
        return e.name[6:] not in ONE_CUDA_KERNEL and any(
            c.name.startswith("aten::") and (computes(c) or calls_compute(c)) for c in e.cpu_children)

    def inside_one_kernel(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name[6:] in ONE_CUDA_KERNEL:
                return True
            p = p.cpu_parent
        return False

    counts = collections.Counter(e.name for e in events
                                 if computes(e) and not calls_compute(e) and not inside_one_kernel(e))
    counts["(_to_copy)"] = sum(e.name == "aten::_to_copy" and not inside_one_kernel(e) for e in events)
    return counts


def main():
    one, three = leaf_ops(1), leaf_ops(3)
    per = {k: (three[k] - one[k]) / 2 for k in set(one) | set(three)}
    per = {k: v for k, v in per.items() if v}
    kernels = sum(v for k, v in per.items() if not k.startswith("("))
    print(f"compute ops ('kernels') per decoder layer: {kernels:.1f}")
    for name, n in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5.1f}  {name}")
    outside = sum(v for k, v in one.items() if not k.startswith("(")) - kernels
    print(f"compute ops outside the layers (embedding, rope tables, final norm; once per step): {outside:.0f}")


if __name__ == "__main__":
    main()
