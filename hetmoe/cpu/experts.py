"""Python face of the CPU expert engine (the C++ extension ``hetmoe._C``).

``CPUExperts`` holds the routed experts of one MoE layer, packed for the CPU kernels, and computes

    out[t] (+)= sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

or, with another gated activation (``Glu``: gpt-oss's clamped SwiGLU) and per-expert biases (``bias=True``,
``load_biases``), ``down_e(glu(gate_e x + bg_e, up_e x + bu_e)) + bd_e`` in place of the expert's term.

It is an experts backend of the MoE layer (``hetmoe.moe.experts.ExpertsBackend``); its jobs run on an
``WorkerPool`` (hetmoe/cpu/pool.py).

Shape letters: T tokens, E experts, k experts per token, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from hetmoe import _C
from hetmoe.config.options import AMX_EMULATED, ISAS, NumaOption
from hetmoe.cpu.numa import resolve_subpools
from hetmoe.cpu.pool import EngineJob, WorkerPool, shared_pool

WEIGHT_FORMATS = ("bf16", "int8", "int4")  # what weights quantized here take (one CPUExperts(weight_format=...) each)
# lut4: nibbles indexing a codebook of 16 int8 values (csrc/formats/layout.h), for checkpoints' own 4-bit codes
LUT_FORMAT = "lut4"
# fp8: E4M3 codes, one byte per weight (csrc/formats/layout.h), for FP8 checkpoints' own experts (hetmoe/cpu/codes.py
# load_fp8); floats loaded into it are rounded to E4M3
FP8_FORMAT = "fp8"
# bit-plane formats: b-bit codes at b bits each (csrc/formats/layout.h), for the K-quants' own codes (Q6_K, Q5_K, Q3_K,
# Q2_K: hetmoe/cpu/codes.py); floats loaded into them are quantized absmax (affine: min/max) per group
PLANE_FORMATS = ("int6", "int5", "int3", "int2")
# grid: GGUF's i-quant blocks (IQ2_XXS .. IQ1_M) as the file holds them, decoded to int8 codes in the kernels
# (csrc/formats/layout.h); loaded from the file's bytes only (hetmoe/cpu/codes.py load_codes), never from floats
GRID_FORMAT = "grid"
# how int8/int4/lut4/fp8 scales are stored (csrc/formats/layout.h); k8: the K-quants' int8 sub-scale x fp16 per 256
# (integer formats only); k4: Q2_K's 4-bit sub-scale and sub-min in one byte x fp16 d and dmin per 256 (affine only)
# fp32_zp / fp16_zp / bf16_zp: affine scales of that dtype and one int8 zero point z per group, min = fl(scale * z)
# (the int4 of GPTQ, AWQ and compressed-tensors with zero points)
SCALE_DTYPES = ("fp32", "fp16", "bf16", "e8m0", "k8", "k4", "e4m3", "e4m3_div", "fp32_zp", "fp16_zp", "bf16_zp")
CODEBOOKS = ("e2m1", "iq4nl")  # lut4's codebooks: FP4 (MXFP4, NVFP4) doubled, llama.cpp's IQ4_NL table
GRID_TYPES = tuple(_C.LAYOUT["grids"])  # grid's codebooks: the i-quant each grid matrix holds (iq2_xxs, ...)

GLU_KINDS = ("swiglu", "clamped_swiglu")  # csrc/formats/activation.h GluKind


@dataclass(frozen=True)
class Glu:
    """The experts' gated activation. ``"swiglu"``: silu(gate) * up. ``"clamped_swiglu"``: g = min(gate, limit),
    u = clamp(up, -limit, limit), h = (u + offset) * g * sigmoid(alpha * g), with alpha > 0 and limit > 0: gpt-oss
    and MiniMax-M3 (alpha 1.702, offset 1), DeepSeek-V4 (alpha 1, offset 0: silu(g) * u on clamped inputs)."""

    kind: str = "swiglu"
    alpha: float = 1.0
    limit: float = 0.0
    offset: float = 1.0

    def __post_init__(self):
        if self.kind not in GLU_KINDS:
            raise ValueError(f"unknown activation {self.kind!r}; expected one of {', '.join(GLU_KINDS)}")
        if self.kind == "clamped_swiglu":
            for name in ("alpha", "limit"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
                    raise ValueError(f"clamped_swiglu needs a finite {name} > 0, got {v!r}")
            v = self.offset
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"clamped_swiglu needs a finite offset, got {v!r}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation in PyTorch (the reference of the engine's, in the inputs' dtype)."""
        if self.kind == "swiglu":
            return torch.nn.functional.silu(gate) * up
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return (u + self.offset) * (g * torch.sigmoid(g * self.alpha))


SWIGLU = Glu()

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]
PARTS = ("all", "immediate", "deferred")  # Slots.part


@dataclass(frozen=True, eq=False)
class Slots:
    """Which of each token's k routed slots a job computes (Expert Deferral without splitting the routing first).

    ``"all"``; ``"immediate"``: the k - ``defer`` highest-weighted; ``"deferred"``: the ``defer`` lowest-weighted
    (among equal weights the earlier slot is the lower; 1 <= defer < k for both). ``pair`` (deferred only): the same
    layer's immediate job, prepared with the same x, routing buffers, n_tokens and mask (see ``CPUExperts.prepare``).
    """

    part: str = "all"
    defer: int = 0
    pair: Optional[EngineJob] = None

    def __post_init__(self):
        if self.part not in PARTS:
            raise ValueError(f"slots part must be one of {', '.join(PARTS)}, got {self.part!r}")
        if isinstance(self.defer, bool) or not isinstance(self.defer, int):
            raise ValueError(f"slots defer must be an integer, got {self.defer!r}")
        if self.part == "all" and self.defer:
            raise ValueError(f"Slots.all() computes every slot: defer must be 0, got {self.defer}")
        if self.part != "all" and self.defer < 1:
            raise ValueError(f"an {self.part} part needs defer >= 1 (the number of lowest-weighted slots deferred), "
                             f"got {self.defer}")
        if self.pair is not None and self.part != "deferred":
            raise ValueError("pair goes with Slots.deferred(d, pair=...): it names the immediate job of the same layer")

    @classmethod
    def all(cls) -> "Slots":
        return cls()

    @classmethod
    def immediate(cls, d: int) -> "Slots":
        return cls("immediate", d)

    @classmethod
    def deferred(cls, d: int, pair: Optional[EngineJob] = None) -> "Slots":
        return cls("deferred", d, pair)


@dataclass(frozen=True, eq=False)
class HostRoute:
    """The job routes each token itself from the router's logits and *writes* topk_ids / topk_weights.

    ``logits`` ``[T, E]`` fp32/bf16, CPU, contiguous; ``router``: a ``hetmoe.moe.router.RouterSpec`` with
    ``host_routable`` (kind softmax or sigmoid_grouped; csrc/moe/routing.h), its top_k = k, its ``correction_bias``
    a CPU fp32 ``[E]`` tensor or None."""

    logits: torch.Tensor
    router: object  # hetmoe.moe.router.RouterSpec (kind, top_k, host_routable, correction_bias)


def _check_tensor(name: str, t, dtypes: tuple, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the CPU expert engine needs CPU tensors (copy it with .cpu())")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {names}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    return t


class CPUExperts:
    """The routed experts of one MoE layer on the CPU.

    Args:
        num_experts: E.
        hidden_size: H.
        intermediate_size: I (per expert).
        weight_format: ``"bf16"``, ``"int8"``, ``"int4"``, ``"lut4"`` (4-bit indices into a ``codebook``) or
            ``"fp8"`` (E4M3 codes), or a pair (gate/up, down) of int8/int4/lut4.
        group_size: int8/int4/fp8 scale group along the input dimension (16, 32, 64 or 128; fp8 32, 64 or 128);
            ``0`` = one scale per row (symmetric). ``down_group_size``: down's own group (default: ``group_size``).
        scaling: ``"symmetric"`` (value = scale * q) or ``"affine"`` (value = scale * q - min, GGUF's K-quants), or a
            pair (gate/up, down); codes go in with ``hetmoe.cpu.codes.load_codes``.
        scale_dtype: how the scales (and an affine matrix's mins) are stored: ``"fp32"`` (default), ``"fp16"``,
            ``"bf16"``, ``"e8m0"`` (a power of two, MXFP4's; symmetric only) or ``"k8"`` (the K-quants' two levels:
            an int8 sub-scale per group times an fp16 scale per 256 values of a row) or ``"k4"`` (Q2_K's: a 4-bit
            sub-scale and a 4-bit sub-min per group in one byte, times an fp16 scale and an fp16 min per 256 values
            of a row; affine only) or ``"e4m3"`` / ``"e4m3_div"`` (NVFP4's: an E4M3 byte per group and a per-tensor
            fp32 factor f per matrix, scale = fl(e4m3 * f) / 2 or fl(e4m3 / f) / 2; lut4 only, f given to
            ``load_codes``, 1 for scales quantized here) or ``"fp32_zp"`` / ``"fp16_zp"`` / ``"bf16_zp"`` (scales of
            that dtype, and each min held as one int8 zero point z, min = fl(scale * z): GPTQ's, AWQ's and
            compressed-tensors' zero points at their file's bytes; affine only), or a pair (gate/up, down);
            grouped matrices only. Scales quantized here are rounded to the type; codes loaded with ``load_codes``
            must have scales (and mins) the type holds exactly.
        codebook: lut4's 16 values: ``"e2m1"`` (FP4 doubled) or ``"iq4nl"``; grid's type (``"iq2_xxs"``, ...); or a
            pair (gate/up, down; None for a matrix that is neither).
        shared_scales: fp8 only: one scale per 16 rows and group (block FP8's 128 x 128 blocks, stored once per row
            block instead of per row), or a pair (gate/up, down).
        threads: pool size (default: one per physical core). Ignored when ``pool`` is given.
        isa: ``"auto"`` (best the CPU supports) or one of ``scalar``, ``avx2``, ``avx512``, ``amx``
            (``"amx-emulated"``: tests only). With ``amx``, each call computes experts that have at least
            ``amx_min_tokens`` tokens with AMX tiles and the others with the AVX-512 kernels, on the same
            weights; ``avx512`` forces the AVX-512 kernels for all.
        pool: an ``WorkerPool`` to run on (default: the shared pool for ``threads`` and ``numa``).
        numa: ``"auto"`` (default), ``"off"`` or N subpools (hetmoe/cpu/numa.py); with a ``pool``, it must agree
            with it. With N > 1 every expert's intermediate dimension is split across the subpools.
        amx_min_tokens: the per-expert token count from which AMX is used (default: the engine's measured
            crossover for the format, ``cpu_info()["amx_min_tokens_default"]``); also settable later as
            ``.amx_min_tokens``.
        glu: the gated activation (``Glu``; default SwiGLU).
        bias: every expert has fp32 biases (zeros until ``load_biases``): gate and up ``[I]`` added before the
            activation, down ``[H]`` added to the expert's output before its routing weight.

    AMX multiplies bf16 x bf16 and int8 x int8, so AMX experts read activations rounded to bf16 (bf16 and fp8
    weights) or int8 per group (int8 weights; the AVX-512 path keeps int16); int4 weights use int8
    activations on both paths (AMX, per-row weights: one x scale per token). Accuracy: tests/cpu/test_amx.py.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        weight_format: Union[str, tuple] = "bf16",
        group_size: int = 128,
        threads: Optional[int] = None,
        isa: str = "auto",
        pool: Optional[WorkerPool] = None,
        amx_min_tokens: Optional[int] = None,
        numa: Optional[NumaOption] = None,
        down_group_size: Optional[int] = None,
        scaling: Union[str, tuple] = "symmetric",
        scale_dtype: Union[str, tuple] = "fp32",
        codebook: Union[None, str, tuple] = None,
        shared_scales: Union[bool, tuple] = False,
        glu: Glu = SWIGLU,
        bias: bool = False,
    ):
        if not isinstance(glu, Glu):
            raise TypeError(f"glu must be a Glu (hetmoe.cpu.experts.Glu), got {glu!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        scaling = (scaling, scaling) if isinstance(scaling, str) else tuple(scaling)
        scale_dtype = (scale_dtype, scale_dtype) if isinstance(scale_dtype, str) else tuple(scale_dtype)
        codebook = (codebook, codebook) if codebook is None or isinstance(codebook, str) else tuple(codebook)
        shared_scales = (shared_scales, shared_scales) if isinstance(shared_scales, bool) else tuple(shared_scales)
        weight_format, down_format = (weight_format, "") if isinstance(weight_format, str) else weight_format
        formats = WEIGHT_FORMATS + PLANE_FORMATS + (LUT_FORMAT, FP8_FORMAT, GRID_FORMAT)
        if weight_format not in formats or down_format not in formats + ("",):
            raise ValueError(f"unknown weight_format {weight_format!r}; expected one of {', '.join(formats)}")
        if len(scale_dtype) != 2 or any(t not in SCALE_DTYPES for t in scale_dtype):
            raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)} or a (gate/up, down) pair of them, "
                             f"got {scale_dtype!r}")
        if len(shared_scales) != 2 or any(not isinstance(b, bool) for b in shared_scales):
            raise ValueError(f"shared_scales must be a bool or a (gate/up, down) pair of them, got {shared_scales!r}")
        if len(codebook) != 2 or any(c is not None and c not in CODEBOOKS + GRID_TYPES for c in codebook):
            raise ValueError(f"codebook must be one of {', '.join(CODEBOOKS + GRID_TYPES)}, None or a (gate/up, down) "
                             f"pair, got {codebook!r}")
        features = _C.cpu_features()
        emulated = isa == AMX_EMULATED
        if isa == "auto":
            isa = features["best_isa"]
        elif emulated:  # row blocks on the best real non-AMX level
            isa = next(i for i in ("avx512", "avx2", "scalar") if i in features["supported_isas"])
        elif isa not in ISAS:
            raise ValueError(f"unknown isa {isa!r}; expected 'auto' or one of {', '.join(ISAS)}")
        if amx_min_tokens is None:
            amx_min_tokens = features["amx_min_tokens_default"][weight_format]
        elif isinstance(amx_min_tokens, bool) or not isinstance(amx_min_tokens, int) or amx_min_tokens < 1:
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {amx_min_tokens!r}")
        if pool is None:
            pool = shared_pool(threads, "auto" if numa is None else numa)
        elif numa is not None and resolve_subpools(numa, pool.threads) != pool.subpools:
            raise ValueError(f"numa={numa!r} asks for {resolve_subpools(numa, pool.threads)} subpools; the pool given "
                             f"has {pool.subpools}")
        self.pool = pool
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.weight_format = (weight_format, down_format) if down_format else weight_format
        split = self.pool.subpools > 1  # tensor parallel over NUMA subpools: same interface
        self._ex = (_C.NumaExperts if split else _C.MoeExperts)(
            self.pool._numa if split else self.pool._pool, self.num_experts, self.hidden_size, self.intermediate_size,
            weight_format, int(group_size), isa, emulated, int(amx_min_tokens), int(down_group_size or 0), *scaling,
            down_format, *scale_dtype, *(c or "" for c in codebook), *shared_scales, glu.kind, float(glu.alpha),
            float(glu.limit), float(glu.offset), bias)
        self.glu, self.bias = glu, bias
        self._skip_mask: Optional[torch.Tensor] = None  # static: experts computed elsewhere (set_skip_mask)

    @property
    def amx_min_tokens(self) -> Optional[int]:
        """Experts with at least this many tokens in a call use the AMX GEMM (None: this engine has no AMX path)."""
        return self._ex.amx_min_tokens if self._ex.info()["amx"] != "off" else None

    @amx_min_tokens.setter
    def amx_min_tokens(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {n!r}")
        self._ex.amx_min_tokens = n

    # ------------------------------------------------------------------ weights

    def load(self, gate: TensorOrList, up: TensorOrList, down: TensorOrList, first_expert: int = 0) -> None:
        """Pack experts from Hugging Face-oriented weights: gate, up ``[n, I, H]``, down ``[n, H, I]``.

        Accepts stacked tensors or per-expert lists, in any floating dtype. The engine keeps no reference to
        them afterwards. ``first_expert`` loads a slice (experts ``first_expert .. first_expert + n``).
        """
        if GRID_FORMAT in (self.weight_format if isinstance(self.weight_format, tuple) else (self.weight_format,)):
            raise ValueError("grid weights hold a GGUF file's i-quant blocks as they are (hetmoe.cpu.codes."
                             "load_codes); floats are not quantized into them")
        gate, up, down = (self._as_list(n, w) for n, w in (("gate", gate), ("up", up), ("down", down)))
        n = len(gate)
        if len(up) != n or len(down) != n:
            raise ValueError(f"gate, up and down hold {len(gate)}, {len(up)} and {len(down)} experts; they must match")
        if not 0 <= first_expert or first_expert + n > self.num_experts:
            raise ValueError(
                f"experts [{first_expert}, {first_expert + n}) do not fit in num_experts={self.num_experts}"
            )
        I, H = self.intermediate_size, self.hidden_size
        for i in range(n):
            for name, w, shape in (("gate", gate[i], (I, H)), ("up", up[i], (I, H)), ("down", down[i], (H, I))):
                if tuple(w.shape) != shape:
                    raise ValueError(f"{name}[{i}] has shape {tuple(w.shape)}; expected {shape} (out x in)")
                if w.device.type == "meta":
                    raise ValueError(f"{name}[{i}] is a meta tensor and holds no data")
        for i in range(n):  # one expert at a time: only one fp32 copy exists at once
            g, u, d = (w.detach().to("cpu", torch.float32).contiguous() for w in (gate[i], up[i], down[i]))
            try:
                self._ex.load(first_expert + i, 1, g.data_ptr(), u.data_ptr(), d.data_ptr())
            except ValueError as err:  # "<gate|up|down> of expert E contains NaN or Inf", found while packing
                which = str(err).split()[0]
                loaded = f"; experts {first_expert}..{first_expert + i - 1} were loaded" if i else ""
                raise ValueError(
                    f"{which}[{i}] contains NaN or Inf (expert {first_expert + i}, not loaded{loaded})"
                ) from None

    def load_biases(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, first_expert: int = 0) -> None:
        """Set the biases of experts ``first_expert ..`` (experts made with ``bias=True``): gate, up ``[n, I]``, down
        ``[n, H]``, any float dtype, held as fp32."""
        if not self.bias:
            raise ValueError("these experts were made without biases (CPUExperts(bias=True) holds them)")
        I, H = self.intermediate_size, self.hidden_size
        n = gate.shape[0] if isinstance(gate, torch.Tensor) and gate.dim() == 2 else -1
        ready = []
        for name, b, width in (("gate", gate, I), ("up", up, I), ("down", down, H)):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"{name} bias must be a torch.Tensor, got {type(b).__name__}")
            if not b.is_floating_point() or tuple(b.shape) != (n, width):
                raise ValueError(f"{name} bias must be floating point [n, {width}] (n = gate's {n} experts), got "
                                 f"{b.dtype} {list(b.shape)}")
            ready.append(b.detach().to("cpu", torch.float32).contiguous())
        if not 0 <= first_expert or first_expert + n > self.num_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + n}) do not fit in "
                             f"num_experts={self.num_experts}")
        self._ex.load_biases(first_expert, n, *(b.data_ptr() for b in ready))

    @staticmethod
    def _as_list(name: str, w: TensorOrList) -> list:
        if isinstance(w, torch.Tensor):
            if w.dim() != 3:
                raise ValueError(
                    f"{name} must be a stacked 3-D tensor or a list of 2-D tensors, got shape {tuple(w.shape)}")
            w = list(w.unbind(0))
        w = list(w)
        for i, t in enumerate(w):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name}[{i}] has dtype {t.dtype}; expert weights must be floating point")
        return w

    def fill_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights written straight into the packed layout (benchmarks without a checkpoint), std ~``std``."""
        self._ex.fill_random(int(seed), float(std))

    def storage(self) -> list:
        """The packed weights and scales as writable memoryviews (fixed order, no empty ones): what the converted-expert
        cache saves and restores (then ``mark_loaded()``)."""
        return [m for m in self._ex.storage() if m.nbytes]

    def mark_loaded(self) -> None:  # after restoring storage()
        self._ex.mark_loaded(0, self.num_experts)

    def checksum(self) -> int:
        return self._ex.checksum()  # 64-bit hash of the packed storage

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.storage())

    def dequantized(self, expert: int) -> tuple:
        """fp32 ``(gate [I, H], up [I, H], down [H, I])``: the values the kernels multiply by."""
        I, H = self.intermediate_size, self.hidden_size
        g, u, d = torch.empty(I, H), torch.empty(I, H), torch.empty(H, I)
        self._ex.unpack(int(expert), g.data_ptr(), u.data_ptr(), d.data_ptr())
        return g, u, d

    def info(self) -> dict:
        """Format, ISA path and kernel chosen, activation precision, bytes per expert, threads."""
        d = dict(self._ex.info())
        d["experts_loaded"] = self._ex.n_loaded
        d.setdefault("numa_subpools", 1)  # split engines report their subpools and [i0, i1) slices
        d.setdefault("numa_slices", [(0, self.intermediate_size)])
        return d

    JOB_STAGES = ("route", "quantize_x", "experts", "combine")

    def set_profiling(self, on: bool = True) -> None:
        """Time every job's stages from now on (``profile()``; on clears the sums), or stop (sums stay readable)."""
        if on:
            self._ex.reset_profile()
        self._ex.set_profiling(bool(on))

    def profile(self) -> dict:
        """Where the jobs since ``set_profiling()`` spent their time: ``{"jobs": n, "ms": {stage: mean ms per job}}``
        over ``JOB_STAGES`` (a NUMA-split layer: the mean over its slices)."""
        slices = self._ex.profile()
        jobs = slices[0]["jobs"]
        ms = {st: sum(p[st] for p in slices) / len(slices) / max(jobs, 1) / 1e6 for st in self.JOB_STAGES}
        return {"jobs": jobs, "ms": ms}

    def set_skip_mask(self, mask: Optional[torch.Tensor]) -> None:
        """Experts this layer never computes from now on (computed elsewhere, e.g. GPU-resident experts): bool
        ``[E]`` for later calls without a ``skip_mask`` of their own (jobs prepared before keep theirs); None clears."""
        if mask is not None:
            mask = _check_tensor("skip_mask", mask, (torch.bool, torch.uint8), 1).to(torch.bool).clone()
            if mask.numel() != self.num_experts:
                raise ValueError(f"skip_mask has {mask.numel()} entries; expected num_experts={self.num_experts}")
        self._skip_mask = mask

    skip_mask = property(lambda self: self._skip_mask)

    # ------------------------------------------------------------------ calls

    def prepare(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        *,
        n_tokens: Optional[torch.Tensor] = None,
        accumulate: bool = False,
        skip_mask: Optional[torch.Tensor] = None,
        slots: Slots = Slots(),
        route: Optional[HostRoute] = None,
        addend: Optional[torch.Tensor] = None,
    ) -> EngineJob:
        """Bind buffers into a job that can be submitted many times.

        x ``[T, H]`` fp32/bf16, topk_ids ``[T, k]`` int32/int64 (-1 = skip), topk_weights ``[T, k]`` fp32,
        out ``[T, H]`` fp32/bf16 (allocated like x when omitted). ``n_tokens``: an int64 CPU tensor of one
        element read when the job runs (T is then a capacity); ``skip_mask``: bool/uint8 ``[E]``, experts the
        CPU must skip (they are computed elsewhere), also read when the job runs.

        ``slots``: all of each token's k slots, or one part of them (Expert Deferral), from the same routing.
        ``route``: the job first routes every token from the logits and *writes* topk_ids / topk_weights.
        ``addend`` ``[T, H]`` fp32 is added to each token's sum after the experts (out = experts + addend, in that
        order: the previous layer's deferred output in a hybrid decode step).

        ``Slots.deferred(d, pair=imm)``: whenever this job is submitted right behind ``imm`` to the same pool (a
        hybrid decode step does) with at most 16 tokens, the two run as one list of tasks: ``imm`` completes as
        soon as its output is written while the workers go on with this one's tasks. When the next layer's
        immediate job is already queued meanwhile, its tasks join the same list too (its combine waits for this
        job's output). Results are the same bits either way. No effect on NUMA-split layers.
        """
        if self._ex.n_loaded == 0:
            raise RuntimeError("CPUExperts has no experts loaded yet: call load(gate, up, down) first")
        if not isinstance(slots, Slots):
            raise TypeError(f"slots must be a Slots (Slots.all(), .immediate(d), .deferred(d)), got {slots!r}")
        _check_tensor("x", x, (torch.float32, torch.bfloat16), 2)
        T, H = x.shape
        if H != self.hidden_size:
            raise ValueError(f"x has hidden size {H}; this layer has hidden_size={self.hidden_size}")
        _check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2)
        _check_tensor("topk_weights", topk_weights, (torch.float32,), 2)
        if topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={T}, k]"
            )
        k = topk_ids.shape[1]
        if k < 1:
            raise ValueError("topk_ids must have at least one column (k >= 1)")
        if slots.defer and not slots.defer < k:
            raise ValueError(f"slots defer must be in [1, k={k}), got {slots.defer}")
        if slots.pair is not None and (not isinstance(slots.pair, EngineJob) or slots.pair.experts is not self):
            raise ValueError("pair must be a job prepared by this same CPUExperts")
        if out is None:
            if accumulate:
                raise ValueError("accumulate=True needs an out tensor to accumulate into")
            out = torch.empty_like(x)
        _check_tensor("out", out, (torch.float32, torch.bfloat16), 2)
        if tuple(out.shape) != (T, H):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {(T, H)}")
        keep = [x, topk_ids, topk_weights, out]
        if route is not None:
            keep += self._check_route(route, T, k)
        if addend is not None:
            _check_tensor("addend", addend, (torch.float32,), 2)
            if tuple(addend.shape) != (T, H):
                raise ValueError(f"addend has shape {tuple(addend.shape)}; expected {(T, H)}")
            keep.append(addend)
        if n_tokens is not None:
            _check_tensor("n_tokens", n_tokens.reshape(-1), (torch.int64,), 1)
            if n_tokens.numel() != 1:
                raise ValueError(f"n_tokens must hold one value, got {n_tokens.numel()}")
            keep.append(n_tokens)
        skip_mask = self._skip_mask if skip_mask is None else skip_mask
        if skip_mask is not None:
            _check_tensor("skip_mask", skip_mask, (torch.bool, torch.uint8), 1)
            if skip_mask.numel() != self.num_experts:
                raise ValueError(f"skip_mask has {skip_mask.numel()} entries; expected num_experts={self.num_experts}")
            keep.append(skip_mask)

        def addr(t: Optional[torch.Tensor]) -> int:
            return 0 if t is None else t.data_ptr()

        spec = _C.JobSpec(
            x=x.data_ptr(), x_bf16=x.dtype == torch.bfloat16, ids=topk_ids.data_ptr(),
            ids_int32=topk_ids.dtype == torch.int32, weights=topk_weights.data_ptr(), k=k, out=out.data_ptr(),
            out_bf16=out.dtype == torch.bfloat16, accumulate=bool(accumulate), n_tokens_ptr=addr(n_tokens), T=T,
            skip_mask=addr(skip_mask), part=_C.JobPart.__members__[slots.part], defer=slots.defer, addend=addr(addend),
        )
        if route is not None:
            r = route.router
            spec.logits, spec.logits_bf16 = route.logits.data_ptr(), route.logits.dtype == torch.bfloat16
            spec.router, spec.norm_topk_prob = _C.RouterKind.__members__[r.kind], bool(r.norm_topk_prob)
            spec.n_group, spec.topk_group = int(r.n_group), int(r.topk_group)
            spec.routed_scaling_factor, spec.correction_bias = float(r.routed_scaling_factor), addr(r.correction_bias)
        job = self._ex.make_job(spec)
        if slots.pair is not None and isinstance(job, _C.MoeJob) and isinstance(slots.pair._job, _C.MoeJob):
            _C.pair_deferral_jobs(slots.pair._job, job)  # not the NUMA-split job
        return EngineJob(job, tuple(keep), self, out)

    def _check_route(self, route: HostRoute, T: int, k: int) -> list:
        """Validates a HostRoute for a [T, k] job; returns the tensors the job points into."""
        if not isinstance(route, HostRoute):
            raise TypeError(f"route must be a HostRoute(logits, router), got {route!r}")
        _check_tensor("logits", route.logits, (torch.float32, torch.bfloat16), 2)
        if tuple(route.logits.shape) != (T, self.num_experts):
            raise ValueError(f"logits has shape {tuple(route.logits.shape)}; expected "
                             f"[T={T}, num_experts={self.num_experts}]")
        router = route.router
        if not hasattr(router, "host_routable"):
            raise ValueError(f"a job that routes from logits needs a router (RouterSpec), got {router!r}")
        if not router.host_routable:
            raise ValueError(f"router kind {router.kind!r} is not host routable: a CPU job routes softmax or "
                             f"sigmoid_grouped (route it on the device with RouterSpec.route)")
        if router.top_k != k:
            raise ValueError(f"the router's top_k {router.top_k} differs from topk_ids' {k} columns")
        bias = router.correction_bias
        if bias is not None:
            _check_tensor("correction_bias", bias, (torch.float32,), 1)
            if bias.numel() != self.num_experts:
                raise ValueError(f"correction_bias has {bias.numel()} entries; expected num_experts={self.num_experts}")
        return [route.logits] if bias is None else [route.logits, bias]

    def submit(self, job_or_x: Union[EngineJob, torch.Tensor], *args, **kwargs) -> EngineJob:
        """Enqueue a prepared job, or prepare one from ``prepare``'s arguments and enqueue it. Returns the job."""
        job = job_or_x if isinstance(job_or_x, EngineJob) else self.prepare(job_or_x, *args, **kwargs)
        self.pool.submit(job)
        return job

    def sync(self, allow_pending: int = 0) -> None:  # wait until <= allow_pending jobs are unfinished; raise errors
        self.pool.sync(allow_pending)

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        *,
        accumulate: bool = False,
        skip_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Compute the routed experts now and return ``out``."""
        job = self.submit(x, topk_ids, topk_weights, out, accumulate=accumulate, skip_mask=skip_mask)
        self.pool.sync(0)
        return job.out

    __call__ = forward
