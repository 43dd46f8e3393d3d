"""A GGUF model as the loader reads a checkpoint (hetmoe/load/checkpoint.py's interface): ``config``, ``names``,
``shape``, ``get_float`` under Hugging Face names, ``release`` / ``close`` / ``fingerprint``, plus what only a GGUF
file has: the routed experts' own quantized blocks (``expert_codes``) and the engine format that holds them exactly
(``exact_format``).

Tensors are read from the memory-mapped file when asked for, one at a time (a stacked experts tensor one expert at
a time), so loading holds one layer's weights as the safetensors path does. Exact types (hetmoe/cpu/codes.py lists
the layout of each): the blocks of 32 Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (``block_codes``), the K-quants Q2_K .. Q6_K
(hetmoe/load/gguf/kquants.py), IQ4_NL, IQ4_XS and MXFP4 (lut4: 4-bit indices into a codebook,
hetmoe/load/gguf/lut4_blocks.py), the ternary TQ2_0 and TQ1_0 (int2, hetmoe/load/gguf/ternary.py), and the i-quants
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (grid: their blocks moved as they are, ``grid_blocks``). Gate/up
and down may have different exact types, and each layer its own (4-bit codes go into int8 under an explicit
--experts-format int8). They are packed from the codes (hetmoe/cpu/codes.py):
the kernels multiply by exactly what ``gguf``'s dequantization gives. Every other type is dequantized (gguf.quants)
and quantized into the experts format of the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import re
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from hetmoe.cpu.codes import EXACT_TYPES, GRID_TYPES, exact_layout, layout_of, load_codes, lut4_values, plan_format
from hetmoe.load.gguf.kquants import KQUANTS, kquant_codes
from hetmoe.load.gguf.lut4_blocks import LUT4_BLOCKS, lut4_codes
from hetmoe.load.gguf.metadata import config_from_gguf
from hetmoe.load.gguf.names import PAIRS, Transform, hf_names, merge_pair, undo
from hetmoe.load.gguf.reader import GGUFError, open_gguf
from hetmoe.load.gguf.ternary import TERNARY, ternary_codes
from hetmoe.models.config import ModelConfig
from hetmoe.plan.memory import HeldLayouts

# GGML type -> (engine format, bytes per block of 32) of the blocks block_codes decodes
EXACT = {"Q8_0": ("int8", 34), "Q4_0": ("int4", 18), "Q4_1": ("int4", 20), "Q5_0": ("int5", 22), "Q5_1": ("int5", 24)}
BLOCK = 32
CHUNK = 8  # experts decoded and packed at once
_LAYER = re.compile(r"\.layers\.\d+\.")
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def nearest_format(ggml_type: str) -> Optional[str]:
    """The engine format nearest a GGML type by bits (None for a float type: the plan's auto choice): up to 5 bits
    int4, 6 and 8 bits int8."""
    if ggml_type in FLOAT_TYPES:
        return None
    digits = "".join(ch for ch in ggml_type.split("_")[0] if ch.isdigit())
    return "int4" if digits and int(digits) <= 5 else "int8"


@functools.lru_cache(maxsize=None)
def runnable_types() -> tuple:
    """The GGML types hetmoe runs weights of: the float types, the exactly held ones (hetmoe/cpu/codes.py), and
    every block type gguf's reference dequantization decodes (those are re-quantized, or decoded for dense
    weights), found by decoding one block of zeros of each."""
    import gguf

    out = list(FLOAT_TYPES) + [k for k in EXACT_TYPES if k not in FLOAT_TYPES]
    for kind in gguf.GGMLQuantizationType:
        if kind.name in out or kind not in gguf.GGML_QUANT_SIZES:
            continue
        per, nbytes = gguf.GGML_QUANT_SIZES[kind]
        if kind.name.startswith("I") and kind.name[1:].isdigit():
            continue  # integers, not weights
        try:
            gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), kind)
        except (NotImplementedError, ValueError):
            continue
        out.append(kind.name)
    return tuple(out)


def block_codes(raw: np.ndarray, kind: str, shape: tuple) -> tuple:
    """(codes int8 ``shape``, scales fp32 ``shape[:-1] + (shape[-1] / 32,)``, mins of the scales' shape or None) of
    blocks of 32 ``raw`` (bytes, rows of blocks): Q8_0 (fp16 d, 32 int8), Q4_0 (fp16 d, 16 bytes whose low nibbles are
    values 0..15 and high nibbles 16..31, stored + 8), Q4_1 (fp16 d, fp16 m, Q4_0's nibbles as they are: value =
    d * q + m, so min = -m), Q5_0 / Q5_1 (Q4_0 / Q4_1 with a uint32 of fifth bits before the nibbles, bit i for value
    i; Q5_0 stored + 16)."""
    nb = shape[-1] // BLOCK
    blocks = raw.reshape(*shape[:-1], nb, EXACT[kind][1])

    def half(at: int) -> np.ndarray:  # the fp16 field at byte `at` of every block, as fp32
        return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

    d = half(0)
    mins = torch.from_numpy(-half(2)) if kind in ("Q4_1", "Q5_1") else None
    if kind == "Q8_0":
        q8 = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return torch.from_numpy(q8.reshape(shape)), torch.from_numpy(d), None
    start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[kind]
    nib = blocks[..., start:]  # the nibbles into uint8 in place (no temporaries of the whole matrix)
    q = np.empty((*shape[:-1], nb, BLOCK), np.uint8)
    np.bitwise_and(nib, 0x0F, out=q[..., :BLOCK // 2])
    np.right_shift(nib, 4, out=q[..., BLOCK // 2:])
    if kind in ("Q5_0", "Q5_1"):
        qh = np.ascontiguousarray(blocks[..., start - 4:start]).view("<u4")  # [..., nb, 1]
        q |= (((qh >> np.arange(BLOCK, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    q = q.view(np.int8)
    if kind in ("Q4_0", "Q5_0"):
        q -= 8 if kind == "Q4_0" else 16
    return torch.from_numpy(q.reshape(shape)), torch.from_numpy(d), mins


def grid_blocks(raw: np.ndarray, kind: str, shape: tuple) -> torch.Tensor:
    """The blocks of an i-quant matrix held as grid (hetmoe/cpu/codes.py GRID_TYPES) as load_codes takes them: uint8
    [*shape[:-1], shape[-1] / 256 * bytes per block], a view of ``raw`` (the file's bytes) where it is contiguous;
    ValueError for rows that are not whole blocks or a byte count that does not match the shape."""
    import gguf

    per, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    if shape[-1] % per:
        raise ValueError(f"{kind} rows of {shape[-1]} values are not whole blocks of {per}")
    raw = np.ascontiguousarray(np.asarray(raw, np.uint8)).reshape(-1)
    want = int(np.prod(shape[:-1])) * (shape[-1] // per) * nbytes
    if raw.size != want:
        raise ValueError(f"{kind} {list(shape)} needs {want} bytes, got {raw.size} (a truncated file?)")
    with warnings.catch_warnings():  # the mapped file's pages are read-only, and only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(*shape[:-1], shape[-1] // per * nbytes)


def tokenizer_of(path):
    """hetmoe's Tokenizer from a GGUF file's tokenizer.ggml.* keys and chat template (tokenizer.py)."""
    from hetmoe.load.gguf.tokenizer import tokenizer_from_gguf

    with open_gguf(gguf_file(path)) as f:
        return tokenizer_from_gguf(f)


def is_gguf(path) -> bool:
    """A .gguf file, or a directory holding GGUF files and no config.json."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def gguf_file(path) -> Path:
    """The file to open for ``path``: itself, or a directory's one model (a single file or the first part of one
    split set); ValueError when the directory holds several."""
    path = Path(path)
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    firsts = [f for f in files if "-of-" not in f.name or f.name.split("-of-")[0].endswith("-00001")]
    if len(firsts) != 1:
        raise GGUFError(f"{path} holds {len(firsts)} GGUF models ({', '.join(f.name for f in firsts)}); pass the "
                        "file to load as --model")
    return firsts[0]


class GGUFCheckpoint:
    floats_are_copies = True  # get_float returns memory of its own (the loader keeps it rather than copy it)

    def __init__(self, path):
        self.file = open_gguf(gguf_file(path))
        self.path = Path(self.file.path)
        self.config_source = self.path  # what errors about the config name
        self.config = ModelConfig(config_from_gguf(self.file))
        self._map: dict = {}  # HF name -> (GGUFTensor, transform, expert index or None) or a pair's two tensors
        self._scratch: dict = {}  # (matrix, GGML type, shape) -> decode buffers of CHUNK experts (load_exact_experts)
        self._own_formats = False  # experts_options chose the format: each exact layer is planned in its own layout
        pairs: dict = {}
        second = {b: a for a, b in PAIRS.items()}
        skipped = []
        for gguf_name, (name, transform) in hf_names(self.file).items():
            t = self.file.tensors[gguf_name]
            if transform is Transform.SKIP:
                skipped.append(gguf_name)
            elif transform is Transform.EXPERTS:
                for e in range(t.shape[0]):
                    self._map[name.format(expert=e)] = (t, transform, e)
            elif transform in PAIRS or transform in second:
                pairs.setdefault(name, {})[transform] = t
            else:
                self._map[name] = (t, transform, None)
        for name, pair in pairs.items():
            first = next(iter(pair)) if len(pair) == 1 else None
            if first is not None:
                first = first if first in PAIRS else second[first]
                names = {Transform.KV_B_K: "attn_k_b and attn_v_b", Transform.QKVZ_QKV: "attn_qkv and attn_gate"}
                raise GGUFError(f"{self.path}: {name} needs both {names[first]}")
            first = next(k for k in pair if k in PAIRS)
            self._map[name] = (pair, first, None)
        self.notes = []
        if skipped:
            self.notes.append(f"{self.path.name}: {len(skipped)} tensor(s) of the multi-token-prediction layer(s) "
                              f"({skipped[0]}, ...) are not read: hetmoe runs the main layers only")
        self._check_types()

    def _check_types(self) -> None:
        """GGUFError naming the first tensor the model takes whose type hetmoe cannot run (neither held exactly nor
        decoded), before any weight is read."""
        runnable, seen = runnable_types(), set()
        for name, (t, transform, _) in self._map.items():
            for part in (t.values() if isinstance(t, dict) else (t,)):
                if id(part) in seen:
                    continue
                seen.add(id(part))
                kind = part.ggml_type.name
                if transform is Transform.INTEGERS:  # an integer table: any GGML integer type, nothing else
                    if not (kind.startswith("I") and kind[1:].isdigit()):
                        raise GGUFError(f"{self.path}: tensor {part.name} ({name}) is {kind}; an integer table "
                                        "(I8, I16, I32 or I64) was expected")
                elif part.ggml_type.name not in runnable:
                    raise GGUFError(f"{self.path}: tensor {part.name} ({name}) is {part.ggml_type.name}, which hetmoe "
                                    f"cannot run; supported types: {', '.join(runnable)}")

    def __contains__(self, name: str) -> bool:
        return name in self._map

    def names(self) -> list:
        return list(self._map)

    def _entry(self, name: str) -> tuple:
        try:
            return self._map[name]
        except KeyError:
            raise GGUFError(f"{self.path} has no tensor for {name}") from None

    def shape(self, name: str) -> tuple:
        t, transform, e = self._entry(name)
        if transform is Transform.KV_B_K:
            cfg = self.config
            return (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        if transform is Transform.QKVZ_QKV:
            qkv, z = t[Transform.QKVZ_QKV].shape, t[Transform.QKVZ_Z].shape
            return (qkv[0] + z[0], qkv[1])
        if transform is Transform.ROW:
            return (1, int(np.prod(t.shape)))
        if transform in (Transform.CONV, Transform.V_CONV):
            return (t.shape[0], 1, int(np.prod(t.shape[1:])))
        return tuple(t.shape[1:]) if e is not None else tuple(t.shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored: an integer table (Transform.INTEGERS) as its integers, any other as fp32."""
        t, transform, _ = self._entry(name)
        if transform is Transform.INTEGERS:
            return torch.from_numpy(np.array(t.data))
        return self.get_float(name)

    def get_float(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tensor under its Hugging Face name, dequantized to fp32 (or ``dtype``), transforms undone."""
        t, transform, e = self._entry(name)
        if transform in PAIRS:
            w = merge_pair(transform, t[transform].float32(), t[PAIRS[transform]].float32(), self.config)
        elif transform in (Transform.COPY, Transform.EXPERTS):  # decoded straight into the dtype
            return t.dequantized(dtype or torch.float32, e)
        else:
            w = undo(transform, t.float32(), self.config)
        out = torch.from_numpy(np.ascontiguousarray(w))
        return out if dtype is None else out.to(dtype)

    def ggml_type(self, name: str) -> str:
        t, _, _ = self._entry(name)
        return next(iter(t.values())).ggml_type.name if isinstance(t, dict) else t.ggml_type.name

    def exact_format(self, names: list, plan: Optional[str] = None) -> Optional[dict]:
        """The CPUExperts layout holding one layer's gate, up, down (``names``) exactly (hetmoe/cpu/codes.py
        exact_layout; ``plan``: the format the plan gives the layer), or None (gate and up of different types, or a
        type no layout holds)."""
        kinds = [self.ggml_type(n) for n in names]
        return exact_layout(kinds[0], kinds[2], plan) if kinds[0] == kinds[1] else None

    def expert_codes(self, name: str) -> tuple:
        """(codes int8 [rows, cols], scales fp32 [rows, cols / group], mins of the same shape or None) of an expert
        matrix of an exactly held type (Q8_0 / Q4_0 / K-quants / TQ2_0 / TQ1_0; lut4 types: codebook indices)."""
        t, _, e = self._entry(name)
        kind = t.ggml_type.name
        if kind not in EXACT_TYPES:
            raise GGUFError(f"{self.path}: {name} is {kind}, not one of the exactly held types "
                            f"{', '.join(EXACT_TYPES)}")
        try:
            if kind in GRID_TYPES:
                return grid_blocks(np.asarray(t.data[e]), kind, tuple(t.shape[1:])), None, None
            if kind in KQUANTS:
                return kquant_codes(np.asarray(t.data[e]), kind, tuple(t.shape[1:]))
            if kind in LUT4_BLOCKS:
                return (*lut4_codes(np.asarray(t.data[e]), kind, tuple(t.shape[1:])), None)
            if kind in TERNARY:
                return (*ternary_codes(np.asarray(t.data[e]), kind, tuple(t.shape[1:])), None)
        except ValueError as err:
            raise GGUFError(f"{self.path}: {name}: {err}") from None
        return block_codes(np.asarray(t.data[e]), kind, tuple(t.shape[1:]))

    def expert_layouts(self, prefixes: list, names: list) -> tuple:
        """A HeldLayouts for each MoE block of ``prefixes`` (``names``: gate, up, down as the model calls them): the
        exact layout the loader builds the block in when the plan gives it int8 or int4 (4-bit codes in int8: in an
        explicit --experts-format int8), and, where ``experts_options`` chose the format, the (format, group) of the
        block's own exact layout (int4 for Q4_K, int8 class for Q4_K gate/up beside Q6_K down, ...): what the memory
        plan places and counts each layer by (hetmoe/plan/memory.py ModelShapes.layer_layout)."""
        out = []
        for prefix in prefixes:
            layouts = {}
            for fmt in ("int8", "int4"):
                x = self.experts_layout(prefix, names, fmt)
                if x is not None and plan_format(x)[0] == fmt:
                    layouts[fmt] = x
            own = self.experts_layout(prefix, names) if self._own_formats else None
            out.append(HeldLayouts(layouts, None if own is None else plan_format(own)))
        return tuple(out)

    def experts_layout(self, prefix: str, names: list, plan: Optional[str] = None) -> Optional[dict]:
        """exact_format of block ``prefix``'s experts (``names``: gate, up, down as the model calls them)."""
        return self.exact_format([f"{prefix}.experts.0.{w}.weight" for w in names], plan)

    def load_exact_experts(self, prefix: str, names: list, experts) -> bool:
        """Pack block ``prefix``'s experts from their own codes when ``experts`` has the layout that holds them
        exactly (nothing re-quantized): True when done, False when not (the loader packs from floats then).
        GGUFError naming the file, expert and matrix for a block the engine refuses (a NaN scale, ...).

        CHUNK experts at a time: their K-quant blocks decoded on the experts' threads into buffers kept from layer
        to layer (fresh pages cost more than the decoding on some machines), then packed in one engine call."""
        held = layout_of(experts)
        if self.experts_layout(prefix, names, plan_format(held)[0]) != held:
            return False
        stacked = [self._entry(f"{prefix}.experts.0.{w}.weight")[0] for w in names]
        threads = experts.info()["threads"]
        fmts = held["weight_format"] if isinstance(held["weight_format"], tuple) else (held["weight_format"],) * 2
        for e0 in range(0, experts.num_experts, CHUNK):
            n = min(CHUNK, experts.num_experts - e0)
            parts = [self._chunk_codes(t, e0, n, threads, slot) for slot, t in enumerate(stacked)]
            for slot, t in enumerate(stacked):  # lut4 types in an int8 layout (an int8 plan): indices -> values
                own = EXACT_TYPES[t.ggml_type.name]
                if own[0] == "lut4" and fmts[slot // 2] == "int8":
                    parts[slot] = (lut4_values(parts[slot][0], own[4]), *parts[slot][1:])
            try:
                load_codes(experts, [p[0] for p in parts], [p[1] for p in parts], first_expert=e0,
                           mins=[p[2] for p in parts], scan_first=False)
            except ValueError as err:
                raise self._refused(experts, parts, prefix, e0, err) from None
        return True

    def _refused(self, experts, parts: list, prefix: str, e0: int, err: ValueError) -> GGUFError:
        """The error of a chunk of experts the engine refused, naming its first bad expert and matrix (each
        loaded alone, its values scanned first)."""
        for e in range(parts[0][0].shape[0]):
            one = [[None if t is None else t[e:e + 1] for t in p] for p in parts]
            try:
                load_codes(experts, [p[0] for p in one], [p[1] for p in one], first_expert=e0 + e,
                           mins=[p[2] for p in one])
            except ValueError as bad:
                return GGUFError(f"{self.path}: {prefix}.experts.{e0 + e}: {bad}")
        return GGUFError(f"{self.path}: {prefix}.experts.{e0}-{e0 + len(parts[0][0]) - 1}: {err}")

    def _chunk_codes(self, t, e0: int, n: int, threads: int, slot: int) -> tuple:
        """(codes, scales, mins or None) of experts [e0, e0 + n) of the stacked tensor ``t``; K-quants: views of
        the buffers of ``slot`` (gate, up, down: 0, 1, 2) reused from layer to layer."""
        kind, shape = t.ggml_type.name, (n, *t.shape[1:])
        if kind in GRID_TYPES:  # the blocks themselves: the engine moves them into its layout
            try:
                return grid_blocks(np.asarray(t.data[e0:e0 + n]), kind, shape), None, None
            except ValueError as err:
                raise GGUFError(f"{self.path}: {t.name}: {err}") from None
        if kind in LUT4_BLOCKS or kind in TERNARY:
            try:
                if kind in TERNARY:
                    return (*ternary_codes(np.asarray(t.data[e0:e0 + n]), kind, shape, threads), None)
                return (*lut4_codes(np.asarray(t.data[e0:e0 + n]), kind, shape), None)
            except ValueError as err:
                raise GGUFError(f"{self.path}: {t.name}: {err}") from None
        if kind not in KQUANTS:
            return block_codes(np.asarray(t.data[e0:e0 + n]), kind, shape)
        group, affine = KQUANTS[kind][2], KQUANTS[kind][1] == "affine"
        key = (slot, kind, tuple(t.shape[1:]))
        if key not in self._scratch:
            rows, cols = t.shape[1:]
            scales = torch.empty(CHUNK, rows, cols // group)
            self._scratch[key] = (torch.empty(CHUNK, rows, cols, dtype=torch.int8), scales,
                                  torch.empty_like(scales) if affine else None)
        out = tuple(None if b is None else b[:n] for b in self._scratch[key])
        try:
            return kquant_codes(np.asarray(t.data[e0:e0 + n]), kind, shape, out, threads)
        except ValueError as err:
            raise GGUFError(f"{self.path}: {t.name}: {err}") from None

    def _layer_names(self, names: list) -> list:
        """``names`` (one MoE layer's expert 0 gate, up, down) for every layer of the file that has them."""
        out = []
        for i in range(self.config.num_hidden_layers):
            mine = [_LAYER.sub(f".layers.{i}.", n, count=1) for n in names]
            if all(n in self._map for n in mine):
                out.append(mine)
        return out or [names]

    def experts_options(self, names: list, options, log: Callable[[str], None]):
        """``options`` with the experts format this file's experts (``names``: one layer's gate, up, down) load
        at by default: the exact one, each layer in its own layout (``expert_layouts`` tells the plan: a Q4_K layer
        int4 beside a Q4_K_M layer's int4 / int6), the others in int8 where any layer's types need it, else int4, in
        the group most layers have; else the nearest by bits (a note says what re-quantizing costs is measured by
        ``hetmoe eval``). Layers whose types no layout holds exactly are re-quantized, with a note. An explicit
        --experts-format is kept (still exact where it holds the types: int4 codes in int8)."""
        self._own_formats = False
        layers = self._layer_names(names)
        kinds = sorted({self.ggml_type(n) for layer in layers for n in layer})
        layouts = [x for x in (self.exact_format(layer) for layer in layers) if x is not None]
        exact = [plan_format(x) for x in layouts]
        held = sorted({f for x in layouts for f in (x["weight_format"] if isinstance(x["weight_format"], tuple)
                                                    else (x["weight_format"],))})  # the engine formats, e.g. int6
        chosen = None
        if exact:
            fmt = "int8" if any(x[0] == "int8" for x in exact) else "int4"
            groups = [x[1] for x in exact]
            chosen = (fmt, max(set(groups), key=groups.count))
        if options.experts_format != "auto":  # as asked; exactly where that format holds the types (int4 in int8)
            fmt, group = options.experts_format, options.group_size or (chosen[1] if chosen else None)
            held = fmt != "bf16" and all(x is not None and plan_format(x) == (fmt, group)
                                         for x in (self.exact_format(layer, fmt) for layer in layers))
            if held:
                log(f"hetmoe: {self.path.name}'s experts are {'/'.join(kinds)}: packed as {fmt} group {group} as "
                    "asked, exactly")
            else:
                log(f"hetmoe: note: {self.path.name}'s experts are {'/'.join(kinds)}: dequantized and re-quantized "
                    f"into {fmt} as asked")
            keep = chosen is None or options.group_size or fmt == "bf16"  # bf16 has no groups
            return options if keep else dataclasses.replace(options, group_size=chosen[1])
        if chosen is not None:
            self._own_formats = True
            off = len(layers) - len(exact)
            classes = sorted(sorted(set(exact)), key=lambda c: -exact.count(c))  # most layers' first
            planned = ("as " if len(classes) == 1 else "per layer: ") + ", ".join(f"{f} group {g}" for f, g in classes)
            log(f"hetmoe: {self.path.name}'s experts are {'/'.join(kinds)}: packed as {'/'.join(held)} (planned "
                f"{planned})"
                + (f", exactly except {off} layer(s) of other types (re-quantized)" if off else ", exactly"))
            return dataclasses.replace(options, experts_format=chosen[0], group_size=chosen[1])
        near = [nearest_format(k) for k in kinds]
        fmt = "int8" if "int8" in near else "int4" if "int4" in near else None
        if fmt is None:
            return options
        log(f"hetmoe: note: {self.path.name}'s experts are {'/'.join(kinds)}, which no engine format holds exactly: "
            f"dequantized and re-quantized into {fmt} group {BLOCK} (--experts-format chooses; `hetmoe eval` "
            "measures the cost)")
        return dataclasses.replace(options, experts_format=fmt, group_size=BLOCK)

    def release(self) -> None:
        """Drop the mapped pages of every part from this process's resident memory (tensors are copied out of the
        mapping as they are read; the pages stay in the page cache): the loader calls it after each layer."""
        for reader in self.file._readers:
            mm = getattr(reader.data, "_mmap", None)
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):
                pass

    def close(self) -> None:
        self._scratch.clear()
        self.file.close()

    def fingerprint(self) -> list:
        """(name, size, mtime) of every part: what the converted-expert cache keys on."""
        return [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.file.parts]
