"""DeepSeek-V4's ``GroupedLinear`` (hetmoe/layers/compressed_attention.py) widened on the CPU for a prefill's rows
(layers/widen.py): the same values as PyTorch's bf16 product, within the one rounding both make (fp32 sums in
another order)."""

from __future__ import annotations

import pytest
import torch

from hetmoe.layers.compressed_attention import GroupedLinear
from hetmoe.layers.widen import WIDEN_ROWS


def _close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    # one bf16 rounding of an fp32 sum: half an ulp of each value, 2^-8 relative
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-6).all()


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
