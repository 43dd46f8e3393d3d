"""The streamed prefill's VRAM model: which chunk lengths it tries, how many slots of packed experts it keeps, and
the bytes of its buffers for a chunk (the plan counts them before anything loads; layerwise.py allocates them)."""

from __future__ import annotations

from hetmoe.cpu.layout import expert_bytes

# Prefill chunks tried for the layerwise GPU path, largest first: the first whose buffers fit is used.
GPU_PREFILL_CHUNKS = (32768, 16384, 8192, 4096, 2048, 1024)
BIG_CHUNK = 8192  # larger chunks cross the link fewer times per long prompt, at more VRAM
GPU_PREFILL_SLOTS = 2
UNPACK_EXPERTS = 16  # experts unpacked at once into the layer's weight scratch (bounds the temporaries)


# Slots of a group of experts (a budget too small for two whole layers): a group's copy should take long enough
# (>= MIN_GROUP_BYTES at the link's rate, ~1.4 ms) that its fixed costs (a few launches, an event wait) stay small;
# the ring takes as many slots as the room allows, up to a layer and one slot (copies may run a layer ahead, as two
# whole-layer slots do, which covers the next layer's attention).
MIN_GROUP_BYTES = 64 << 20
# A chunk's rows computed at once where a layer runs in groups: twice a group's even share of the T·k rows (routing
# is uneven; more rows than that go in several passes), at least MIN_ROWS.
ROW_SLACK, MIN_ROWS = 2, 2048
# The model's own activations per token of a chunk (hidden-width buffers in the model dtype), of which the plan's
# "activations" (sized for --prefill-chunk) hold a part: a longer GPU prefill chunk needs the rest beside them
DENSE_ACT_BUFFERS = 8


def min_group(num_experts: int, expert_nbytes: int) -> int:
    """The experts a slot should hold at least: MIN_GROUP_BYTES of them, rounded up to a power of two, at most E
    (a tight budget goes below it: ``group_sizes``)."""
    g = max(1, -(-MIN_GROUP_BYTES // max(expert_nbytes, 1)))
    return min(num_experts, 1 << (g - 1).bit_length())


def group_sizes(num_experts: int, expert_nbytes: int) -> list:
    """Experts per slot to try, preferred first: ``min_group``, then halves of it down to one expert."""
    g = min_group(num_experts, expert_nbytes)
    return [g >> j for j in range(g.bit_length())]


def group_rows(chunk: int, top_k: int, group: int, num_experts: int) -> int:
    """(token, expert) rows computed at once for chunks of ``chunk`` tokens with slots of ``group`` experts."""
    rows = chunk * top_k
    return min(rows, max(MIN_ROWS, -(-ROW_SLACK * rows * group // num_experts)))


def gpu_prefill_bytes(shapes, fmt: str, group: int, chunk: int, itemsize: int, ctx: int, experts: int = 0,
                      slots: int = GPU_PREFILL_SLOTS, planned_act: int = 0, torch_unpack: bool = False) -> dict:
    """VRAM of the layerwise GPU prefill for prefill chunks of ``chunk`` tokens (hetmoe/moe/streamed/layerwise.py):
    ``slots`` slots of packed experts (``experts`` each; 0: a whole layer), a slot's weights unpacked to the model
    dtype (``torch_unpack``, PyTorch ops unpacking where Triton is missing: + the temporaries of unpacking
    UNPACK_EXPERTS experts, one where a layer runs in groups; Triton's kernel writes straight into the weights and
    needs none), the activations of one MoE layer (in groups: a
    window of ``group_rows`` rows, the layer's fp32 sum and its sorted pairs; groups unpack one expert at a time
    where PyTorch ops unpack), the model's own activations for a chunk (DENSE_ACT_BUFFERS per token) beyond the
    ``planned_act`` bytes the plan's "activations" hold, and the attention mask of one chunk over a context of
    ``ctx`` positions (0: the paged kernels, no mask). ``shapes``: the plan's ModelShapes."""
    E = shapes.n_routed // max(shapes.n_moe_layers, 1)
    H, I, k = shapes.hidden, shapes.expert_inter, shapes.top_k
    G = E if not experts or experts >= E else experts
    weights = G * 3 * H * I * itemsize + torch_unpack * (UNPACK_EXPERTS if G == E else 1) * 3 * H * I * 8
    rows = chunk * k  # (token, expert) pairs
    if G == E:
        act = rows * (H * itemsize + 3 * I * itemsize + H * itemsize + H * 4 + 16) + chunk * H * 4
    else:
        window = group_rows(chunk, k, G, E)
        act = window * (2 * H * itemsize + 3 * I * itemsize + H * 4 + 16) + chunk * H * 4 + rows * 48
    act += max(0, chunk * DENSE_ACT_BUFFERS * H * itemsize - planned_act)
    mask = chunk * shapes.q_per_kv * ctx * itemsize
    return {"prefill slots": slots * G * expert_bytes(fmt, H, I, group), "prefill weights": weights,
            "prefill activations": act + mask}
