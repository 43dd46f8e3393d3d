"""The engine options every command shares (``EngineOptions``), their command-line flags and their checks.

Each field with ``cli_flag`` metadata is a flag of every command that runs a model (hetmoe/cli/options.py builds
them); the memory plan that these options ask for is hetmoe/plan/placement.py's. Nothing here imports torch:
``hetmoe --help`` builds its flags from these fields and stays instant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

from hetmoe.config.units import parse_size

FORMATS = ("bf16", "int8", "int4")  # what --experts-format auto chooses among, the most precise first
# --experts-format's choices: fp8 holds an FP8 checkpoint's E4M3 experts at their own bytes (auto prefers it for those:
# hetmoe/load/loader.py plan_model); other checkpoints' experts are rounded to E4M3
EXPERT_FORMATS = FORMATS + ("fp8",) + ("int3", "int2")
# hetmoe's own 3- and 2-bit experts (hetmoe/cpu/lowbit.py), quantized at load from float weights: int3 3.3125 bits
# per weight with its scales (symmetric, group 32, k8 scales), int2 2.625 (affine, group 32, k8 scales and mins).
# --experts-format auto takes them, per layer and projection, where int4 does not fit (hetmoe/plan/lowbit.py).
LOW_BIT_FORMATS = ("int3", "int2")
FP8_GROUPS = (128, 32)  # fp8 experts: block FP8 (fp32 scales, one per 16 rows and group), MXFP8 (e8m0 per row)
ATTENTION_CHOICES = ("auto", "triton", "sdpa")
ISAS = ("scalar", "avx2", "avx512", "amx")  # the CPU engine's ISA levels (csrc/runtime/cpu_features.h)
# Tests only: the AMX GEMM through a plain C++ emulation of the tile instructions (any CPU; slow), with the
# best non-AMX row-block kernels for experts with few tokens.
AMX_EMULATED = "amx-emulated"
ISA_CHOICES = ("auto",) + ISAS
DEFAULT_GROUP = {"bf16": 0, "int8": 128, "int4": 64, "fp8": 128, "int3": 32, "int2": 32}
DENSE_CHOICES = ("auto", "bf16", "fp8", "int8", "int4")  # "auto" and hetmoe.config.formats.DENSE_FORMATS
NumaOption = Union[str, int]


def cli_flag(name: str, help: str, **spec) -> dict:
    """Field metadata: the command-line flag of an engine option. hetmoe/cli/options.py adds one flag per field
    that has one to every command that runs a model (``add_engine_options``; the default is the field's) and
    builds an EngineOptions back from the parsed arguments (``engine_options``). ``spec``: ``type`` (an argument
    type of hetmoe/cli/options.py by name: "int", "positive_int", "numa", "gpu_prefill", "size", "gpu_experts",
    "context"; default: the text as typed),
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
        "--experts-format", "format of the routed experts on the CPU: bf16, int8 (8.25 bits per weight with its "
        "scales), int4 (4.5), fp8, or hetmoe's own int3 (3.3 bits per weight) and int2 (2.6), quantized at load "
        "from float weights; auto: the most precise that fits in RAM (an FP8 checkpoint's own fp8 experts first; "
        "where int4 does not fit, int4/int3/int2 per layer and projection)", choices=("auto",) + EXPERT_FORMATS))
    group_size: Optional[int] = field(default=None, metadata=cli_flag(
        "--group-size", "int8/int4 scale group (default: 128 for int8, 64 for int4; 0 = per-row scales; bf16 has none; "
        "fp8: 128, block FP8, or 32, MXFP8)",
        type="int", choices=(0, 16, 32, 64, 128)))  # 16: int8 only (GGUF's Q6_K)
    threads: Optional[int] = field(default=None, metadata=cli_flag(
        "--threads", "CPU expert threads (default: physical cores; with a GPU, 2 fewer)", type="positive_int"))
    numa: Union[str, int] = field(default="auto", metadata=cli_flag(  # hetmoe/cpu/numa.py
        "--numa", "split each expert across N NUMA subpools (tensor parallel); auto: one per NUMA node",
        type="numa", metavar="auto|off|N"))
    max_context: Optional[int] = field(default=None, metadata=cli_flag(  # None: auto
        "--max-context", "KV cache positions per sequence; auto: the model's limit, or the largest multiple of 1024 "
        "that fits (default: auto)", type="context", metavar="auto|N"))
    max_batch: int = 1  # sequences with a KV cache slot each (`hetmoe serve --max-batch`)
    dtype: str = field(default="auto", metadata=cli_flag(
        "--dtype", "dense weights and activations (default: bf16 on GPU, fp32 on CPU for small models)",
        choices=("auto", "bf16", "fp32")))
    dense_format: str = field(default="auto", metadata=cli_flag(  # the table: hetmoe/layers/linear.py
        "--dense-format", "format of the dense weights (attention projections, shared experts, dense MLPs, lm_head): "
        "bf16 (the --dtype's own weights: fp32 where the dtype is fp32), int8 or int4 weight-only with a scale per "
        "64, fp8 (GPU only, DeepSeek's block scales); auto: on a GPU the most precise that fits --gpu-memory; on the "
        "CPU, by the bytes a decode token reads, the dtype's own weights when they stay within the caches (32 MiB) "
        "or int8 would save under a tenth of a token's bytes, else int8; the plan's table says which "
        "(default: auto)", choices=DENSE_CHOICES))
    gpu_memory: Optional[int] = field(default=None, metadata=cli_flag(  # bytes; None: HEADROOM x what is free
        "--gpu-memory", "VRAM the plan may use, e.g. 24GiB, 500MiB, 1.5TB (default: what the GPU has free, less a "
        "margin); needed to plan for a GPU this machine does not have (hetmoe plan)", type="size", metavar="SIZE"))
    cpu_memory: Optional[int] = field(default=None, metadata=cli_flag(
        "--cpu-memory", "RAM the plan may use, as --gpu-memory (default: what is available, less a margin)",
        type="size", metavar="SIZE"))
    prefill_chunk: int = 1024  # prompt tokens per forward call
    defer_experts: int = field(default=0, metadata=cli_flag(
        "--defer-experts", "Expert Deferral: per token, compute the D lowest-weighted of its top-k routed experts "
        "alongside the next layer and add them to the next MoE layer's output (0 <= D < top-k; default: 0)",
        type="int", metavar="D", min=0))
    gpu_experts: Union[int, str] = field(default=0, metadata=cli_flag(  # hybrid placement only
        "--gpu-experts", "with a GPU: keep N routed experts of every MoE layer on it as well and compute them "
        "there, the N most often routed on a calibration text (0 <= N <= experts per layer); auto: as many as "
        "fill the VRAM the rest of the plan leaves (default: 0)", type="gpu_experts", metavar="auto|N", min=0))
    gpu_experts_format: str = field(default="auto", metadata=cli_flag(  # hetmoe/moe/gpu_resident/format.py
        "--gpu-experts-format", "how the --gpu-experts are stored on the GPU: bf16 (the dtype), int8 or int4 "
        "(weight-only, symmetric, a scale per group); auto: the routed experts' own format, their very codes "
        "(int4 experts: ~3.5x as many per GiB as bf16) (default: auto)", choices=("auto",) + FORMATS))
    calibration_file: Optional[str] = field(default=None, metadata=cli_flag(  # default: calibration.DEFAULT_TEXT
        "--calibration-file", "UTF-8 text whose routing picks the --gpu-experts (default: a built-in mixed text)",
        metavar="FILE"))
    cuda_graph: bool = field(default=True, metadata=cli_flag(
        "--no-cuda-graph", "with a GPU: run each decode step eagerly instead of replaying it as a CUDA graph",
        negate=True))
    fused_decode: str = field(default="on", metadata=cli_flag(  # hetmoe/ops/triton/fused.py
        "--fused-decode", "with a GPU and Triton: run a decode step's small per-layer work (residual add + RMSNorm, "
        "q/k norm + RoPE + KV-cache write, MLA's latent norm + RoPE, SwiGLU) as fused kernels, fewer per layer; off: "
        "the unfused PyTorch ops (default: on)", choices=("on", "off")))
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
    gpu_prefill: Union[str, int] = field(default="auto", metadata=cli_flag(  # hetmoe/moe/streamed/layerwise.py
        "--gpu-prefill", "with a GPU: compute the routed experts of prefill chunks of at least N tokens on the GPU, "
        "streaming each layer's experts from RAM; auto: the N from which that is faster, measured at load; off: "
        "always on the CPU (default: auto)", type="gpu_prefill", metavar="auto|off|N"))
    gpu_prefill_cpu_share: Union[str, int] = field(default="auto", metadata=cli_flag(  # moe/streamed/cpu_share.py
        "--gpu-prefill-cpu-share", "with the GPU prefill on: how many of each layer's experts the CPU computes "
        "meanwhile instead of copying them; auto: chosen from the rates measured at load; off or 0: none; N: the "
        "last N experts (default: auto)", type="cpu_share", metavar="auto|off|N"))
    rules: Optional[str] = field(default=None, metadata=cli_flag(  # hetmoe/config/rules.py
        "--rules", "placement rules, a YAML file: per module its device, experts format and group, GPU-resident "
        "experts, deferral (docs/rules.md); the flags above apply where no rule does", metavar="FILE"))

    def __post_init__(self):
        from hetmoe import _C

        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.experts_format not in ("auto",) + EXPERT_FORMATS:
            raise ValueError(f"experts format must be auto, {', '.join(EXPERT_FORMATS)}; got {self.experts_format!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.dense_format not in DENSE_CHOICES:
            raise ValueError(f"dense format must be {', '.join(DENSE_CHOICES)}; got {self.dense_format!r}")
        self.numa = parse_numa(self.numa)
        if self.max_context == "auto":
            self.max_context = None
        for name in ("gpu_memory", "cpu_memory"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, parse_size(v, f"--{name.replace('_', '-')}"))
        for name in ("threads", "max_context"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {v}")
        if isinstance(self.defer_experts, bool) or not isinstance(self.defer_experts, int) or self.defer_experts < 0:
            raise ValueError(f"defer-experts must be an integer >= 0, got {self.defer_experts!r}")
        if self.gpu_experts != "auto" and (isinstance(self.gpu_experts, bool) or not isinstance(self.gpu_experts, int)
                                          or self.gpu_experts < 0):
            raise ValueError(f"gpu-experts must be auto or an integer >= 0, got {self.gpu_experts!r}")
        if self.gpu_experts_format not in ("auto",) + FORMATS:
            raise ValueError(f"gpu-experts-format must be auto, {', '.join(FORMATS)}; got {self.gpu_experts_format!r}")
        if self.isa not in ("auto",) + ISAS + (AMX_EMULATED,):
            raise ValueError(f"isa must be auto, {', '.join(ISAS)} (or {AMX_EMULATED}), got {self.isa!r}")
        runs = _C.cpu_features()  # also refuses a bad HETMOE_MAX_ISA before anything loads
        if self.isa in ISAS and self.isa not in runs["supported_isas"]:
            cap = f" ({runs['isa_cap']})" if runs["isa_cap"] else ""
            raise ValueError(f"isa {self.isa}: this CPU runs only {', '.join(runs['supported_isas'])}{cap}")
        if self.amx_min_tokens is not None and (isinstance(self.amx_min_tokens, bool)
                                                or not isinstance(self.amx_min_tokens, int) or self.amx_min_tokens < 1):
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {self.amx_min_tokens!r}")
        self.gpu_prefill = parse_gpu_prefill(self.gpu_prefill)
        self.gpu_prefill_cpu_share = parse_cpu_share(self.gpu_prefill_cpu_share)
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        if self.fused_decode not in ("on", "off"):
            raise ValueError(f"fused-decode must be on or off, got {self.fused_decode!r}")
        if not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        if self.group_size is not None and self.group_size not in (0, 16, 32, 64, 128):
            raise ValueError(f"group size must be 16, 32, 64 or 128, or 0 = per-row, got {self.group_size}")
        if self.experts_format in LOW_BIT_FORMATS and self.group_size not in (None, 32):
            raise ValueError(f"{self.experts_format} experts have a group size of 32 (their k8 scales), got "
                             f"{self.group_size}")
        if self.experts_format == "fp8" and self.group_size not in (None,) + FP8_GROUPS:
            raise ValueError(f"fp8 experts need a group size of 128 (block FP8) or 32 (MXFP8), got {self.group_size}")
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


def parse_numa(value: Optional[NumaOption]) -> NumaOption:
    """``"auto"`` (also None), ``"off"``, or an int >= 1 (also given as text); ValueError otherwise."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"numa must be auto, off or a number of subpools >= 1, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    elif isinstance(value, str) and value.strip().isdigit():
        n = int(value)
    else:
        raise ValueError(f"numa must be auto, off or a number of subpools >= 1, got {value!r}")
    if n < 1:
        raise ValueError(f"numa must be auto, off or a number of subpools >= 1, got {value!r}")
    return n


def parse_cpu_share(value) -> Union[str, int]:
    """``--gpu-prefill-cpu-share``: "auto", "off" or a number of experts >= 0 (0 = off) -> "auto", "off" or that
    int."""
    text = str(value).strip().lower() if not isinstance(value, bool) else "?"
    if text in ("auto", "off"):
        return text
    if text.isdigit():
        return int(text) if int(text) else "off"
    raise ValueError(f"gpu-prefill-cpu-share must be auto, off or a number of experts, got {value!r}")
