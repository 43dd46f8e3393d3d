"""The lean CPU decode step (hetmoe/engine/cpu_decode.py) against the eager path it replaces, and its fused
attention block (hetmoe/cpu/attention.py decode_block, csrc/dense/decode_block.h) against torch ops.

Paths: the CPU engine with int8 dense weights on the avx2 row blocks (both paths run the same projection and
attention kernels), the decode block's portable code, and the attention's span loops of this CPU.
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.cpu.attention import decode_block, prepare_decode_block  # noqa: E402
from hetmoe.cpu.pool import default_pool  # noqa: E402
from hetmoe.engine.cpu_decode import CPUDecode, moe_on_engine, why_not  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.layers.rope import apply_rope, cos_sin, inv_frequencies  # noqa: E402
from hetmoe.load.loader import load_model  # noqa: E402

MODELS = {  # qwen3_moe: q/k norm; qwen2_moe: q/k/v bias, a dense MLP layer, a shared expert; mixtral: plain GQA
    "qwen3_moe": {"num_hidden_layers": 3},
    "qwen2_moe": {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {"num_hidden_layers": 3},
}
PROMPTS = ([3, 17, 5, 42, 8, 11, 29, 2, 33], [9, 4, 21, 6])
# Logits of the lean step against the eager one, max |lean - eager| / max |eager| over 3-4 greedy decode steps.
# MEASURED on AVX2: fp32 0 (bitwise: the engine's norms sum in PyTorch's AVX2 order). Where PyTorch sums in another
# order (its AVX-512 kernels), the input norm moves by an ulp and the int16 activation rounding of int8 weights
# turns that into up to 4.8e-5 (MEASURED here with the engine's own order): the fp32 bound covers it.
# bf16 <= 8.4e-3 for one sequence, <= 2.4e-2 for the batch of two (the eager path
# rounds the input norm's output and o_proj's output to bf16 before the residual add; the lean step does not).
# With the MoE blocks on the engine too (bf16 qwen3_moe, mixtral: the experts' fp32 sum added to the residual
# before rounding, where eager rounds it first): <= 7.1e-3 for one sequence, <= 6.8e-3 for the batch (MEASURED).
TOL = {"fp32": 1e-4, "bf16": 5e-2}


def load(path, dtype: str):
    opts = EngineOptions(device="cpu", dtype=dtype, experts_format="bf16", max_context=64, max_batch=2,
                         dense_format="int8", isa="avx2")
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def loaded_models(checkpoints):
    return {(arch, dt): load(checkpoints(arch, over, seed=11), dt) for arch, over in MODELS.items()
            for dt in ("fp32", "bf16")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", MODELS)
def test_lean_decode_equals_eager(loaded_models, arch, dtype):
    loaded = loaded_models[(arch, dtype)]
    lean, eager = Runner(loaded), Runner(loaded, lean=False)
    assert isinstance(lean.lean, CPUDecode) and eager.lean is None
    a, b = lean.prefill(PROMPTS[0]), eager.prefill(PROMPTS[0])  # both eager (S > 1)
    assert torch.equal(a, b)
    errs = []
    for _ in range(4):  # greedy: the eager path's choice fed to both
        token = int(b.argmax())
        a, b = lean.decode(token), eager.decode(token)
        errs.append(rel(a, b))
    assert max(errs) <= TOL[dtype], errs
    assert max(errs) > 0 or dtype == "fp32"  # bf16: the rounding points do differ
    for layer in range(len(loaded.model.model.layers)):  # the caches hold the same keys and values
        n = len(PROMPTS[0]) + 4
        assert rel(lean.cache.k[layer, 0, :n], eager.cache.k[layer, 0, :n]) <= 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", MODELS)
def test_lean_decode_batch_of_different_lengths(loaded_models, arch, dtype):
    loaded = loaded_models[(arch, dtype)]
    lean, eager = Runner(loaded), Runner(loaded, lean=False)
    for runner in (lean, eager):
        runner.prefill(PROMPTS[0], slot=1)
        runner.prefill(PROMPTS[1], slot=0)
    tokens, first = [7, 19], None
    for _ in range(3):  # slots out of order, positions 9.. and 4..
        a, b = lean.decode_batch(tokens, [1, 0]), eager.decode_batch(tokens, [1, 0])
        assert a.shape == b.shape == (2, loaded.config.vocab_size)
        assert rel(a, b) <= TOL[dtype]
        first = a if first is None else first
        tokens = b.argmax(dim=-1).tolist()
    alone = Runner(loaded)  # the short prompt's row of the batch is its own lean decode
    alone.prefill(PROMPTS[1])
    assert rel(first[1], alone.decode(19)) <= TOL[dtype]


def test_lean_decode_covers_only_packed_gqa_models(checkpoints, loaded_models):
    mla = load(checkpoints("deepseek_v3", {"num_hidden_layers": 2}, seed=11), "fp32")
    assert Runner(mla).lean is None
    assert why_not(mla.model, Runner(mla, lean=False).cache)  # a reason: MLA has its own forward
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", max_context=64, dense_format="bf16")
    plain = load_model(checkpoints("qwen3_moe", MODELS["qwen3_moe"], seed=11), opts, expert_cache=None,
                       progress=False, log=lambda m: None)  # fp32 weights kept in PyTorch: nothing packed
    assert Runner(plain).lean is None
    with pytest.raises(ValueError, match="does not cover"):
        CPUDecode(plain.model, Runner(plain, lean=False).cache)


def test_lean_decode_moe_blocks_on_the_engine_and_back(loaded_models):
    """bf16 qwen3_moe / mixtral: every MoE block is two engine jobs (norm + router, experts routing and adding into
    the residual) in the step's one job list; qwen2_moe's shared expert keeps its blocks in PyTorch. A layer that
    starts dropping experts leaves the job list at the next step (the plan is rebuilt) and comes back after."""
    for arch in ("qwen3_moe", "mixtral"):
        layers = loaded_models[(arch, "bf16")].model.model.layers
        assert all(moe_on_engine(layer) is None for layer in layers)
    assert all("shared" in moe_on_engine(layer) for layer in loaded_models[("qwen2_moe", "bf16")].model.model.layers)
    loaded = loaded_models[("qwen3_moe", "bf16")]
    lean, eager = Runner(loaded), Runner(loaded, lean=False)
    a, b = lean.prefill(PROMPTS[0]), eager.prefill(PROMPTS[0])
    moe = loaded.model.model.layers[1].mlp.moe
    try:
        for drop in (1, 0):
            moe.set_drop(drop)
            token = int(b.argmax())
            a, b = lean.decode(token), eager.decode(token)
            assert rel(a, b) <= TOL["bf16"]
            in_python = [c for name, _, c in lean.lean._plan(1)["calls"] if name == "mlp (PyTorch)"]
            assert in_python == ([loaded.model.model.layers[1]] if drop else [])
    finally:
        moe.set_drop(0)


# ---------------------------------------------------------------- the fused block alone


def reference_block(qkv, Hq, Hkv, cos, sin, k_cache, v_cache, rows, positions, q_norm, k_norm, eps):
    """GQAAttention's torch ops on one token per sequence: norm, rope, cache write, attention in fp32 math."""
    B, D = qkv.shape[0], k_cache.shape[-1]
    qkv = qkv.view(B, 1, Hq + 2 * Hkv, D)
    qk, v = qkv[:, :, :Hq + Hkv], qkv[:, :, Hq + Hkv:]
    if q_norm is not None:
        weight = torch.cat((q_norm.expand(Hq, D), k_norm.expand(Hkv, D))).to(qk.dtype)
        qk = weight * F.rms_norm(qk, (D,), eps=eps)
    qk = apply_rope(qk, cos.view(B, 1, 1, D), sin.view(B, 1, 1, D))
    q, k = qk.split((Hq, Hkv), dim=2)
    k_cache[rows, positions] = k[:, 0].to(k_cache.dtype)
    v_cache[rows, positions] = v[:, 0].to(v_cache.dtype)
    out = torch.empty(B, Hq, D)
    for b in range(B):
        keys = k_cache[rows[b], :positions[b] + 1].float().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        vals = v_cache[rows[b], :positions[b] + 1].float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b, 0].float(), keys) * D**-0.5
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), vals)
    return out.view(B, Hq * D), q[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (6, 1, 32), (3, 3, 128)])
def test_decode_block_against_torch(dtype, qk_norm, Hq, Hkv, D):
    g = torch.Generator().manual_seed(Hq * 100 + D + qk_norm)
    B, n_rows, cap = 3, 4, 300
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    k_cache = torch.randn(n_rows, cap, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(n_rows, cap, Hkv, D, generator=g).to(dtype)
    q_norm = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    k_norm = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype) if qk_norm else None
    rows, positions = torch.tensor([2, 0, 3]), torch.tensor([5, 0, 290])  # 290: two splits of the keys
    cos, sin = cos_sin(positions[:, None], inv_frequencies(D, 10000.0), dtype)
    cos, sin = cos.view(B, D), sin.view(B, D)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref, ref_q = reference_block(qkv.clone(), Hq, Hkv, cos, sin, ref_k, ref_v, rows, positions, q_norm, k_norm, 1e-6)
    out = decode_block(qkv, Hq, Hkv, cos, sin, k_cache, v_cache, rows, positions, D**-0.5, q_norm, k_norm, 1e-6,
                       out=torch.empty(B, Hq * D))
    # the roped q/k and the cache: RoPE and its bf16 rounding points are bitwise the torch ops'; so is the q/k
    # norm where PyTorch sums in its AVX2 order (MEASURED: bitwise here, fp32 and bf16); another build's order moves
    # the norm by an ulp
    tol = 0 if not qk_norm else 1e-6 if dtype == torch.float32 else 8e-3
    q = qkv.view(B, Hq + 2 * Hkv, D)[:, :Hq]
    assert rel(q, ref_q) <= tol
    assert rel(k_cache, ref_k) <= tol
    assert torch.equal(v_cache, ref_v)
    # attention on the engine (fp32 math) against einsum over the same q/k/v: MEASURED <= 2.5e-7
    assert rel(out, ref) <= 1e-5


def test_decode_block_spreads_many_rows_over_the_pool():
    """70 tokens x 8 head rows x 128 (>= 2^16 values): the rows run as pool tasks; the same result as torch."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D = 70, 4, 2, 128
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g)
    k_cache, v_cache = torch.randn(2, B, 40, Hkv, D, generator=g)
    q_norm, k_norm = 1 + 0.1 * torch.randn(2, D, generator=g)
    rows, positions = torch.arange(B), torch.arange(B) % 40
    cos, sin = cos_sin(positions[:, None], inv_frequencies(D, 10000.0), torch.float32)
    cos, sin = cos.view(B, D), sin.view(B, D)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref, ref_q = reference_block(qkv.clone(), Hq, Hkv, cos, sin, ref_k, ref_v, rows, positions, q_norm, k_norm, 1e-6)
    out = decode_block(qkv, Hq, Hkv, cos, sin, k_cache, v_cache, rows, positions, D**-0.5, q_norm, k_norm, 1e-6)
    assert rel(qkv.view(B, -1, D)[:, :Hq], ref_q) <= 1e-6 and rel(k_cache, ref_k) <= 1e-6
    assert torch.equal(v_cache, ref_v)
    assert rel(out, ref) <= 1e-5


def test_decode_block_refuses_bad_input():
    qkv = torch.randn(2, 8 * 16)
    k = torch.zeros(2, 8, 2, 16)
    cos = sin = torch.ones(2, 16)
    with pytest.raises(ValueError, match="q heads"):
        decode_block(qkv, 3, 2, cos, sin, k, k.clone(), [0, 1], [0, 1], 0.25)
    with pytest.raises(ValueError, match="cos and sin"):
        decode_block(qkv, 4, 2, cos[:1], sin[:1], k, k.clone(), [0, 1], [0, 1], 0.25)
    with pytest.raises(ValueError, match="positions"):
        decode_block(qkv, 4, 2, cos, sin, k, k.clone(), [0, 1], [0, 8], 0.25)
    with pytest.raises(ValueError, match="rows"):
        decode_block(qkv, 4, 2, cos, sin, k, k.clone(), [0, 2], [0, 1], 0.25)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        decode_block(qkv, 4, 2, cos, sin, k, k.clone(), [0, 1], [0, 1], 0.25, q_norm=torch.ones(16))
    with pytest.raises(ValueError, match="qkv"):
        decode_block(qkv.half(), 4, 2, cos, sin, k, k.clone(), [0, 1], [0, 1], 0.25)
    pool = default_pool()
    block = prepare_decode_block(qkv, 4, 2, cos, sin, k, k.clone(), [0, 1], [0, 1], 0.25)
    pos = block._keep[6]  # the positions tensor the job reads when it runs
    pos[1] = 8
    pool.submit(block.job())
    with pytest.raises(ValueError, match="positions"):  # the job's error, at the sync
        pool.sync()
    pos[1] = 1
    before = [t.clone() for t in (qkv, k, block._keep[4])]  # qkv, k and v cache: the block writes all three
    pool.submit(block.job())
    pool.sync()
    assert torch.equal(block.out, decode_block(*before[:1], 4, 2, cos, sin, *before[1:], [0, 1], [0, 1], 0.25))
