"""Where each part of a model lives, and whether it fits, decided before anything is loaded.

With a GPU: embeddings, attention, norms, routers, shared experts, dense MLPs, lm_head and the KV cache go to
the GPU; the routed experts stay in CPU DRAM, packed for the CPU expert engine. Without one (or with
``device="cpu"``) everything is on the CPU. ``plan_memory`` adds up the bytes of that placement from the
model's shapes alone and ``check_fits`` refuses, with the breakdown, a plan that does not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional, Union

from hetmoe.engine.sysmem import expert_bytes, free_ram, free_vram, gib, packed_matrix_bytes, wrap  # noqa: F401  (importers use them from here)

if TYPE_CHECKING:
    import torch

# torch and hetmoe.cpu (hetmoe._C) are imported where they are used, so that the command line can build its
# flags from EngineOptions' fields without them: ``hetmoe --help`` stays instant.

FORMATS = ("bf16", "int8", "int4")
ATTENTION_CHOICES = ("auto", "triton", "sdpa")
ISA_CHOICES = ("auto", "scalar", "avx2", "avx512", "amx")  # "auto" and hetmoe.cpu.ISAS (tests/engine/test_cli.py)
DEFAULT_GROUP = {"bf16": 0, "int8": 128, "int4": 64}
# Fraction of the currently free RAM / VRAM a plan may use (the rest: allocator slack, the OS, other processes).
HEADROOM = 0.92
CUDA_CONTEXT_BYTES = 600 << 20
CPU_RUNTIME_BYTES = 400 << 20  # the Python process, torch and the engine's scratch


def cli_flag(name: str, help: str, **spec) -> dict:
    """Field metadata: the command-line flag of an engine option. hetmoe/cli/options.py adds one flag per field
    that has one to every command that runs a model (``add_engine_options``; the default is the field's) and
    builds an EngineOptions back from the parsed arguments (``engine_options``). ``spec``: ``type`` (an argument
    type of hetmoe/cli/options.py by name: "int", "positive_int", "numa", "gpu_prefill"; default: the text as typed),
    ``choices``, ``metavar``, ``negate`` (a switch that sets the field to False) and ``min`` (a bound checked
    after parsing, not by the type, so that parse_args stays lenient and EngineOptions refuses the value)."""
    return {"flag": name, "help": help, **spec}


@dataclass
class EngineOptions:
    """The engine options every command shares (``--device``, ``--experts-format``, ...): a field with ``flag``
    metadata is that command-line option, its help text written here once."""

    device: str = field(default="auto", metadata=cli_flag(
        "--device", "auto: the GPU for everything but the routed experts when there is one (default: auto)",
        choices=("auto", "cuda", "cpu")))
    experts_format: str = field(default="auto", metadata=cli_flag(
        "--experts-format", "format of the routed experts on the CPU; auto: the most precise that fits in RAM",
        choices=("auto",) + FORMATS))
    group_size: Optional[int] = field(default=None, metadata=cli_flag(
        "--group-size", "int8/int4 scale group (default: 128 for int8, 64 for int4; 0 = per-row int8; bf16 has none)",
        type="int", choices=(0, 32, 64, 128)))
    threads: Optional[int] = field(default=None, metadata=cli_flag(
        "--threads", "CPU expert threads (default: physical cores; with a GPU, 2 fewer)", type="positive_int"))
    numa: Union[str, int] = field(default="auto", metadata=cli_flag(  # hetmoe/cpu/numa.py
        "--numa", "split each expert across N NUMA subpools (tensor parallel); auto: one per NUMA node",
        type="numa", metavar="auto|off|N"))
    max_context: Optional[int] = field(default=None, metadata=cli_flag(
        "--max-context", "KV cache positions per sequence (default: the model's limit, or the most that fits)",
        type="positive_int"))
    max_batch: int = 1  # sequences with a KV cache slot each (`hetmoe serve --max-batch`)
    dtype: str = field(default="auto", metadata=cli_flag(
        "--dtype", "dense weights and activations (default: bf16 on GPU, fp32 on CPU for small models)",
        choices=("auto", "bf16", "fp32")))
    dense_format: str = field(default="auto", metadata=cli_flag(  # the table: hetmoe/layers/linear.py
        "--dense-format", "format of the dense weights (attention projections, shared experts, dense MLPs, lm_head): "
        "bf16 (the --dtype), int8 or int4 weight-only with a scale per 64, fp8 (GPU only, DeepSeek's block scales); "
        "auto: the placement's choice (default: auto)", choices=("auto", "bf16", "fp8", "int8", "int4")))
    prefill_chunk: int = 1024  # prompt tokens per forward call
    defer_experts: int = field(default=0, metadata=cli_flag(
        "--defer-experts", "Expert Deferral: per token, compute the D lowest-weighted of its top-k routed experts "
        "alongside the next layer and add them to the next MoE layer's output (0 <= D < top-k; default: 0)",
        type="int", metavar="D", min=0))
    gpu_experts: int = field(default=0, metadata=cli_flag(  # hybrid placement only
        "--gpu-experts", "with a GPU: keep N routed experts of every MoE layer on it as well and compute them "
        "there, the N most often routed on a calibration text (0 <= N <= experts per layer; default: 0)",
        type="int", metavar="N", min=0))
    calibration_file: Optional[str] = field(default=None, metadata=cli_flag(  # default: calibration.DEFAULT_TEXT
        "--calibration-file", "UTF-8 text whose routing picks the --gpu-experts (default: a built-in mixed text)",
        metavar="FILE"))
    cuda_graph: bool = field(default=True, metadata=cli_flag(
        "--no-cuda-graph", "with a GPU: run each decode step eagerly instead of replaying it as a CUDA graph",
        negate=True))
    attention: str = field(default="auto", metadata=cli_flag(  # hetmoe/layers/attention.py
        "--attention", "with a GPU: triton = paged KV cache and hetmoe's Triton kernels (split-KV decode, mask-free "
        "prefill); sdpa = PyTorch's SDPA over a contiguous cache; auto: triton when installed (default: auto)",
        choices=ATTENTION_CHOICES))
    # CPU expert kernels; besides the flag's choices, amx-emulated (tests: the AMX GEMM's logic on any CPU).
    # amx_min_tokens: per-expert token count from which the AMX GEMM runs (default: the engine's measured
    # crossover; 1: every expert on the AMX path)
    isa: str = field(default="auto", metadata=cli_flag(
        "--isa", "CPU expert kernels (default: auto, the best this CPU runs within $HETMOE_MAX_ISA)",
        choices=ISA_CHOICES))
    amx_min_tokens: Optional[int] = None
    gpu_prefill: Union[str, int] = field(default="auto", metadata=cli_flag(  # hetmoe/moe/layerwise.py
        "--gpu-prefill", "with a GPU: compute the routed experts of prefill chunks of at least N tokens on the GPU, "
        "streaming each layer's experts from RAM; auto: the N from which that is faster, measured at load; off: "
        "always on the CPU (default: auto)", type="gpu_prefill", metavar="auto|off|N"))
    rules: Optional[str] = field(default=None, metadata=cli_flag(  # hetmoe/engine/rules.py
        "--rules", "placement rules, a YAML file: per module its device, experts format and group, GPU-resident "
        "experts, deferral (docs/rules.md); the flags above apply where no rule does", metavar="FILE"))

    def __post_init__(self):
        from hetmoe.cpu import AMX_EMULATED, ISAS, cpu_info
        from hetmoe.cpu.numa import parse_numa

        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.experts_format not in ("auto",) + FORMATS:
            raise ValueError(f"experts format must be auto, {', '.join(FORMATS)}; got {self.experts_format!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.dense_format not in ("auto", "bf16", "fp8", "int8", "int4"):
            raise ValueError(f"dense format must be auto, bf16, fp8, int8 or int4, got {self.dense_format!r}")
        self.numa = parse_numa(self.numa)
        for name in ("threads", "max_context"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {v}")
        if isinstance(self.defer_experts, bool) or not isinstance(self.defer_experts, int) or self.defer_experts < 0:
            raise ValueError(f"defer-experts must be an integer >= 0, got {self.defer_experts!r}")
        if isinstance(self.gpu_experts, bool) or not isinstance(self.gpu_experts, int) or self.gpu_experts < 0:
            raise ValueError(f"gpu-experts must be an integer >= 0, got {self.gpu_experts!r}")
        if self.isa not in ("auto",) + ISAS + (AMX_EMULATED,):
            raise ValueError(f"isa must be auto, {', '.join(ISAS)} (or {AMX_EMULATED}), got {self.isa!r}")
        runs = cpu_info()  # also refuses a bad HETMOE_MAX_ISA before anything loads
        if self.isa in ISAS and self.isa not in runs["supported_isas"]:
            cap = f" ({runs['isa_cap']})" if runs["isa_cap"] else ""
            raise ValueError(f"isa {self.isa}: this CPU runs only {', '.join(runs['supported_isas'])}{cap}")
        if self.amx_min_tokens is not None and (isinstance(self.amx_min_tokens, bool)
                                                or not isinstance(self.amx_min_tokens, int) or self.amx_min_tokens < 1):
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {self.amx_min_tokens!r}")
        self.gpu_prefill = parse_gpu_prefill(self.gpu_prefill)
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        if self.group_size is not None and self.group_size not in (0, 32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128 (or 0 = per-row int8), got {self.group_size}")
        if self.group_size == 0 and self.experts_format == "int4":
            raise ValueError("int4 experts need a group size of 32, 64 or 128 (per-row scales are int8 only)")
        if not isinstance(self.rules, (str, os.PathLike, type(None))):
            raise ValueError(f"rules must be the path of a YAML file, got {self.rules!r}")


def parse_gpu_prefill(value) -> Union[str, int]:
    """``--gpu-prefill``: "auto", "off" or a token count >= 1."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    try:
        n = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 1:
        raise ValueError(f"gpu-prefill must be auto, off or a token count >= 1, got {value!r}")
    return n


# Prefill chunks tried for the layerwise GPU path, largest first: the first whose buffers fit is used.
GPU_PREFILL_CHUNKS = (8192, 4096, 2048, 1024)
GPU_PREFILL_SLOTS = 2
UNPACK_EXPERTS = 16  # experts unpacked at once into the layer's weight scratch (bounds the temporaries)


def gpu_prefill_bytes(shapes: "ModelShapes", fmt: str, group: int, chunk: int, itemsize: int, ctx: int) -> dict:
    """VRAM of the layerwise GPU prefill for prefill chunks of ``chunk`` tokens (hetmoe/moe/layerwise.py): the
    slots of packed experts, one layer's weights unpacked to the model dtype (+ the temporaries of unpacking
    UNPACK_EXPERTS experts), and the activations of one MoE layer and the attention mask of one chunk over a
    context of ``ctx`` positions (0: the paged kernels, no mask)."""
    E = shapes.n_routed // max(shapes.n_moe_layers, 1)
    H, I, k = shapes.hidden, shapes.expert_inter, shapes.top_k
    layer = E * expert_bytes(fmt, H, I, group)
    weights = E * 3 * H * I * itemsize + UNPACK_EXPERTS * 3 * H * I * 8
    rows = chunk * k  # (token, expert) pairs
    act = rows * (H * itemsize + 3 * I * itemsize + H * itemsize + H * 4 + 16) + chunk * H * 4
    mask = chunk * shapes.q_per_kv * ctx * itemsize
    return {"prefill slots": GPU_PREFILL_SLOTS * layer, "prefill weights": weights, "prefill activations": act + mask}


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device "
                           f"(torch {torch.__version__}; use --device cpu)")
    return torch.device(device)


@dataclass
class LayerPlan:
    """One MoE layer's routed experts: packed for the CPU engine, ``gpu_experts`` of them also on the GPU (all: the
    rules' ``device: cuda``), ``defer_experts`` deferred per token; ``ram`` / ``vram``: the bytes they take."""

    name: str
    experts_format: str
    group_size: int
    gpu_experts: int
    defer_experts: int
    ram: int
    vram: int


def layer_group(fmt: str, group: Optional[int]) -> int:
    """The scale group of ``fmt`` experts asked for as ``group``: None, or 0 with int4 (per-row is int8 only), is the
    format's default; bf16 has no groups: 0 whatever was asked (it keys the expert cache)."""
    return 0 if fmt == "bf16" else DEFAULT_GROUP[fmt] if group is None or (group == 0 and fmt == "int4") else group


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
    layers: list = field(default_factory=list)  # LayerPlan of every MoE layer, in forward order
    kv_paged: bool = False  # the KV cache is paged (layers/kv_cache.py): "KV cache" holds one full sequence
    notes: list = field(default_factory=list)  # what the plan chose that the user did not ask for, said at load

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


def plan_layers(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, fmt: str, itemsize: int,
                layers: Optional[list] = None) -> list:
    """The LayerPlan of every MoE layer: ``fmt`` and the options where ``layers`` (a ``rules.Placement`` each) don't."""
    n, H, I = shapes.n_moe_layers, shapes.hidden, shapes.expert_inter
    names = list(shapes.moe_names) or [f"moe layer {i}" for i in range(n)]
    out = []
    for name, p in zip(names, layers if layers is not None else [None] * n):
        got = {k: getattr(p, k, None) for k in ("experts_format", "group_size", "gpu_experts", "defer_experts")}
        f = got["experts_format"] or fmt
        group = layer_group(f, opts.group_size if got["group_size"] is None else got["group_size"])
        gpu = opts.gpu_experts if got["gpu_experts"] is None else got["gpu_experts"]
        gpu = gpu if device.type == "cuda" else 0  # a CPU-only placement keeps every expert on the CPU
        defer = opts.defer_experts if got["defer_experts"] is None else got["defer_experts"]
        ram = shapes.n_routed // n * expert_bytes(f, H, I, group)
        out.append(LayerPlan(name, f, group, gpu, defer, ram, gpu * 3 * H * I * itemsize))
    return out


def plan_memory(shapes: "ModelShapes", opts: EngineOptions, device: torch.device, fmt: str,
                layers: Optional[list] = None, max_context: Optional[int] = None) -> MemoryPlan:
    """Bytes of RAM and VRAM the placement of ``shapes`` under ``opts`` needs; ``layers``: the placement rules'
    settings of each MoE layer (``rules.apply_native``), None for none (``fmt`` and the options everywhere);
    ``max_context``: instead of --max-context or the model's limit."""
    dtype = resolve_dtype(opts.dtype, device, shapes.dense_params)
    group = layer_group(fmt, opts.group_size)
    ctx = max_context or opts.max_context or shapes.context_limit or shapes.max_position_embeddings or 4096
    paged = kv_paged(opts, device)
    per_layer = plan_layers(shapes, opts, device, fmt, dtype.itemsize, layers)
    experts = sum(lp.ram for lp in per_layer) or shapes.n_routed * expert_bytes(fmt, shapes.hidden,
                                                                                 shapes.expert_inter, group)
    if per_layer:  # the most common format and group name the plan (the expert cache keys each layer by its own)
        pairs = [(lp.experts_format, lp.group_size) for lp in per_layer]
        fmt, group = max(pairs, key=pairs.count)
    dense = shapes.dense_params * dtype.itemsize
    # paged: one full sequence (pages are taken as sequences grow); contiguous: every row's capacity grows together
    kv = shapes.kv_elems_per_token * (1 if paged else opts.max_batch) * ctx * dtype.itemsize
    tokens = opts.prefill_chunk * opts.max_batch
    act = tokens * (shapes.act_width * 4 + shapes.vocab_size * 4)  # a few hidden-width buffers + the last logits
    host_staging = 3 * tokens * shapes.hidden * 4
    plan = MemoryPlan(device, dtype, fmt, group, ctx, layers=per_layer, kv_paged=paged)
    plan.ram = {"routed experts": experts, "runtime": CPU_RUNTIME_BYTES + host_staging}
    if device.type == "cuda":
        plan.vram = {"dense weights": dense, "KV cache": kv, "activations": act, "CUDA context": CUDA_CONTEXT_BYTES}
        # --gpu-experts: N experts per MoE layer in the dense dtype (they stay in RAM too, packed for the CPU)
        plan.vram["GPU experts"] = sum(lp.vram for lp in per_layer)
    else:
        plan.ram.update({"dense weights": dense, "KV cache": kv, "activations": act})
    plan.prefill_chunk = opts.prefill_chunk
    return plan


def add_gpu_prefill(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, vram_free: int) -> None:
    """With a GPU and --gpu-prefill not off: the largest chunk of GPU_PREFILL_CHUNKS (at least --prefill-chunk)
    whose layerwise prefill buffers fit beside the rest of the plan goes into the plan. None fitting: auto goes
    without (the CPU computes every prefill), a token count given is refused (MemoryError with the breakdown)."""
    if plan.device.type != "cuda" or opts.gpu_prefill == "off" or not shapes.n_moe_layers:
        return
    budget = HEADROOM * vram_free - plan.vram_bytes
    need = {}
    # the slots hold any layer: sized for the largest (mixed formats under placement rules)
    big = max(plan.layers, key=lambda lp: lp.ram, default=None)
    fmt, group = (big.experts_format, big.group_size) if big is not None else (plan.experts_format, plan.group_size)
    for chunk in [c for c in GPU_PREFILL_CHUNKS if c >= opts.prefill_chunk] or [opts.prefill_chunk]:
        mask_ctx = 0 if plan.kv_paged else plan.max_context
        need = gpu_prefill_bytes(shapes, fmt, group, chunk, plan.dtype.itemsize, mask_ctx)
        if sum(need.values()) <= budget:
            plan.vram.update(need)
            plan.prefill_chunk, plan.gpu_prefill = chunk, True
            return
    if opts.gpu_prefill != "auto":
        parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items())
        raise MemoryError(f"--gpu-prefill {opts.gpu_prefill}: its buffers do not fit the GPU beside the model "
                          f"(smallest chunk {chunk} tokens: {parts}; {gib(max(0, int(budget)))} left of "
                          f"{gib(vram_free)} free). Use --gpu-prefill off, or a smaller --max-context.")


def resolve_dtype(name: str, device: torch.device, dense_params: int) -> torch.dtype:
    """auto: bf16 on a GPU; on the CPU fp32 while the dense part is small (<= 1 G parameters), else bf16."""
    import torch

    if name == "bf16":
        return torch.bfloat16
    if name == "fp32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" or dense_params > 1_000_000_000 else torch.float32


def choose_plan(shapes: "ModelShapes", opts: EngineOptions, layers: Optional[list] = None) -> MemoryPlan:
    """Resolve device and experts format (auto: for the MoE layers ``layers``, the rules, leave to it); refuse a plan
    that cannot fit (MemoryError with the numbers) or a --max-context beyond the model's positions (ValueError)."""
    check_context(shapes, opts)
    device = resolve_device(opts.device)
    ram, vram = free_ram(), (free_vram(device) if device.type == "cuda" else 0)
    if opts.experts_format == "auto":
        plans = [plan_memory(shapes, opts, device, f, layers) for f in FORMATS]
        fitting = [p for p in plans if p.ram_bytes <= HEADROOM * ram]
        plan = fitting[0] if fitting else plans[-1]
    else:
        plan = plan_memory(shapes, opts, device, opts.experts_format, layers)
    if opts.max_context is None:
        plan = fit_context(plan, shapes, opts, layers, ram, vram)
    problems = []
    if plan.ram_bytes > HEADROOM * ram:
        problems.append(f"RAM: needs {gib(plan.ram_bytes)}, {gib(ram)} available")
    if device.type == "cuda" and plan.vram_bytes > HEADROOM * vram:
        problems.append(f"GPU memory: needs {gib(plan.vram_bytes)}, {gib(vram)} free")
    if not problems:
        add_gpu_prefill(plan, shapes, opts, vram)
    if problems:
        hints = []
        if plan.experts_format != "int4":
            hints.append("--experts-format int4")
        hints.append("a smaller --max-context")
        if plan.vram.get("GPU experts") and any("GPU memory" in p for p in problems):
            hints.append("fewer --gpu-experts")
        raise MemoryError(
            f"the model does not fit this machine with {plan.experts_format} experts on {device.type} "
            f"({'; '.join(problems)}). Plan: {plan.describe()}. Try {' or '.join(hints)}."
        )
    return plan


def kv_paged(opts: EngineOptions, device: torch.device) -> bool:
    """Whether the runner's KV cache will be paged (layers/kv_cache.py): a GPU with the Triton kernels."""
    from hetmoe.layers.attention import paged_kernels

    paged = opts.attention != "sdpa" and paged_kernels(device)
    if opts.attention == "triton" and not paged:
        raise RuntimeError("--attention triton needs a CUDA device and the triton package")
    return paged


def fit_context(plan: MemoryPlan, shapes: "ModelShapes", opts: EngineOptions, layers, ram: int,
                vram: int) -> MemoryPlan:
    """No --max-context: the model's limit if the plan fits, else the largest fitting multiple of 1024 (a note says)."""
    per_pos = {k: v / plan.max_context for k, v in (("ram", plan.ram.get("KV cache", 0)),
                                                    ("vram", plan.vram.get("KV cache", 0)))}
    room = [(HEADROOM * ram - plan.ram_bytes, per_pos["ram"]), (HEADROOM * vram - plan.vram_bytes, per_pos["vram"])]
    short = [(-left, each) for left, each in room if each and left < 0]
    if not short:
        return plan
    ctx = min(plan.max_context - int(over / each) - 1 for over, each in short) // 1024 * 1024
    if ctx < 1024:
        return plan
    fitted = plan_memory(shapes, opts, plan.device, plan.experts_format, layers, max_context=ctx)
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
