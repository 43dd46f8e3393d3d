"""The MoE layer: four named stages, each in its own file.

    route      router.py       RouterSpec: router logits -> each token's top-k expert ids and weights (softmax,
                               DeepSeek-V2 group-limited, DeepSeek-V3 sigmoid with bias), on the device or inside the
                               CPU job
    dispatch   dispatch.py     MoELayer, one flat object per layer: where each (token, slot) is computed: the CPU
                               engine (activations staged through pinned memory from a GPU model), the GPU-resident
                               experts, Expert Deferral's two parts (deferral.py), drop (accuracy studies);
               stream.py       the same inside a decode step, in CUDA stream order (capturable into a CUDA graph)
               layerwise.py    long prefill chunks on the GPU, each layer's packed experts streamed from RAM
                               (packed.py reads the CPU engine's layout with torch ops)
    experts    backends.py     the ExpertsBackend call: hetmoe.cpu.CPUExperts (csrc/), TorchExperts;
               gpu_experts.py  GpuExperts, a layer's GPU-resident experts (stored as resident_format.py says:
                               bf16 or int8/int4; decode kernels gpu_experts_triton.py, gpu_experts_triton_int.py)
    combine    combine.py      combine(): CPU part + GPU-resident part + previous layer's deferred part (fp32) ->
                               model dtype -> + shared experts, the one addition order of every path

A model's MoE block is ``self.moe(x, self.gate(x), shared=...)``: it builds a RouterSpec from its config and never
asks where its experts run. In a fused decode step it hands over ``RouterLogits`` instead of the logits, and the
dispatch computes them where they are needed.
"""

from hetmoe.moe.combine import combine
from hetmoe.moe.deferral import DeferralChain, drop_lowest, split_deferred
from hetmoe.moe.dispatch import HostStaging, MoELayer, defer_experts, moe_layers, set_deferrals
from hetmoe.moe.experts import ExpertsBackend, TorchExperts
from hetmoe.moe.gpu_resident.experts import GpuExperts
from hetmoe.moe.router import RouterLogits, RouterSpec, route_deepseek_v2, route_deepseek_v3, route_softmax
from hetmoe.moe.stream import StreamDecode
from hetmoe.moe.streamed import layerwise

__all__ = [
    "ExpertsBackend", "TorchExperts", "DeferralChain", "drop_lowest", "split_deferred", "HostStaging", "MoELayer",
    "combine", "defer_experts", "moe_layers", "set_deferrals", "GpuExperts", "RouterLogits", "RouterSpec",
    "route_deepseek_v2", "route_deepseek_v3", "route_softmax", "StreamDecode", "layerwise",
]
