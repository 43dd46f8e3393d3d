"""A GGUF file's bytes per GGML type against the bytes hetmoe holds them in, from the tensor headers alone (what
``hetmoe plan --model FILE.gguf`` prints under the plan's table).

Routed experts: a layer whose types the planned format holds exactly (hetmoe/cpu/codes.py exact_layout, as the loader's
``new_experts`` takes it) counts each matrix in its own layout (hetmoe/cpu/layout.py packed_matrix_bytes: codes, scale
sets of the type's scale dtype, affine mins the same; the K-quants' two-level k8 scales at ~1.06 bytes per group, Q2_K's
k4 scale and min pairs at 1.25 bytes per group of 16 for both, as in the file); any other layer counts the plan's format
and group (re-quantized at load). Dense part: each parameter dequantized into the dtype, the linears a dense format
packs (hetmoe/load/dense.py) in that format, as the plan's ``dense weights`` counts them. So the expert rows add up to
the plan's ``routed experts`` (what the engine allocates) and the dense rows to its ``dense weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hetmoe.config.formats import DENSE_FORMATS
from hetmoe.config.units import gib
from hetmoe.cpu.codes import plan_format
from hetmoe.cpu.layout import packed_matrix_bytes
from hetmoe.load.dense import KEEP


@dataclass
class TypeRow:
    """One GGML type of one part ("experts" or "dense"): tensors of the file, their bytes there, the bytes held."""

    part: str
    ggml_type: str
    tensors: int = 0
    file_bytes: int = 0
    held_bytes: int = 0
    held_as: set = field(default_factory=set)  # how hetmoe holds them ("int4 g32 k8 affine (exact)", "int4 g32", ...)

    @property
    def ratio(self) -> float:
        return self.held_bytes / self.file_bytes if self.file_bytes else 0.0


def stored_bytes(t) -> int:
    """Bytes of GGUF tensor ``t`` in its file, from its shape and type (its data is not touched)."""
    from gguf import GGML_QUANT_SIZES

    per, nbytes = GGML_QUANT_SIZES[t.ggml_type]
    rows = 1
    for d in t.shape[:-1]:
        rows *= int(d)
    return rows * (int(t.shape[-1]) // per) * nbytes


def _matrix_layouts(exact: dict) -> tuple:
    """(format, group, affine, scale dtype, codebook) of gate/up and of down in an exact_layout."""
    fmts = exact["weight_format"] if isinstance(exact["weight_format"], tuple) else (exact["weight_format"],) * 2
    groups = (exact["group_size"], exact["down_group_size"] or exact["group_size"])
    return tuple((fmts[j], groups[j], exact["scaling"][j] == "affine", exact["scale_dtype"][j], exact["codebook"][j])
                 for j in (0, 1))


def _row(rows: dict, part: str, kind: str) -> TypeRow:
    return rows.setdefault((part, kind), TypeRow(part, kind))


def expert_rows(ckpt, blocks: list, names: tuple, plan, rows: dict) -> None:
    """Add the routed experts of ``blocks`` (``names``: gate, up, down as the model calls them) to ``rows``, each
    layer as ``plan.layers`` places it (the loader's decision: ``experts_layout`` and ``plan_format``)."""
    seen = set()
    for (prefix, block), lp in zip(blocks, plan.layers):
        fmt, group = lp.experts_format, lp.group_size
        exact = ckpt.experts_layout(prefix, list(names), fmt)
        held = exact is not None and plan_format(exact) == (fmt, group)
        for j, w in enumerate(names):
            t, _, _ = ckpt._entry(f"{prefix}.experts.0.{w}.weight")
            n, k = ckpt.shape(f"{prefix}.experts.0.{w}.weight")
            row = _row(rows, "experts", t.ggml_type.name)
            if id(t) not in seen:  # a stacked tensor holds every expert of the matrix
                seen.add(id(t))
                row.tensors += 1
                row.file_bytes += stored_bytes(t)
            if held:
                mfmt, mgroup, affine, sdt, book = _matrix_layouts(exact)[0 if j < 2 else 1]
                row.held_bytes += block.num_experts * packed_matrix_bytes(mfmt, n, k, mgroup, affine, sdt,
                                                                          codebook=book)
                how = f"{mfmt}{' ' + book if book else ''} g{mgroup} {sdt}{' affine' if affine else ''}"
                row.held_as.add(f"{how} (exact)")
            else:
                row.held_bytes += block.num_experts * packed_matrix_bytes(fmt, n, k, group)
                row.held_as.add(f"{fmt}{f' g{group}' if fmt != 'bf16' else ''} (re-quantized)")


def dense_rows(ckpt, model: nn.Module, plan, rows: dict) -> None:
    """Add every dense parameter of ``model`` (meta) to ``rows`` under the GGML type of its tensor in the file: held
    in the plan's dtype, or its dense format for the linears that format packs (placement.dense_bytes' rule)."""
    itemsize = plan.dtype.itemsize
    fmt = plan.dense_format
    packed = {} if fmt == "bf16" else {
        f"{name}.weight": (m.out_features, m.in_features) for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in KEEP}
    seen = set()
    for name, p in model.named_parameters():
        kind = ckpt.ggml_type(name) if name in ckpt else "tied or absent"
        row = _row(rows, "dense", kind)
        if name in ckpt:
            t, _, _ = ckpt._entry(name)
            for part in (t.values() if isinstance(t, dict) else (t,)):  # MLA's kv_b_proj: attn_k_b and attn_v_b
                if id(part) not in seen:
                    seen.add(id(part))
                    row.tensors += 1
                    row.file_bytes += stored_bytes(part)
        if name in packed:
            row.held_bytes += DENSE_FORMATS[fmt].nbytes(*packed[name])
            row.held_as.add(fmt)
        else:
            row.held_bytes += p.numel() * itemsize
            row.held_as.add(str(plan.dtype).replace("torch.", "").replace("float32", "fp32").replace(
                "bfloat16", "bf16").replace("float16", "fp16"))


def type_rows(ckpt, model: nn.Module, blocks: list, names: tuple, plan) -> list:
    """TypeRow of every (part, GGML type) of the file as ``plan`` holds it: experts first, then dense, each by
    bytes held (largest first)."""
    rows: dict = {}
    if blocks:
        expert_rows(ckpt, blocks, names, plan, rows)
    dense_rows(ckpt, model, plan, rows)
    return sorted(rows.values(), key=lambda r: (r.part != "experts", -r.held_bytes))


def type_table(rows: list) -> list:
    """The rows as lines: part, type, tensors, file bytes, held bytes, held ÷ file, how held; a total per part."""
    lines = [f"{'part':<8} {'type':<14} {'tensors':>7} {'file':>10} {'held':>10} {'ratio':>6}  held as"]
    for part in ("experts", "dense"):
        mine = [r for r in rows if r.part == part]
        if not mine:
            continue
        for r in mine:
            ratio = f"{r.ratio:.2f}x" if r.file_bytes else "-"
            lines.append(f"{part:<8} {r.ggml_type:<14} {r.tensors:>7} {gib(r.file_bytes):>10} {gib(r.held_bytes):>10} "
                         f"{ratio:>6}  {', '.join(sorted(r.held_as))}")
        file, held = sum(r.file_bytes for r in mine), sum(r.held_bytes for r in mine)
        lines.append(f"{part:<8} {'total':<14} {sum(r.tensors for r in mine):>7} {gib(file):>10} {gib(held):>10} "
                     f"{(f'{held / file:.2f}x' if file else '-'):>6}")
    return lines

