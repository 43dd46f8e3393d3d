"""Dense weights in bf16/fp8/int8/int4 (hetmoe/layers/gpu_linear.py, triton_linear.py) against two references:
the fp32 product with the same dequantized weights (kernel correctness, tight) and the fp32 product with the bf16
weights the format was made from (the format's error, bound DENSE_FORMATS[fmt].tolerance).

Paths: the reference path (dequantize + F.linear) on the CPU; the Triton kernels in Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set by tests/conftest.py; skipped without the triton package) and on the GPU (marked gpu);
fp8 through torch._scaled_mm where the GPU takes block scales (gpu).

Measured, N(0, 0.02) weights, N(0, 1) inputs, ||y - ref|| / ||ref|| (bench/device/gpu_linear.py --errors on an H200;
the interpreter here):
* kernel vs its dequantized weights: fp32 x and out (interpreter) <= 1e-6 (bound 1e-5); bf16 out: the output's
  rounding, 1.7e-3 for the GEMV (M <= 4), 2.3e-3 (M = 16..64) and 2.9e-3 (M >= 256) where the weights are also
  rounded to bf16 for the tensor cores; 3.4e-3 in the interpreter, which truncates to bf16 (bound 4e-3). fp8
  through _scaled_mm (M > 16) also rounds x to fp8 per token and 128 columns: 2.6e-2 (bound 4e-2).
* format vs bf16 weights (all paths): int8 6.6e-3 (table 1e-2), int4 1.1e-1 (table 1.5e-1), fp8 weight-only
  2.7e-2, fp8 through _scaled_mm 3.7e-2 (table 6e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triton_interp import triton_module

from cases import WEIGHT_STD, generator
from hetmoe.config.formats import DENSE_FORMATS
from hetmoe.layers.gpu_linear import GPULinear, blockwise_scaled_mm, pack_int4, quantize_fp8, quantize_int, unpack_int4
from reference import rel_err

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
QUANTIZED = ("fp8", "int8", "int4")
KERNEL_BOUND = 4e-3  # bf16 output rounding (see the module docstring)
SCALED_MM_BOUND = 4e-2  # x rounded to fp8 per token and 128 block
FP32_BOUND = 1e-5
MS = (1, 3, 8, 64, 300)


@pytest.fixture(scope="module")
def tl_linear():
    return triton_module("hetmoe.ops.triton.linear")


def make_linears(sizes, K: int, bias: bool, *params) -> list:
    """bf16 linears [n, K] with N(0, 0.02) weights (and biases), seeded by the case."""
    gen = generator("gpu_linear", tuple(sizes), K, bias, *params)
    linears = []
    for n in sizes:
        lin = nn.Linear(K, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, K, generator=gen) * WEIGHT_STD)
            if bias:
                lin.bias.copy_(torch.randn(n, generator=gen) * WEIGHT_STD)
        linears.append(lin.to(torch.bfloat16))
    return linears


def inputs(M: int, K: int, *params) -> torch.Tensor:
    return torch.randn(M, K, generator=generator("x", M, K, *params)).to(DEVICE, torch.bfloat16)


def bf16_reference(linears, x) -> torch.Tensor:
    """fp32 product with the bf16 weights the format was made from."""
    w = torch.cat([lin.weight.float() for lin in linears]).to(x.device)
    b = torch.cat([lin.bias.float() for lin in linears]).to(x.device) if linears[0].bias is not None else None
    return F.linear(x.float(), w, b)


def dequantized_reference(lin: GPULinear, x) -> torch.Tensor:
    return F.linear(x.float(), lin.dequantized_weight(), lin.bias)


# ----------------------------------------------------------------------------------------- packing, reference path


def test_int4_pack_roundtrip():
    gen = generator("int4 pack")
    q = torch.randint(-8, 8, (5, 192), generator=gen, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (5, 96) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(packed[0, 0]) == (int(q[0, 0]) + 8) | ((int(q[0, 32]) + 8) << 4)  # group-local nibble pairs


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_int_codes_and_padding(fmt):
    w = torch.randn(7, 100, generator=generator("qint", fmt)) * WEIGHT_STD
    w[3, :64] = 0.0  # an all-zero group: scale 0, codes 0, no NaN
    codes, scale = quantize_int(w, fmt)
    assert scale.shape == (7, 2) and scale.dtype == torch.float32 and scale[3, 0] == 0
    q = unpack_int4(codes) if fmt == "int4" else codes
    assert q.shape == (7, 128) and not q[:, 100:].any()  # K padded with zero codes
    qmax = 127 if fmt == "int8" else 7
    assert int(q.abs().max()) == qmax
    deq = q.float() * scale.repeat_interleave(64, 1)
    # symmetric rounding: each weight within half a step of its group
    assert ((deq[:, :100] - w).abs() <= scale.repeat_interleave(64, 1)[:, :100] / 2 + 1e-7).all()


def test_fp8_matches_checkpoint_convention():
    """from_fp8 keeps a checkpoint's weights: its dequantized weight is the loader's dequantize_fp8."""
    from hetmoe.load.checkpoint import dequantize_fp8

    w = torch.randn(300, 200, generator=generator("fp8 conv")) * WEIGHT_STD
    q, s = quantize_fp8(w)
    assert q.shape == (300, 256) and s.shape == (3, 2)
    lin = GPULinear.from_fp8(q[:, :200].contiguous(), s, kernel="reference")
    assert torch.equal(lin.dequantized_weight(), dequantize_fp8(q[:, :200], s))
    assert rel_err(lin.dequantized_weight(), w) < DENSE_FORMATS["fp8"].tolerance


@pytest.mark.parametrize("fmt", list(DENSE_FORMATS))
def test_reference_path_within_format_tolerance(fmt):
    linears = make_linears([70, 33], 200, True, fmt)
    lin = GPULinear.from_linears(linears, fmt, DEVICE, kernel="torch" if fmt == "bf16" else "reference")
    x = inputs(64, 200, fmt)
    y = lin(x)
    assert y.shape == (64, 103) and y.dtype == torch.bfloat16
    assert rel_err(y, dequantized_reference(lin, x)) < KERNEL_BOUND
    assert rel_err(y, bf16_reference(linears, x)) < max(DENSE_FORMATS[fmt].tolerance, KERNEL_BOUND)


@pytest.mark.parametrize("fmt", list(DENSE_FORMATS))
def test_nbytes_matches_the_table(fmt):
    lin = GPULinear.from_linears(make_linears([256], 384, False, fmt), fmt, "cpu", kernel=None)
    assert lin.nbytes == DENSE_FORMATS[fmt].nbytes(256, 384)


def test_fused_parts_and_bias():
    linears = make_linears([70, 33, 129], 150, True, "parts")
    x = inputs(5, 150, "parts").view(1, 5, 150)
    for fmt in DENSE_FORMATS:
        lin = GPULinear.from_linears(linears, fmt, DEVICE, kernel="torch" if fmt == "bf16" else "reference")
        parts = lin.parts(x)
        assert [p.shape for p in parts] == [(1, 5, 70), (1, 5, 33), (1, 5, 129)]
        whole = lin(x)
        for p, lo, hi in zip(parts, (0, 70, 103), (70, 103, 232)):
            assert torch.equal(p, whole[..., lo:hi])
        for one, p in zip(linears, parts):  # each part is that linear's output, its bias included
            alone = GPULinear.from_linears([one], fmt, DEVICE, kernel="torch" if fmt == "bf16" else "reference")
            if fmt != "fp8":  # fp8 blocks of 128 rows straddle the packed linears, so scales differ alone
                assert torch.equal(alone(x), p)
            assert rel_err(p, bf16_reference([one], x.view(5, 150)).view(1, 5, -1)) < \
                max(DENSE_FORMATS[fmt].tolerance, KERNEL_BOUND)


def test_from_fp8_parts():
    ws = [torch.randn(n, 256, generator=generator("fp8 parts", n)) * WEIGHT_STD for n in (256, 100)]
    packed = [quantize_fp8(w) for w in ws]
    lin = GPULinear.from_fp8([q for q, _ in packed], [s for _, s in packed], kernel="reference")
    assert lin.sizes == [256, 100] and lin.scale.shape == (3, 2)
    assert torch.equal(lin.dequantized_weight(), torch.cat([GPULinear.from_fp8(q, s, kernel="reference")
                                                           .dequantized_weight() for q, s in packed]))
    with pytest.raises(ValueError, match="only the last packed part"):
        GPULinear.from_fp8([packed[1][0], packed[0][0]], [packed[1][1], packed[0][1]])


def test_bad_inputs():
    linears = make_linears([64], 128, False, "bad")
    lin = GPULinear.from_linears(linears, "int8", "cpu", kernel="reference")
    with pytest.raises(ValueError, match="bfloat16"):
        lin(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]"):
        lin(torch.randn(2, 96).bfloat16())
    with pytest.raises(ValueError, match="dense format must be one of"):
        GPULinear.from_linears(linears, "int3", "cpu")
    with pytest.raises(ValueError, match="one size"):
        GPULinear.from_linears(linears + make_linears([8], 64, False, "bad2"), "int8", "cpu")
    with pytest.raises(ValueError, match="all have a bias"):
        GPULinear.from_linears(linears + make_linears([8], 128, True, "bad3"), "int8", "cpu")
    with pytest.raises(ValueError, match="kernel must be one of"):
        GPULinear.from_linears(linears, "int8", "cpu", kernel="marlin")
    with pytest.raises(ValueError, match="does not run the int8"):
        GPULinear.from_linears(linears, "int8", "cpu", kernel="torch")
    q, s = quantize_fp8(linears[0].weight.float())
    with pytest.raises(ValueError, match="need their scale_inv"):
        GPULinear.from_fp8(q, None)
    with pytest.raises(ValueError, match="needs \\[1, 1\\]"):
        GPULinear.from_fp8(q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        GPULinear.from_fp8(linears[0].weight, s)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="scaled_mm"):
            GPULinear.from_fp8(q, s, kernel="scaled_mm")


# ----------------------------------------------------------------------------------------- Triton kernels


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("M", MS)
def test_triton_kernel_against_both_references(tl_linear, fmt, M):
    """Odd N and K (K not a whole group: padded), bias, the planned launch (split K for small M)."""
    linears = make_linears([97, 40], 200, True, fmt, M)
    lin = GPULinear.from_linears(linears, fmt, DEVICE, kernel="triton")
    x = inputs(M, 200, fmt, M)
    y = lin(x)
    assert y.shape == (M, 137) and y.dtype == torch.bfloat16
    assert rel_err(y, dequantized_reference(lin, x)) < KERNEL_BOUND
    assert rel_err(y, bf16_reference(linears, x)) < DENSE_FORMATS[fmt].tolerance


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("M", [1, 3, 5])
def test_swiglu_in_the_gemv(tl_linear, fmt, M):
    """down(silu(gate) * up) with the activation computed by the GEMV as it reads x equals silu_mul's output
    through the same GEMV, bitwise (the same roundings; K split or not); 5 rows are past the GEMV (None: the
    caller runs silu_mul)."""
    from hetmoe.ops.triton.fused import silu_mul

    linears = make_linears([97], 200, True, fmt, "swiglu")
    lin = GPULinear.from_linears(linears, fmt, DEVICE, kernel="triton")
    gate_up = inputs(M, 400, fmt, "swiglu", M) * 3
    fused = lin.swiglu(gate_up.view(M, 1, 400))
    if M > 4:
        assert fused is None
        return
    assert fused.shape == (M, 1, 97)
    assert torch.equal(fused.view(M, 97), lin(silu_mul(gate_up)))
    assert lin.swiglu(gate_up[:, :398]) is None  # not gate | up of this linear's input


def launches(tl, kernel: str, M: int, fmt: str, kp: int) -> list:
    """Explicit launches of one kernel: K in one split and in one split per step (dot: also scaled after)."""
    group = tl.GROUP[fmt]
    if kernel == "dequant":
        return [tl.Launch("dequant", M, 128, kp, 1, 1, 4, 1)]  # 130 rows: two slabs
    bk = 256 if kernel == "gemv" else group
    steps = -(-kp // bk)
    bm = 1 << (M - 1).bit_length() if kernel == "gemv" else (16 if M <= 16 else 64)
    out = [tl.Launch(kernel, bm, 32 if kernel == "gemv" else 64, bk, 1, steps, 4, 2),
           tl.Launch(kernel, bm, 32 if kernel == "gemv" else 64, bk, steps, 1, 4, 2)]
    if kernel == "dot":
        out.append(tl.Launch(kernel, bm, 64, bk, 2, -(-steps // 2), 4, 2, scale_after=True))
    if kernel == "gemv" and M == 1:
        out.append(tl.Launch(kernel, bm, 32, bk, 2, -(-steps // 2), 4, 2, defer=False))
    return out


@pytest.mark.skipif(HAS_CUDA, reason="fp32 activations run in the interpreter only (the GPU kernel takes bf16)")
@pytest.mark.parametrize("fmt,fp8_bits", [("int8", False), ("int4", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("kernel,M", [("gemv", 1), ("gemv", 3), ("dot", 5), ("dot", 20), ("dequant", 20)])
def test_triton_kernel_fp32_exact(tl_linear, fmt, fp8_bits, kernel, M):
    """fp32 in and out: the kernel's only rounding is fp32 summation order. Every kernel (CUDA-core GEMV, tensor-core
    tiles, dequantize + matmul), K whole and split, fp8 decoded from its bytes (GPUs without fp8 conversion)."""
    linears = make_linears([130], 200, True, fmt, "exact")
    lin = GPULinear.from_linears(linears, fmt, "cpu", kernel="triton")
    x = inputs(M, 200, fmt, "exact").float()
    ref = dequantized_reference(lin, x)
    for launch in launches(tl_linear, kernel, M, fmt, lin.scale.shape[1] * tl_linear.GROUP[fmt]):
        y = tl_linear.linear(x, lin.weight, lin.scale, lin.bias, fmt, 130, fp8_bits=fp8_bits, launch=launch)
        assert y.dtype == torch.float32 and y.shape == (M, 130)
        assert rel_err(y, ref) < FP32_BOUND, launch


@pytest.mark.parametrize("kernel,M", [("gemv", 1), ("gemv", 3), ("dot", 5)])
def test_split_tickets_equal_the_second_kernel(tl_linear, kernel, M, monkeypatch):
    """K split over programs: the tile's last split to finish sums the partials (tickets) bitwise as the second
    kernel does, bias included, and leaves every counter at zero for the next launch."""
    linears = make_linears([130], 1000, True, "int8", "tickets")
    lin = GPULinear.from_linears(linears, "int8", DEVICE, kernel="triton")
    x = inputs(M, 1000, "int8", "tickets")
    launch = launches(tl_linear, kernel, M, "int8", lin.scale.shape[1] * tl_linear.GROUP["int8"])[1]
    assert launch.splits > 1  # one split per K step

    def run():
        return tl_linear.linear(x, lin.weight, lin.scale, lin.bias, "int8", 130, launch=launch)

    with_tickets = run()
    assert all(not buf.any() for buf in tl_linear.triton_tickets._COUNTERS.values())
    monkeypatch.setattr(tl_linear.triton_tickets, "ENABLED", False)
    assert torch.equal(with_tickets, run())
    assert rel_err(with_tickets, dequantized_reference(lin, x)) < KERNEL_BOUND


def test_plan_fills_the_gpu(tl_linear):
    """Decode splits K so tiles x splits fill the GPU (every split has steps); prefill with many tiles does not
    split; the dequantize path's slabs are whole scale rows."""
    for M, kernel in ((1, "gemv"), (4, "gemv"), (16, "dot")):
        d = tl_linear.plan(M, 2048, 4096, "int4", 132)
        assert d.kernel == kernel and d.splits > 1 and d.splits * -(-2048 // d.bn) >= 132
        steps = 4096 // d.bk
        assert (d.splits - 1) * d.per_split < steps <= d.splits * d.per_split
    assert tl_linear.plan(128, 151936, 2048, "int8", 132).splits == 1
    # fp8 (DeepSeek-V3's o_proj): K split until 8 programs per SM, int8 at 4 (gpu_linear.py --variants on an H200)
    o_fp8, o_int8 = (tl_linear.plan(1, 7168, 16384, fmt, 132) for fmt in ("fp8", "int8"))
    assert o_fp8.splits * -(-7168 // o_fp8.bn) == 896 and o_int8.splits * -(-7168 // o_int8.bn) == 448
    # at 4 < M <= 16 fp8 takes 8 programs per SM and scales the dot's partials; int8 stays at 4, scaled before
    d_fp8, d_int8 = (tl_linear.plan(8, 7168, 16384, fmt, 132) for fmt in ("fp8", "int8"))
    assert d_fp8.kernel == d_int8.kernel == "dot" and d_fp8.scale_after and not d_int8.scale_after
    assert 896 < d_fp8.splits * -(-7168 // d_fp8.bn) <= 1056 and d_int8.splits * -(-7168 // d_int8.bn) <= 528
    big = tl_linear.plan(2048, 7168, 16384, "fp8", 132)
    assert big.kernel == "dequant" and big.bn % 128 == 0 and big.bn * 16384 <= tl_linear.DEQUANT_ELEMENTS


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(DENSE_FORMATS))
@pytest.mark.parametrize("M", MS)
def test_gpu_auto_kernel(fmt, M):
    """The kernel chosen on this GPU (fp8: _scaled_mm for M > 16 where block scales go through it)."""
    linears = make_linears([256, 128], 512, False, fmt, M, "gpu")
    lin = GPULinear.from_linears(linears, fmt, "cuda")
    if fmt == "fp8" and blockwise_scaled_mm(torch.device("cuda")):  # small weights choose Triton; cover both
        forced = GPULinear.from_linears(linears, fmt, "cuda", kernel="scaled_mm")
        x = inputs(M, 512, fmt, M, "gpu")
        bound = SCALED_MM_BOUND if M > 16 else KERNEL_BOUND
        assert rel_err(forced(x), dequantized_reference(forced, x)) < bound
        assert rel_err(forced(x), bf16_reference(linears, x)) < DENSE_FORMATS[fmt].tolerance
    x = inputs(M, 512, fmt, M, "gpu")
    y = lin(x)
    bound = SCALED_MM_BOUND if lin.kernel == "scaled_mm" and M > 16 else KERNEL_BOUND
    assert rel_err(y, dequantized_reference(lin, x)) < bound
    assert rel_err(y, bf16_reference(linears, x)) < max(DENSE_FORMATS[fmt].tolerance, KERNEL_BOUND)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(DENSE_FORMATS))
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_graph_replay_equals_eager(fmt, M):
    lin = GPULinear.from_linears(make_linears([576, 64], 512, True, fmt, "graph"), fmt, "cuda")
    x = inputs(M, 512, fmt, "graph")
    eager = lin(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lin(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(x)
    x.copy_(inputs(M, 512, fmt, "graph 2"))
    graph.replay()
    assert torch.equal(out, lin(x)) and not torch.equal(out, eager)
