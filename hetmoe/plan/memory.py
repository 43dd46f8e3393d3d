"""The memory plan's data: what a model needs to be placed (``ModelShapes``), where each part goes and its bytes
(``MemoryPlan``, ``LayerPlan`` per MoE layer), and the plan as a table (``MemoryPlan.table``): one row per part
with its device, bytes and why, then each budget's total. hetmoe/plan/placement.py makes the plans.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from hetmoe.config.options import LOW_BIT_FORMATS
from hetmoe.config.units import gib, wrap
from hetmoe.cpu.layout import FP8_LAYOUTS, layout_bytes

if TYPE_CHECKING:
    import torch


class PlanError(MemoryError):
    """A plan that does not fit its budgets; ``plan``: the plan (its ``table()`` is in the message)."""

    def __init__(self, message: str, plan: "MemoryPlan"):
        super().__init__(message)
        self.plan = plan



@dataclass
class LayerPlan:
    """One MoE layer's routed experts: packed for the CPU engine, ``gpu_experts`` of them also on the GPU (all: the
    rules' ``device: cuda``) stored as ``gpu_format`` (hetmoe/moe/gpu_resident/format.py), ``defer_experts`` deferred
    per token; ``ram`` / ``vram``: the bytes they take."""

    name: str
    experts_format: str
    group_size: int
    gpu_experts: int
    defer_experts: int
    ram: int
    vram: int
    gpu_format: str = "bf16"  # resident_format.Storage.name: bf16, int8, int4
    gpu_expert_bytes: int = 0  # one resident expert, as stored
    down_format: Optional[str] = None  # down_proj's own format where it differs (hetmoe/plan/lowbit.py's mixes)

    @property
    def formats(self) -> str:
        """The format as the plan prints it: ``int4`` or, gate/up and down differing, ``int3/int4``."""
        down = self.down_format or self.experts_format
        return self.experts_format if down == self.experts_format else f"{self.experts_format}/{down}"


@dataclass
class MemoryPlan:
    device: torch.device
    dtype: torch.dtype
    experts_format: str
    group_size: int
    max_context: int
    ram: dict = field(default_factory=dict)  # part -> bytes
    vram: dict = field(default_factory=dict)
    prefill_chunk: int = 1024  # prompt tokens per forward call
    gpu_prefill: bool = False  # the layerwise GPU prefill's buffers are in the plan (for prefill_chunk tokens)
    prefill_group: int = 0  # experts per slot of the layerwise prefill (0: whole layers)
    prefill_slots: int = 2  # its ring of slots
    prefill_rows: int = 0  # (token, expert) rows it computes at once in a layer of several groups (0: all)
    layers: list = field(default_factory=list)  # LayerPlan of every MoE layer, in forward order
    kv_paged: bool = False  # the KV cache is paged (layers/kv_cache.py): "KV cache" holds one full sequence
    notes: list = field(default_factory=list)  # what the plan chose that the user did not ask for, said at load
    dense_format: str = "bf16"  # of the dense linears (hetmoe/load/dense.py), resolved: a DENSE_FORMATS key
    max_batch: int = 1  # KV cache rows (sequences)
    why: dict = field(default_factory=dict)  # part -> why it is there at that size (the table's last column)
    budgets: dict = field(default_factory=dict)  # "RAM" / "VRAM" -> (bytes it may use, their source: message, table)
    vram_limit: Optional[object] = None  # vram_cap.VramLimit: torch's allocator limit this plan holds (--gpu-memory)

    @property
    def ram_bytes(self) -> int:
        return sum(self.ram.values())

    @property
    def vram_bytes(self) -> int:
        return sum(self.vram.values())

    def describe(self) -> str:
        def parts(d):
            return ", ".join(f"{k} {gib(v)}" for k, v in d.items() if v)

        text = f"RAM {gib(self.ram_bytes)} ({parts(self.ram)})"
        if self.device.type == "cuda":
            text += f"; VRAM {gib(self.vram_bytes)} ({parts(self.vram)})"
        return text

    def summary_lines(self, width: int = 100) -> list:
        """The plan's memory as log lines of at most ``width`` columns: one "RAM total: part size, ..." group
        (then VRAM), wrapped."""
        groups = [("RAM", self.ram)] + ([("VRAM", self.vram)] if self.device.type == "cuda" else [])
        lines = []
        for name, d in groups:
            items = [f"{k} {gib(v)}" for k, v in d.items() if v]
            lines += wrap(f"hetmoe:   {name} {gib(sum(d.values()))}:", items, width)
        return lines

    def table(self, width: int = 100) -> list:
        """The plan as lines of at most ``width`` columns: one row per part (where, bytes, why), then each
        budget's total (``plan_table`` below)."""
        return plan_table(self, width)


@dataclass
class ModelShapes:
    """What the memory plan needs to know about a model, read from its (meta-device) modules."""

    hidden: int
    vocab_size: int
    n_routed: int  # routed experts over all MoE layers
    expert_inter: int
    dense_params: int  # everything else
    kv_elems_per_token: int  # all layers, K and V
    act_width: int
    max_position_embeddings: Optional[int]
    n_moe_layers: int = 0  # blocks with routed experts (what --gpu-experts multiplies)
    top_k: int = 1  # routed experts per token
    q_per_kv: int = 1  # query heads per key/value head (the prefill attention mask repeats per query group)
    context_limit: Optional[int] = None  # positions the model attends over (models.context_limit), and why
    context_why: str = ""
    moe_names: tuple = ()  # the MoE blocks' names, in forward order (the plan's per-layer entries)
    dense_linears: tuple = ()  # (out, in) of each linear a dense format packs (load/dense.py), part of dense_params
    # per MoE layer, how its checkpoint holds its routed experts exactly (HeldLayouts): the layouts the loader builds
    # in place of a planned format's own, and the format the layer takes by default
    expert_layouts: tuple = ()
    # per sequence, the fixed-size states of recurrent (linear-attention) layers: conv-window elements, stored in
    # the model dtype, and bytes of the fp32 recurrent states (layers/kv_cache.py RecurrentStates)
    conv_state_elems: int = 0
    recurrent_state_bytes: int = 0

    def state_bytes(self, itemsize: int) -> int:
        """One sequence's recurrent-layer states, the same at any context length."""
        return self.conv_state_elems * itemsize + self.recurrent_state_bytes

    def layer_layout(self, i: int, fmt: str, group: int, down: Optional[str] = None) -> dict:
        """One routed expert's layout (CPUExperts' keyword arguments) in MoE layer ``i`` as the loader builds it in
        ``fmt`` / ``group`` (``down``: down_proj in its own format; hetmoe's own int3 / int2 in their layout,
        hetmoe/cpu/lowbit.py): the checkpoint's exact layout where the layer's ``expert_layouts`` has one for that
        format and group (the loader's ``new_experts`` takes it then), else the format's own (fp8: FP8_LAYOUTS)."""
        if fmt in LOW_BIT_FORMATS or (down is not None and down != fmt):
            from hetmoe.cpu.lowbit import layout

            return layout(fmt, down or fmt)
        held = self.expert_layouts[i] if i < len(self.expert_layouts) else None
        exact = held.layouts.get(fmt) if held is not None else None
        if exact is not None:
            from hetmoe.cpu.codes import plan_format

            if plan_format(exact) == (fmt, group):
                return exact
        extra = FP8_LAYOUTS.get(group or 128, {}) if fmt == "fp8" else {}
        return {"weight_format": fmt, "group_size": group, **extra}

    def layer_expert_bytes(self, i: int, fmt: str, group: int, down: Optional[str] = None) -> int:
        """One routed expert of MoE layer ``i`` as the loader allocates it (``layer_layout``)."""
        return layout_bytes(self.layer_layout(i, fmt, group, down), self.hidden, self.expert_inter)

    def layer_own(self, i: int) -> Optional[tuple]:
        """The (format, group) MoE layer ``i`` is planned in when its checkpoint chose the experts' format (a GGUF
        file's layers each in their own exact layout), or None (the plan's format)."""
        return self.expert_layouts[i].own if i < len(self.expert_layouts) else None


@dataclass(frozen=True)
class HeldLayouts:
    """How a checkpoint holds one MoE layer's routed experts exactly, before any weight is read: ``layouts``, planned
    format -> the CPUExperts keyword arguments the loader builds the layer in when the plan gives it that format
    (and the layout's group: hetmoe/cpu/codes.py plan_format); ``own``: the (format, group) the layer is planned in
    when the checkpoint chose the experts' format (a GGUF file with --experts-format auto: the layer's own exact
    layout, whatever its other layers need), None for the plan's."""

    layouts: dict
    own: Optional[tuple] = None


# The table's rows in this order (parts not named here after them, in the plan's order).
ORDER = ("dense weights", "KV cache", "recurrent states", "activations", "prefill slots", "prefill weights",
         "prefill activations", "GPU experts", "resident prefill", "CUDA context", "routed experts", "runtime")


def _label(plan: MemoryPlan, part: str) -> str:
    """A part's name in the table, with its format or size where the plan chose one."""
    if part == "dense weights":
        fmt = plan.dense_format
        if fmt == "bf16":  # the dtype's own weights
            fmt = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(str(plan.dtype), str(plan.dtype))
        return f"dense weights ({fmt})"
    if part == "KV cache":
        return f"KV cache ({plan.max_context} x {1 if plan.kv_paged else plan.max_batch})"
    if part == "recurrent states":
        return f"recurrent states (x {plan.max_batch})"
    if part == "GPU experts":
        counts = sorted({lp.gpu_experts for lp in plan.layers}) or [0]
        n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        fmts = sorted({lp.gpu_format for lp in plan.layers if lp.gpu_experts})
        return f"GPU experts ({n} per layer{', ' + '/'.join(fmts) if fmts else ''})"
    if part == "routed experts":
        kinds = {(lp.formats, lp.group_size) for lp in plan.layers} or {(plan.experts_format, plan.group_size)}
        if len(kinds) > 1:
            return "routed experts (mixed per layer)"
        fmt, group = kinds.pop()
        return f"routed experts ({fmt}{'' if fmt == 'bf16' else f', group {group}' if group else ', per row'})"
    return part


def plan_table(plan: MemoryPlan, width: int = 100) -> list:
    """``MemoryPlan.table``: rows of (part, device, bytes, why), the why column wrapped within ``width``."""
    groups = ([("VRAM", "cuda", plan.vram)] if plan.device.type == "cuda" else []) + [("RAM", "cpu", plan.ram)]
    rows = []
    for name, where, parts in groups:
        keys = [k for k, v in parts.items() if v]
        if where == "cuda":  # what the plan considered and left out
            keys += [k for k in ("GPU experts", "prefill slots") if k not in keys and k in plan.why
                     and plan.why[k].startswith(("auto", "none"))]
        keys.sort(key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))
        rows += [(_label(plan, k), where, gib(parts.get(k, 0)), plan.why.get(k, "")) for k in keys]
        total = sum(parts.values())
        if name in plan.budgets:
            budget, _, source = plan.budgets[name]
            verdict = "fits" if total <= budget else "DOES NOT FIT"
            rows.append((f"{name} total", where, gib(total), f"{verdict}: {gib(budget)} budget ({source})"))
        else:
            rows.append((f"{name} total", where, gib(total), ""))
    pw = max(len(r[0]) for r in rows)
    lead = pw + 1 + 4 + 1 + 10 + 2
    lines = [f"{'part':<{pw}} {'on':<4} {'bytes':>10}  why"]
    for part, where, size, why in rows:
        text = textwrap.wrap(why, max(20, width - lead)) or [""]
        lines.append(f"{part:<{pw}} {where:<4} {size:>10}  {text[0]}".rstrip())
        lines += [" " * lead + t for t in text[1:]]
    return lines
