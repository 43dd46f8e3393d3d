"""Loading a Hugging Face checkpoint directory into a runnable model.

    config.json, checked (models.check_config: every size, top-k, groups, RoPE; a bad entry is named before any
    weight is read) -> model class (hetmoe.models.model_class) built on the meta device (no memory)
    -> memory plan (placement.choose_plan: refuses what cannot fit, before reading any weight)
    -> the globals (embeddings, final norm, lm_head), then one decoder layer at a time:
         dense tensors copied to their device in the plan's dtype (FP8 dequantized on the fly),
         routed experts packed into the CPU engine's format (or read from the converted-expert cache; a GGUF
         file's and compressed-tensors int4 experts from their own codes, hetmoe/cpu/codes.py),
         the dense linears packed in the dense format (on a GPU other than bf16: read into host memory, uploaded
         and converted a slab at a time, so VRAM holds no bf16 copy: load/dense.py),
         the layer's source pages released
    -> the model, on its devices, with its CPU experts attached to every MoE layer (hetmoe/moe/: ``MoELayer.attach``;
       Expert Deferral set when options.defer_experts > 0), its projections that read one input fused into one
       matmul (CausalLM.fuse_projections)
    -> with --gpu-experts N on a GPU: N experts per MoE layer also kept there, chosen by a calibration prefill
       (load/calibration.py).

Checkpoint tensors are found by the model's own parameter names (Hugging Face names), so no rename table
exists; routed experts are ``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` (Mixtral:
``w1, w3, w2``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from hetmoe.config.options import LOW_BIT_FORMATS, EngineOptions
from hetmoe.config.rules import load as load_rules
from hetmoe.config.units import gib, show_progress, wrap
from hetmoe.cpu import HYBRID_RESERVED_CORES, CPUExperts, default_threads
from hetmoe.cpu.codes import plan_format
from hetmoe.cpu.layout import FP8_LAYOUTS
from hetmoe.cpu.lowbit import layout as low_bit_layout
from hetmoe.cpu.numa import resolve_subpools
from hetmoe.load import fp8_formats
from hetmoe.load.calibration import calibration_text, check_gpu_experts, keep_gpu_experts
from hetmoe.load.checkpoint import Checkpoint, CheckpointError, block_fp8, check_quantization, read_config
from hetmoe.load.dense import FP8Source, pack_dense
from hetmoe.load.expert_cache import ExpertCache, default_cache_dir
from hetmoe.load.lowbit import fill_low_bits, low_bit_formats, low_bit_key
from hetmoe.load.materialize import Materializer, expert_keys, fill_experts
from hetmoe.load.rules import apply_native, defer_layers, layerwise_layers
from hetmoe.load.shapes import model_shapes
from hetmoe.models import APPLIES_ROPE_SCALING, MODEL_TYPES, ConfigError, check_config, model_class
from hetmoe.models.config import ModelConfig
from hetmoe.moe import HostStaging, MoELayer, moe_layers
from hetmoe.moe.streamed import choice as prefill_choice
from hetmoe.moe.streamed.layerwise import LayerwisePrefill
from hetmoe.plan.memory import HeldLayouts, LayerPlan, MemoryPlan, PlanError
from hetmoe.plan.placement import choose_plan, normalize_options, resolve_device, resolve_dtype

# (*) defer_experts (the uniform deferral) is imported from here by hetmoe/bench/decode_variants.py and tests.


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    plan: MemoryPlan
    options: EngineOptions
    path: Optional[Path] = None
    info: dict = field(default_factory=dict)
    layerwise: Optional[LayerwisePrefill] = None  # the streamed GPU prefill (moe/streamed/layerwise.py), or None

    @property
    def device(self) -> torch.device:
        return self.plan.device


moe_blocks = moe_layers  # (block name, MoELayer) of every MoE block of a model, in forward order


_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "constant_", "zeros_", "ones_")


def build_meta(cfg: ModelConfig) -> nn.Module:
    # Random init is skipped: it is meaningless on meta tensors, and normal_ on a meta tensor imports
    # torch._dynamo (about 2 s on every first load in a process).
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}
    try:
        for n in saved:
            setattr(nn.init, n, lambda t, *args, **kwargs: t)
        with torch.device("meta"):
            return model_class(cfg)(cfg)
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def new_experts(layer: MoELayer, cfg: ModelConfig, inter: int, plan: MemoryPlan,
                options: EngineOptions, spec: Optional[LayerPlan] = None, exact: Optional[dict] = None) -> CPUExperts:
    """Empty CPU experts for a MoE layer, in the format of its ``spec`` (``plan.layers[i]``; default: the plan's;
    group 0: per-row scales), on the options' threads, NUMA split and kernel ISA. ``exact``: a GGUF
    layer's own code layout (GGUFCheckpoint.experts_layout), taken when the plan counted it (codes.plan_format)."""
    threads = options.threads
    if threads is None and plan.device.type == "cuda":
        threads = default_threads(reserve=HYBRID_RESERVED_CORES)
    fmt, group = (spec.experts_format, spec.group_size) if spec else (plan.experts_format, plan.group_size)
    formats = low_bit_formats(spec) if spec else (fmt, fmt)
    if exact is None and (formats[0] != formats[1] or fmt in LOW_BIT_FORMATS):  # quantized in hetmoe/cpu/lowbit.py
        return CPUExperts(layer.num_experts, cfg.hidden_size, inter, threads=threads, numa=options.numa,
                          isa=options.isa, amx_min_tokens=options.amx_min_tokens, glu=layer.glu, bias=layer.bias,
                          **low_bit_layout(*formats))
    own = dict(FP8_LAYOUTS[group]) if fmt == "fp8" else {}  # what a plan's fp8 group holds (block FP8, MXFP8)
    if exact is not None and plan_format(exact) == (fmt, group):  # e.g. int4 gate/up, int8 down in an int8 plan
        fmt, own = exact["weight_format"], {k: v for k, v in exact.items() if k not in ("weight_format", "group_size")}
    return CPUExperts(layer.num_experts, cfg.hidden_size, inter, fmt, group,
                      threads=threads, numa=options.numa, isa=options.isa, amx_min_tokens=options.amx_min_tokens,
                      glu=layer.glu, bias=layer.bias, **own)


def plan_model(model: nn.Module, cfg: ModelConfig, blocks: list, options: EngineOptions, inter: int,
               device: Optional[torch.device] = None, expert_layouts: tuple = ()) -> MemoryPlan:
    """The checks that read no weight (deferral, --gpu-experts, the placement rules of ``options.rules`` against the
    model's modules) and the memory plan, its ``layers`` placed as the rules say (on ``device``: hetmoe plan's).
    ``expert_layouts``: a GGUF file's (GGUFCheckpoint.expert_layouts, a HeldLayouts per MoE layer), so that layers
    held exactly are planned and counted in the layouts the loader builds; an FP8 checkpoint's experts count theirs
    (hetmoe/load/fp8_formats.py layout: per-channel FP8's scales are per row and group, not shared)."""
    check_deferral(cfg, len(blocks), options.defer_experts)
    check_gpu_experts([b.num_experts for _, b in blocks], 0 if options.gpu_experts == "auto" else options.gpu_experts)
    kind = fp8_formats.scheme(cfg.get("quantization_config"))  # FP8: block, MX, channel
    if not expert_layouts and kind is not None and blocks:
        expert_layouts = (HeldLayouts({"fp8": fp8_formats.layout(kind)}),) * len(blocks)
    shapes = replace(model_shapes(model, cfg, inter), expert_layouts=tuple(expert_layouts))
    layers = None
    if options.rules is not None:
        where = device or resolve_device(options.device)
        layers = apply_native(load_rules(options.rules), model, blocks, where,
                              resolve_dtype(options.dtype, where, shapes.dense_params), shapes.top_k)
    group = fp8_formats.GROUPS.get(kind)
    if options.experts_format == "auto" and group and options.group_size in (None, group) and blocks:
        try:  # an FP8 checkpoint's own routed experts: exact, one byte per weight (if they fit; else auto as usual)
            plan = _choose_dense(shapes, replace(options, experts_format="fp8", group_size=group), cfg, layers, device)
            plan.why["routed experts"] = ("auto: the checkpoint's own FP8 experts (exact: e4m3 codes and scales as "
                                          "stored)")
            return plan
        except (PlanError, ValueError):
            pass
    return _choose_dense(shapes, options, cfg, layers, device)


def _choose_dense(shapes, options: EngineOptions, cfg: ModelConfig, layers, device) -> MemoryPlan:
    """choose_plan, trying a DeepSeek FP8 checkpoint's own dense weights first on a GPU (--dense-format auto)."""
    if options.dense_format == "auto" and block_fp8(cfg) and (device or resolve_device(options.device)).type == "cuda":
        try:  # a DeepSeek FP8 checkpoint's own weights: exact, half of bf16 (if they fit and run; else auto says why)
            plan = choose_plan(shapes, replace(options, dense_format="fp8"), layers, device)
            plan.why["dense weights"] = "auto: the checkpoint's own FP8 weights (exact; half of bf16)"
            return plan
        except (PlanError, ValueError):
            pass
    return choose_plan(shapes, options, layers, device)


def check_deferral(cfg: ModelConfig, n_moe: int, d: int) -> None:
    """Refuse, before any weight is read, a deferral the model cannot do: d must be below its top-k."""
    if not d:
        return
    if not n_moe:
        raise ValueError(f"--defer-experts {d}: this model has no routed experts")
    k = cfg.num_experts_per_tok
    if d >= k:
        raise ValueError(f"--defer-experts {d}: each token has {k} routed experts (top-{k}); at most {k - 1} can be "
                         "deferred")


def checked_config(cfg: ModelConfig, source) -> ModelConfig:
    """``cfg`` when the model files can run it (models.check_config) and the loader can read its weights
    (checkpoint.check_quantization); else CheckpointError naming the entry, its value and ``source`` (the
    config.json file)."""
    try:
        check_config(cfg, str(source))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    if cfg.get("model_type") in MODEL_TYPES:
        check_quantization(cfg, source)
    return cfg


def is_gguf(path) -> bool:
    """A .gguf file, or a directory holding GGUF files and no config.json (hetmoe/load/gguf/)."""
    from hetmoe.load.gguf.checkpoint import is_gguf as gguf_path

    return gguf_path(path)


def check_model_kind(path) -> None:
    """A ``--model`` path that exists but is neither a directory nor a GGUF file is refused by what it is, with what
    is accepted (ValueError); a missing .gguf file is a FileNotFoundError (a missing directory: read_config's)."""
    path = Path(path)
    if not path.exists() and path.suffix == ".gguf":
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    if not path.exists() or path.is_dir() or is_gguf(path):
        return
    accepted = ("--model takes a Hugging Face checkpoint directory (config.json, tokenizer and *.safetensors) or a "
                "GGUF file (.gguf)")
    if path.suffix == ".safetensors" or path.name in ("config.json", "model.safetensors.index.json"):
        what = f"a file of a Hugging Face checkpoint: pass its directory, {path.parent}"
    elif not path.is_file():
        what = "not a regular file or directory"
    else:
        what = f"a file ({path.suffix or 'no suffix'}), not a model"
    raise ValueError(f"{path} is {what}. {accepted}")


def open_checkpoint(path):
    """A Checkpoint of a Hugging Face directory, or a GGUFCheckpoint of a GGUF file (the same interface)."""
    check_model_kind(path)
    if not is_gguf(path):
        return Checkpoint(path)
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RuntimeError(f"{path}: reading GGUF files needs the gguf package (pip install -e '.[gguf]' in the "
                           "hetmoe repository, or pip install gguf)") from None
    from hetmoe.load.gguf.checkpoint import GGUFCheckpoint

    return GGUFCheckpoint(path)


def check_model_dir(path) -> ModelConfig:
    """The checks of a model directory (or GGUF file) that read no weight: it exists (a hub id gets the download
    hint), config.json (a GGUF file's metadata) parses and describes a model hetmoe can build. Returns the config."""
    path = Path(path)
    check_model_kind(path)
    if is_gguf(path):
        ckpt = open_checkpoint(path)
        ckpt.close()
        return checked_config(ckpt.config, ckpt.config_source)
    return checked_config(read_config(path), path / "config.json")


def config_notes(cfg: ModelConfig) -> list:
    """What a config asks for that the model file does not do (said at load, not refused)."""
    scaling = cfg.rope_scaling_params
    notes = []
    if scaling and cfg.get("model_type") not in APPLIES_ROPE_SCALING:
        notes.append(f"config.json asks for {scaling['rope_type']} RoPE scaling, which hetmoe's "
                     f"{cfg.get('model_type')} model does not apply: it runs default RoPE, over at most "
                     "max_position_embeddings positions")
    if cfg.get("model_type") == "deepseek_v4" and cfg.get("num_nextn_predict_layers"):
        notes.append(f"the checkpoint's {cfg['num_nextn_predict_layers']} multi-token-prediction layer(s) (mtp.*) "
                     "are not read: hetmoe decodes one token per step")
    return notes


def check_activation(blocks: list, options: EngineOptions, source) -> EngineOptions:
    """MoE layers whose routed experts are not plain SwiGLU without biases (a clamped SwiGLU: gpt-oss, DeepSeek-V4,
    MiniMax-M3; biases: gpt-oss) run on the CPU engine only (the GPU experts' kernels compute plain SwiGLU):
    --gpu-experts N is refused (CheckpointError naming the activation, before any weight is read), auto plans none.
    Returns the options."""
    odd = [b for _, b in blocks if not b.plain_swiglu]
    if not odd:
        return options
    what = f"{odd[0].glu.kind}{' with biases' if odd[0].bias else ''}"
    if isinstance(options.gpu_experts, int) and options.gpu_experts > 0:
        raise CheckpointError(f"{source}: --gpu-experts {options.gpu_experts}: this model's routed experts are {what}, "
                              "which only the CPU engine computes; run it without --gpu-experts")
    return replace(options, gpu_experts=0) if options.gpu_experts == "auto" else options


def load_summary(cfg: ModelConfig, path: Path, n_layers: int, n_moe: int, plan: MemoryPlan,
                 options: EngineOptions, width: int = 100) -> list:
    """The lines logged when a load starts, each at most ``width`` columns (a long path overflows alone): what,
    from where, how placed, the memory plan, and notes on options or config entries that do not apply."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(plan.dtype, str(plan.dtype).replace("torch.", ""))
    def fmt(f: str, g: int) -> str:
        return f + ("" if f == "bf16" else f" (group {g})" if g else " (per-row scales)")

    kinds = [fmt(lp.formats, lp.group_size) for lp in plan.layers] or [fmt(plan.experts_format,
                                                                                   plan.group_size)]
    experts = (f"{kinds[0]} experts" if len(set(kinds)) == 1
               else "experts " + " + ".join(f"{k} in {kinds.count(k)} layer{'s' * (kinds.count(k) > 1)}"
                                        for k in dict.fromkeys(kinds)))
    how = [f"{n_layers} layers ({n_moe} MoE)", f"on {plan.device.type}", f"{dtype} dense part", experts]
    defers = [lp.defer_experts for lp in plan.layers]
    if len(set(defers)) > 1:
        how.append(f"deferral per layer {','.join(map(str, defers))}")
    elif defers and defers[0]:
        how.append(f"{defers[0]} deferred per token")
    if options.rules is not None:
        how.append(f"rules {options.rules}")
    if options.threads is not None:
        how.append(f"{options.threads} expert threads")
    lines = wrap(f"hetmoe: {cfg.get('model_type')} from", [str(path)], width)
    lines += wrap("hetmoe:  ", how, width)
    lines += [f"hetmoe:   {line}" for line in plan.table(width - 10)]
    notes = config_notes(cfg) + plan.notes
    if options.group_size is not None and plan.experts_format == "bf16":
        notes.append(f"--group-size {options.group_size} does not apply to bf16 experts (they have no scale "
                     "groups); ignored")
    for note in notes:
        lines += wrap("hetmoe: note:", note.split(" "), width, indent="hetmoe:   ", sep="")
    return lines


def load_tokenizer(path, cfg: Optional[ModelConfig] = None, log: Optional[Callable[[str], None]] = None):
    """The tokenizer of model directory ``path`` with every file read now — tokenizer.json (or Kimi's
    tiktoken.model), tokenizer_config.json, the chat template compiled — so that a broken one is reported before
    any weight is read (ValueError / FileNotFoundError naming the file). A tokenizer with more tokens than
    ``cfg``'s vocab_size is noted."""
    import jinja2

    from hetmoe.tokenizer import TIKTOKEN_FILE, Tokenizer, compile_template

    path = Path(path)
    if is_gguf(path):  # tokenizer.ggml.* and tokenizer.chat_template of the file
        from hetmoe.load.gguf.checkpoint import tokenizer_of

        return tokenizer_of(path)
    try:
        tok = Tokenizer.from_dir(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: a tokenizer file is not UTF-8 ({err})") from None
    if tok.chat_template:
        try:
            compile_template(tok.chat_template)
        except jinja2.TemplateError as err:
            src = path / "chat_template.jinja"
            src = src if src.is_file() else path / "tokenizer_config.json"
            raise ValueError(f"{src}: the chat template does not compile ({err})") from None
    vocab = (cfg or {}).get("vocab_size")
    if log is not None and isinstance(vocab, int) and tok.vocab_size > vocab:
        file = path / "tokenizer.json" if (path / "tokenizer.json").is_file() else path / TIKTOKEN_FILE
        log(f"hetmoe: note: {file} has {tok.vocab_size} tokens, config.json's vocab_size is "
            f"{vocab}: ids from {vocab} on have no embedding")
    return tok


def load_model(
    path,
    options: Optional[EngineOptions] = None,
    *,
    expert_cache: Optional[str] = "auto",
    progress: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> LoadedModel:
    """Load the checkpoint directory ``path`` as ``options`` place it.

    ``expert_cache``: a directory for converted experts, ``"auto"`` (``$XDG_CACHE_HOME/hetmoe/experts``), or
    None or ``"off"`` (no cache, as the CLI's ``--expert-cache off``). Raises FileNotFoundError / CheckpointError
    (ValueError) naming the file and tensor for a bad checkpoint, MemoryError when the plan does not fit.
    """
    t0 = time.perf_counter()
    options = normalize_options(options or EngineOptions(), log)
    ckpt = open_checkpoint(path)  # config.json and every shard header (a GGUF file's metadata); no weight
    source = getattr(ckpt, "config_source", ckpt.path / "config.json")  # what describes the model
    cfg = checked_config(ckpt.config, source)
    try:
        model = build_meta(cfg)
    except (AttributeError, KeyError, TypeError) as err:  # a config.json without an entry the model needs
        raise CheckpointError(f"{source} does not describe a {cfg.get('model_type')} model "
                              f"({err})") from None
    blocks = moe_blocks(model)
    options = check_activation(blocks, options, source)
    inter = 0
    if blocks:
        names = expert_keys(ckpt, blocks[0][0])
        inter = ckpt.shape(f"{blocks[0][0]}.experts.0.{names[0]}.weight")[0]
    if blocks and hasattr(ckpt, "experts_options"):  # GGUF / compressed-tensors experts: their own bits by default
        options = ckpt.experts_options([f"{blocks[0][0]}.experts.0.{n}.weight" for n in names], options, log)
    held = getattr(ckpt, "expert_layouts", lambda *a: ())([name for name, _ in blocks], names) if blocks else ()
    plan = plan_model(model, cfg, blocks, options, inter, expert_layouts=held)
    if options.gpu_experts or any(lp.gpu_experts for lp in plan.layers):
        calibration_text(options.calibration_file)  # a bad file fails now, not after loading
    for line in load_summary(cfg, ckpt.path, len(model.model.layers), len(blocks), plan, options):
        log(line)
    for note in getattr(ckpt, "notes", ()):  # e.g. a multimodal checkpoint's vision tower, left out
        for line in wrap("hetmoe: note:", note.split(" "), 100, indent="hetmoe:   ", sep=""):
            log(line)
    caches = {}  # (format, group) -> ExpertCache: each layer's packed experts keyed by its own format
    said: set = set()  # the expert-cache warnings given in this load: each said once, whatever the layer or format

    def cache_for(lp: LayerPlan) -> Optional[ExpertCache]:
        if expert_cache is None or expert_cache == "off":
            return None
        key = (low_bit_key(lp), lp.group_size)
        if key not in caches:
            root = default_cache_dir() if expert_cache == "auto" else Path(expert_cache)
            caches[key] = ExpertCache(root, ckpt, *key, warn=lambda m: log(f"hetmoe: {m}"),
                                      numa=resolve_subpools(options.numa, options.threads), said=said)
        return caches[key]
    staging = (HostStaging(cfg.hidden_size, cfg.num_experts_per_tok, plan.dtype)
               if plan.device.type == "cuda" and blocks else None)
    fp8 = FP8Source.of(ckpt, plan)  # fp8 dense weights on a GPU: a DeepSeek FP8 checkpoint's own (or None)
    filler = Materializer(ckpt, plan, fp8)
    filler.fill(model, "")
    pack_dense(model, plan.dense_format, plan.device, options, plan.dtype, fp8)  # lm_head now (the layers: meta)
    layers = model.model.layers
    expert_bytes = 0
    with show_progress(len(layers), "loading", "layer", progress, say=log) as bar:
        for i in range(len(layers)):
            prefix = f"model.layers.{i}"
            filler.fill(model, prefix)
            for (name, block), lp in zip(blocks, plan.layers):
                if not name.startswith(prefix + "."):
                    continue
                exact = getattr(ckpt, "experts_layout", lambda *a: None)(name, expert_keys(ckpt, name),
                                                                          lp.experts_format)
                experts = new_experts(block, cfg, inter, plan, options, lp, exact)
                cache = cache_for(lp)
                if cache is None or not cache.load(i, experts):
                    if exact is None and low_bit_key(lp) != lp.experts_format:
                        fill_low_bits(ckpt, name, experts, low_bit_formats(lp))  # quantized here from floats
                    else:
                        fill_experts(ckpt, name, experts)
                    if cache is not None:
                        cache.save(i, experts)
                expert_bytes += experts.nbytes
                block.attach(experts, staging)
            pack_dense(layers[i], plan.dense_format, plan.device, options, plan.dtype, fp8)  # its source freed now
            ckpt.release()
            bar.update(1)
    ckpt.close()
    defer_layers(blocks, plan)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{ckpt.path}: tensors were never loaded: {', '.join(missing[:5])}")
    model.fuse_projections()  # q/k/v (and gate/up) as one matmul each; parameters and their names unchanged
    pack_dense(model, plan.dense_format, plan.device, options, plan.dtype, fp8)  # what is left (none, normally)
    if fp8 is not None:
        fp8.done(log)
    gpu_experts = keep_gpu_experts(model.eval(), blocks, plan, options, lambda text: load_tokenizer(path).encode(text),
                                   log)
    streamed = layerwise_layers(blocks, plan)
    lw, gpu_prefill = prefill_choice.setup(streamed, plan, options, log)
    used = list(caches.values())
    info = {
        "load_s": time.perf_counter() - t0,
        "expert_bytes": expert_bytes,
        "cache_hits": sum(c.hits for c in used),
        "cache_misses": sum(c.misses for c in used),
        "cache_dir": str(used[0].dir) if used else None,
        "cache_dirs": [str(c.dir) for c in used],
        "gpu_experts": gpu_experts,
        "gpu_prefill": gpu_prefill,
    }
    done = [f"routed experts {gib(expert_bytes)}"]
    if used:
        total = sum(c.hits + c.misses + c.rebuilt for c in used)
        done.append(f"expert cache {info['cache_hits']}/{total} layers reused")
        rebuilt, unwritten = sum(c.rebuilt for c in used), sum(c.unwritten for c in used)
        if rebuilt:
            done.append(f"{rebuilt} bad cache file{'s' * (rebuilt > 1)} rebuilt")
        if unwritten:
            done.append(f"{unwritten} layer{'s' * (unwritten > 1)} not written to the cache")
    for line in wrap(f"hetmoe: loaded in {info['load_s']:.1f} s:", done):
        log(line)
    return LoadedModel(model.eval(), cfg, plan, options, ckpt.path, info, lw)
