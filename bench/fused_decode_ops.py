"""A CPU proxy for the GPU kernels of one decode step, fused decode path off and on (issue 27): torch.profiler over
one eager decode step of a tiny model of each architecture on CPU tensors, counting the ops that would launch a
kernel on a GPU: top-level aten ops that are not views (a cast, reshape or contiguous counts only when it copies),
and each Triton kernel (run by Triton's interpreter here) as one. The routed experts are a stub (on the GPU they are
the CPU engine's work; the MoE layer's own ops still count), attention runs the paged Triton decode kernel as on a
GPU with Triton. Run from the repo root (about a minute):

    TRITON_INTERPRET=1 python3 bench/fused_decode_ops.py [--arch=qwen3_moe,deepseek_v3,...] [--ops]

``--ops`` lists the counted ops of each variant's first layer-ish slice (the whole step's op names with counts).
"""

import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.load.random_weights import _config  # noqa: E402
from hetmoe.models import ModelConfig, model_class  # noqa: E402
from hetmoe.ops.triton import attention as triton_attention  # noqa: E402
from hetmoe.ops.triton import fused as triton_fused

VIEWS = {"aten::view", "aten::reshape", "aten::split", "aten::split_with_sizes", "aten::slice", "aten::expand",
         "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::t", "aten::as_strided", "aten::select",
         "aten::empty", "aten::empty_like", "aten::detach", "aten::alias", "aten::to", "aten::contiguous",
         "aten::flatten", "aten::view_as", "aten::chunk", "aten::narrow", "aten::permute", "aten::_unsafe_view",
         "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::empty_strided", "aten::unbind",
         "aten::type_as", "aten::numpy_T", "aten::expand_as", "aten::item", "aten::_local_scalar_dense"}
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2")


_patch = interp._patch_lang_tensor


def _index_patch(tensor, *rest):  # numpy >= 2.4 refuses int() of the interpreter's 1-element scalars (loop bounds)
    _patch(tensor, *rest)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])


interp._patch_lang_tensor = _index_patch


class StubExperts:
    """Routed experts that cost one op: on the GPU they are the CPU engine's work, not a kernel."""

    def __init__(self, n: int):
        self.num_experts = n

    def forward(self, x, topk_ids, topk_weights, out=None, **_):
        return torch.zeros_like(x, dtype=torch.float32)

    __call__ = forward


def traced(name, fn):
    def call(*a, **k):
        with record_function(f"triton::{name}"):
            return fn(*a, **k)
    return call


for mod, names in ((triton_fused, ("add_rms_norm", "qkv_epilogue", "mla_epilogue", "silu_mul")),
                   (triton_attention, ("decode",))):
    for name in names:
        setattr(mod, name, traced(name, getattr(mod, name)))


def kernels(events) -> collections.Counter:
    """Ops that would launch a kernel: top-level aten ops (views, and casts/reshapes that copy nothing, excluded)
    and Triton kernels."""
    counts = collections.Counter()
    for e in events:
        name = e.name
        if name.startswith("triton::"):
            counts[name] += 1
            continue
        if not name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not (p.name.startswith("aten::") or p.name.startswith("triton::")):
            p = p.cpu_parent
        if p is not None:
            continue  # inside an op already counted
        if name in VIEWS and not any(c.name not in VIEWS for c in _descendants(e)):
            continue
        counts[name] += 1
    return counts


def _descendants(e):
    for c in e.cpu_children:
        yield c
        yield from _descendants(c)


def measure(arch: str, show: bool, layers: int) -> dict:
    cfg = _config(arch, {"num_hidden_layers": layers}, 300).to_dict()
    torch.manual_seed(0)
    model = model_class(ModelConfig(cfg))(ModelConfig(cfg)).float().eval()
    for module in model.modules():
        if hasattr(module, "weight") and isinstance(module.weight, torch.nn.Parameter):
            with torch.no_grad():
                module.weight.normal_(0, 0.05) if module.weight.dim() > 1 else module.weight.fill_(1.0)
        if hasattr(module, "moe") and hasattr(module.moe, "attach"):
            module.moe.attach(StubExperts(module.moe.num_experts))
    model.fuse_projections()
    cache = model.make_cache(2, 64, torch.float32, "cpu", page_size=16, initial_tokens=64)
    cache.reserve(0, 20)
    with torch.inference_mode():
        model(torch.arange(3, 22).view(1, 19), Step(torch.arange(19).view(1, 19), torch.tensor([0]), kv_len=19),
              cache)
        out = {}
        for fused in (False, True):
            step = Step(torch.tensor([[19]]), torch.tensor([0]), kv_len=20, fused=fused)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model.logits(model(torch.tensor([[5]]), step, cache)[:, -1])
            counts = kernels(prof.events())
            out[fused] = sum(counts.values())
            if show:
                print(f"  {arch} fused={fused}: " + ", ".join(f"{k.split('::')[1]} {v}" for k, v in
                                                                  counts.most_common()))
    return out


if __name__ == "__main__":
    archs = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--arch=")), ARCHS)
    # ops per layer: the difference between a model of 4 and of 2 decoder layers (the tiny DeepSeek configs' first
    # layer is dense, the others MoE), so the step's own ops (embedding, RoPE table, final norm, lm_head) drop out
    print(f"{'architecture':<14} {'ops/step off':>12} {'ops/step on':>11} {'ops/layer off':>13} {'ops/layer on':>12}"
          "   (steps of 4 layers; per layer: 4 layers minus 2, halved)")
    for arch in archs:
        two, four = measure(arch, False, 2), measure(arch, "--ops" in sys.argv, 4)
        print(f"{arch:<14} {four[False]:>12} {four[True]:>11} {(four[False] - two[False]) / 2:>13.1f} "
              f"{(four[True] - two[True]) / 2:>12.1f}")
