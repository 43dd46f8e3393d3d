"""The streamed prefill's VRAM model: which chunk lengths it tries, how many slots of packed experts it keeps, and
the bytes of its buffers for a chunk (the plan counts them before anything loads; layerwise.py allocates them)."""

from __future__ import annotations

from hetmoe.cpu.layout import expert_bytes

# Prefill chunks tried for the layerwise GPU path, largest first: the first whose buffers fit is used.
GPU_PREFILL_CHUNKS = (32768, 16384, 8192, 4096, 2048, 1024)
BIG_CHUNK = 8192  # larger chunks cross the link fewer times per long prompt, at more VRAM
GPU_PREFILL_SLOTS = 2
UNPACK_EXPERTS = 16  # experts unpacked at once into the layer's weight scratch (bounds the temporaries)


def gpu_prefill_bytes(shapes, fmt: str, group: int, chunk: int, itemsize: int, ctx: int) -> dict:
    """VRAM of the layerwise GPU prefill for prefill chunks of ``chunk`` tokens (hetmoe/moe/streamed/layerwise.py): the
    slots of packed experts, one layer's weights unpacked to the model dtype (+ the temporaries of unpacking
    UNPACK_EXPERTS experts), and the activations of one MoE layer and the attention mask of one chunk over a
    context of ``ctx`` positions (0: the paged kernels, no mask). ``shapes``: the plan's ModelShapes."""
    E = shapes.n_routed // max(shapes.n_moe_layers, 1)
    H, I, k = shapes.hidden, shapes.expert_inter, shapes.top_k
    layer = E * expert_bytes(fmt, H, I, group)
    weights = E * 3 * H * I * itemsize + UNPACK_EXPERTS * 3 * H * I * 8
    rows = chunk * k  # (token, expert) pairs
    act = rows * (H * itemsize + 3 * I * itemsize + H * itemsize + H * 4 + 16) + chunk * H * 4
    mask = chunk * shapes.q_per_kv * ctx * itemsize
    return {"prefill slots": GPU_PREFILL_SLOTS * layer, "prefill weights": weights, "prefill activations": act + mask}
