"""The dense linear on the CPU engine (hetmoe/cpu/linear.py, csrc/dense/linear.h) against naive references, on every
engine path this machine runs (tests/paths.py: scalar, avx2, avx512 row blocks; amx-emulated / amx GEMM, forced for
every token count with amx_min_tokens=1):

- kernel correctness: the reference multiplies the same dequantized weights with the activations rounded as the path
  rounds them (row blocks: fp32 / int16 / int8 groups; AMX: bf16 / int8 groups), in float64. They differ by fp32
  summation order only: ||y - ref|| / ||ref|| < TIGHT (measured below 5e-7, the fused RMSNorm included).
- accuracy: against the bf16 weights with exact activations, N(0, 0.02) weights and N(0, 1) inputs, the bound of
  the format measured per path class (FORMAT_BOUND) and the DENSE_FORMATS table's.
- bitwise: the same bits for 1 and 2 threads and for any split of the tokens into calls.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetmoe import _C
from hetmoe.config.formats import DENSE_FORMATS
from hetmoe.cpu import CPULinear, WorkerPool
from hetmoe.cpu import linear as cpu_linear
from hetmoe.layers.norm import RMSNorm
from reference import fake_quantize, rel_err

# (format, group): the DENSE_FORMATS groups and int8/int4 per row (0)
FORMATS = [("bf16", 0), ("int8", 64), ("int8", 0), ("int4", 64), ("int4", 32), ("int8", 128), ("int4", 0)]
FMT_IDS = [f"{f}-g{g}" if f != "bf16" else f for f, g in FORMATS]
TOKENS = (1, 2, 3, 7, 64, 300)
N_ODD, K_ODD = 37, 150  # N not a multiple of 16, K not a multiple of any group
TIGHT = 2e-6  # fp32 summation order only: measured <= 1.8e-7 (<= 4.9e-7 with the fused norm) on every path and format

# ||y - y_bf16|| / ||y_bf16|| over [T=16, K=512] x [N=256] (N(0, 1) x, N(0, 0.02) W), worst of seeds 2..4, MEASURED on
# the AVX2 dev machine (row class: scalar/avx2, the same bits as avx512; AMX class: amx-emulated, the same bits as amx
# for int8/int4). Bounds: ~1.3x the measured maxima.
#                 row class     AMX class (activations: bf16 / int8 per group / int8 per row)
#   bf16          2.9e-7        1.7e-3
#   int8 g64      6.1e-3        8.6e-3
#   int8 g128     6.5e-3        9.3e-3
#   int8 per row  7.6e-3        1.1e-2
#   int4 g32      8.7e-2        8.7e-2
#   int4 g64      9.6e-2        9.6e-2  (int4 reads int8 activations on both)
#   int4 per row  1.07e-1       1.07e-1
FORMAT_BOUND = {
    ("bf16", 0): (1e-6, 2.5e-3),
    ("int8", 64): (8e-3, 1.1e-2),
    ("int8", 128): (9e-3, 1.2e-2),
    ("int8", 0): (1e-2, 1.5e-2),
    ("int4", 32): (0.115, 0.115),
    ("int4", 64): (0.125, 0.125),
    ("int4", 0): (0.14, 0.14),
}


@pytest.fixture(scope="module")
def pools():
    return {1: WorkerPool(1), 2: WorkerPool(2)}


def make(path, fmt, group, w, pool, bias=None, sizes=None) -> CPULinear:
    lin = CPULinear(w.shape[1], w.shape[0], fmt, group, bias=bias, isa=path.isa, pool=pool,
                    amx_min_tokens=path.amx_min_tokens, sizes=sizes)
    lin.load(w)
    return lin


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def activations(lin: CPULinear, path, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32 rounded as the path's kernels read it (formats/activation.h), as float64."""
    fmt, K = lin.format.name, lin.in_features
    if path.amx:  # AMX GEMM: bf16, or int8 per group (per-row int8/int4 weights: one group over the row)
        if fmt == "bf16":
            return x.bfloat16().double()
        group = lin.group_size or K
        return fake_quantize(x, group, 127).double()
    if fmt == "bf16":
        return x.double()
    group = lin.group_size or 128
    return fake_quantize(x, group, 32767 if fmt == "int8" else 127).double()


def emulated(lin: CPULinear, path, x: torch.Tensor, norm=None) -> torch.Tensor:
    """The linear's math on its dequantized weights with the path's activation rounding, float64 [T, N]."""
    x = x.float()
    if norm is not None:
        x = rms_norm_fp32(x, *norm)
    y = activations(lin, path, x) @ lin.dequantized_weight().double().T
    return y + lin.bias.double() if lin.bias is not None else y


@pytest.mark.parametrize("fmt, group", FORMATS, ids=FMT_IDS)
def test_matches_the_dequantized_reference(engine_path, pools, fmt, group):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(N_ODD, K_ODD, generator=gen) * 0.02
    lin = make(engine_path, fmt, group, w, pools[2])
    for T in TOKENS:
        x = torch.randn(T, K_ODD, generator=gen)
        y = lin(x)
        assert y.shape == (T, N_ODD) and y.dtype == torch.float32
        assert rel_err(y, emulated(lin, engine_path, x)) < TIGHT, T


@pytest.mark.parametrize("fmt, group", list(FORMAT_BOUND), ids=[f"{f}-g{g}" for f, g in FORMAT_BOUND])
def test_accuracy_against_the_bf16_weights(engine_path, pools, fmt, group):
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(256, 512, generator=gen) * 0.02).bfloat16()
    x = torch.randn(16, 512, generator=gen)
    lin = make(engine_path, fmt, group, w, pools[2])
    err = rel_err(lin(x), x.double() @ w.double().T)
    assert err < FORMAT_BOUND[fmt, group][1 if engine_path.amx else 0]
    table = DENSE_FORMATS[fmt]
    if group == table.group:
        assert err < table.tolerance


@pytest.mark.parametrize("fmt, group", [("bf16", 0), ("int8", 64), ("int4", 64)], ids=["bf16", "int8", "int4"])
def test_fused_parts_bias_norm_accumulate_strided_bf16(engine_path, pools, fmt, group):
    """q/k/v as one matrix with biases, an RMSNorm fused on a bf16 input, and the output accumulated into a column
    slice of a wider bf16 buffer (the residual add)."""
    gen = torch.Generator().manual_seed(3)
    K = 96
    linears = [nn.Linear(K, n) for n in (40, 17, 17)]
    for m in linears:
        nn.init.normal_(m.weight, std=0.02, generator=gen)
        nn.init.normal_(m.bias, std=0.1, generator=gen)
    lin = CPULinear.from_linear(linears, fmt, group, isa=engine_path.isa, pool=pools[2],
                                amx_min_tokens=engine_path.amx_min_tokens)
    assert lin.sizes == [40, 17, 17] and lin.out_features == 74
    norm = RMSNorm(K, eps=1e-5)
    norm.weight.data = torch.rand(K, generator=gen) + 0.5
    for T in (1, 7, 64):
        x = torch.randn(2, T, K, generator=gen).bfloat16()
        wide = torch.randn(2, T, 100, generator=gen).bfloat16()
        before = wide.clone()
        out = wide[..., 10:84]
        y = lin(x, out=out, accumulate=True, norm=norm)
        assert y is out
        ref = emulated(lin, engine_path, x.reshape(-1, K), norm=(norm.weight.data, 1e-5)).reshape(2, T, 74)
        # bf16 output: the sum rounded once; the kernel's fp32 error may move a rounding by one bf16 ulp (2^-7)
        want = before[..., 10:84].double() + ref
        err = (wide[..., 10:84].double() - want).abs()
        assert bool((err <= want.abs() * 2**-7 + 1e-30).all())
        assert (wide[..., 10:84] != want.bfloat16()).float().mean().item() < 0.02  # nearly all rounded as want
        assert torch.equal(wide[..., :10], before[..., :10]) and torch.equal(wide[..., 84:], before[..., 84:])
        # fp32, no accumulate: the tight bound; parts are the linears' outputs
        parts = lin.parts(x.float(), norm=norm)
        ref = emulated(lin, engine_path, x.reshape(-1, K), norm=(norm.weight.data, 1e-5)).reshape(2, T, 74)
        assert [p.shape[-1] for p in parts] == [40, 17, 17]
        assert rel_err(torch.cat(parts, -1), ref) < TIGHT


@pytest.mark.parametrize("fmt, group", [("bf16", 0), ("int8", 0), ("int4", 32)], ids=["bf16", "int8-row", "int4"])
def test_bitwise_across_threads_and_token_splits(engine_path, pools, fmt, group):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(203, 333, generator=gen) * 0.02
    one, two = (make(engine_path, fmt, group, w, pools[n]) for n in (1, 2))
    assert one.checksum() == two.checksum()
    x = torch.randn(300, 333, generator=gen)
    whole = two(x)
    assert torch.equal(one(x), whole)
    pieces = torch.cat([two(x[a:b]) for a, b in ((0, 1), (1, 3), (3, 40), (40, 300))])
    assert torch.equal(pieces, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_out_is_the_eager_norm_and_what_the_product_reads(pools, dtype):
    """``norm_out``: the normed rows as the eager RMSNorm module in x's dtype rounds them (MEASURED on the AVX2 dev
    machine: bitwise, fp32 and bf16, K in 64..2048; a PyTorch summing in another order moves a value by an ulp of
    the dtype), and the product is exactly the linear of those rows. Row-block path of this CPU, bf16 and int8."""
    gen = torch.Generator().manual_seed(8)
    K, T = 150, 7
    norm = RMSNorm(K, eps=1e-6)
    norm.weight.data = torch.rand(K, generator=gen) + 0.5
    norm = norm.to(dtype)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
    for fmt in ("bf16", "int8"):
        lin = CPULinear(K, 40, fmt, 64, pool=pools[2])
        lin.load(torch.randn(40, K, generator=gen) * 0.02)
        x = (torch.randn(T, K, generator=gen) * 3).to(dtype)
        h = torch.full_like(x, float("nan"))
        y = lin(x, norm=norm, norm_out=h)
        with torch.no_grad():
            ref = norm(x)
        assert ((h.float() - ref.float()).abs() <= ulp * ref.float().abs()).all()
        assert torch.equal(y, lin(h))
        wide = torch.zeros(T, K + 10, dtype=dtype)  # strided rows: a column slice of a wider buffer
        assert torch.equal(lin(x, norm=norm, norm_out=wide[:, :K]), y) and torch.equal(wide[:, :K], h)
    with pytest.raises(ValueError, match="norm_out needs a norm"):
        lin(x, norm_out=h)
    with pytest.raises(ValueError, match="norm_out must be"):
        lin(x, norm=norm, norm_out=h[:3])


def test_load_in_chunks_and_parts_gives_the_same_bytes(monkeypatch, pools):
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(70, 64, generator=gen) * 0.02).bfloat16().float()  # exact in every dtype below
    whole = CPULinear(64, 70, "int4", 32, pool=pools[2])
    whole.load(w)
    monkeypatch.setattr(cpu_linear, "LOAD_CHUNK_BYTES", 16 * 64 * 4)  # 16 rows a chunk, parts cut at 5, 38
    chunked = CPULinear(64, 70, "int4", 32, pool=pools[2])
    chunked.load([w[:5].bfloat16(), w[5:38], w[38:].double()])
    assert chunked.checksum() == whole.checksum()
    assert torch.equal(chunked.dequantized_weight(), whole.dequantized_weight())


def test_storage_roundtrip_random_fill_and_job(pools):
    lin = CPULinear(1024, 300, "int8", 64, pool=pools[2])
    lin.fill_random(seed=7, std=0.02)
    w = lin.dequantized_weight()
    assert 0.015 < w.std().item() < 0.025
    copy = CPULinear(1024, 300, "int8", 64, pool=pools[2])
    for dst, src in zip(copy.storage(), lin.storage()):
        dst[:] = src
    copy.mark_loaded()
    assert copy.checksum() == lin.checksum() and torch.equal(copy.dequantized_weight(), w)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(6))
    n_tokens = torch.tensor([3], dtype=torch.int64)
    out = torch.zeros(8, 300)
    job = copy.prepare(x, out, n_tokens=n_tokens)
    pools[2].submit(job)
    pools[2].sync()
    assert torch.equal(out[:3], lin(x[:3])) and not out[3:].any()
    n_tokens[0] = 8
    pools[2].submit(job)
    pools[2].sync()
    assert torch.equal(out, lin(x))


def test_bad_inputs_raise_clear_errors(pools):
    pool = pools[2]
    with pytest.raises(ValueError, match="dense format"):
        CPULinear(64, 32, "fp8", pool=pool)
    with pytest.raises(ValueError, match=r"group_size for int4 must be one of 32, 64, 128 or 0 \(per row\), got 16"):
        CPULinear(64, 32, "int4", 16, pool=pool)
    with pytest.raises(ValueError, match="group_size"):
        CPULinear(64, 32, "int8", 48, pool=pool)
    with pytest.raises(ValueError, match="isa"):
        CPULinear(64, 32, "int8", isa="neon", pool=pool)
    with pytest.raises(ValueError, match="bias"):
        CPULinear(64, 32, "int8", bias=torch.zeros(31), pool=pool)
    with pytest.raises(ValueError, match="sizes"):
        CPULinear(64, 32, "int8", sizes=[16, 15], pool=pool)
    lin = CPULinear(64, 32, "int8", pool=pool)
    with pytest.raises(RuntimeError, match="not all loaded"):
        lin(torch.randn(2, 64))
    with pytest.raises(ValueError, match="NaN or Inf"):
        lin.load(torch.full((32, 64), float("nan")))
    with pytest.raises(ValueError, match="rows"):
        lin.load(torch.randn(31, 64))
    with pytest.raises(ValueError, match="in_features"):
        lin.load(torch.randn(32, 63))
    with pytest.raises(ValueError, match="multiple of 16"):
        lin._lin.load_rows(8, 16, torch.randn(16, 64).data_ptr())
    lin.load(torch.randn(32, 64) * 0.02)
    with pytest.raises(ValueError, match="in_features"):
        lin(torch.randn(2, 65))
    with pytest.raises(ValueError, match="dtype"):
        lin(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match="accumulate"):
        lin(torch.randn(2, 64), accumulate=True)
    with pytest.raises(ValueError, match="shape"):
        lin(torch.randn(2, 64), out=torch.empty(3, 32))
    with pytest.raises(ValueError, match="overlap"):
        lin(torch.randn(2, 64), out=torch.empty(1, 32).expand(2, 32))
    with pytest.raises(ValueError, match="norm"):
        lin(torch.randn(2, 64), norm=torch.ones(64))
    with pytest.raises(ValueError, match="norm weight"):
        lin(torch.randn(2, 64), norm=(torch.ones(63), 1e-6))
    job = lin.prepare(torch.randn(2, 64), n_tokens=torch.tensor([3]))
    pool.submit(job)
    with pytest.raises(ValueError, match="outside"):
        pool.sync()
    with pytest.raises(ValueError, match="row stride"):
        lin._lin.run(_C.LinearSpec(x=1, out=1, T=1, x_stride=10))
    with pytest.raises(ValueError, match="x and out"):
        lin._lin.run(_C.LinearSpec(T=1))
    assert lin(torch.randn(0, 64)).shape == (0, 32)
