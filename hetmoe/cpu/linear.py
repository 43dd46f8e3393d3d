"""A dense linear on the CPU engine (``CPULinear``): one weight ``[N, K]`` (Hugging Face out x in) packed in the
engine's own formats and computed by its kernels (csrc/dense/linear.h):

    out[t] (+)= W norm(x[t]) (+ bias)

Attention projections, shared experts, dense MLPs and the lm_head run this way on the CPU: the weights stream once
per decode step with every pool thread on its own rows, and a long prompt takes the AMX GEMM where the CPU has one.
Several linears that read the same input (q/k/v, gate/up) are packed as one matrix of concatenated rows
(``from_linear([...])``) and computed by one call; ``parts(x)`` splits the output back (the interface of
``hetmoe.layers.linear.FusedLinears``). Formats and groups come from ``hetmoe.layers.linear.DENSE_FORMATS``.

Shape letters: T tokens, K in_features, N out_features.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from hetmoe import _C
from hetmoe.config.formats import dense_format
from hetmoe.config.options import AMX_EMULATED, ISAS
from hetmoe.cpu.pool import EngineJob, WorkerPool, shared_pool

GROUPS = (32, 64, 128)  # int8 / int4 scale groups along K; both also take 0 (one scale per row)
LOAD_CHUNK_BYTES = 64 << 20  # fp32 rows converted at once by load(): no fp32 copy of a whole lm_head

WeightSource = Union[torch.Tensor, nn.Linear, Sequence[Union[torch.Tensor, nn.Linear]]]


def _floats(name: str, t: torch.Tensor, numel: int) -> torch.Tensor:
    """A CPU fp32 contiguous copy (or the tensor itself) of a 1-D parameter of ``numel`` values."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {type(t).__name__}")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} values; expected {numel}")
    return t.detach().to("cpu", torch.float32).reshape(-1).contiguous()


def _rows_2d(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [..., width] as a 2-D view [rows, width] with unit column stride (no copy), else a clear error."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    try:
        v = t.view(-1, width)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows of "
                         f"{width} (a slice of the last dimension of a contiguous tensor can)") from None
    if v.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides {t.stride()}")
    return v


class CPULinear(nn.Module):
    """``y = W x (+ bias)`` on the CPU engine, W ``[out_features, in_features]`` packed in ``fmt``.

    Args:
        in_features, out_features: K and N.
        fmt: ``"bf16"``, ``"int8"`` or ``"int4"`` (``DENSE_FORMATS`` entries that run on the CPU).
        group_size: int8/int4 scale group along K: 32, 64 or 128, or 0 (one scale per row). Ignored for bf16.
        bias: ``[out_features]`` (any float dtype; kept in fp32) or None.
        isa: ``"auto"`` (best the CPU supports) or ``scalar``, ``avx2``, ``avx512``, ``amx`` (``"amx-emulated"``:
            tests only), as ``CPUExperts``.
        pool: an ``WorkerPool`` (default: the process-wide shared pool). A pool split over NUMA subpools runs the
            linear on its first subpool.
        amx_min_tokens: calls with at least this many tokens use the AMX GEMM (default: the engine's crossover for
            the format, ``cpu_info()["amx_min_tokens_default"]``).
        sizes: output features of the linears packed together (``parts``); default ``[out_features]``.

    The weights are loaded afterwards with ``load`` (or ``from_linear`` does both). Activations are rounded as the
    experts' (int16 per group for int8 weights, int8 for int4, fp32 for bf16; AMX: bf16 / int8), so the output
    agrees with a bf16 matmul within the format's ``DENSE_FORMATS[fmt].tolerance``.
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "int8", group_size: int = 64,
                 bias: Optional[torch.Tensor] = None, isa: str = "auto", pool: Optional[WorkerPool] = None,
                 amx_min_tokens: Optional[int] = None, sizes: Optional[Sequence[int]] = None):
        super().__init__()
        self.format = dense_format(fmt, "cpu")
        self.in_features, self.out_features = int(in_features), int(out_features)
        if self.in_features < 1 or self.out_features < 1:
            raise ValueError(f"in_features and out_features must be >= 1, got {in_features} and {out_features}")
        if fmt == "bf16":
            group_size = 0
        elif group_size not in GROUPS and group_size != 0:
            raise ValueError(f"group_size for {fmt} must be one of {', '.join(map(str, GROUPS))} or 0 (per row), "
                             f"got {group_size!r}")
        self.group_size = int(group_size)
        features = _C.cpu_features()
        emulated = isa == AMX_EMULATED
        if isa == "auto":
            isa = features["best_isa"]
        elif emulated:  # row blocks on the best real non-AMX level, the GEMM emulated
            isa = next(i for i in ("avx512", "avx2", "scalar") if i in features["supported_isas"])
        elif isa not in ISAS:
            raise ValueError(f"unknown isa {isa!r}; expected 'auto', {AMX_EMULATED!r} or one of {', '.join(ISAS)}")
        if amx_min_tokens is None:
            amx_min_tokens = features["amx_min_tokens_default"][fmt]
        elif isinstance(amx_min_tokens, bool) or not isinstance(amx_min_tokens, int) or amx_min_tokens < 1:
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {amx_min_tokens!r}")
        if pool is None:
            pool = shared_pool()
        elif not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be an WorkerPool, got {type(pool).__name__}")
        self.pool = pool
        self.sizes = [self.out_features] if sizes is None else [int(s) for s in sizes]
        if sum(self.sizes) != self.out_features or min(self.sizes) < 1:
            raise ValueError(f"sizes {self.sizes} must be positive and add up to out_features={self.out_features}")
        self.bias = None if bias is None else _floats("bias", bias, self.out_features)
        self._lin = _C.DenseLinear(pool._pool, self.out_features, self.in_features, fmt, self.group_size, isa,
                                   emulated, int(amx_min_tokens))

    @classmethod
    def from_linear(cls, source: WeightSource, fmt: str = "int8", group_size: int = 64, **kwargs) -> "CPULinear":
        """A ``CPULinear`` packed from an ``nn.Linear``, a weight ``[N, K]``, or a list of them read by one input
        (fused q/k/v, gate/up): their rows concatenated in order, ``sizes`` their output features, their biases
        concatenated (all or none). ``kwargs``: the constructor's (isa, pool, amx_min_tokens)."""
        items = [source] if isinstance(source, (torch.Tensor, nn.Linear)) else list(source)
        if not items:
            raise ValueError("from_linear needs at least one linear or weight")
        weights, biases = [], []
        for i, item in enumerate(items):
            if isinstance(item, nn.Linear):
                weights.append(item.weight)
                biases.append(item.bias)
            elif isinstance(item, torch.Tensor):
                weights.append(item)
                biases.append(None)
            else:
                raise TypeError(f"item {i} must be an nn.Linear or a weight tensor, got {type(item).__name__}")
        if len({b is None for b in biases}) != 1:
            raise ValueError("fused linears must all have a bias or all have none")
        for i, w in enumerate(weights):
            if w.dim() != 2:
                raise ValueError(f"weight {i} must be 2-D [out, in], got shape {tuple(w.shape)}")
        if len({w.shape[1] for w in weights}) != 1:
            raise ValueError(f"fused linears must read inputs of one size, got {[w.shape[1] for w in weights]}")
        sizes = [w.shape[0] for w in weights]
        bias = None if biases[0] is None else torch.cat([b.detach().float().cpu() for b in biases])
        lin = cls(weights[0].shape[1], sum(sizes), fmt, group_size, bias=bias, sizes=sizes, **kwargs)
        lin.load(weights)
        return lin

    # ------------------------------------------------------------------ weights

    def load(self, weight: Union[torch.Tensor, Sequence[torch.Tensor]]) -> None:
        """Pack W from ``[out_features, in_features]`` (any float dtype, any device), or from a list of weights
        whose rows concatenate to it. Converted to fp32 a chunk of rows at a time; the source can be freed after."""
        parts = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        K, N = self.in_features, self.out_features
        for i, w in enumerate(parts):
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"weight {i} must be a torch.Tensor, got {type(w).__name__}")
            if not w.is_floating_point():
                raise ValueError(f"weight {i} has dtype {w.dtype}; weights must be floating point")
            if w.dim() != 2 or w.shape[1] != K:
                raise ValueError(f"weight {i} has shape {tuple(w.shape)}; expected [rows, in_features={K}]")
            if w.device.type == "meta":
                raise ValueError(f"weight {i} is a meta tensor and holds no data")
        if sum(w.shape[0] for w in parts) != N:
            raise ValueError(f"the weights hold {sum(w.shape[0] for w in parts)} rows; expected out_features={N}")
        starts = [0]
        for w in parts:
            starts.append(starts[-1] + w.shape[0])
        chunk = max(16, LOAD_CHUNK_BYTES // (4 * K) // 16 * 16)
        for r0 in range(0, N, chunk):
            r1 = min(N, r0 + chunk)
            pieces = [w.detach()[max(r0, s) - s:min(r1, s + w.shape[0]) - s]
                      for w, s in zip(parts, starts) if s < r1 and s + w.shape[0] > r0]
            rows = torch.cat([p.to("cpu", torch.float32) for p in pieces]) if len(pieces) > 1 else \
                pieces[0].to("cpu", torch.float32).contiguous()
            self._lin.load_rows(r0, r1 - r0, rows.data_ptr())

    def fill_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights written straight into the packed layout (benchmarks): std about ``std``."""
        self._lin.fill_random(int(seed), float(std))

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 ``[out_features, in_features]``: the values the kernels multiply by."""
        w = torch.empty(self.out_features, self.in_features)
        self._lin.unpack(w.data_ptr())
        return w

    def storage(self) -> list:
        """The packed weights and scales as writable memoryviews (empty ranges left out); ``mark_loaded()`` after
        restoring them."""
        return [m for m in self._lin.storage() if m.nbytes]

    def mark_loaded(self) -> None:
        self._lin.mark_loaded()

    def checksum(self) -> int:
        return self._lin.checksum()

    @property
    def nbytes(self) -> int:
        """Bytes held: packed weights and scales (padding included), and the fp32 bias."""
        return self._lin.nbytes + (self.bias.numel() * 4 if self.bias is not None else 0)

    @property
    def amx_min_tokens(self) -> Optional[int]:
        """Calls with at least this many tokens use the AMX GEMM (None: no AMX path here)."""
        return self._lin.amx_min_tokens if self._lin.info()["amx"] != "off" else None

    @amx_min_tokens.setter
    def amx_min_tokens(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"amx_min_tokens must be an integer >= 1, got {n!r}")
        self._lin.amx_min_tokens = n

    def info(self) -> dict:
        """Format, group, ISA, kernel (and AMX GEMM), activation precision, bytes, threads."""
        return dict(self._lin.info())

    def extra_repr(self) -> str:
        info = self._lin.info()
        group = f", group_size={self.group_size}" if self.format.name != "bf16" else ""
        sizes = f", sizes={self.sizes}" if len(self.sizes) > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.format.name}{group}, "
                f"bias={self.bias is not None}, kernel={info['kernel']}{sizes}")

    # ------------------------------------------------------------------ calls

    def _bind(self, x: torch.Tensor, out: Optional[torch.Tensor], accumulate: bool, norm,
              norm_out: Optional[torch.Tensor] = None) -> tuple:
        """(LinearSpec, tensors it points into, out) for one call."""
        K, N = self.in_features, self.out_features
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"x is on {x.device}; CPULinear needs CPU tensors")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"x has dtype {str(x.dtype).replace('torch.', '')}; expected float32 or bfloat16")
        if x.dim() < 1 or x.shape[-1] != K:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., in_features={K}]")
        x2 = x.reshape(-1, K)
        T = x2.shape[0]
        if x2.stride(1) != 1 or (T > 1 and x2.stride(0) < K):  # e.g. broadcast rows: one copy, rows apart
            x2 = x2.contiguous()
        if out is None:
            if accumulate:
                raise ValueError("accumulate=True needs an out tensor to accumulate into")
            out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            raise ValueError("out must be a CPU tensor")
        if out.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out has dtype {str(out.dtype).replace('torch.', '')}; expected float32 or bfloat16")
        if tuple(out.shape) != tuple(x.shape[:-1]) + (N,):
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(x.shape[:-1]) + (N,)}")
        out2 = _rows_2d("out", out, N)
        if T > 1 and out2.stride(0) < N:
            raise ValueError(f"out's rows overlap (row stride {out2.stride(0)} < out_features={N})")
        keep = [x2, out2]
        spec = _C.LinearSpec(x=x2.data_ptr(), x_bf16=x2.dtype == torch.bfloat16, x_stride=x2.stride(0) if T > 1 else K,
                             out=out2.data_ptr(), out_bf16=out2.dtype == torch.bfloat16,
                             out_stride=out2.stride(0) if T > 1 else N, accumulate=bool(accumulate), T=T)
        if self.bias is not None:
            spec.bias = self.bias.data_ptr()
            keep.append(self.bias)
        if norm is not None:
            weight, eps = self._norm_args(norm)
            spec.norm_weight, spec.norm_eps = weight.data_ptr(), eps
            keep.append(weight)
        if norm_out is not None:
            if norm is None:
                raise ValueError("norm_out needs a norm (the rows it receives are x's rows normed)")
            if not isinstance(norm_out, torch.Tensor) or norm_out.device.type != "cpu" or norm_out.dtype != x.dtype \
                    or tuple(norm_out.shape) != tuple(x.shape):
                raise ValueError(f"norm_out must be a CPU tensor of x's shape {tuple(x.shape)} and dtype {x.dtype}")
            n2 = _rows_2d("norm_out", norm_out, K)
            if T > 1 and n2.stride(0) < K:
                raise ValueError(f"norm_out's rows overlap (row stride {n2.stride(0)} < in_features={K})")
            spec.norm_out, spec.norm_out_stride = n2.data_ptr(), n2.stride(0) if T > 1 else K
            keep.append(n2)
        return spec, tuple(keep), out

    def _norm_args(self, norm) -> tuple:
        """(fp32 weight [K], eps) from an RMSNorm module (``weight`` and ``variance_epsilon`` or ``eps``) or a
        ``(weight, eps)`` pair."""
        if isinstance(norm, tuple) and len(norm) == 2:
            weight, eps = norm
        elif hasattr(norm, "weight") and (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps")):
            weight, eps = norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        else:
            raise ValueError(f"norm must be an RMSNorm module or a (weight, eps) pair, got {type(norm).__name__}")
        eps = float(eps)
        if not eps >= 0 or eps == float("inf"):
            raise ValueError(f"norm eps must be finite and >= 0, got {eps}")
        return _floats("norm weight", weight, self.in_features), eps

    @torch.no_grad()
    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                norm=None, norm_out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [..., K]`` fp32/bf16 -> ``[..., N]`` in x's dtype (or written into ``out``, fp32/bf16, whose rows
        may be strided: a column slice of a wider buffer). ``accumulate``: out += the result (a residual add).
        ``norm``: an RMSNorm (module, or ``(weight, eps)``) applied to each row of x first, in fp32.
        ``norm_out`` (with ``norm``; x's shape and dtype): receives the normed rows, rounded as the eager module
        rounds them in x's dtype, and the product reads those rounded values: exactly ``h = norm(x); W h``."""
        spec, keep, out = self._bind(x, out, accumulate, norm, norm_out)
        if spec.T:
            self._lin.run(spec)
        return out

    def parts(self, x: torch.Tensor, **kwargs) -> tuple:
        """``x [..., K]`` -> each packed linear's output ``[..., size_i]``: views of one output."""
        return self.forward(x, **kwargs).split(self.sizes, dim=-1)

    def prepare(self, x: torch.Tensor, out: Optional[torch.Tensor] = None, *, accumulate: bool = False, norm=None,
                norm_out: Optional[torch.Tensor] = None, n_tokens: Optional[torch.Tensor] = None) -> EngineJob:
        """Bind buffers into a job for ``pool.submit`` / ``submit_on_stream``, submitted as often as needed (their
        contents may change). ``n_tokens``: an int64 CPU tensor of one element read when the job runs (x's rows
        are then a capacity)."""
        spec, keep, out = self._bind(x, out, accumulate, norm, norm_out)
        if n_tokens is not None:
            if not isinstance(n_tokens, torch.Tensor) or n_tokens.dtype != torch.int64 or n_tokens.numel() != 1 \
                    or n_tokens.device.type != "cpu":
                raise ValueError("n_tokens must be an int64 CPU tensor of one element")
            spec.n_tokens_ptr = n_tokens.data_ptr()
            keep += (n_tokens,)
        return EngineJob(self._lin.make_job(spec), keep, self, out)
