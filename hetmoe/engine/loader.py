"""Loading a Hugging Face checkpoint directory into a runnable model.

    config.json -> model class (hetmoe.models.model_class) built on the meta device (no memory)
    -> memory plan (placement.choose_plan: refuses what cannot fit, before reading any weight)
    -> the globals (embeddings, final norm, lm_head), then one decoder layer at a time:
         dense tensors copied to their device in the plan's dtype (FP8 dequantized on the fly),
         routed experts packed into the CPU engine's format (or read from the converted-expert cache),
         the layer's source pages released
    -> the model, on its devices, with an experts backend attached to every MoE block
       (wrapped for Expert Deferral when options.defer_experts > 0: defer_experts), its projections that read one
       input fused into one matmul (CausalLM.fuse_projections)
    -> with --gpu-experts N on a GPU: N experts per MoE layer also kept there, chosen by a calibration prefill
       (engine/calibration.py).

Checkpoint tensors are found by the model's own parameter names (Hugging Face names), so no rename table
exists; routed experts are ``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`` (Mixtral:
``w1, w3, w2``).
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from hetmoe.engine.calibration import calibration_text, check_gpu_experts, keep_gpu_experts
from hetmoe.engine.checkpoint import Checkpoint, CheckpointError
from hetmoe.engine.expert_cache import ExpertCache, default_cache_dir
from hetmoe.engine.placement import EngineOptions, MemoryPlan, ModelShapes, choose_plan
from hetmoe.kernels import HYBRID_RESERVED_CORES, CPUExperts, default_threads
from hetmoe.layers.moe import DeferralChain, DeferredExperts, HostStaging, OffloadedExperts
from hetmoe.models import model_class
from hetmoe.models.config import ModelConfig
from hetmoe.numa import resolve_subpools

EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # HF names of gate, up, down
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    plan: MemoryPlan
    options: EngineOptions
    path: Optional[Path] = None
    info: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.plan.device


def moe_blocks(model: nn.Module) -> list:
    """(module name, module) of every block that takes a routed-experts backend (``experts`` attribute)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "experts") and not isinstance(m.experts, nn.Module)]


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


def _experts_of(block: nn.Module) -> int:
    return getattr(block, "num_experts", None) or block.gate.weight.shape[0]


def new_experts(block: nn.Module, cfg: ModelConfig, inter: int, plan: MemoryPlan,
                options: EngineOptions) -> CPUExperts:
    """Empty CPU experts for a MoE block, in the plan's format (group 0 with int8: per-row scales), on the
    options' threads, NUMA split and kernel ISA."""
    threads = options.threads
    if threads is None and plan.device.type == "cuda":
        threads = default_threads(reserve=HYBRID_RESERVED_CORES)
    return CPUExperts(_experts_of(block), cfg.hidden_size, inter, plan.experts_format, plan.group_size,
                      threads=threads, numa=options.numa, isa=options.isa, amx_min_tokens=options.amx_min_tokens)


def attach_experts(block: nn.Module, experts: CPUExperts, staging) -> None:
    """The block's routed experts: the CPU engine directly, or through pinned staging when the model is on a GPU."""
    block.experts = OffloadedExperts(experts, staging) if staging is not None else experts


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


def defer_experts(model: nn.Module, d: int, overlap: bool = True) -> Optional[DeferralChain]:
    """Expert Deferral on every MoE block of ``model``: the backend attached to each (in forward order) wrapped in
    a ``DeferredExperts`` deferring ``d`` experts per token, all sharing one ``DeferralChain`` (returned). d = 0
    leaves the model as it is and returns None."""
    if not d:
        return None
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"cannot defer {d} experts: the model has no MoE blocks")
    if any(isinstance(b.experts, DeferredExperts) for _, b in blocks):
        raise ValueError("the model's experts are already deferred")
    chain = DeferralChain(len(blocks))
    for i, (_, block) in enumerate(blocks):
        block.experts = DeferredExperts(block.experts, chain, i, d, overlap)
    return chain


def model_shapes(model: nn.Module, cfg: ModelConfig, expert_inter: int) -> ModelShapes:
    n_routed = sum(_experts_of(b) for _, b in moe_blocks(model))
    cache = model.make_cache(1, 1, device="meta")
    return ModelShapes(
        hidden=cfg.hidden_size, vocab_size=cfg.vocab_size, n_routed=n_routed, expert_inter=expert_inter,
        dense_params=sum(p.numel() for p in model.parameters()),
        kv_elems_per_token=(cache.k.numel() + cache.v.numel()), act_width=8 * cfg.hidden_size,
        max_position_embeddings=cfg.get("max_position_embeddings"), n_moe_layers=len(moe_blocks(model)),
    )


def _expert_keys(ckpt: Checkpoint, prefix: str) -> tuple:
    for names in EXPERT_NAMES:
        if f"{prefix}.experts.0.{names[0]}.weight" in ckpt:
            return names
    raise CheckpointError(f"{ckpt.path}: no routed experts found for {prefix} (expected tensors like "
                          f"{prefix}.experts.0.gate_proj.weight)")


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", disable=not enabled, file=sys.stderr, leave=False)


class _Materializer:
    """Copies checkpoint tensors into a meta-built model, module by module."""

    def __init__(self, ckpt: Checkpoint, plan: MemoryPlan):
        self.ckpt, self.plan = ckpt, plan
        self.used: set = set()

    def fill(self, model: nn.Module, prefix: str) -> None:
        """Every parameter and persistent buffer of ``model.get_submodule(prefix)`` (or of the globals when
        prefix is "" — everything outside model.layers)."""
        root = model.get_submodule(prefix) if prefix else model
        for mod_name, module in root.named_modules(prefix=prefix):
            if not prefix and _LAYER.match(mod_name + "."):
                continue
            for leaf, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[leaf] = nn.Parameter(self._tensor(f"{mod_name}.{leaf}", p), requires_grad=False)
            persistent = [b for b in module._buffers if b not in module._non_persistent_buffers_set]
            for leaf in persistent:
                b = module._buffers[leaf]
                if b is not None:
                    module._buffers[leaf] = self._tensor(f"{mod_name}.{leaf}", b, keep_dtype=True)
            for leaf in module._non_persistent_buffers_set:
                b = module._buffers.get(leaf)
                if b is not None:
                    module._buffers[leaf] = b.to(self.plan.device)

    def _tensor(self, name: str, like: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        ckpt = self.ckpt
        if name not in ckpt and name == "lm_head.weight" and ckpt.config.get("tie_word_embeddings"):
            name = "model.embed_tokens.weight"
        dtype = like.dtype if keep_dtype else self.plan.dtype
        src = ckpt.get_float(name)
        if tuple(src.shape) != tuple(like.shape):
            raise CheckpointError(f"tensor {name} has shape {list(src.shape)} in {ckpt.path}; the config implies "
                                  f"{list(like.shape)}")
        out = torch.empty(like.shape, dtype=dtype, device=self.plan.device)
        out.copy_(src)  # never a view of the mapped file
        self.used.add(name)
        return out


def fill_experts(ckpt: Checkpoint, prefix: str, experts: CPUExperts) -> None:
    """Pack the routed experts of block ``prefix`` from the checkpoint, one expert at a time (FP8 dequantized
    per expert, so at most one expert's fp32 copy exists at once)."""
    names = _expert_keys(ckpt, prefix)
    H, I = experts.hidden_size, experts.intermediate_size
    for e in range(experts.num_experts):
        mats = []
        for which, want in zip(names, ((I, H), (I, H), (H, I))):
            key = f"{prefix}.experts.{e}.{which}.weight"
            if tuple(ckpt.shape(key)) != want:
                raise CheckpointError(f"tensor {key} has shape {list(ckpt.shape(key))}; expected {list(want)}")
            mats.append(ckpt.get_float(key))
        try:
            experts.load([mats[0]], [mats[1]], [mats[2]], first_expert=e)
        except ValueError as err:
            raise CheckpointError(f"{prefix}.experts.{e}: {err}") from None


def _tokenize_with(path: Path) -> Callable[[str], list]:
    def tokenize(text: str) -> list:
        from hetmoe.engine.tokenizer import Tokenizer

        return Tokenizer.from_dir(path).encode(text)

    return tokenize


def load_model(
    path,
    options: Optional[EngineOptions] = None,
    *,
    expert_cache: Optional[str] = "auto",
    progress: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> LoadedModel:
    """Load the checkpoint directory ``path`` as ``options`` place it.

    ``expert_cache``: a directory for converted experts, ``"auto"`` (``$XDG_CACHE_HOME/hetmoe/experts``) or
    None (no cache). Raises FileNotFoundError / CheckpointError (ValueError) naming the file and tensor for a
    bad checkpoint, MemoryError when the plan does not fit.
    """
    t0 = time.perf_counter()
    options = options or EngineOptions()
    ckpt = Checkpoint(path)
    cfg = ckpt.config
    try:
        model = build_meta(cfg)
    except (AttributeError, KeyError, TypeError) as err:  # a config.json without an entry the model needs
        raise CheckpointError(f"{ckpt.path / 'config.json'} does not describe a {cfg.get('model_type')} model "
                              f"({err})") from None
    blocks = moe_blocks(model)
    check_deferral(cfg, len(blocks), options.defer_experts)
    check_gpu_experts([_experts_of(b) for _, b in blocks], options.gpu_experts)
    if options.gpu_experts:
        calibration_text(options.calibration_file)  # a bad file fails now, not after loading
    inter = 0
    if blocks:
        names = _expert_keys(ckpt, blocks[0][0])
        inter = ckpt.shape(f"{blocks[0][0]}.experts.0.{names[0]}.weight")[0]
    plan = choose_plan(model_shapes(model, cfg, inter), options)
    log(f"hetmoe: {cfg.get('model_type')} from {ckpt.path}: {len(model.model.layers)} layers, "
        f"{len(blocks)} MoE; {plan.device.type}, {plan.dtype}, experts {plan.experts_format}"
        f"{f' group {plan.group_size}' if plan.experts_format != 'bf16' else ''}"
        f"{f', {options.defer_experts} deferred per token' if options.defer_experts else ''}; {plan.describe()}")
    cache = None
    if expert_cache is not None and blocks:
        root = default_cache_dir() if expert_cache == "auto" else Path(expert_cache)
        cache = ExpertCache(root, ckpt, plan.experts_format, plan.group_size, warn=lambda m: log(f"hetmoe: {m}"),
                            numa=resolve_subpools(options.numa, options.threads))
    staging = (HostStaging(cfg.hidden_size, cfg.num_experts_per_tok, plan.dtype)
               if plan.device.type == "cuda" and blocks else None)
    filler = _Materializer(ckpt, plan)
    filler.fill(model, "")
    layers = model.model.layers
    expert_bytes = 0
    with _progress(len(layers), progress, "loading") as bar:
        for i in range(len(layers)):
            prefix = f"model.layers.{i}"
            filler.fill(model, prefix)
            for name, block in blocks:
                if not name.startswith(prefix + "."):
                    continue
                experts = new_experts(block, cfg, inter, plan, options)
                if cache is None or not cache.load(i, experts):
                    fill_experts(ckpt, name, experts)
                    if cache is not None:
                        cache.save(i, experts)
                expert_bytes += experts.nbytes
                attach_experts(block, experts, staging)
            ckpt.release()
            bar.update(1)
    ckpt.close()
    defer_experts(model, options.defer_experts)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{ckpt.path}: tensors were never loaded: {', '.join(missing[:5])}")
    model.fuse_projections()  # q/k/v (and gate/up) as one matmul each; parameters and their names unchanged
    gpu_experts = keep_gpu_experts(model.eval(), blocks, plan, options, _tokenize_with(ckpt.path), log)
    info = {
        "load_s": time.perf_counter() - t0,
        "expert_bytes": expert_bytes,
        "cache_hits": cache.hits if cache else 0,
        "cache_misses": cache.misses if cache else 0,
        "cache_dir": str(cache.dir) if cache else None,
        "gpu_experts": gpu_experts,
    }
    log(f"hetmoe: loaded in {info['load_s']:.1f} s (routed experts {expert_bytes / 2**30:.2f} GiB"
        + (f", expert cache {cache.hits}/{cache.hits + cache.misses + cache.rebuilt} layers reused" if cache else "")
        + ")")
    return LoadedModel(model.eval(), cfg, plan, options, ckpt.path, info)
