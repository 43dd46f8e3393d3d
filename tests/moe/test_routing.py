"""The route stage (hetmoe/moe/router.py) against transformers' own routers, and TorchExperts (hetmoe/moe/experts.py)
against the engine on every engine path this machine runs (tests/paths.py)."""

import pytest
import torch

from hetmoe.cpu import CPUExperts
from hetmoe.moe import TorchExperts, route_deepseek_v2, route_deepseek_v3, route_softmax
from reference import moe_reference, rel_err

transformers = pytest.importorskip("transformers")

H, E, T = 64, 16, 37


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple:
    """transformers may return top-k unsorted: compare (id, weight) sets per token."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def check_router(hf_router, ours) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen))
        x = torch.randn(T, H, generator=gen)
        _, hf_w, hf_ids = hf_router(x)
        w, ids = ours(x @ hf_router.weight.float().T)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    hf_w, hf_ids = sorted_by_id(hf_w.float(), hf_ids)
    w, ids = sorted_by_id(w, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_router(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4, norm_topk_prob=norm)
    check_router(Qwen3MoeTopKRouter(cfg), lambda logits: route_softmax(logits, 4, norm))


def test_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)
    check_router(MixtralTopKRouter(cfg), lambda logits: route_softmax(logits, 2, True))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, topk_method=method, n_group=4,
                           topk_group=2, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    check_router(router, lambda logits: route_deepseek_v2(logits, 3, method, 4, 2, 1.5))


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_router(norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.1
    router.e_score_correction_bias.copy_(bias)
    check_router(router, lambda logits: route_deepseek_v3(logits, bias, 4, 4, 2, norm, 2.5))


def test_deepseek_v3_bias_changes_choice_not_weight():
    """The correction bias picks experts but never enters their weights."""
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 5.0])
    w, ids = route_deepseek_v3(logits, bias, 1, 1, 1, False, 1.0)
    assert ids.item() == 7 and w.item() == pytest.approx(0.5)


def test_torch_experts_match_reference_and_engine(engine_path):
    gen = torch.Generator().manual_seed(2)
    I = 48
    gate, up = (torch.randn(E, I, H, generator=gen) * 0.05 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) * 0.05
    x = torch.randn(T, H, generator=gen)
    w, ids = route_softmax(torch.randn(T, E, generator=gen), 4, True)
    ids[3, 1] = -1
    ref = moe_reference(x, gate, up, down, ids, w)
    ours = TorchExperts(gate, up, down)(x, ids, w)
    assert rel_err(ours, ref) < 1e-5
    engine = CPUExperts(E, H, I, "bf16", **engine_path.options)
    engine.load(gate, up, down)
    # MEASURED rel. error vs fp32 TorchExperts: row blocks (scalar, avx2, avx512: the same bits; bf16 weights)
    # 2.79e-3; amx-emulated (every expert on the tile GEMM: bf16-rounded activations too; amx the same math in the
    # hardware's fp32 summation order) 4.06e-3.
    err = rel_err(engine(x, ids, w), ours)
    print(f"{engine_path}: engine bf16 vs TorchExperts fp32 rel. error {err:.3e}")
    assert err < (4.7e-3 if engine_path.amx else 4e-3), err
    out = torch.ones(T, H)
    TorchExperts(gate, up, down)(x, ids, w, out, accumulate=True)
    assert rel_err(out, ref + 1) < 1e-5
