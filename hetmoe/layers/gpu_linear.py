"""Dense weights on the GPU in a format of hetmoe.layers.linear.DENSE_FORMATS: bf16, fp8 (e4m3, one scale per
128 x 128 block), int8 and int4 (weight-only, symmetric, one fp32 scale per 64 weights along K).

``GPULinear`` holds one or several linears that read the same input (q/k/v, gate/up) as one packed [N, K] matrix,
their rows side by side (``sizes``), and computes ``y [..., N] = x [..., K] W^T + b`` in bf16. The kernel is chosen
once, at construction, from the format and the device (``kernel``):

* ``torch``: bf16 weights through F.linear (cuBLAS).
* ``triton``: int8/int4/fp8 weights (hetmoe/ops/triton/linear.py): a CUDA-core GEMV that dequantizes in its
  K loop for decode (M <= 4), tensor-core tiles that dequantize in the K loop up to M < 256, and for prefill slabs
  of the weights dequantized to bf16 for cuBLAS. fp8 on GPUs without fp8 conversion (compute capability < 8.9)
  decodes the e4m3 bytes arithmetically.
* ``scaled_mm``: fp8 where the GPU multiplies fp8 (capability >= 8.9), PyTorch takes DeepSeek's block scales
  (1 x 128 per token for x, 128 x 128 for W; checked once per device), the shape fits cuBLAS and the weight is
  large enough to repay x's quantization: for M > 16, x is quantized per token and 128-column block, then one
  scaled matmul. Decode rows (M <= 16) still take the Triton kernels, which read the fp8 weights with bf16 x
  (no activation rounding) faster than cuBLAS does.
* ``reference``: dequantize to fp32 and F.linear, the tests' reference and the path where Triton is missing.

Packed layouts are documented in triton_linear.py. Every kernel launch depends only on the shapes, so a CUDA graph
captured for a fixed M replays it.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.config.formats import DENSE_FORMATS, dense_format

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_BLOCK = 128  # DeepSeek-V3/R1: one weight_scale_inv per 128 x 128 block
INT_QMAX = {"int8": 127, "int4": 7}
KERNELS = ("torch", "triton", "scaled_mm", "reference")
DECODE_M = 16  # rows at most for the GEMV (triton_linear.DECODE_M, kept here so no import of triton is needed)
_CHUNK_ELEMENTS = 1 << 22  # weight elements converted at a time while packing: a slab, 16 MiB in fp32; its
# temporaries are about 5 such slabs (tests/load/test_build_peak.py measures them)
SCALED_MM_MIN_WEIGHTS = 1 << 25  # fp8 weights at least this large take _scaled_mm for prefill
# a fused decode step's SwiGLU MLP computes silu(gate) * up inside the down projection's GEMV (``swiglu``), one kernel
# fewer (the A/B that chose it: BENCHMARKS.md, "GPU part of the decode step")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# ------------------------------------------------------------------------------------------ packing (PyTorch ops)


def _row_slabs(linears: Sequence[nn.Linear], n: int, step: Optional[int] = None):
    """(r0, r1, rows [r1 - r0, K]) over the rows of ``linears`` stacked (their weights as they are: dtype, device),
    ``step`` rows at a time (all when None): a view of one linear's weight where a slab lies in one, else a copy of
    the slab's parts joined."""
    bounds, r = [], 0
    for lin in linears:
        bounds.append((r, r + lin.out_features, lin.weight.detach()))
        r += lin.out_features
    step = step or n
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        parts = [w[max(r0, a) - a:min(r1, b) - a] for a, b, w in bounds if a < r1 and b > r0]
        yield r0, r1, parts[0] if len(parts) == 1 else torch.cat(parts)


def quantize_int(w: torch.Tensor, fmt: str) -> tuple:
    """fp32 ``w [N, K]`` -> (codes, fp32 scales [N, Kp/64]) in ``fmt`` (int8: int8 [N, Kp]; int4: uint8 [N, Kp/2]),
    Kp = K padded with zeros to a multiple of 64; symmetric, scale = max |w| of the group / qmax."""
    group, qmax = DENSE_FORMATS[fmt].group, INT_QMAX[fmt]
    N, K = w.shape
    kp = _cdiv(K, group) * group
    w = F.pad(w.float(), (0, kp - K)).view(N, kp // group, group)
    scale = w.abs().amax(-1) / qmax  # [N, G]
    q = torch.round(w / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    if fmt == "int8":
        return q.view(N, kp), scale
    return pack_int4(q.view(N, kp)), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], [N, Kp] -> uint8 [N, Kp/2]; in each group of 64, byte i holds
    (q[i] + 8) | (q[32 + i] + 8) << 4."""
    N, kp = q.shape
    u = (q.to(torch.int16) + 8).view(N, kp // 64, 2, 32)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).to(torch.uint8).view(N, kp // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [N, Kp/2] -> int8 codes [N, Kp]."""
    N, half = packed.shape
    b = packed.to(torch.int16).view(N, half // 32, 1, 32)
    return (torch.cat([b & 15, b >> 4], dim=2) - 8).to(torch.int8).view(N, half * 2)


def quantize_fp8(w: torch.Tensor) -> tuple:
    """fp32 ``w [N, K]`` -> (float8_e4m3fn [N, Kp], fp32 scale_inv [ceil(N/128), Kp/128]), Kp = K padded to a
    multiple of 128: one scale per 128 x 128 block, max |w| of the block / 448 (DeepSeek's convention)."""
    N, K = w.shape
    np_, kp = _cdiv(N, FP8_BLOCK) * FP8_BLOCK, _cdiv(K, FP8_BLOCK) * FP8_BLOCK
    blocks = F.pad(w.float(), (0, kp - K, 0, np_ - N)).view(np_ // FP8_BLOCK, FP8_BLOCK, kp // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax((1, 3)) / FP8_MAX  # [NB, KB]
    q = (blocks / torch.where(scale > 0, scale, 1.0)[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).view(np_, kp)[:N], scale


def dequantize(fmt: str, weight: torch.Tensor, scale: Optional[torch.Tensor], k: int) -> torch.Tensor:
    """Packed ``weight``/``scale`` of ``fmt`` -> fp32 [N, k]."""
    if fmt == "bf16":
        return weight.float()
    if fmt == "fp8":
        s = scale.repeat_interleave(FP8_BLOCK, 0)[: weight.shape[0]].repeat_interleave(FP8_BLOCK, 1)
        return (weight.float() * s)[:, :k]
    codes = unpack_int4(weight) if fmt == "int4" else weight
    return (codes.float() * scale.repeat_interleave(DENSE_FORMATS[fmt].group, 1))[:, :k]


# ------------------------------------------------------------------------------------------ kernel choice

_BLOCKWISE_OK: dict = {}


def blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether torch._scaled_mm on ``device`` multiplies fp8 with 1 x 128 x-scales and 128 x 128 W-scales (tried
    once on a small product and compared with its dequantized form)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    if device not in _BLOCKWISE_OK:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(384, 1024, device=device, generator=g)
        x = torch.randn(20, 1024, device=device, generator=g).bfloat16()
        wq, ws = quantize_fp8(w)
        try:
            y = _scaled_mm_fp8(x, wq, ws, None).float()
            ref = x.float() @ dequantize("fp8", wq, ws, 1024).t()
            _BLOCKWISE_OK[device] = bool(((y - ref).norm() / ref.norm()) < 0.1)
        except (RuntimeError, TypeError, ValueError) as err:
            log.info("torch._scaled_mm takes no block scales here (%s); fp8 runs on the Triton kernel", err)
            _BLOCKWISE_OK[device] = False
    return _BLOCKWISE_OK[device]


def scaled_mm_fits(n_out: int, k: int) -> bool:
    """cuBLAS's block-scaled fp8 product takes N a multiple of 16 and a count of 128-column blocks that is a
    multiple of 4 (seen on an H200; every DeepSeek-V3 shape has both)."""
    return n_out % 16 == 0 and _cdiv(k, FP8_BLOCK) % 4 == 0


def choose_kernel(fmt: str, device: torch.device, n_out: int, k: int, kernel: Optional[str] = None) -> str:
    """The kernel for an [n_out, k] weight of ``fmt`` on ``device`` (module docstring); ``kernel`` asks for one,
    checked."""
    if kernel is not None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if (kernel == "torch") != (fmt == "bf16") and kernel != "reference":
            raise ValueError(f"kernel {kernel!r} does not run the {fmt} format")
        if kernel in ("triton", "scaled_mm") and not has_triton():
            raise ValueError(f"kernel {kernel!r} needs the triton package, which is not installed")
        if kernel == "scaled_mm" and (fmt != "fp8" or not scaled_mm_fits(n_out, k) or not blockwise_scaled_mm(device)):
            raise ValueError("kernel 'scaled_mm' needs fp8 weights, N a multiple of 16, K in a multiple of 4 blocks "
                             "of 128 and a GPU where PyTorch's scaled matmul takes block scales")
        return kernel
    if fmt == "bf16":
        return "torch"
    if device.type != "cuda" or not has_triton():
        return "reference"
    # x's quantization costs more than the fp8 product saves on small weights (bench/device/gpu_linear.py)
    large = n_out * k >= SCALED_MM_MIN_WEIGHTS
    return "scaled_mm" if fmt == "fp8" and large and scaled_mm_fits(n_out, k) and blockwise_scaled_mm(device) \
        else "triton"


def _scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    """bf16 x [M, K] quantized per token and 128-column block, times fp8 ``weight`` [N, Kp] with its block scales
    [NB, Kp/128], through PyTorch's scaled matmul -> bf16 [M, N]."""
    M, K = x.shape
    kp = weight.shape[1]
    mp = _cdiv(M, 16) * 16  # cuBLAS refuses block-scaled products of some row counts (1, 3, 17: seen on an H200)
    if kp != K or mp != M:
        x = F.pad(x, (0, kp - K, 0, mp - M))
    xb = x.view(mp, kp // FP8_BLOCK, FP8_BLOCK).float()
    sx = xb.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [M, KB]
    xq = (xb / sx.unsqueeze(-1)).to(torch.float8_e4m3fn).view(mp, kp)
    # both scale tensors K-block-major: x's [M, KB] with strides (1, M), W's as [KB, NB]
    sx = sx.t().contiguous().t()
    if hasattr(F, "scaled_mm"):  # the explicit recipes (PyTorch >= 2.10)
        kinds = F.ScalingType
        y = F.scaled_mm(xq, weight.t(), sx, kinds.BlockWise1x128, scale.t(), kinds.BlockWise128x128,
                        output_dtype=torch.bfloat16)
    else:
        y = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=scale.t(), out_dtype=torch.bfloat16)
    y = y[:M]
    return y if bias is None else y + bias.to(y.dtype)


# ------------------------------------------------------------------------------------------ the module


class GPULinear(nn.Module):
    """Linears that read one input, packed side by side in a dense format (module docstring). Build it with
    ``from_linears`` or ``from_fp8``; ``forward`` returns all outputs side by side, ``parts`` one view each."""

    def __init__(self, fmt: str, weight: torch.Tensor, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 in_features: int, sizes: Sequence[int], kernel: Optional[str] = None):
        super().__init__()
        self.format = dense_format(fmt, "cuda")
        self.in_features = in_features
        self.sizes = list(sizes)
        self.out_features = sum(self.sizes)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.kernel = choose_kernel(fmt, weight.device, self.out_features, in_features, kernel)
        self.fp8_bits = (fmt == "fp8" and weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (8, 9))
        log.debug("GPULinear [%d, %d] %s on %s: kernel %s", self.out_features, in_features, fmt, weight.device,
                  self.kernel)

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], fmt: str, device, kernel: Optional[str] = None) -> GPULinear:
        """Pack ``linears`` (one input size; all with a bias or none) into ``fmt`` on ``device``; the source
        weights are read, not kept."""
        dense_format(fmt, "cuda")
        if not linears:
            raise ValueError("GPULinear.from_linears needs at least one linear")
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError(f"packed linears must read inputs of one size, got {[lin.in_features for lin in linears]}")
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("packed linears must all have a bias or all have none")
        device = torch.device(device)
        K = linears[0].in_features
        sizes = [lin.out_features for lin in linears]
        N = sum(sizes)
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([lin.bias.detach() for lin in linears]).to(device, torch.float32)
        if fmt == "bf16":
            weight = torch.empty(N, K, dtype=torch.bfloat16, device=device)
            for r0, r1, rows in _row_slabs(linears, N):
                weight[r0:r1].copy_(rows)
            return cls(fmt, weight, None, bias, K, sizes, kernel)
        # A slab of rows at a time, written into the packed tensors made up front: the weights may stay where they
        # are (host memory: loader/synthetic stage them there), and the device holds the packed result and one
        # slab's temporaries, never a whole matrix in bf16 or fp32, nor a second packed copy.
        group = DENSE_FORMATS[fmt].group
        kp = _cdiv(K, group) * group
        if fmt == "fp8":
            weight = torch.empty(N, kp, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(_cdiv(N, FP8_BLOCK), kp // FP8_BLOCK, dtype=torch.float32, device=device)
        else:
            int8 = fmt == "int8"  # int4: two codes a byte
            weight = torch.empty(N, kp if int8 else kp // 2, dtype=torch.int8 if int8 else torch.uint8, device=device)
            scale = torch.empty(N, kp // group, dtype=torch.float32, device=device)
        step = max(FP8_BLOCK, _CHUNK_ELEMENTS // max(K, 1) // FP8_BLOCK * FP8_BLOCK)
        for r0, r1, rows in _row_slabs(linears, N, step):
            slab = rows.to(device).float()  # bf16 over the bus, widened where it lands
            q, s = quantize_fp8(slab) if fmt == "fp8" else quantize_int(slab, fmt)
            del slab
            weight[r0:r1].copy_(q)
            if fmt == "fp8":  # r0 is a whole number of 128-row blocks
                scale[r0 // FP8_BLOCK:r0 // FP8_BLOCK + s.shape[0]].copy_(s)
            else:
                scale[r0:r1].copy_(s)
        return cls(fmt, weight, scale, bias, K, sizes, kernel)

    @classmethod
    def from_fp8(cls, weight, scale_inv, bias=None, device=None, kernel: Optional[str] = None) -> GPULinear:
        """A DeepSeek FP8 checkpoint's own weights, kept as they are: ``weight`` float8_e4m3fn [N, K] and
        ``scale_inv`` [ceil(N/128), ceil(K/128)] (w = weight * scale_inv per 128 x 128 block), or lists of them
        to pack side by side (every part but the last must have N a multiple of 128, so blocks stay whole)."""
        weights = list(weight) if isinstance(weight, (list, tuple)) else [weight]
        scales = list(scale_inv) if isinstance(scale_inv, (list, tuple)) else [scale_inv]
        if isinstance(bias, torch.Tensor) and len(weights) > 1:
            raise ValueError("packed fp8 weights take one bias per part (a list), or none")
        biases = list(bias) if isinstance(bias, (list, tuple)) else [bias] * len(weights)
        if scale_inv is None or any(s is None for s in scales):
            raise ValueError("fp8 weights need their scale_inv (one fp32 scale per 128 x 128 block)")
        if len(scales) != len(weights) or len(biases) != len(weights):
            raise ValueError(f"got {len(weights)} fp8 weights, {len(scales)} scale_inv and {len(biases)} biases")
        if len({b is None for b in biases}) != 1:
            raise ValueError("packed linears must all have a bias or all have none")
        for i, (w, s) in enumerate(zip(weights, scales)):
            if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
                raise ValueError(f"fp8 weight {i} must be a 2-D float8_e4m3fn tensor, got {w.dtype} "
                                 f"{tuple(w.shape)}")
            want = (_cdiv(w.shape[0], FP8_BLOCK), _cdiv(w.shape[1], FP8_BLOCK))
            if tuple(s.shape) != want:
                raise ValueError(f"scale_inv {i} has shape {tuple(s.shape)}; a {list(w.shape)} weight in "
                                 f"128 x 128 blocks needs {list(want)}")
            if i < len(weights) - 1 and w.shape[0] % FP8_BLOCK:
                raise ValueError(f"fp8 weight {i} has {w.shape[0]} rows; only the last packed part may have a "
                                 f"row count that is not a multiple of {FP8_BLOCK}")
        K = weights[0].shape[1]
        if any(w.shape[1] != K for w in weights):
            raise ValueError(f"packed linears must read inputs of one size, got {[w.shape[1] for w in weights]}")
        device = torch.device(device) if device is not None else weights[0].device
        kp = _cdiv(K, FP8_BLOCK) * FP8_BLOCK
        # each part copied into its rows of the packed tensor: the device holds no copy of a part besides
        w = torch.zeros(sum(x.shape[0] for x in weights), kp, dtype=torch.uint8, device=device)
        r0 = 0
        for x in weights:
            w[r0:r0 + x.shape[0], :K].copy_(x.view(torch.uint8))
            r0 += x.shape[0]
        s = torch.cat([x.to(device, torch.float32) for x in scales])
        b = torch.cat([x.to(device, torch.float32) for x in biases]) if biases[0] is not None else None
        return cls("fp8", w.view(torch.float8_e4m3fn), s.contiguous(), b, K, [x.shape[0] for x in weights], kernel)

    @property
    def nbytes(self) -> int:
        """Bytes this linear holds on its device: packed weights (K padded to a group), scales, bias."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.bias) if t is not None)

    def dequantized_weight(self) -> torch.Tensor:
        """The weights this linear multiplies by, fp32 [N, K]."""
        return dequantize(self.format.name, self.weight, self.scale, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16: every packed linear's output side by side."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"GPULinear takes bfloat16 inputs, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"GPULinear expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"input on {x.device}, weights on {self.weight.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        if self.kernel == "torch":
            y = F.linear(x2, self.weight, None if self.bias is None else self.bias.to(x.dtype))
        elif self.kernel == "reference":
            y = F.linear(x2.float(), self.dequantized_weight(), self.bias).to(x.dtype)
        elif self.kernel == "scaled_mm" and M > DECODE_M:
            y = _scaled_mm_fp8(x2, self.weight, self.scale, self.bias)
        else:
            from hetmoe.ops.triton import linear as triton_linear

            y = triton_linear.linear(x2, self.weight, self.scale, self.bias, self.format.name, self.out_features,
                                     fp8_bits=self.fp8_bits)
        return y.view(*lead, self.out_features)

    def swiglu(self, gate_up: torch.Tensor):
        """silu(gate) * up times this linear for ``gate_up`` [..., 2 * in_features] (a fused decode step's SwiGLU MLP)
        with the activation computed by the GEMV as it reads its input: the ``silu_mul`` kernel's output bitwise,
        one kernel fewer. None where this linear does not run the Triton GEMV for these rows (the caller runs
        ``silu_mul`` and the linear)."""
        from hetmoe.ops.triton import linear as triton_linear

        lead = gate_up.shape[:-1]
        x2 = gate_up.reshape(-1, gate_up.shape[-1])
        M = x2.shape[0]
        fits = (gate_up.shape[-1] == 2 * self.in_features and 0 < M <= triton_linear.GEMV_M
                and gate_up.dtype == torch.bfloat16 and gate_up.device == self.weight.device)
        if self.kernel not in ("triton", "scaled_mm") or not fits:
            return None
        y = triton_linear.linear(x2, self.weight, self.scale, self.bias, self.format.name, self.out_features,
                                 fp8_bits=self.fp8_bits, swiglu=True)
        return y.view(*lead, self.out_features)

    def parts(self, x: torch.Tensor) -> tuple:
        """x [..., K] -> each packed linear's output [..., out_i] (views of one output)."""
        return self(x).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.sizes}, {self.format.name}, kernel={self.kernel}"
