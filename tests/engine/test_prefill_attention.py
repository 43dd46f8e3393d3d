"""The SDPA prefill of one sequence's consecutive positions (hetmoe/layers/attention.py ``attend`` with
``step.start``), CPU path: the same bits as torch's lower-right causal bias, without importing it (its import pulls in
torch._dynamo, ~1 s that the first prefill of every process paid)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hetmoe.layers.attention import Step, attend


def _inputs(start, S, dtype, heads=8, kv_heads=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = start + S + 5  # cache rows past the prompt, which must not be read
    q = torch.randn(1, S, heads, D, generator=g).to(dtype)
    k = torch.randn(1, ctx, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(1, ctx, kv_heads, D, generator=g).to(dtype)
    step = Step(positions=torch.arange(start, start + S).unsqueeze(0), slots=torch.zeros(1, dtype=torch.long),
                start=start)
    return q, k, v, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start, S", [(0, 7), (0, 64), (3, 5), (40, 17), (1, 2)])
def test_matches_torch_lower_right_bias(start, S, dtype):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, step = _inputs(start, S, dtype)
    L = start + S
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :L].transpose(1, 2), v[:, :L].transpose(1, 2),
                                         attn_mask=causal_lower_right(S, L), scale=0.2, enable_gqa=True)
    assert torch.equal(attend(q, k, v, step, 0.2), ref.transpose(1, 2))
    # the same as the masked path every batch takes (positions only, no start): causal by position
    plain = Step(positions=step.positions, slots=step.slots)
    assert torch.allclose(attend(q, k, v, plain, 0.2).float(), ref.transpose(1, 2).float(), atol=2e-2, rtol=0)


def test_prefill_does_not_import_the_bias_module():
    code = ("import sys, torch\n"
            f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_prefill_attention import _inputs\n"
            "from hetmoe.layers.attention import attend\n"
            "for start in (0, 9):\n"
            "    attend(*_inputs(start, 6, torch.bfloat16), 0.2)\n"
            "print('torch.nn.attention.bias' in sys.modules, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
