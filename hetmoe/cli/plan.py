"""``hetmoe plan``: the memory plan of a model — a checkpoint directory, a GGUF file or a named shape — under the
engine and budget options, printed as a table (what goes where, bytes, why) without reading any weight. Exit
status 0 when it fits, 1 when it does not (the table, then the reason on stderr).

The model is built on the meta device from its config (config.json, the GGUF metadata, or
hetmoe.load.random_weights.SHAPES) and planned as the loader plans it (loader.plan_model). ``--device cuda`` on a
machine without a GPU plans for one: its memory then comes from ``--gpu-memory``. For a GGUF file a second table
gives its bytes per GGML type, in the file and as held (hetmoe/load/gguf/type_bytes.py), from the tensor headers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from hetmoe.cli.options import add_shape_options
from hetmoe.config.flags import add_engine_options, engine_options

WIDTH = 100  # columns of the table


def checkpoint_formats() -> dict:
    """Name -> CPUExperts layout of the experts' formats hetmoe holds exactly as checkpoints ship them (GGUF types
    and mixes, NVFP4, int4 with zero points, FP8 blocks and MXFP8): ``--shape-experts``'s choices, the same names
    as ``hetmoe bench kernel --formats``."""
    from hetmoe.bench import kernel

    names = [*kernel.GGUF_FORMATS, *kernel.NVFP4_FORMATS, *kernel.FP8_FORMATS, *kernel.ZP_FORMATS]
    return {n: kernel.format_args(n, None) for n in names}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="the memory plan of a model (what goes where, bytes, why), without loading it")
    add_engine_options(p)
    add_shape_options(p)
    p.add_argument("--shape-experts", metavar="FORMAT", default=None,
                   help="with --shape: plan the routed experts as a checkpoint that ships them in FORMAT holds them "
                        "(its own bytes, every layer): a GGUF type or mix (q4_k_m, mxfp4, iq2_xxs, ud_iq2_xxs, ...), "
                        "nvfp4, nvfp4_div, fp8 (128x128 blocks), mxfp8, int4_zp (GPTQ / AWQ zero points); the names "
                        "of `hetmoe bench kernel --formats`")
    p.set_defaults(handler=run)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def checkpoint_model(ckpt, options, log: Callable[[str], None]) -> tuple:
    """(config, meta model, MoE blocks, expert intermediate size, options, GGUF expert types, expert names) of the
    open checkpoint ``ckpt``: its config and tensor headers only, as load_model reads them before its plan (a GGUF
    file's experts format and per-layer types too)."""
    from hetmoe.load.checkpoint import CheckpointError
    from hetmoe.load.loader import build_meta, checked_config, moe_blocks
    from hetmoe.load.materialize import expert_keys

    types, names = (), ()
    source = getattr(ckpt, "config_source", ckpt.path / "config.json")
    cfg = checked_config(ckpt.config, source)
    try:
        model = build_meta(cfg)
    except (AttributeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{source} does not describe a {cfg.get('model_type')} model ({err})") from None
    blocks, inter = moe_blocks(model), 0
    if blocks:
        names = expert_keys(ckpt, blocks[0][0])
        inter = ckpt.shape(f"{blocks[0][0]}.experts.0.{names[0]}.weight")[0]
        if hasattr(ckpt, "experts_options"):  # a GGUF file: experts at their own precision by default
            options = ckpt.experts_options([f"{blocks[0][0]}.experts.0.{n}.weight" for n in names], options, log)
            types = ckpt.expert_layouts([name for name, _ in blocks], names)
    return cfg, model, blocks, inter, options, types, names


def shape_model(shape: str, layers, options, experts: Optional[str] = None) -> tuple:
    """As ``checkpoint_model``, for a named shape of hetmoe.load.random_weights.SHAPES; ``experts``: a name of
    ``checkpoint_formats``, the layout every MoE layer's experts are held in exactly (as a checkpoint of those
    types is loaded: the plan's experts format and group are the layout's, every layer planned in it)."""
    import dataclasses

    from hetmoe.cpu.codes import plan_format
    from hetmoe.load.loader import build_meta, moe_blocks
    from hetmoe.load.random_weights import shape_config
    from hetmoe.plan.memory import HeldLayouts

    cfg = shape_config(shape, layers)
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    inter = (cfg.get("moe_intermediate_size") or cfg.intermediate_size) if blocks else 0
    held = ()
    if experts is not None:
        formats = checkpoint_formats()
        if experts not in formats:
            raise ValueError(f"--shape-experts {experts!r} is not a checkpoint format hetmoe holds exactly; one of: "
                             f"{', '.join(formats)}")
        if options.experts_format != "auto" or options.group_size is not None:
            raise ValueError("--shape-experts sets the experts' format and group; leave --experts-format and "
                             "--group-size out")
        layout = formats[experts]
        fmt, group = plan_format(layout)
        held = (HeldLayouts({fmt: layout}, (fmt, group)),) * len(blocks)
        options = dataclasses.replace(options, experts_format=fmt, group_size=group)
    return cfg, model, blocks, inter, options, held, ()


def make_plan(args: argparse.Namespace, log: Callable[[str], None] = _log) -> tuple:
    """(title line, plan or the PlanError it did not fit with, lines of bytes per GGML type: a GGUF file's, else
    none) of the model ``args`` name under their options."""

    from hetmoe.engine.llm import default_model_path
    from hetmoe.load.loader import open_checkpoint
    from hetmoe.plan.placement import normalize_options

    if args.model is not None and args.shape is not None:
        raise ValueError("--model and --shape name two models; give one")
    if args.layers is not None and args.shape is None:
        raise ValueError("--layers applies to --shape only")
    experts = getattr(args, "shape_experts", None)
    if experts is not None and args.shape is None:
        raise ValueError("--shape-experts applies to --shape only (a checkpoint's experts are held as it ships them)")
    options = normalize_options(engine_options(args), log)
    if args.shape is not None:
        name = f"{args.shape} shape" + (f", experts as {experts}" if experts else "")
        return _plan(shape_model(args.shape, args.layers, options, experts), name, options, None)
    path = args.model if args.model is not None else default_model_path()
    ckpt = open_checkpoint(path)  # config and tensor headers; no weight
    try:
        return _plan(checkpoint_model(ckpt, options, log), str(path), options, ckpt)
    finally:
        ckpt.close()


def _plan(model_parts: tuple, name: str, options, ckpt) -> tuple:
    """make_plan's result for a model (checkpoint_model's tuple) named ``name``; ``ckpt``: its open checkpoint."""
    import torch

    from hetmoe.load.loader import plan_model
    from hetmoe.plan.memory import PlanError
    from hetmoe.plan.placement import resolve_device

    cfg, model, blocks, inter, options, types, names = model_parts
    # --device cuda without a GPU here: plan for one (its size from --gpu-memory)
    planned = torch.device("cuda") if options.device == "cuda" and not torch.cuda.is_available() else None
    where = "cuda (a GPU this machine does not have)" if planned else resolve_device(options.device).type
    dense = sum(p.numel() for p in model.parameters())
    routed = sum(b.num_experts for _, b in blocks) * 3 * cfg.hidden_size * inter
    title = (f"{name}: {cfg.get('model_type')}, {cfg.num_hidden_layers} layers ({len(blocks)} MoE), "
             f"{dense / 1e9:.2f} G dense + {routed / 1e9:.2f} G routed-expert parameters, on {where}")
    try:
        plan = plan_model(model, cfg, blocks, options, inter, planned, types)
    except PlanError as err:
        plan = err
    by_type = []
    from hetmoe.load.gguf.checkpoint import GGUFCheckpoint

    if isinstance(ckpt, GGUFCheckpoint):  # a GGUF file: its bytes per GGML type
        from hetmoe.load.gguf.type_bytes import type_rows, type_table

        by_type = type_table(type_rows(ckpt, model, blocks, names, getattr(plan, "plan", plan)))
    return title, plan, by_type


def run(args: argparse.Namespace) -> int:
    title, plan, by_type = make_plan(args)
    err = plan if isinstance(plan, MemoryError) else None
    plan = err.plan if err is not None else plan
    print(title)
    print("\n".join(plan.table(WIDTH)))
    if by_type:
        print()
        print("\n".join(by_type))
    for note in plan.notes:
        print(f"note: {note}")
    if err is not None:
        print(f"hetmoe plan: does not fit: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0
