"""bf16 products on the CPU computed on fp32 widenings (hetmoe/layers/widen.py ``matmul``, ``einsum``, ``linear``) and
MLA's per-head products (``head_products`` through models/deepseek_v2.py ``per_head``: one GEMV per row) and
DeepSeek-V4's ``GroupedLinear`` (widened for a prefill's rows): the same values as PyTorch's bf16
products, within the one rounding both make (fp32 sums in another order). CPU path only; fp32 inputs are PyTorch's
own products, bitwise."""

from __future__ import annotations

import pytest
import torch

from hetmoe.layers.attention import Step
from hetmoe.layers.compressed_attention import GroupedLinear
from hetmoe.layers.widen import WIDEN_ROWS, einsum, linear, matmul
from hetmoe.models.deepseek_v2 import per_head


def _close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    # one bf16 rounding of an fp32 sum: half an ulp of each value, 2^-8 relative
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-6).all()


def test_matmul_and_einsum_equal_the_bf16_products():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 4, 40, 64, generator=g).bfloat16()
    b = torch.randn(2, 1, 64, 33, generator=g).bfloat16()  # broadcast over the heads, as the window keys are
    _close(matmul(a, b), torch.matmul(a, b))
    e = torch.randn(2, 40, 7, 64, generator=g).bfloat16()  # per-query entries
    _close(einsum("bhsd,bskd->bhsk", a, e), torch.einsum("bhsd,bskd->bhsk", a, e))
    f = torch.randn(3, 5, dtype=torch.float32, generator=g)
    assert torch.equal(matmul(f, f.T), torch.matmul(f, f.T))  # fp32: PyTorch's own product


@pytest.mark.parametrize("rows", [1, 7, WIDEN_ROWS - 1, WIDEN_ROWS, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_either_side_of_the_widening(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 48, generator=g).bfloat16()
    b = torch.randn(70, generator=g).bfloat16() if bias else None
    x = torch.randn(2, rows, 48, generator=g).bfloat16()
    got = linear(x, w, b)
    if rows * 2 >= WIDEN_ROWS:  # fp32 sums (the bias added in fp32) rounded once
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        _close(got, want.bfloat16())
    else:  # PyTorch's own bf16 product
        assert torch.equal(got, torch.nn.functional.linear(x, w, b))
    f = x.float()
    assert torch.equal(linear(f, w.float()), torch.nn.functional.linear(f, w.float()))


@pytest.mark.parametrize("rows", [(1, 1), (2, 1), (1, 3), (3, 4), (WIDEN_ROWS, 1)])
@pytest.mark.parametrize("layout", ["uk", "vu"])
def test_per_head_on_the_cpu_equals_the_bf16_einsum(rows, layout):
    B, S = rows
    h, nope, v, r = 5, 24, 16, 40
    g = torch.Generator().manual_seed(B * 10 + S)
    w_kv = torch.randn(h, nope + v, r, generator=g).bfloat16()  # kv_b_proj.weight per head, as the model views it
    w_uk, w_uv = w_kv.split([nope, v], dim=1)
    w = w_uk if layout == "uk" else w_uv.transpose(1, 2)  # [h, K, N]: N contiguous (uk) or K contiguous (vu)
    x = torch.randn(B, S, h, w.shape[1], generator=g).bfloat16()
    step = Step(positions=torch.zeros(B, S, dtype=torch.long), slots=torch.arange(B))
    got = per_head(x, w, step)
    _close(got, torch.einsum("bshk,hkn->bshn", x.float(), w.float()).bfloat16())


@pytest.mark.parametrize("rows", [1, WIDEN_ROWS - 1, WIDEN_ROWS, 3 * WIDEN_ROWS + 5])
def test_grouped_linear_rows_either_side_of_the_widening(rows):
    g = torch.Generator().manual_seed(rows)
    layer = GroupedLinear(64, 4 * 24, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4 * 24, 64, generator=g))
    layer = layer.bfloat16()
    x = torch.randn(rows, 4, 64, generator=g).bfloat16()
    w = layer.weight.view(4, 24, 64)
    want = torch.einsum("rgi,goi->rgo", x.float(), w.float())  # each group's block of rows, in fp32
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, 4, 24) and got.dtype == torch.bfloat16
    if rows >= WIDEN_ROWS:  # fp32 sums rounded once
        _close(got, want.bfloat16())
    else:  # PyTorch's bf16 product, which may round more than once
        assert (got.float() - want).abs().max() <= 2**-7 * want.abs().max()


@pytest.mark.parametrize("rows", [1, 4, WIDEN_ROWS + 3])
def test_grouped_linear_packed_group_by_group(rows):
    """On the CPU in bf16, ``pack_dense`` packs DeepSeek-V4's grouped o_a_proj one group at a time (``split_linears``):
    each group's block a linear of the engine's, run on its own slice; the bf16 weight is no longer held. The engine's
    bf16 format reads the weights exactly and sums in fp32: one rounding of the fp32 product. In fp32 nothing packs."""
    from hetmoe.cpu import CPULinear
    from hetmoe.load.dense import pack_dense

    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(4 * 24, 64, generator=g).bfloat16()
    layer = GroupedLinear(64, 4 * 24, 4)
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    assert pack_dense(layer, "bf16", torch.device("cpu"), None, torch.bfloat16) > 0
    assert layer.weight is None and [type(m) for m in layer.groups] == [CPULinear] * 4
    x = torch.randn(rows, 4, 64, generator=g).bfloat16()
    want = torch.einsum("rgi,goi->rgo", x.float(), weight.view(4, 24, 64).float())
    with torch.no_grad():
        _close(layer(x), want.bfloat16())
    fp32 = GroupedLinear(64, 4 * 24, 4)
    assert pack_dense(fp32, "bf16", torch.device("cpu"), None, torch.float32) == 0 and fp32.weight is not None
