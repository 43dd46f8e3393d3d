"""Dense weights in the dense format of the placement (``--dense-format``; the table: hetmoe/config/formats.py).

Which linears a dense format applies to, and the swap that packs them once their weights are loaded: attention
projections (q/k/v fused into one, MLA's q/kv_a fused, q_b, o), shared experts and dense MLPs (gate/up fused, down)
and lm_head. Routers (``gate``, ``shared_expert_gate``) stay in the model dtype: top-k choices flip on small errors
(on a bf16 CPU placement they run on the engine in its bf16 format, the same weights: see ``pack_dense``).
MLA's ``kv_b_proj`` stays too: the absorbed decode form reads its per-head slices as weights (layers/attention.py).
The embedding stays: a token reads one row of it.

On the CPU a packed linear is the engine's matrix product (hetmoe/cpu/linear.py ``CPULinear``); on a GPU a
weight-only kernel that dequantizes in its K loop (hetmoe/layers/gpu_linear.py ``GPULinear``). Both take the same
list of ``nn.Linear`` (one fused matrix of their rows) and offer ``forward(x)`` and ``parts(x)``.

Built on a GPU in a format other than bf16, a linear's weight is first made in host memory (``on_host``: the loader
reads it there, synthetic models generate it there) and ``GPULinear`` uploads and converts it a slab of rows at a
time, so the build's VRAM is the packed weights plus one slab's temporaries, within the plan.

A DeepSeek FP8 checkpoint (e4m3 weights, one ``weight_scale_inv`` per 128 x 128 block) packed in the fp8 format on a
GPU keeps its own bytes (``FP8Source``): the fp8 format is DeepSeek's layout (codes [N, K] with K zero-padded to a
multiple of 128, fp32 scales [ceil(N/128), ceil(K/128)], w = code * scale per block), so the codes and scales are
copied as they are, with no dequantize / re-quantize round trip.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hetmoe.config.formats import DENSE_FORMATS, DenseFormat
from hetmoe.layers.linear import FusedLinears
from hetmoe.load.checkpoint import FP8_BLOCK, dequantize_fp8

# Linears left in the model dtype whatever the dense format (see above).
ROUTERS = ("gate", "shared_expert_gate")
KEEP = ROUTERS + ("kv_b_proj",)


def on_host(module: nn.Module, name: str, fmt: str, device) -> bool:
    """Whether the weights of ``module`` (named ``name``; its last part is its attribute in its parent) are to be made
    in host memory rather than on ``device``: a linear ``pack_dense`` packs into ``fmt`` on a GPU other than bf16,
    which ``GPULinear.from_linears`` uploads a slab at a time (module docstring)."""
    return (isinstance(module, nn.Linear) and torch.device(device).type == "cuda" and fmt != "bf16"
            and name.rsplit(".", 1)[-1] not in KEEP)


def _fused_groups(module: nn.Module) -> list:
    """(attribute, FusedLinears) of ``module``'s fused projections (qkv, gate_up, q_kv_a)."""
    return [(name, v) for name, v in vars(module).items() if isinstance(v, FusedLinears)]


def dense_linears(model: nn.Module) -> list:
    """The linears a dense format packs, as (name, out_features, in_features): one entry per fused group (its rows
    side by side, named by its first linear) and per other linear. Works on a meta-device model (the plan)."""
    out, fused = [], set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for _, group in _fused_groups(module):
            fused.update(id(lin) for lin in group.linears)
            first = next(n for n, c in module.named_children() if c is group.linears[0])
            out.append((prefix + first, sum(group.sizes), group.linears[0].in_features))
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and id(module) not in fused and leaf not in KEEP:
            out.append((name, module.out_features, module.in_features))
    return out


class PackedPart(nn.Module):
    """Stands where one linear of a packed fused group was (``q_proj`` of a packed ``qkv``): computes the group and
    returns its own part, so a path that calls the linears one by one stays correct. Holds no weight."""

    def __init__(self, group: nn.Module, index: int):
        super().__init__()
        self.index = index
        self._group = (group,)  # not a child: the group's bytes belong to the module that owns it

    def forward(self, x):
        return self._group[0].parts(x)[self.index]


class FP8Source:
    """The FP8 weights of a checkpoint, kept for the fp8 dense format on a GPU (module docstring).

    The loader offers every packable linear's weight to ``take`` while it fills a layer: a weight stored in e4m3
    with block scales is not read; the linear gets a placeholder of its shape and the stored views are remembered.
    ``pack_dense`` then calls ``claim`` for each group it packs (a fused group, or one linear), which returns the
    stored codes and scales to pack side by side, or None after reading the weights the round-trip way. Every
    taken weight must be claimed (``weights`` empty after loading)."""

    def __init__(self, ckpt, dtype: torch.dtype, device):
        self.ckpt, self.dtype, self.device = ckpt, dtype, torch.device(device)
        self.weights: dict = {}  # nn.Linear -> (checkpoint name, e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)])
        self.kept = 0  # linears packed from the checkpoint's own bytes
        self.round_trips: dict = {}  # why -> linears dequantized and re-quantized

    @classmethod
    def of(cls, ckpt, plan) -> Optional[FP8Source]:
        """The FP8Source of a load placed by ``plan`` (None unless its dense format is fp8 on a GPU)."""
        return cls(ckpt, plan.dtype, plan.device) if plan.dense_format == "fp8" and plan.device.type == "cuda" else None

    def take(self, module: nn.Module, name: str) -> bool:
        """Whether the weight ``name`` of linear ``module`` is kept as stored; if so the module's weight is now a
        placeholder (zeros of its shape, one element expanded) until ``claim``."""
        get_fp8 = getattr(self.ckpt, "get_fp8", None)  # (a GGUF file has no DeepSeek FP8)
        if not isinstance(module, nn.Linear) or not name.endswith(".weight") or get_fp8 is None:
            return False
        if name.rsplit(".", 2)[-2] in KEEP or name not in self.ckpt:  # (a tied lm_head reads the embedding)
            return False
        stored = get_fp8(name)
        if stored is None:
            return False
        if tuple(stored[0].shape) != (module.out_features, module.in_features):
            return False  # the loader's shape check names it
        self.weights[module] = (name, *stored)
        # no bytes; in host memory, as every linear packed on a GPU is (on_host): fusing a layer's projections
        # makes a transient copy of a fused group's there
        placeholder = torch.zeros((), dtype=self.dtype).expand(stored[0].shape)
        module.weight = nn.Parameter(placeholder, requires_grad=False)
        return True

    def claim(self, linears: list) -> Optional[tuple]:
        """(e4m3 weights, scale_invs) of ``linears`` (one group, in order) when all are stored in FP8 and every part
        but the last is a whole number of 128-row blocks: then the parts' code rows and scale rows, one after the
        other, are exactly the fused matrix's blocks. Otherwise None, after dequantizing the stored weights into
        their linears (for the round trip of ``make``) and counting why."""
        stored = [self.weights.get(lin) for lin in linears]
        if not any(stored):
            return None
        for lin in linears:
            self.weights.pop(lin, None)
        why = fp8_parts_why([lin.out_features for lin in linears], [s is not None for s in stored])
        if not why:
            self.kept += len(linears)
            return [s[1] for s in stored], [s[2] for s in stored]
        self.round_trips[why] = self.round_trips.get(why, 0) + len(linears)
        for lin, s in zip(linears, stored):
            if s is not None:
                w = dequantize_fp8(s[1], s[2], self.dtype, s[0])  # in host memory: packed from there (on_host)
                lin.weight = nn.Parameter(w, requires_grad=False)
        return None

    def note(self) -> Optional[str]:
        """One line on the FP8 weights that took the round trip, and why (None when none did)."""
        if not self.round_trips:
            return None
        whys = "; ".join(f"{n}: {why}" for why, n in self.round_trips.items())
        return (f"{sum(self.round_trips.values())} FP8 linears were dequantized and re-quantized into fp8 blocks, "
                f"{self.kept} kept as the checkpoint stores them ({whys})")

    def done(self, log) -> None:
        """After the last ``pack_dense``: every taken weight was packed (else RuntimeError: a placeholder would be
        left in the model); the note, if any, to ``log``."""
        if self.weights:
            raise RuntimeError(f"FP8 weights kept but never packed: {', '.join(n for n, *_ in self.weights.values())}")
        note = self.note()
        if note:
            log(f"hetmoe: note: {note}")


def fp8_parts_why(rows: list, stored: list) -> str:
    """Why linears of ``rows`` output rows each (``stored``: each kept in FP8) cannot be packed side by side from
    their stored blocks ("" when they can): a part that is not stored in FP8, or a part but the last whose rows
    end inside a 128-row block (its last scale row would cover rows of the next part, with the next part's
    scales differing)."""
    if not all(stored):
        return "a fused group mixes FP8 and unquantized weights"
    if any(r % FP8_BLOCK for r in rows[:-1]):
        return f"a fused group's parts have {rows} rows, not whole {FP8_BLOCK}-row blocks"
    return ""


def _linear_factory(device, options):
    """(list of nn.Linear, format) -> a packed linear module on ``device``."""
    if device.type == "cpu":
        from hetmoe.cpu import CPULinear

        kw = {"isa": options.isa, "amx_min_tokens": options.amx_min_tokens} if options is not None else {}
        if getattr(options, "pool", None) is not None:  # the experts' pool (Transformers path): one set of threads
            kw["pool"] = options.pool
        return lambda linears, fmt: CPULinear.from_linear(linears, fmt, DENSE_FORMATS[fmt].group, **kw)
    from hetmoe.layers.gpu_linear import GPULinear

    return lambda linears, fmt: GPULinear.from_linears(linears, fmt, device)


def _packer(device, options, fp8: Optional[FP8Source]):
    """(list of nn.Linear, format) -> a packed linear module: from the checkpoint's FP8 bytes where ``fp8`` has
    them (``FP8Source.claim``), else from the linears' weights."""
    make = _linear_factory(device, options)
    if fp8 is None:
        return make

    def pack(linears, fmt):
        stored = fp8.claim(linears) if fmt == "fp8" else None
        if stored is None:
            return make(linears, fmt)
        from hetmoe.layers.gpu_linear import GPULinear

        bias = [None if lin.bias is None else lin.bias.detach() for lin in linears]
        return GPULinear.from_fp8(*stored, bias=bias, device=device)

    return pack


def pack_dense(root: nn.Module, fmt: str, device, options=None, dtype=None, fp8: Optional[FP8Source] = None) -> int:
    """Packs the dense linears under ``root`` (a decoder layer, or the whole model; see the module docstring) into
    ``fmt`` on ``device``, fusing the layer's projections first (idempotent: packed modules are left alone), and
    frees their source weights. Returns the bytes of the packed weights made. ``fp8``: the checkpoint's FP8
    weights the loader kept (``FP8Source``), packed as they are stored where they can be.

    bf16 on a GPU packs nothing (cuBLAS reads bf16). On the CPU with a bf16 ``dtype`` everything goes to the engine,
    bf16 included, and the routers too in bf16: the weights exactly as given, multiplied in fp32, every product of
    a decode step on the engine's threads (docs/dense-formats.md); with fp32 weights (small models) bf16 packs
    nothing. On the CPU a module whose one weight holds several linears' blocks (``split_linears``: DeepSeek-V4's
    grouped o_a_proj, each group reading its own slice of the input) hands them over as linears, packed one by one."""
    engine_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    if fmt == "bf16" and not engine_bf16:
        return 0
    for module in root.modules():
        if hasattr(module, "fuse_projections") and not hasattr(module, "model") and _loaded(module):
            module.fuse_projections()  # (not a CausalLM: its layers)
    if device.type == "cpu":  # a weight holding several linears' blocks (DeepSeek-V4's grouped o_a_proj): each packed
        for module in root.modules():
            if hasattr(module, "split_linears") and _loaded(module):
                module.split_linears()  # its blocks as nn.Linear children, packed below as any linear
    make = _packer(device, options, fp8)
    made = 0
    for module in list(root.modules()):
        for attr, group in _fused_groups(module):
            packed = make(list(group.linears), fmt)
            setattr(module, attr, packed)
            names = {id(c): n for n, c in module.named_children()}
            for i, lin in enumerate(group.linears):
                setattr(module, names[id(lin)], PackedPart(packed, i))
            made += packed.nbytes
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or name == "kv_b_proj" or not _loaded(child):
                continue
            if name not in ROUTERS or engine_bf16:
                packed = make([child], "bf16" if name in ROUTERS else fmt)
                setattr(module, name, packed)
                made += packed.nbytes
    return made


def _loaded(module: nn.Module) -> bool:
    """Whether every parameter under ``module`` holds data (a layer the loader has not reached is on the meta device:
    ``pack_dense`` of the whole model, run once the globals are filled, packs lm_head and leaves the layers)."""
    return not any(p.is_meta for p in module.parameters())


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed dense weights in ``model`` (the modules ``pack_dense`` made: CPULinear and GPULinear carry
    their ``format`` from the dense format table)."""
    return sum(m.nbytes for m in model.modules() if isinstance(getattr(m, "format", None), DenseFormat))
