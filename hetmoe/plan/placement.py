"""Where each part of a model lives, and whether it fits, decided before anything is loaded.

With a GPU: embeddings, attention, norms, routers, shared experts, dense MLPs, lm_head and the KV cache go to
the GPU; the routed experts stay in CPU DRAM, packed for the CPU expert engine. Without one (or with
``device="cpu"``) everything is on the CPU. ``plan_memory`` adds up the bytes of that placement from the
model's shapes alone; ``choose_plan`` resolves what the options leave to it (dense format, experts format,
context, GPU experts) within the RAM and VRAM budgets (``--cpu-memory``, ``--gpu-memory``; default: what is free,
less a margin) and refuses, with the plan's table, a plan that does not fit (``PlanError``, a MemoryError).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from hetmoe.config.options import (
    DEFAULT_GROUP,
    FORMATS,
    EngineOptions,
)
from hetmoe.config.units import gib
from hetmoe.cpu.layout import expert_bytes, layout_bytes
from hetmoe.moe.streamed.vram import (
    BIG_CHUNK,
    GPU_PREFILL_CHUNKS,
    GPU_PREFILL_SLOTS,
    gpu_prefill_bytes,
    group_rows,
    group_sizes,
)
from hetmoe.plan.lowbit import choose_mix
from hetmoe.plan.lowbit import describe as describe_mix
from hetmoe.plan.memory import LayerPlan, MemoryPlan, ModelShapes, PlanError
from hetmoe.plan.sysmem import free_ram, free_vram
from hetmoe.plan.vram_cap import CUDA_CONTEXT_BYTES, VramLimit, bind, measure

if TYPE_CHECKING:
    import torch

# torch and hetmoe.cpu (hetmoe._C) are imported where they are used, so that the command line can build its
# flags from EngineOptions' fields without them: ``hetmoe --help`` stays instant.

# Fraction of the currently free RAM / VRAM a plan may use (the rest: allocator slack, the OS, other processes).
# An explicit --cpu-memory / --gpu-memory is used whole.
HEADROOM = 0.92
CPU_RUNTIME_BYTES = 400 << 20  # the Python process, torch and the engine's scratch
DENSE_ORDER = ("bf16", "fp8", "int8", "int4")  # --dense-format auto on a GPU: the first that fits
# --dense-format auto with --max-context auto: the dense format is chosen for this many positions (or the model's
# limit, if less), then the context takes what is left: precision before context length.
DENSE_AUTO_CONTEXT = 4096
SMALL_DENSE = 1_000_000_000  # dense parameters up to which the CPU's auto dtype is fp32 (tests, the demo model)
# --dense-format auto on the CPU keeps the dtype's own weights when the dense bytes a decode token reads are within
# the CPU's caches (decode is bound by its per-step work then, not DRAM: the demo model decodes faster in fp32 than
# int8) or when packing would cut a token's bytes (dense + routed experts) by less than KEEP_DTYPE_GAIN; else it
# packs them in the dense format that reads least among those whose tolerance (hetmoe/config/formats.py) is within
# AUTO_DENSE_TOLERANCE: int8 (int4's ~1e-1 output error is for the user to ask for).
CACHED_DENSE_BYTES = 32 << 20
KEEP_DTYPE_GAIN = 0.10
AUTO_DENSE_TOLERANCE = 2e-2


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device "
                           f"(torch {torch.__version__}; use --device cpu)")
    return torch.device(device)


def layer_group(fmt: str, group: Optional[int]) -> int:
    """The scale group of ``fmt`` experts asked for as ``group``: None is the format's default, 0 per-row scales; bf16
    has no groups: 0 whatever was asked (it keys the expert cache)."""
    return 0 if fmt == "bf16" else DEFAULT_GROUP[fmt] if group is None else group


def plan_layers(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, fmt: str, itemsize: int,
                layers: Optional[list] = None, gpu_experts: Optional[int] = None) -> list:
    """The LayerPlan of every MoE layer: ``fmt`` and the options where ``layers`` (a ``rules.Placement`` each) don't;
    ``gpu_experts``: instead of --gpu-experts (its "auto" resolved; unresolved it counts as 0)."""
    n, H, I = shapes.n_moe_layers, shapes.hidden, shapes.expert_inter
    names = list(shapes.moe_names) or [f"moe layer {i}" for i in range(n)]
    if gpu_experts is None:
        gpu_experts = 0 if opts.gpu_experts == "auto" else opts.gpu_experts
    out = []
    for name, p in zip(names, layers if layers is not None else [None] * n):
        got = {k: getattr(p, k, None) for k in ("experts_format", "group_size", "gpu_experts", "defer_experts",
                                                "down_format")}
        own = shapes.layer_own(len(out)) if fmt == opts.experts_format else None
        if own is not None and got["experts_format"] is None and got["group_size"] is None:
            f, group = own  # the checkpoint's own exact layout for this layer
        else:
            f = got["experts_format"] or fmt
            group = layer_group(f, opts.group_size if got["group_size"] is None else got["group_size"])
        gpu = gpu_experts if got["gpu_experts"] is None else got["gpu_experts"]
        gpu = gpu if device.type == "cuda" else 0  # a CPU-only placement keeps every expert on the CPU
        defer = opts.defer_experts if got["defer_experts"] is None else got["defer_experts"]
        down = got["down_format"] if got["down_format"] not in (None, f) else None
        layout = shapes.layer_layout(len(out), f, group, down)
        ram = shapes.n_routed // n * layout_bytes(layout, H, I)
        gfmt = getattr(p, "gpu_experts_format", None) or opts.gpu_experts_format
        each, stored = resident_bytes(gfmt, f, group, H, I, itemsize, layout)
        out.append(LayerPlan(name, f, group, gpu, defer, ram, gpu * each, stored, each, down))
    return out


def resident_bytes(fmt: str, cpu_format: str, group: int, H: int, I: int, itemsize: int,
                   layout: Optional[dict] = None) -> tuple:
    """(bytes, format) of one GPU-resident expert of a layer whose CPU experts are ``cpu_format`` in ``group``
    (``layout``: as the loader builds them, ModelShapes.layer_layout), stored as ``fmt`` (--gpu-experts-format; auto:
    the CPU's): bf16 in the dtype, int8/int4 with fp32 scales (and an affine layout's fp32 mins)."""
    from hetmoe.moe.gpu_resident.format import expert_bytes as stored_bytes
    from hetmoe.moe.gpu_resident.format import planned_storage

    st = planned_storage(fmt, cpu_format, group, layout)
    return stored_bytes(st, H, I, itemsize), st.name


def dense_bytes(shapes: "ModelShapes", fmt: str, itemsize: int) -> int:
    """The dense weights with the linears a dense format packs (``shapes.dense_linears``) in ``fmt`` and every
    other dense parameter (embeddings, norms, routers, MLA's kv_b_proj, biases) in the dtype."""
    from hetmoe.config.formats import DENSE_FORMATS

    if fmt == "bf16":  # the dtype's own weights, unpacked
        return shapes.dense_params * itemsize
    packed = sum(n * k for n, k in shapes.dense_linears)
    return sum(DENSE_FORMATS[fmt].nbytes(n, k) for n, k in shapes.dense_linears) + (
        shapes.dense_params - packed) * itemsize


def dense_token_bytes(shapes: "ModelShapes", fmt: str, itemsize: int) -> int:
    """Bytes of dense weights one decode token reads with its linears in ``fmt``: all of them but the embedding (a
    one-row gather; counted when tied to lm_head, which reads it whole)."""
    embedding = shapes.vocab_size * shapes.hidden
    packed = sum(n * k for n, k in shapes.dense_linears)
    untied = shapes.dense_params - packed >= embedding  # the embedding is not one of the packed linears
    return dense_bytes(shapes, fmt, itemsize) - (embedding * itemsize if untied else 0)


def dense_name(fmt: str, dtype) -> str:
    """What a dense format is called in messages and labels: ``bf16`` is the dtype's own weights (fp32 for a small
    model on the CPU), so it is named by the dtype."""
    if fmt != "bf16" or dtype is None:
        return fmt
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(str(dtype), str(dtype).replace("torch.", ""))


def default_dense(shapes: "ModelShapes", device: torch.device, itemsize: Optional[int] = None,
                  expert_token_bytes: Optional[int] = None) -> tuple:
    """(format, why) of --dense-format auto before any budget. On a GPU bf16 (``choose_dense`` steps down from it
    when it does not fit). On the CPU, decided by the bytes a decode token reads (decode there is bound by them):
    the dtype's own weights ("bf16") when its dense bytes per token are within CACHED_DENSE_BYTES or packing would
    save less than KEEP_DTYPE_GAIN of a token's bytes (dense + ``expert_token_bytes`` of routed experts), else the
    packed format that reads least within AUTO_DENSE_TOLERANCE (int8). Without the shapes' linears and
    ``itemsize`` (the Transformers path) the rule is by size: the dtype up to SMALL_DENSE parameters, else int8."""
    from hetmoe.config.formats import DENSE_FORMATS

    if device.type == "cuda":
        return "bf16", "auto: the most precise; fits"
    if itemsize is None or not getattr(shapes, "dense_linears", ()):
        if shapes.dense_params <= SMALL_DENSE:
            return "bf16", f"auto: a small model ({shapes.dense_params / 1e9:.2f} G dense parameters) keeps its dtype"
        return "int8", "auto on the CPU: decode is bound by the DRAM bytes it reads"
    dtype = {4: "fp32", 2: "bf16"}.get(itemsize, f"{8 * itemsize}-bit")
    keep = dense_token_bytes(shapes, "bf16", itemsize)
    packed = min((f for f in DENSE_FORMATS.values() if "cpu" in f.devices and f.name != "bf16"
                  and f.tolerance <= AUTO_DENSE_TOLERANCE), key=lambda f: dense_token_bytes(shapes, f.name, itemsize))
    small = dense_token_bytes(shapes, packed.name, itemsize)
    experts = expert_token_bytes or 0
    mb = lambda n: f"{n / 1e6:,.0f} MB/token"  # noqa: E731
    if keep <= CACHED_DENSE_BYTES:
        return "bf16", f"auto: {dtype}, {mb(keep)} stays in the CPU's caches"
    if keep - small < KEEP_DTYPE_GAIN * (keep + experts):
        return "bf16", f"auto: {dtype}; {packed.name} would save {mb(keep - small)} of {mb(keep + experts)}"
    return packed.name, f"auto: with experts {mb(small + experts)}, in {dtype} {mb(keep + experts)}"


def plan_memory(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, fmt: str,
                layers: Optional[list] = None, max_context: Optional[int] = None, dense_format: Optional[str] = None,
                gpu_experts: Optional[int] = None) -> MemoryPlan:
    """Bytes of RAM and VRAM the placement of ``shapes`` under ``opts`` needs; ``layers``: the placement rules'
    settings of each MoE layer (``rules.apply_native``), None for none (``fmt`` and the options everywhere);
    ``max_context``, ``dense_format``, ``gpu_experts``: instead of the options' (or their auto's default)."""
    dtype = resolve_dtype(opts.dtype, device, shapes.dense_params)
    group = layer_group(fmt, opts.group_size)
    ctx = max_context or opts.max_context or shapes.context_limit or shapes.max_position_embeddings or 4096
    paged = kv_paged(opts, device)
    per_layer = plan_layers(shapes, opts, device, fmt, dtype.itemsize, layers, gpu_experts)
    experts = sum(lp.ram for lp in per_layer) or shapes.n_routed * expert_bytes(fmt, shapes.hidden,
                                                                                 shapes.expert_inter, group)
    if per_layer:  # the most common format and group name the plan (the expert cache keys each layer by its own)
        pairs = [(lp.experts_format, lp.group_size) for lp in per_layer]
        fmt, group = max(pairs, key=pairs.count)
    why = {}
    if dense_format is None and opts.dense_format != "auto":
        dense_format, why["dense weights"] = opts.dense_format, f"--dense-format {opts.dense_format}"
    elif dense_format is None:
        per_token = sum(shapes.top_k * shapes.layer_expert_bytes(i, lp.experts_format, lp.group_size, lp.down_format)
                        for i, lp in enumerate(per_layer))
        dense_format, why["dense weights"] = default_dense(shapes, device, dtype.itemsize, per_token)
    dense = dense_bytes(shapes, dense_format, dtype.itemsize)
    # paged: one full sequence (pages are taken as sequences grow); contiguous: every row's capacity grows together
    kv = shapes.kv_elems_per_token * (1 if paged else opts.max_batch) * ctx * dtype.itemsize
    states = shapes.state_bytes(dtype.itemsize) * opts.max_batch  # one per slot, paged or not
    tokens = opts.prefill_chunk * opts.max_batch
    act = tokens * (shapes.act_width * 4 + shapes.vocab_size * 4)  # a few hidden-width buffers + the last logits
    host_staging = 3 * tokens * shapes.hidden * 4
    plan = MemoryPlan(device, dtype, fmt, group, ctx, layers=per_layer, kv_paged=paged, dense_format=dense_format,
                      max_batch=opts.max_batch)
    plan.ram = {"routed experts": experts, "runtime": CPU_RUNTIME_BYTES + host_staging}
    if device.type == "cuda":
        plan.vram = {"dense weights": dense, "KV cache": kv, "activations": act, "CUDA context": CUDA_CONTEXT_BYTES}
        if states:
            plan.vram["recurrent states"] = states
        # --gpu-experts: N experts per MoE layer as stored there (they stay in RAM too, packed for the CPU)
        plan.vram["GPU experts"] = sum(lp.vram for lp in per_layer)
    else:
        plan.ram.update({"dense weights": dense, "KV cache": kv, "activations": act})
        if states:
            plan.ram["recurrent states"] = states
    plan.prefill_chunk = opts.prefill_chunk
    limit = shapes.context_limit or shapes.max_position_embeddings
    why.update({"KV cache": f"--max-context {ctx}" if opts.max_context else
                "auto: the model's limit" if ctx == limit else f"auto: the most that fits (the model's limit: {limit})",
                "recurrent states": "the linear-attention layers' states: a fixed size per sequence slot",
                "activations": f"prefill chunks of {opts.prefill_chunk} tokens x {opts.max_batch} "
                               f"sequence{'s' * (opts.max_batch > 1)}",
                "CUDA context": "the CUDA runtime and kernels", "runtime": "Python, torch, staging buffers",
                "routed experts": "the checkpoint's own codes, exactly" if shapes.expert_layouts and all(
                    h.own is not None for h in shapes.expert_layouts) else
                f"--experts-format {opts.experts_format}" if opts.experts_format != "auto" else
                "auto: the most precise that fits",
                "GPU experts": f"--gpu-experts {opts.gpu_experts}" if opts.gpu_experts != "auto" else "auto"})
    if layers is not None and any(getattr(p, "gpu_experts", None) is not None for p in layers):
        why["GPU experts"] = "placement rules, then " + why["GPU experts"]
    plan.why = why
    return plan


def add_gpu_prefill(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, vram_free: Optional[int] = None,
                    budget: Optional[int] = None) -> None:
    """With a GPU and --gpu-prefill not off: the layerwise prefill's buffers that fit beside the rest of the plan in
    the VRAM ``budget`` (default: HEADROOM x ``vram_free``) go into the plan (``fit_prefill``: whole layers, else
    slots of a group of experts). None fitting: auto goes without (the CPU computes every prefill), a token count
    given is refused (MemoryError with the breakdown)."""
    if plan.device.type != "cuda" or opts.gpu_prefill == "off" or not shapes.n_moe_layers:
        return
    if plan.layers and all(lp.gpu_experts >= shapes.n_routed // shapes.n_moe_layers for lp in plan.layers):
        plan.why["prefill slots"] = "none: every routed expert is resident (no layer to stream)"
        return
    total = HEADROOM * vram_free if budget is None else budget
    left = total - plan.vram_bytes
    fit = fit_prefill(plan, shapes, opts, left, total)
    if fit is not None:
        return take_prefill(plan, shapes, *fit)
    chunk = prefill_chunks(opts)[-1]
    need = prefill_need(plan, shapes, chunk, prefill_groups(plan, shapes)[-1])
    slot = need["prefill slots"] // GPU_PREFILL_SLOTS
    plan.why["prefill slots"] = (f"none: two slots of one expert ({gib(slot)} each) with their buffers for "
                                 f"chunks of {chunk} tokens need {gib(sum(need.values()))}, "
                                 f"{gib(max(0, int(left)))} left (the CPU prefills)")
    if opts.gpu_prefill != "auto":
        parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items())
        raise MemoryError(f"--gpu-prefill {opts.gpu_prefill}: its buffers do not fit the GPU beside the model "
                          f"(smallest chunk {chunk} tokens: {parts}; {gib(max(0, int(left)))} left of "
                          f"{gib(int(total))}). Use --gpu-prefill off, or a smaller --max-context.")


def prefill_chunks(opts: EngineOptions) -> list:
    return [c for c in GPU_PREFILL_CHUNKS if c >= opts.prefill_chunk] or [opts.prefill_chunk]


def _streamed_format(plan: MemoryPlan) -> tuple:
    """(format, group) the slots hold: the largest layer's (mixed formats under placement rules)."""
    big = max(plan.layers, key=lambda lp: lp.ram, default=None)
    return (big.experts_format, big.group_size) if big is not None else (plan.experts_format, plan.group_size)


def prefill_need(plan: MemoryPlan, shapes: "ModelShapes", chunk: int, experts: int = 0,
                 slots: int = GPU_PREFILL_SLOTS) -> dict:
    """The layerwise prefill's VRAM for ``chunk`` tokens beside ``plan`` with ``slots`` slots of ``experts`` experts
    each (0: whole layers); the slots hold any layer: sized for the largest (mixed formats under placement
    rules)."""
    fmt, group = _streamed_format(plan)
    return gpu_prefill_bytes(shapes, fmt, group, chunk, plan.dtype.itemsize, 0 if plan.kv_paged else plan.max_context,
                             experts, slots, plan.vram.get("activations", 0), torch_unpack=_torch_unpacks(plan))


def _torch_unpacks(plan: MemoryPlan) -> bool:
    """Whether the layerwise prefill of ``plan`` unpacks with PyTorch ops: only with a GPU on this machine and no
    Triton (a plan for a GPU elsewhere counts Triton, which torch's CUDA builds bring)."""
    import torch

    from hetmoe.ops.triton import packed

    return plan.device.type == "cuda" and torch.cuda.is_available() and not packed.available()


def prefill_groups(plan: MemoryPlan, shapes: "ModelShapes") -> list:
    """Experts per slot of the layerwise prefill to try for this plan's layers, preferred first
    (``vram.group_sizes``)."""
    fmt, group = _streamed_format(plan)
    E = shapes.n_routed // shapes.n_moe_layers
    return group_sizes(E, expert_bytes(fmt, shapes.hidden, shapes.expert_inter, group))


# At most this many groups a layer: each costs the host a few kernel launches, which must stay below its copy
MAX_UNITS = 128


def fit_prefill(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, left: float, total: float,
                whole: bool = True) -> Optional[tuple]:
    """The layerwise prefill's buffers that fit in ``left`` bytes -> (chunk, need, experts per slot, slots, rows) or
    None. Whole layers (two slots of a layer each: copies a layer ahead) with the largest chunk of
    GPU_PREFILL_CHUNKS (at least --prefill-chunk) whose buffers fit, above BIG_CHUNK only where they take at most an
    eighth of ``total`` (``whole``: try them). Else slots of a group of experts: the longest chunk whose activations
    fit beside two slots (each expert crosses PCIe once per chunk: the chunk matters most), with the largest group
    of ``vram.group_sizes`` that fits there (``min_group`` first, at most MAX_UNITS groups a layer), then as many
    slots as the room left holds, up to a layer and one (the copies run ahead into the next layer while it
    attends)."""
    E = shapes.n_routed // shapes.n_moe_layers
    for chunk in prefill_chunks(opts) if whole else ():
        need = prefill_need(plan, shapes, chunk)
        if chunk > BIG_CHUNK and sum(need.values()) > total / 8:  # not worth the resident experts it would displace
            continue
        if sum(need.values()) <= left:
            return chunk, need, 0, GPU_PREFILL_SLOTS, 0
    groups = [g for g in prefill_groups(plan, shapes) if g < E and E <= MAX_UNITS * g]
    for chunk, g in ((c, g) for c in prefill_chunks(opts) for g in groups):
        need = prefill_need(plan, shapes, chunk, g)
        if sum(need.values()) > left:
            continue
        slot = need["prefill slots"] // GPU_PREFILL_SLOTS
        slots = min(GPU_PREFILL_SLOTS + int((left - sum(need.values())) // slot), -(-E // g) + 1)
        return chunk, prefill_need(plan, shapes, chunk, g, slots), g, slots, group_rows(chunk, shapes.top_k, g, E)
    return None


def take_prefill(plan: MemoryPlan, shapes: "ModelShapes", chunk: int, need: dict, group: int, slots: int,
                 rows: int) -> None:
    """``fit_prefill``'s choice into the plan, the table's why column saying what it is and what it promises."""
    plan.vram.update(need)
    plan.prefill_chunk, plan.gpu_prefill = chunk, True
    plan.prefill_group, plan.prefill_slots, plan.prefill_rows = group, slots, rows
    E = shapes.n_routed // shapes.n_moe_layers
    rate = projected_prefill(plan, shapes)
    if not group:
        plan.why.update(dict.fromkeys(need, f"layerwise GPU prefill, chunks of {chunk} tokens"))
        plan.why["prefill slots"] += f"; {rate}"
        return
    slot = need["prefill slots"] // slots
    plan.why["prefill slots"] = (f"layerwise GPU prefill in groups: {slots} slots of {group} of {E} experts "
                                 f"({gib(slot)} each; two whole layers and a layer's weights do not fit); {rate}")
    plan.why["prefill weights"] = f"one slot's {group} experts unpacked to {str(plan.dtype).replace('torch.', '')}"
    plan.why["prefill activations"] = (f"chunks of {chunk} tokens, the longest whose activations fit (each expert "
                                       f"crosses PCIe once per chunk); {rows} expert rows at a time")


PROJECTED_PROMPT = 8192  # the prompt length the plan projects a prefill rate for


def projected_prefill(plan: MemoryPlan, shapes: "ModelShapes", tokens: int = PROJECTED_PROMPT) -> str:
    """The cost model's prefill rate for a prompt of ``tokens`` tokens with the plan's layerwise prefill (every
    streamed expert over PCIe once per chunk at the nominal LINK_BPS, against the GPU's compute) and on the CPU
    engine, as the plan's table says it."""
    E = shapes.n_routed // shapes.n_moe_layers
    chunk = min(plan.prefill_chunk, tokens)
    resident = min((lp.gpu_experts for lp in plan.layers), default=0)
    _, gpu = modelled_rates(plan, shapes, resident, chunk)
    _, cpu = modelled_rates(plan, shapes, resident, None)
    passes = -(-tokens // plan.prefill_chunk)
    streamed = sum(lp.ram * (E - min(lp.gpu_experts, E)) // E for lp in plan.layers) or \
        shapes.n_routed * expert_bytes(plan.experts_format, shapes.hidden, shapes.expert_inter, plan.group_size)
    bound = "PCIe-bound" if streamed / LINK_BPS >= chunk / gpu - 1e-12 else "GPU-bound"
    return (f"projected prefill of {tokens} tokens: {gpu:,.0f} tok/s ({bound}: {passes} x {streamed / 1e9:.1f} GB "
            f"of experts over PCIe at a nominal {LINK_BPS / 1e9:.0f} GB/s), {gpu / cpu:.1f}x the CPU engine's "
            f"{cpu:,.0f} tok/s")


def resolve_dtype(name: str, device: torch.device, dense_params: int) -> torch.dtype:
    """auto: bf16 on a GPU; on the CPU fp32 while the dense part is small (<= 1 G parameters), else bf16."""
    import torch

    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" or dense_params > SMALL_DENSE else torch.float32


def budgets(opts: EngineOptions, device: torch.device, gpu_here: bool = True,
            cap: Optional[VramLimit] = None) -> tuple:
    """({"RAM": (bytes, source, short source), "VRAM": ...}, notes): what a plan on ``device`` may use. --cpu-memory /
    --gpu-memory replace what is free (a plan for a smaller GPU on a bigger one), a note when more than is free;
    else HEADROOM x what is free. ``gpu_here`` False: planning for a GPU this machine does not have (hetmoe plan
    --device cuda): --gpu-memory is required. ``cap``: --gpu-memory's limit measured on the GPU here
    (vram_cap.measure); where it keeps more outside torch than the plan's CUDA context, the VRAM budget is less by
    the difference (a note says)."""
    notes, out = [], {}
    for name, asked, flag, device_type in (("RAM", opts.cpu_memory, "--cpu-memory", "cpu"),
                                           ("VRAM", opts.gpu_memory, "--gpu-memory", "cuda")):
        if device_type != device.type and device_type == "cuda":
            if asked is not None:
                notes.append(f"{flag} {gib(asked)} does not apply: the placement is CPU-only")
            continue
        if not gpu_here and device_type == "cuda":
            if asked is None:
                raise ValueError("planning for a GPU this machine does not have (--device cuda): give its memory "
                                 "with --gpu-memory SIZE, e.g. --gpu-memory 24GiB")
            out[name] = (asked, f"budget {gib(asked)} ({flag})", flag)
            continue
        free = free_ram() if device_type == "cpu" else free_vram(device)
        kind = "available" if device_type == "cpu" else "free"
        if asked is None:
            out[name] = (int(HEADROOM * free), f"{gib(free)} {kind}", f"{HEADROOM:.0%} of {gib(free)} {kind}")
            continue
        out[name] = (asked, f"budget {gib(asked)} ({flag})", flag)
        more = cap.reserve - CUDA_CONTEXT_BYTES if cap is not None and device_type == "cuda" else 0
        if more > 0:
            out[name] = (asked - more, f"budget {gib(asked - more)} ({flag} {gib(asked)} less {gib(more)} more "
                                       "outside torch than the plan's CUDA context)", f"{flag} less {gib(more)}")
            notes.append(f"{gib(cap.outside)} of the GPU is outside torch already: {flag} keeps {gib(cap.reserve)} "
                         f"of its {gib(asked)} for it, {gib(more)} more than the plan's CUDA context, and plans "
                         f"within {gib(asked - more)}")
        if asked > free:
            notes.append(f"{flag} {gib(asked)} is more than the {gib(free)} {kind} on this machine now: the plan may "
                         "not fit when it runs")
    return out, notes


def fp8_runs(device: torch.device, gpu_here: bool) -> str:
    """Why the GPU cannot run fp8 dense weights ("" when it can): it needs compute capability >= 8.9 and torch's
    scaled matmul. A GPU that is not here (hetmoe plan) is taken to be one that can."""
    import torch

    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no scaled matmul"
    if not gpu_here or not torch.cuda.is_available():  # (tests place on a "cuda" device they do not have)
        return ""
    cc = torch.cuda.get_device_capability(device)
    return "" if cc >= (8, 9) else f"compute capability {cc[0]}.{cc[1]} < 8.9"


def choose_dense(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, layers, vram: int,
                 gpu_here: bool) -> tuple:
    """(dense format, why): --dense-format as asked (refused where it does not run), or auto: on the CPU (None,
    None): ``plan_memory`` applies ``default_dense`` for each experts format it plans; on a GPU the most precise of
    DENSE_ORDER whose plan (dense, KV cache for the asked context or DENSE_AUTO_CONTEXT, activations, asked GPU
    experts and --gpu-prefill N's smallest buffers) fits ``vram``."""
    from hetmoe.config.formats import dense_format

    where = "cuda" if device.type == "cuda" else "cpu"
    if opts.dense_format != "auto":
        dense_format(opts.dense_format, where)  # ValueError: fp8 on the CPU
        if opts.dense_format == "fp8" and (why := fp8_runs(device, gpu_here)):
            raise ValueError(f"--dense-format fp8: this GPU cannot run it ({why}); use int8 or int4")
        return opts.dense_format, f"--dense-format {opts.dense_format}"
    if where == "cpu":  # by the bytes a token reads, which depend on the experts format: plan_memory decides
        return None, None
    if not shapes.dense_linears:  # (nothing to pack: every format is the dtype's bytes)
        return default_dense(shapes, device)
    limit = shapes.context_limit or shapes.max_position_embeddings or DENSE_AUTO_CONTEXT
    ctx = opts.max_context or min(limit, DENSE_AUTO_CONTEXT)
    tried, skipped = [], []
    for name in DENSE_ORDER:
        if name == "fp8" and (why := fp8_runs(device, gpu_here)):
            skipped.append(f"fp8 does not run here ({why})")
            continue
        plan = plan_memory(shapes, opts, device, "int4", layers, max_context=ctx, dense_format=name)
        need = plan.vram_bytes
        if isinstance(opts.gpu_prefill, int) and shapes.n_moe_layers:
            need += sum(prefill_need(plan, shapes, prefill_chunks(opts)[-1]).values())
        if need <= vram:
            break
        tried.append(f"{name} {gib(need)}")
    why = f"VRAM with {', '.join(tried)} > {gib(vram)}" if tried else "the most precise; fits"
    return name, "; ".join([f"auto: {why}"] + skipped)


def choose_plan(shapes: "ModelShapes", opts: EngineOptions, layers: Optional[list] = None,
                device: Optional[torch.device] = None) -> MemoryPlan:
    """Resolve device, dense format, experts format (auto: for the MoE layers ``layers``, the rules, leave to it),
    context and --gpu-experts auto within the budgets; refuse a plan that cannot fit (PlanError, a MemoryError,
    with the table) or a --max-context beyond the model's positions (ValueError). ``device``: plan for it instead
    of --device, without asking whether this machine has it (hetmoe plan; a GPU then needs --gpu-memory)."""
    check_context(shapes, opts)
    gpu_here = device is None
    device = resolve_device(opts.device) if device is None else device
    # --gpu-memory on a GPU here: torch's allocator is limited to it (vram_cap.py), measured before the first CUDA call
    cap = measure(device, opts.gpu_memory) if gpu_here and device.type == "cuda" and opts.gpu_memory else None
    limits, notes = budgets(opts, device, gpu_here, cap)
    (ram, ram_src, _), (vram, vram_src, _) = limits["RAM"], limits.get("VRAM", (0, "", ""))
    dense, dense_why = choose_dense(shapes, opts, device, layers, vram, gpu_here)
    if opts.experts_format == "auto":
        plans = [plan_memory(shapes, opts, device, f, layers, dense_format=dense) for f in FORMATS]
        fitting = [p for p in plans if p.ram_bytes <= ram]
        plan = fitting[0] if fitting else plans[-1]
        tried = [f"{p.experts_format} {gib(p.ram_bytes)}" for p in plans[:plans.index(plan)]]
        if not fitting and shapes.n_moe_layers and low_bits_apply(shapes, opts, device, layers, dense, ram):
            # int4 does not fit even at a short context: int3 / int2 per layer and projection (precision before
            # context, as the dense format: DENSE_AUTO_CONTEXT)
            short = min(DENSE_AUTO_CONTEXT, plan.max_context) if opts.max_context is None else None
            layers, plan = choose_mix(shapes, layers, ram, lambda ls: plan_memory(
                shapes, opts, device, "int4", ls, max_context=short, dense_format=dense), ram_src)
            plan = plan_memory(shapes, opts, device, "int4", layers, dense_format=dense)
            tried.append(f"int4 {gib(plans[-1].ram_bytes)}")
            plan.why["routed experts"] = (f"auto: RAM with {', '.join(tried)} > {gib(ram)}; "
                                          f"{describe_mix(plan)}")
        elif tried:
            plan.why["routed experts"] = f"auto: RAM with {', '.join(tried)} > {gib(ram)}"
    else:
        plan = plan_memory(shapes, opts, device, opts.experts_format, layers, dense_format=dense)
    if dense_why is not None:
        plan.why["dense weights"] = dense_why
    plan.budgets, plan.notes = limits, notes + plan.notes
    if opts.max_context is None:
        plan = fit_context(plan, shapes, opts, layers, ram, vram)
    problems = []
    if plan.ram_bytes > ram:
        problems.append(f"RAM: needs {gib(plan.ram_bytes)}, {ram_src}")
    if device.type == "cuda" and plan.vram_bytes > vram:
        problems.append(f"GPU memory: needs {gib(plan.vram_bytes)}, {vram_src}")
        if plan.vram["dense weights"] > vram:
            problems.append(f"the dense weights alone ({plan.dense_format}) need {gib(plan.vram['dense weights'])}")
    if not problems and device.type == "cuda" and opts.gpu_experts == "auto" and plan.layers:
        spend_vram(plan, shapes, opts, layers, vram)
    elif not problems:
        add_gpu_prefill(plan, shapes, opts, budget=vram)
        fill_gpu_experts(plan, shapes, opts, layers, vram)
    if not problems and device.type == "cuda":
        add_resident_prefill(plan, shapes, opts, vram)
        if plan.vram_bytes > vram:
            problems.append(f"GPU memory: needs {gib(plan.vram_bytes)} with the resident experts' prefill scratch "
                            f"({gib(plan.vram['resident prefill'])}), {vram_src}")
    if problems:
        ram_short, gpu_short = plan.ram_bytes > ram, device.type == "cuda" and plan.vram_bytes > vram
        hints = ["--experts-format int4"] * (ram_short and plan.experts_format != "int4")
        hints += ["--dense-format int4"] * (gpu_short and plan.dense_format != "int4")
        hints += ["a smaller --max-context"] * (gpu_short or (ram_short and device.type == "cpu"))
        hints += ["fewer --gpu-experts"] * bool(gpu_short and plan.vram.get("GPU experts"))
        hint = f"Try {' or '.join(hints)}." if hints else "It needs a machine with more memory."
        raise PlanError(
            f"the model does not fit this machine with {plan.experts_format} experts on {device.type} "
            f"({'; '.join(problems)}). Plan: {plan.describe()}. {hint}\n" + "\n".join(plan.table()), plan)
    if cap is not None:  # binding from now on, while the plan (the model holding it) is alive
        plan.vram_limit = cap
        plan.notes.append(cap.describe())
        bind(plan, cap)
    return plan


def low_bits_apply(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, layers, dense: str,
                   ram: int) -> bool:
    """Whether --experts-format auto steps below int4: int4 experts with a float checkpoint's weights (a GGUF
    file's own types are chosen by the file), no --group-size asked for, and the int4 plan over the RAM budget
    even at the short context auto keeps precision for."""
    # a quantized file (GGUF) hands its layers' layouts: its own codes, never below them; an FP8 checkpoint's fp8 ones
    # are floats here
    if any(set(held.layouts) != {"fp8"} for held in shapes.expert_layouts) or opts.group_size is not None:
        return False
    short = min(DENSE_AUTO_CONTEXT, opts.max_context or shapes.context_limit or shapes.max_position_embeddings
                or DENSE_AUTO_CONTEXT)
    return plan_memory(shapes, opts, device, "int4", layers, max_context=short, dense_format=dense).ram_bytes > ram


def resident_prefill_bytes(shapes: "ModelShapes", n: int, chunk: int, itemsize: int) -> tuple:
    """(weights, activations): VRAM of the resident experts' prefill (hetmoe/moe/gpu_resident/experts.py, grouped
    GEMMs in hetmoe/moe/grouped.py) with ``n`` resident experts per layer and chunks of ``chunk`` tokens, where the
    layerwise prefill's buffers are not in the plan (its weight scratch holds a whole layer and is shared): the
    model-dtype weights of n experts, and per (token, slot) row x, gate|up, h and y in the dtype, y's fp32 sum."""
    H, I, k = shapes.hidden, shapes.expert_inter, shapes.top_k
    if not n:
        return 0, 0
    return n * 3 * H * I * itemsize, chunk * k * (2 * H + 3 * I) * itemsize + chunk * (H * 4 + k * 24)


def add_resident_prefill(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, vram: int) -> None:
    """The resident experts' prefill buffers into the plan (``resident_prefill_bytes``): none with the layerwise
    prefill's (shared) or no resident expert. Where every routed expert is resident, every prefill runs on them:
    the longest chunk (``prefill_chunks``, the layerwise prefill's rule for chunks above BIG_CHUNK) whose
    activations fit the ``vram`` budget, since each chunk unpacks every layer's routed experts once."""
    n = max((lp.gpu_experts for lp in plan.layers), default=0)
    if plan.device.type != "cuda" or plan.gpu_prefill or not n:
        return
    itemsize, chunk = plan.dtype.itemsize, plan.prefill_chunk
    if all(lp.gpu_experts >= shapes.n_routed // max(shapes.n_moe_layers, 1) for lp in plan.layers):
        weights = resident_prefill_bytes(shapes, n, chunk, itemsize)[0]
        ctx = 0 if plan.kv_paged else plan.max_context
        for c in prefill_chunks(opts):  # longest first
            act = gpu_prefill_bytes(shapes, plan.experts_format, plan.group_size, c, itemsize, ctx,
                                    planned_act=plan.vram.get("activations", 0))["prefill activations"]
            if c > BIG_CHUNK and weights + act > vram / 8:
                continue
            if plan.vram_bytes + weights + act <= vram:
                plan.prefill_chunk = chunk = c
                plan.vram["resident prefill"] = weights + act
                break
    if "resident prefill" not in plan.vram:
        weights, act = resident_prefill_bytes(shapes, n, chunk, itemsize)
        plan.vram["resident prefill"] = weights + act
    plan.why["resident prefill"] = (f"prefill of the resident experts: {n} experts' weights in the model dtype, one "
                                    f"layer at a time; chunks of {chunk} tokens")


def fill_gpu_experts(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, layers, vram: int) -> None:
    """--gpu-experts auto: the same count N of routed experts on the GPU in every MoE layer the rules leave it to,
    the most that fit in the VRAM the rest of the plan leaves (at most the experts per layer)."""
    if opts.gpu_experts != "auto" or not plan.layers:
        return
    if plan.device.type != "cuda":
        plan.why["GPU experts"] = "auto: none (the placement is CPU-only)"
        return
    E = shapes.n_routed // shapes.n_moe_layers
    free = [lp for lp, p in zip(plan.layers, layers or [None] * len(plan.layers))
            if getattr(p, "gpu_experts", None) is None]
    left = max(0, vram - plan.vram_bytes)
    # each layer's experts at their stored bytes (int4: ~3.5x as many per GiB as bf16); without the layerwise
    # prefill's buffers, each also widens the resident prefill's weight scratch by one expert in the model dtype
    scratch, act = resident_prefill_bytes(shapes, 1, plan.prefill_chunk, plan.dtype.itemsize)
    if plan.gpu_prefill:
        scratch = act = 0
    n = min(E, max(0, left - act) // (sum(lp.gpu_expert_bytes for lp in free) + scratch)) if free else 0
    for lp in free:
        lp.gpu_experts, lp.vram = n, n * lp.gpu_expert_bytes
    plan.vram["GPU experts"] = sum(lp.vram for lp in plan.layers)
    plan.why["GPU experts"] = (f"auto: {n} of {E} per layer" + (" (all)" if n == E else
                                                                 f" fill the {gib(left)} left"))


# --gpu-experts auto keeps this much VRAM unplanned beside resident experts (allocator slack, fragmentation)
RESIDENT_MARGIN = 256 << 20
# The planner's cost model (``modelled_rates``): nominal rates of a PCIe gen5 host with an H100-class GPU
# (rounded down from peak to what the kernels reach). Only their ratios matter to the choice: what VRAM buys as
# resident experts against what it buys as layerwise prefill buffers.
HBM_BPS = 2.0e12  # bytes/s a decode step reads from GPU memory
CPU_DRAM_BPS = 120e9  # bytes/s the CPU engine reads its experts at in decode
LINK_BPS = 45e9  # pinned host-to-device copies (the layerwise prefill's slots)
GPU_FLOPS = 400e12  # prefill matmuls on the GPU
CPU_FLOPS = 4e12  # prefill expert matmuls on the CPU engine (AMX-class)


def modelled_rates(plan: MemoryPlan, shapes: "ModelShapes", resident: int, chunk: Optional[int]) -> tuple:
    """(decode tok/s, long-prompt prefill tok/s) the cost model gives ``plan`` with ``resident`` routed experts of
    every MoE layer on the GPU and the layerwise prefill at chunks of ``chunk`` tokens (None: without it). Decode:
    the GPU reads the dense weights and the resident share of each token's k experts, the CPU the rest (in series).
    Prefill: the GPU computes the dense part and the resident share; the CPU computes the rest, or, with the
    layerwise prefill, every layer not all resident crosses the link once per chunk, overlapped with the GPU."""
    E = shapes.n_routed // shapes.n_moe_layers
    k, f = shapes.top_k, min(resident, E) / E
    cpu_bytes = sum(lp.ram for lp in plan.layers) / E  # one expert of every layer, packed for the CPU
    gpu_bytes = sum(lp.gpu_expert_bytes for lp in plan.layers)
    itemsize = plan.dtype.itemsize
    decode = (dense_token_bytes(shapes, plan.dense_format, itemsize) + k * f * gpu_bytes) / HBM_BPS \
        + k * (1 - f) * cpu_bytes / CPU_DRAM_BPS
    expert_flops = 2 * 3 * shapes.hidden * shapes.expert_inter * k * shapes.n_moe_layers  # per token
    gpu = (2 * shapes.dense_params + expert_flops * (1 if chunk else f)) / GPU_FLOPS
    if chunk and resident < E:
        prefill = max(gpu, E * cpu_bytes / chunk / LINK_BPS)
    else:
        prefill = gpu + expert_flops * (1 - f) / CPU_FLOPS
    return 1 / decode, 1 / prefill


def spend_vram(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, layers, vram: int) -> None:
    """--gpu-experts auto on a GPU: spend the VRAM the rest of the plan leaves by value. Every routed expert
    resident when they all fit (less RESIDENT_MARGIN), with no layerwise prefill buffers (no layer is left to
    stream); else each candidate -- no layerwise prefill, or each of its chunks whose buffers fit -- with the
    most resident experts per layer that fit beside it, and the candidate of the highest value: the geometric mean
    of the decode and long-prompt prefill rates of the cost model (``modelled_rates``). --gpu-prefill N must
    have its buffers: only the chunks are compared then; --gpu-prefill off: experts only. The table says why."""
    E = shapes.n_routed // shapes.n_moe_layers
    free = [lp for lp, p in zip(plan.layers, layers or [None] * len(plan.layers))
            if getattr(p, "gpu_experts", None) is None]
    if not free:  # the rules place every layer: --gpu-experts auto has nothing to choose
        add_gpu_prefill(plan, shapes, opts, budget=vram)
        fill_gpu_experts(plan, shapes, opts, layers, vram)
        return
    per = sum(lp.gpu_expert_bytes for lp in free)  # one more resident expert in every free layer
    left = max(0, vram - plan.vram_bytes - RESIDENT_MARGIN)
    fixed_resident = all(lp.gpu_experts >= E for lp, p in zip(plan.layers, layers or [None] * len(plan.layers))
                         if getattr(p, "gpu_experts", None) is not None)
    # without the layerwise prefill's buffers, the resident prefill's scratch: one more expert per resident one
    scratch, act = resident_prefill_bytes(shapes, 1, plan.prefill_chunk, plan.dtype.itemsize)

    def resident(room: float, own_scratch: bool = False) -> int:
        if own_scratch:
            return int(min(E, max(0, room - act) // (per + scratch)))
        return int(min(E, max(0, room) // per))

    def choose(n: int, chunk: Optional[int], need: dict, why: str) -> None:
        for lp in free:
            lp.gpu_experts, lp.vram = n, n * lp.gpu_expert_bytes
        plan.vram["GPU experts"] = sum(lp.vram for lp in plan.layers)
        if chunk:
            take_prefill(plan, shapes, *layouts[chunk])
        plan.why["GPU experts"] = why

    if E * (per + scratch) + act <= left and fixed_resident and not isinstance(opts.gpu_prefill, int):
        choose(E, None, {}, f"auto: {E} of {E} per layer (all): the whole model fits "
                            f"({gib(E * per)} of {gib(left)} left)")
        plan.why["prefill slots"] = "none: every routed expert is resident (no layer to stream)"
        return
    if opts.gpu_prefill == "off":
        n = resident(left, True)
        return choose(n, None, {}, f"auto: {n} of {E} per layer fill the {gib(left)} left (--gpu-prefill off)")
    options = [] if isinstance(opts.gpu_prefill, int) else [(resident(left, True), None, {})]
    layouts = {}  # chunk -> fit_prefill's (chunk, need, group, slots, rows)
    for chunk in prefill_chunks(opts):
        need = prefill_need(plan, shapes, chunk)
        if chunk > BIG_CHUNK and sum(need.values()) > vram / 8:  # a chunk that large is not worth its VRAM
            continue
        if sum(need.values()) <= left:
            options.append((resident(left - sum(need.values())), chunk, need))
            layouts[chunk] = (chunk, need, 0, GPU_PREFILL_SLOTS, 0)
    if not layouts:  # no room for whole layers: slots of a group of experts, with no resident expert beside them
        fit = fit_prefill(plan, shapes, opts, left, vram, whole=False)
        if fit is not None:
            options.append((0, fit[0], fit[1]))
            layouts[fit[0]] = fit
    if not options:  # --gpu-prefill N whose buffers do not fit: refused as add_gpu_prefill refuses
        add_gpu_prefill(plan, shapes, opts, budget=vram)
        return
    scored = []
    for n, chunk, need in options:
        dec, pre = modelled_rates(plan, shapes, n, chunk)
        scored.append(((dec * pre) ** 0.5, n, chunk, need, dec, pre))
    best = max(scored, key=lambda s: s[0])
    _, n, chunk, need, dec, pre = best

    def said(s) -> str:
        where = f"prefill chunks of {s[2]} on the GPU" if s[2] else "no GPU prefill buffers"
        return f"{s[1]}/{E} resident with {where}: decode {s[4]:,.0f}, prefill {s[5]:,.0f} tok/s"

    # the runner-up: the best candidate of the other kind (buffers or none), else the next chunk
    rest = sorted((s for s in scored if s is not best), key=lambda s: (bool(s[2]) == bool(best[2]), -s[0]))
    others = [said(s) for s in rest[:1]]
    reason = f"auto: {n} of {E} per layer" + (" (all)" if n == E else "") + f" by modelled value ({said(best)}"
    reason += f"; over {'; '.join(others)})" if others else ")"
    choose(n, chunk, need, reason)
    if not chunk:
        plan.why["prefill slots"] = ("none: resident experts are worth more than the layerwise prefill's buffers "
                                     "(see GPU experts)" if others else
                                     "none: the smallest chunk's buffers do not fit (the CPU prefills)")


def kv_paged(opts: EngineOptions, device: torch.device) -> bool:
    """Whether the runner's KV cache will be paged (layers/kv_cache.py): a GPU with the Triton kernels."""
    from hetmoe.layers.attention import paged_kernels

    paged = opts.attention != "sdpa" and paged_kernels(device)
    if opts.attention == "triton" and not paged:
        raise RuntimeError("--attention triton needs a CUDA device and the triton package")
    return paged


def fit_context(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, layers, ram: int,
                vram: int) -> MemoryPlan:
    """--max-context auto: the model's limit if the plan fits the ``ram`` / ``vram`` budgets, else the largest
    fitting multiple of 1024 (a note says)."""
    per_pos = {k: v / plan.max_context for k, v in (("ram", plan.ram.get("KV cache", 0)),
                                                    ("vram", plan.vram.get("KV cache", 0)))}
    room = [(ram - plan.ram_bytes, per_pos["ram"]), (vram - plan.vram_bytes, per_pos["vram"])]
    short = [(-left, each) for left, each in room if each and left < 0]
    if not short:
        return plan
    ctx = min(plan.max_context - int(over / each) - 1 for over, each in short) // 1024 * 1024
    if ctx < 1024:
        return plan
    fmt = plan.experts_format if opts.experts_format == "auto" else opts.experts_format  # (GGUF: layers differ)
    fitted = plan_memory(shapes, opts, plan.device, fmt, layers, max_context=ctx, dense_format=plan.dense_format)
    fitted.why = {**fitted.why, **{k: v for k, v in plan.why.items() if k != "KV cache"}}
    fitted.budgets, fitted.notes = plan.budgets, list(plan.notes)
    rows = 1 if plan.kv_paged else opts.max_batch
    kv = fitted.vram.get("KV cache") or fitted.ram["KV cache"]
    fitted.notes.append(f"the context is {ctx} positions, not the model's {plan.max_context}: a KV cache of {rows} "
                        f"full sequence{'s' * (rows > 1)} at that length ({gib(kv)}) is what fits beside the rest of "
                        "the plan (--max-context chooses)")
    return fitted


def check_context(shapes: "ModelShapes", opts: EngineOptions) -> None:
    limit = shapes.context_limit or shapes.max_position_embeddings
    if opts.max_context is not None and limit and opts.max_context > limit:
        why = shapes.context_why or f"max_position_embeddings {limit}"
        raise ValueError(f"--max-context {opts.max_context} is beyond the {limit} positions this model was trained "
                         f"for ({why} in config.json); use --max-context {limit} or less")


def normalize_options(opts: EngineOptions, log=None) -> EngineOptions:
    """``opts`` with what this machine cannot honour brought within it, each said once through ``log``: more
    --threads than the physical cores this process may run on are capped to them (extra threads only contend
    for the same cores). Returns ``opts`` itself when nothing changes."""
    from hetmoe.cpu import default_threads

    cores = default_threads()
    if opts.threads is not None and opts.threads > cores:
        if log is not None:
            log(f"hetmoe: --threads {opts.threads} is more than the {cores} physical cores this process may use; "
                f"using {cores}")
        return replace(opts, threads=cores)
    return opts
