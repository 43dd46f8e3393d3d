"""The MoE layer: route -> dispatch -> experts -> combine, each stage in its own file.

    route      router.py        RouterSpec: router logits -> each token's top-k expert ids and weights (softmax,
                                DeepSeek-V2 group-limited, DeepSeek-V3 sigmoid with bias), on the device or inside
                                the CPU job
    dispatch   dispatch.py      MoELayer, one flat object per layer: where each (token, slot) is computed: the CPU
                                engine (activations staged through pinned memory from a GPU model), the GPU-resident
                                experts, Expert Deferral's two parts (deferral.py), drop (accuracy studies);
               stream.py        the same inside a decode step, in CUDA stream order (capturable into a CUDA graph)
    experts    experts.py       the ExpertsBackend call: hetmoe.cpu.CPUExperts (csrc/), TorchExperts; the experts' gated
                                activation (hetmoe.cpu.Glu: SwiGLU, or gpt-oss's clamped SwiGLU) and biases
    combine    combine.py       combine(): CPU part + GPU-resident part + previous layer's deferred part (fp32) ->
                                model dtype -> + shared experts, the one addition order of every path

Below them, two sub-packages that own their VRAM:
    gpu_resident/   a layer's GPU-resident experts (--gpu-experts): GpuExperts (experts.py), stored as format.py
                    says (bf16 or int8/int4; kernels: hetmoe/ops/triton/experts.py)
    streamed/       long prefill chunks on the GPU, each layer's packed experts streamed from RAM (layerwise.py;
                    copy.py, packed.py; the CPU's share: cpu_share.py; when: choice.py; its VRAM: vram.py)

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
