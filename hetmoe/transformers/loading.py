"""``from_pretrained``: a Transformers model whose routed experts run on hetmoe's CPU engine, loaded streaming.

    config.json (AutoConfig) -> the model class built with its parameters on the meta device (buffers such as RoPE
    frequencies are computed as usual) -> every ``@use_experts_implementation`` module sorted: the engine computes
    it (backend.unsupported is None) or Transformers does (one warning naming the modules and why)
    -> the checkpoint's tensors (hetmoe/load/checkpoint.py: memory-mapped, FP8 dequantized), named by the
    model's own renamings (transformers.conversion_mapping), one decoder layer at a time: dense tensors copied to
    their device; each engine module's experts packed into a CPUExperts one expert at a time straight from the
    mapped shards (per-expert ``experts.<e>.{gate,up,down}_proj`` / ``w1, w3, w2``, or fused ``gate_up_proj`` /
    ``down_proj``, either orientation); the layer's pages released
    -> tied weights tied, the model in eval mode with ``config._experts_implementation = "hetmoe"``.

A fallback module's experts are assembled into its own parameters instead (they are materialised: that is what
Transformers' implementation needs).
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hetmoe.transformers import backend
from hetmoe.transformers import dense as dense_part

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)")
_FUSED = re.compile(r"(gate_up_proj|down_proj|gate_proj|up_proj)(_bias)?")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "constant_", "zeros_", "ones_")


@contextmanager
def _parameters_on_meta():
    """Parameters registered meanwhile are moved to the meta device (their storage, never written, is freed);
    buffers stay real. Random init is skipped: it is meaningless on meta tensors."""
    register = nn.Module.register_parameter
    saved = {n: getattr(nn.init, n) for n in _INIT_FNS}

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    for n in saved:
        setattr(nn.init, n, lambda t, *args, **kwargs: t)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def build_model(config, dtype: torch.dtype):
    """The causal-LM class of ``config`` with meta parameters and the hetmoe experts implementation."""
    from transformers import AutoModelForCausalLM

    backend.register()
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, experts_implementation=backend.NAME, dtype=dtype)


def _choose_format(fmt: str, n_experts: int, H: int, I: int, dense_bytes: int) -> str:
    from hetmoe.config.options import DEFAULT_GROUP, FORMATS
    from hetmoe.cpu.layout import expert_bytes
    from hetmoe.plan.placement import HEADROOM
    from hetmoe.plan.sysmem import free_ram

    if fmt != "auto":
        return fmt
    budget = HEADROOM * free_ram() - dense_bytes
    for f in FORMATS:
        if n_experts * expert_bytes(f, H, I, DEFAULT_GROUP[f]) <= budget:
            return f
    return FORMATS[-1]


class _Sources:
    """The checkpoint tensors of one experts module: per-expert matrices or fused stacks, by role."""

    def __init__(self):
        self.per_expert: dict = {}  # (role, e, "weight"|"bias") -> checkpoint key
        self.fused: dict = {}  # "gate_up_proj" | "down_proj" | "gate_proj" | "up_proj" (+ "_bias") -> key

    def add(self, rest: str, key: str) -> bool:
        m = _PER_EXPERT.fullmatch(rest)
        if m:
            self.per_expert[(_ROLE[m.group(2)], int(m.group(1)), m.group(3))] = key
            return True
        m = _FUSED.fullmatch(rest)
        if m:
            self.fused[rest] = key
            return True
        return False


def _expert_mats(ckpt, src: _Sources, module: nn.Module, e: int, E: int, H: int, I: int, where: str) -> tuple:
    """fp32-or-stored views (gate [I, H], up [I, H], down [H, I]) of expert ``e``, Hugging Face out x in."""
    if src.per_expert:
        mats = []
        for role, want in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            key = src.per_expert.get((role, e, "weight"))
            if key is None:
                raise ValueError(f"{where}: the checkpoint has no {role} projection of expert {e}")
            w = ckpt.get_float(key)
            if tuple(w.shape) == want[::-1] and want[0] != want[1]:
                w = w.t()  # stored in x out
            if tuple(w.shape) != want:
                raise ValueError(f"{where}: {key} has shape {list(w.shape)}; expected {list(want)}")
            mats.append(w)
        return tuple(mats)
    t = module.is_transposed
    if "gate_up_proj" in src.fused:
        gu = ckpt.get(src.fused["gate_up_proj"])[e]
        gu = gu.t() if t else gu  # [2I, H]
        g, u = gu[:I], gu[I:]
    else:
        g, u = (ckpt.get(src.fused[n])[e] for n in ("gate_proj", "up_proj"))
        g, u = (m.t() if t else m for m in (g, u))
    d = ckpt.get(src.fused["down_proj"])[e]
    d = d.t() if t else d
    for name, m, want in (("gate", g, (I, H)), ("up", u, (I, H)), ("down", d, (H, I))):
        if tuple(m.shape) != want:
            raise ValueError(f"{where}: the fused {name} projection of expert {e} has shape {list(m.shape)}; "
                             f"expected {list(want)}")
    return g, u, d


def _pack(ckpt, src: _Sources, module: nn.Module, experts, where: str) -> None:
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    for e in range(E):
        g, u, d = _expert_mats(ckpt, src, module, e, E, H, I, where)
        try:
            experts.load([g], [u], [d], first_expert=e)
        except ValueError as err:
            raise ValueError(f"{where}.{e}: {err}") from None


def _assemble(ckpt, src: _Sources, module: nn.Module, device, dtype, where: str) -> None:
    """A fallback module's own parameters from per-expert checkpoint tensors (fused ones load as they are)."""
    if not src.per_expert or not module.has_gate or module.has_bias:
        raise ValueError(f"{where}: per-expert checkpoint tensors for a {type(module).__name__} module are not "
                         "supported; save the model with transformers' save_pretrained")
    E, H, I = backend.expert_shape(module)
    t, cat = module.is_transposed, module.is_concatenated
    gu = torch.empty(module.gate_up_proj.shape, dtype=dtype, device=device)
    down = torch.empty(module.down_proj.shape, dtype=dtype, device=device)
    for e in range(E):
        g, u, d = _expert_mats(ckpt, src, module, e, E, H, I, where)
        both = torch.cat([g, u]) if cat else torch.stack([g, u], 1).reshape(2 * I, H)  # [2I, H]
        gu[e].copy_(both.t() if t else both)
        down[e].copy_(d.t() if t else d)
    module._parameters["gate_up_proj"] = nn.Parameter(gu, requires_grad=False)
    module._parameters["down_proj"] = nn.Parameter(down, requires_grad=False)


def _model_key(key: str, renamings: list, converters: list, prefix: str, meta_sd: dict) -> tuple:
    """(model key, converter source pattern or None) of checkpoint tensor ``key``, by Transformers' own rule
    (core_model_loading.convert_and_load_state_dict_in_model): the renamings, then at most one converter; where the
    result is not a tensor of the model but ``key`` itself is, ``key`` stands as it is. A model's renamings are
    written for its original release's names and may also match the names Transformers writes (DeepSeek-V4's
    ``.norm.`` -> ``.kv_norm.`` turns ``model.norm.weight`` into a tensor the model does not have)."""
    from transformers.core_model_loading import rename_source_key

    target, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
    if target not in meta_sd and key in meta_sd:
        return rename_source_key(key, [], [], prefix, meta_sd)
    return target, pattern


def _rule_placements(rules, model, modules: dict, dev: torch.device, dtype: torch.dtype) -> dict:
    """{experts module name: Placement} from placement rules (hetmoe/config/rules.py: a file or a Rules). Dense
    modules stay on the model's device in its dtype and the native runner's per-layer keys do not apply here:
    a rule asking otherwise is refused at its line."""
    from hetmoe.config.rules import DENSE, EXPERTS, Rules
    from hetmoe.config.rules import load as load_rules

    rules = rules if isinstance(rules, Rules) else load_rules(rules)
    taken = rules.assign([(n, type(m).__name__, EXPERTS if n in modules else DENSE)
                          for n, m in model.named_modules() if n])
    dt = "bf16" if dtype == torch.bfloat16 else "fp32"
    out = {}
    for name, p in taken.items():
        if name in modules:
            for key in ("gpu_experts", "defer_experts"):
                if getattr(p, key) is not None:
                    raise rules.error(p.rule, f"{key} is the native runner's; a model run through Transformers has "
                                              "its experts wholly on the CPU engine or wholly on a device", key)
            if p.device is not None and p.device != "cpu" and dev.type != "cuda":
                raise rules.error(p.rule, f"{name} on {p.device}: the placement is CPU-only", "device")
            out[name] = p
            continue
        if p.device is not None and torch.device(p.device).type != dev.type:
            raise rules.error(p.rule, f"{name} on {p.device}: a model run through Transformers keeps its dense "
                                      f"modules on one device ({dev}); set --device instead", "device")
        if p.dtype is not None and p.dtype != dt:
            raise rules.error(p.rule, f"{name} in {p.dtype}: the dense part runs in one dtype ({dt} here); set "
                                      "--dtype instead", "dtype")
    return out


def _refuse_saving(model: nn.Module, engine_modules: list, dense_fmt: str) -> None:
    """Make ``model.save_pretrained`` and ``push_to_hub`` raise a ValueError with the reason, before anything is
    written or sent, when weights left the model's parameters at load: routed experts packed into the CPU engine
    (``backend.attach`` drops them) or dense linears packed into ``dense_fmt`` (hetmoe/transformers/dense.py).
    Transformers would otherwise write a checkpoint without those tensors, without a word."""
    why = []
    if engine_modules:
        why.append(f"the routed experts of {len(engine_modules)} module(s) ({engine_modules[0]}"
                   f"{', ...' if len(engine_modules) > 1 else ''}) were packed into hetmoe's CPU engine")
    if dense_fmt != "bf16":
        why.append(f"the dense linears were packed into the engine's {dense_fmt} format")
    if not why:
        return  # every weight is still a parameter of the model: Transformers saves it as usual

    def refuse(name: str):
        def refused(*args, **kwargs):
            raise ValueError(f"{name}: {' and '.join(why)}, so those weights are no longer parameters of this model "
                             "and the checkpoint would lack them; use the original checkpoint instead (or load it "
                             "with Transformers alone to change and save it)")

        return refused

    model.save_pretrained, model.push_to_hub = refuse("save_pretrained"), refuse("push_to_hub")


def from_pretrained(path, rules=None, experts_format: str = "auto", device: str = "auto",
                    threads: Optional[int] = None, *, group_size: Optional[int] = None, dtype: str = "auto",
                    isa: str = "auto", numa="auto", dense_format: str = "auto", log=None):
    """A ``transformers.PreTrainedModel`` from the checkpoint directory ``path`` whose routed experts run on the
    CPU engine (``experts_format`` bf16 / int8 / int4; auto: the most precise that fits in RAM) and whose other
    modules sit on ``device`` (auto: the GPU when there is one). Experts the engine cannot compute exactly keep
    Transformers' eager implementation on ``device`` (a ``FallbackWarning`` names them). ``rules``: placement
    rules (a YAML file, docs/rules.md, or a ``hetmoe.config.rules.Rules``): per experts module its format and group,
    or ``device: cuda`` for Transformers' own experts on the GPU. ``dense_format`` (auto / bf16 / int8 / int4, fp8
    on a GPU): the attention projections, shared experts, dense MLPs and lm_head packed in that format as each
    layer loads (hetmoe/transformers/dense.py; auto: int8 on the CPU unless the dense part is small)."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    from hetmoe.config.options import DEFAULT_GROUP
    from hetmoe.cpu import CPUExperts
    from hetmoe.load.checkpoint import Checkpoint
    from hetmoe.plan.placement import resolve_device, resolve_dtype

    path = Path(path)
    dev = resolve_device(device)
    ckpt = Checkpoint(path)
    config = AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    if qc is not None:  # DeepSeek FP8: dequantized by the checkpoint reader
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        if str(method) != "fp8":
            raise ValueError(f"{path}: quantization {method!r} is not supported by the hetmoe Transformers backend")
        experts_dtype = qc.get("expert_dtype") if isinstance(qc, dict) else getattr(qc, "expert_dtype", None)
        if experts_dtype not in (None, "fp8"):  # DeepSeek-V4's released experts: MXFP4 beside FP8 dense weights
            raise ValueError(f"{path}: experts stored as {experts_dtype!r} (quantization_config.expert_dtype) are not "
                             "supported by the hetmoe Transformers backend; only FP8 blocks are dequantized")
        del config.quantization_config
    model = build_model(config, torch.float32)
    modules = {n: m for n, m in model.named_modules() if backend.is_experts_module(m)}
    dense_params = sum(p.numel() for n, p in model.named_parameters()
                       if not any(n.startswith(k + ".") for k in modules))
    torch_dtype = resolve_dtype(dtype, dev, dense_params)
    if torch_dtype != torch.float32:  # built again in that dtype: buffers keep the dtypes the model gives them
        model = build_model(config, torch_dtype)
        modules = {n: m for n, m in model.named_modules() if backend.is_experts_module(m)}
    dense_fmt, dense_why = dense_part.choose(dense_format, dev, torch_dtype, dense_params)
    linear_opts = dense_part.linear_options(dev, isa, threads, numa) if dense_fmt != "bf16" else None

    def pack(prefix: str) -> None:  # the dense linears of one decoder layer ("": those outside the layers)
        if prefix:
            dense_part.pack_layer(model, prefix, dense_fmt, dev, torch_dtype, linear_opts)
        else:
            dense_part.pack_outside_layers(model, dense_fmt, dev, torch_dtype, linear_opts)

    placed = _rule_placements(rules, model, modules, dev, torch_dtype) if rules is not None else {}
    on_device = {n for n, p in placed.items() if p.device not in (None, "cpu")}  # Transformers' experts there
    engine_modules, fallback = {}, {}
    for name, m in modules.items():
        if name in on_device:
            continue
        why = backend.unsupported(m)
        (fallback if why else engine_modules)[name] = why
    if fallback:
        reasons = sorted(set(fallback.values()))
        names = sorted(fallback)
        warnings.warn(f"hetmoe: {len(names)} experts module(s) ({type(modules[names[0]]).__name__}: "
                      f"{names[0]}{', ...' if len(names) > 1 else ''}) have {'; '.join(reasons)}: the engine cannot "
                      f"compute them exactly, so they run with Transformers' eager implementation on {dev.type}",
                      backend.FallbackWarning, stacklevel=2)
    shapes = {n: backend.expert_shape(modules[n]) for n in engine_modules}
    n_experts = sum(s[0] for s in shapes.values())
    H, I = next(iter(shapes.values()))[1:] if shapes else (0, 0)
    fmt = _choose_format(experts_format, n_experts, H, I, dense_part.dense_bytes(model, dense_params, dense_fmt,
                                                                                 torch_dtype.itemsize))
    group = DEFAULT_GROUP[fmt] if group_size is None or fmt == "bf16" else group_size

    def format_of(name: str) -> tuple:
        p = placed.get(name)
        f = p.experts_format if p is not None and p.experts_format else fmt
        g = p.group_size if p is not None and p.group_size is not None else (group if f == fmt else None)
        return f, DEFAULT_GROUP[f] if g is None or f == "bf16" else g

    def device_of(name: str) -> torch.device:  # a parameter's: its experts module's rule, else the model's
        owner = next((n for n in on_device if name.startswith(n + ".")), None)
        return torch.device(placed[owner].device) if owner else dev

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_sd = dict(model.state_dict())
    prefixes = sorted(modules, key=len, reverse=True)
    sources = {n: _Sources() for n in modules}
    dense: dict = {}  # model key -> checkpoint key
    for key in ckpt.names():
        if key.endswith("_scale_inv"):
            continue  # FP8 block scales: read with their weight
        renamed, _ = _model_key(key, renamings, [], model.base_model_prefix, meta_sd)
        owner = next((p for p in prefixes if renamed.startswith(p + ".")), None)
        rest = renamed[len(owner) + 1:] if owner is not None else ""
        # a fallback module's fused tensors are its own parameters: they load as dense tensors
        if owner is not None and (owner in engine_modules or _PER_EXPERT.fullmatch(rest)) and \
                sources[owner].add(rest, key):
            continue
        target, pattern = _model_key(key, renamings, converters, model.base_model_prefix, meta_sd)
        if target in meta_sd:
            dense[target] = key
        elif pattern is not None:
            raise ValueError(f"{path}: tensor {key} needs a conversion ({pattern} -> {target}) that the hetmoe "
                             "loader does not stream")

    def layer_of(name: str) -> int:
        m = _LAYER.search("." + name)
        return int(m.group(1)) if m else -1

    keep_fp32 = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    layers = sorted({layer_of(n) for n in list(dense) + list(modules)})
    for layer in layers:
        for target in [t for t in dense if layer_of(t) == layer]:
            key = dense[target]
            mod_name, _, leaf = target.rpartition(".")
            mod = model.get_submodule(mod_name)
            like = meta_sd[target]
            want = torch.float32 if any(k in target for k in keep_fp32) else like.dtype
            src = ckpt.get_float(key) if like.is_floating_point() else ckpt.get(key)
            if tuple(src.shape) != tuple(like.shape):
                raise ValueError(f"{path}: tensor {key} has shape {list(src.shape)}; the model expects "
                                 f"{list(like.shape)} for {target}")
            out = torch.empty(like.shape, dtype=want if like.is_floating_point() else like.dtype,
                              device=device_of(target))
            out.copy_(src)
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(out, requires_grad=False)
            else:
                mod._buffers[leaf] = out
        for name in [n for n in modules if layer_of(n) == layer]:
            module, src = modules[name], sources[name]
            if name in engine_modules:
                E, H_, I_ = shapes[name]
                f, g = format_of(name)
                experts = CPUExperts(E, H_, I_, f, g, threads=threads, isa=isa, numa=numa)
                _pack(ckpt, src, module, experts, name)
                backend.attach(module, experts)
            elif any(getattr(module, p).is_meta for p in ("gate_up_proj", "down_proj") if hasattr(module, p)):
                _assemble(ckpt, src, module, device_of(name + ".gate_up_proj"), torch_dtype, name)
        for prefix in sorted({dense_part.layer_prefix(t) for t in dense if layer_of(t) == layer}):
            pack(prefix)  # this layer's float copy freed now
        ckpt.release()
    ckpt.close()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: tensors never loaded: {', '.join(missing[:5])}")
    dense_part.pack_rest(model, dense_fmt, dev, torch_dtype, linear_opts)  # a tied lm_head
    for mod in model.modules():  # the buffers computed at build time (RoPE) join the dense part
        for leaf, b in list(mod._buffers.items()):
            if b is not None and b.device != dev:
                mod._buffers[leaf] = b.to(dev)
    model.eval().requires_grad_(False)
    model.hetmoe_info = {"experts_format": fmt, "group_size": group, "device": dev.type, "dtype": torch_dtype,
                         "engine_modules": sorted(engine_modules), "fallback_modules": dict(fallback),
                         "formats": {n: format_of(n) for n in engine_modules},
                         "device_modules": {n: placed[n].device for n in sorted(on_device)},
                         "dense_format": dense_fmt, "dense_why": dense_why}
    _refuse_saving(model, sorted(engine_modules), dense_fmt)
    if log is not None:
        log(f"hetmoe: {type(model).__name__} through Transformers: {len(engine_modules)} experts modules on the CPU "
            f"engine ({fmt}), {len(fallback)} with Transformers' eager experts; dense part {torch_dtype} on "
            f"{dev.type}, its linears {dense_fmt} ({dense_why})")
    return model
