"""The paged KV cache and its Triton attention kernels (hetmoe/layers/kv_cache.py, triton_attention.py) against
SDPA's math backend in fp32 on the same inputs: split-KV decode and causal prefill from positions, for GQA ratios
1/4/8, MLA's two-part keys (absorbed decode, expanded prefill), odd lengths, lengths that are not a multiple of the
page, batches with mixed lengths over scattered pages; decode and prefill with gpt-oss's attention sinks and sliding
window against the naive reference of its eager attention (tests/reference.py ``sink_attention_reference``).

Where there is no GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py);
without the triton package those tests skip (CI's CPU torch has none) and the cache's bookkeeping tests still run.
Measured errors (max |out - ref|, fp32, interpreter): <= 1e-6 (bound 1e-4); bf16 on the GPU: bound 2e-2 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton_interp import checked_accesses, triton_module

from cases import generator
from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import KVCache, KVCacheFull
from reference import rel_err, sink_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    return triton_module("hetmoe.ops.triton.attention")


def sdpa_reference(q, k, v, positions, scale):
    """q [N, H, D] at positions [N] over k/v [N, L, KV, D(v)] (each row its own keys) -> [N, H, Dv]: SDPA's math
    backend in fp32 with a boolean mask of the positions <= each query's."""
    N, H, _ = q.shape
    L, KV = k.shape[1], k.shape[2]
    allowed = (torch.arange(L, device=q.device)[None] <= positions[:, None]).view(N, 1, 1, L)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k.float().transpose(1, 2),
                                             v.float().transpose(1, 2), attn_mask=allowed, scale=scale,
                                             enable_gqa=H != KV)  # [N, H, 1, Dv]
    return out[:, :, 0]


def paged(gen, n_rows, length, P, KV, D, Dv, dtype=torch.float32):
    """Random pages for ``n_rows`` rows of ``length`` positions, scattered over a pool (page 0 unused), and the
    same keys/values per row, contiguous."""
    per_row = -(-length // P)
    n_pages = n_rows * per_row + 3
    k = torch.randn(n_pages, P, KV, D, generator=gen).to(dtype)
    v = torch.randn(n_pages, P, KV, Dv, generator=gen).to(dtype)
    table = (torch.randperm(n_pages - 1, generator=gen)[:n_rows * per_row] + 1).view(n_rows, per_row).int()
    rows_k = k[table.long()].reshape(n_rows, per_row * P, KV, D)
    rows_v = v[table.long()].reshape(n_rows, per_row * P, KV, Dv)
    dev = [t.to(DEVICE) for t in (k, v, table)]
    return (*dev, rows_k.to(DEVICE), rows_v.to(DEVICE))


def tolerance(dtype):
    return 1e-4 if dtype == torch.float32 else 2e-2


DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
def test_decode_matches_sdpa_math(kernels, heads, kv_heads, dtype):
    gen = generator("decode-kernel", heads, kv_heads)
    P, D = 16, 32
    slots = torch.tensor([2, 0, 3, 1])
    positions = torch.tensor([0, 16, 77, 130])  # one position, a page boundary, odd, many pages
    k, v, table, rows_k, rows_v = paged(gen, 4, 131, P, kv_heads, D, D, dtype)
    q = torch.randn(4, heads, D, generator=gen).to(dtype).to(DEVICE)
    out = kernels.decode(q, k, v, table, slots.to(DEVICE), positions.to(DEVICE), D**-0.5)
    ref = sdpa_reference(q, rows_k[slots], rows_v[slots], positions.to(DEVICE), D**-0.5)
    assert out.dtype == dtype and out.shape == (4, heads, D)
    assert rel_err(out.float(), ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40, 1000], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 3)], ids=["gqa4", "gqa2"])
def test_decode_with_sinks_and_window_matches_reference(kernels, heads, kv_heads, window, dtype):
    """gpt-oss's attention: a sink logit per head in the softmax's denominator and a sliding window (p - W < j <= p)
    against the naive reference (tests/reference.py): windows of one position, inside a page, a page exactly, over
    page boundaries and longer than every context; rows at position 0, a page boundary, odd and many pages."""
    gen = generator("decode-kernel-sinks", heads, kv_heads, window)
    P, D = 16, 32
    slots = torch.tensor([2, 0, 3, 1])
    positions = torch.tensor([0, 16, 77, 130])
    k, v, table, rows_k, rows_v = paged(gen, 4, 131, P, kv_heads, D, D, dtype)
    q = torch.randn(4, heads, D, generator=gen).to(dtype).to(DEVICE)
    sinks = (torch.randn(heads, generator=gen) * 2).to(DEVICE)
    out = kernels.decode(q, k, v, table, slots.to(DEVICE), positions.to(DEVICE), D**-0.5, sinks=sinks, window=window)
    ref = sink_attention_reference(q, rows_k[slots], rows_v[slots], positions, D**-0.5, sinks, window)
    assert out.dtype == dtype and out.shape == (4, heads, D)
    assert rel_err(out.float(), ref) < tolerance(dtype)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_decode_extreme_sinks(kernels, window):
    """A sink far above every score takes nearly all the probability (output ~0, absolute error), one far below
    none (the output is the plain softmax's); bf16 sinks are read as they are."""
    gen = generator("decode-kernel-extreme-sinks", window)
    P, D, H = 16, 32, 8
    slots, positions = torch.tensor([1, 0]).to(DEVICE), torch.tensor([130, 9]).to(DEVICE)
    k, v, table, rows_k, rows_v = paged(gen, 2, 131, P, 2, D, D)
    q = torch.randn(2, H, D, generator=gen).to(DEVICE)
    plain = kernels.decode(q, k, v, table, slots, positions, 0.2, window=window)
    low = kernels.decode(q, k, v, table, slots, positions, 0.2, sinks=torch.full((H,), -1e4, device=DEVICE),
                         window=window)
    assert rel_err(low, plain) < 1e-6
    for sinks in (torch.full((H,), 30.0), torch.tensor([1e4, -1e4, 50.0, -50.0, 0.0, 3.0, -3.0, 88.0]),
                  torch.randn(H, generator=gen).bfloat16()):
        sinks = sinks.to(DEVICE)
        out = kernels.decode(q, k, v, table, slots, positions, 0.2, sinks=sinks, window=window)
        ref = sink_attention_reference(q, rows_k[slots], rows_v[slots], positions, 0.2, sinks, window)
        assert out.isfinite().all() and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-7


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 40, 1000], ids=lambda w: f"window{w}")
def test_prefill_with_sinks_and_window_matches_reference(kernels, window, dtype):
    """Prefill with a sink per head and a sliding window: a row from position 0 and one over a cached prefix (its
    first queries' windows reach back into the prefix), a padded tail; 70 tokens, so a window of 5 leaves whole
    blocks of a row seeing nothing of some pages, and rows whose first pages hold nothing visible."""
    gen = generator("prefill-kernel-sinks", window)
    P, D, S, H, KV = 16, 32, 70, 8, 2
    k, v, table, rows_k, rows_v = paged(gen, 2, 37 + S, P, KV, D, D, dtype)
    positions = torch.stack([torch.arange(S), torch.arange(S) + 37])
    q = torch.randn(2, S, H, D, generator=gen).to(dtype).to(DEVICE)
    sinks = (torch.randn(H, generator=gen) * 2).to(DEVICE)
    out = kernels.prefill(q, k, v, table, torch.arange(2, device=DEVICE), positions.to(DEVICE), 0.2, sinks=sinks,
                          window=window)
    for b in range(2):
        ref = sink_attention_reference(q[b], rows_k[b].expand(S, -1, -1, -1), rows_v[b].expand(S, -1, -1, -1),
                                       positions[b], 0.2, sinks, window)
        assert rel_err(out[b].float(), ref) < tolerance(dtype)
    plain = kernels.prefill(q, k, v, table, torch.arange(2, device=DEVICE), positions.to(DEVICE), 0.2)
    low = kernels.prefill(q, k, v, table, torch.arange(2, device=DEVICE), positions.to(DEVICE), 0.2,
                          sinks=torch.full((H,), -1e4, device=DEVICE))
    assert rel_err(low.float(), plain.float()) < 1e-6  # a sink far below every score takes nothing


def test_kernels_refuse_bad_sinks_or_window(kernels):
    gen = generator("decode-kernel-bad")
    k, v, table, *_ = paged(gen, 1, 20, 16, 2, 16, 16)
    q = torch.randn(1, 4, 16, generator=gen).to(DEVICE)
    args = (q, k, v, table, torch.tensor([0], device=DEVICE), torch.tensor([5], device=DEVICE), 0.25)
    for window in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            kernels.decode(*args, window=window)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[4\]"):
        kernels.decode(*args, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="prefill: window must be an int >= 1"):
        kernels.prefill(q[None], k, v, table, torch.tensor([0], device=DEVICE), torch.tensor([[5]], device=DEVICE),
                        0.25, window=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
def test_prefill_matches_sdpa_math(kernels, heads, kv_heads, dtype):
    """Causal from position 0 (row 0) and over a cached prefix (row 1 starts at 37), a padded tail row."""
    gen = generator("prefill-kernel", heads, kv_heads)
    P, D, S = 16, 32, 23
    k, v, table, rows_k, rows_v = paged(gen, 2, 37 + S, P, kv_heads, D, D, dtype)
    positions = torch.stack([torch.arange(S), torch.arange(S) + 37])
    q = torch.randn(2, S, heads, D, generator=gen).to(dtype).to(DEVICE)
    out = kernels.prefill(q, k, v, table, torch.arange(2, device=DEVICE), positions.to(DEVICE), 0.2)
    for b in range(2):
        ref = sdpa_reference(q[b], rows_k[b].expand(S, -1, -1, -1), rows_v[b].expand(S, -1, -1, -1),
                             positions[b].to(DEVICE), 0.2)
        assert rel_err(out[b].float(), ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_absorbed_decode_matches_sdpa_math(kernels, dtype):
    """Two-part key (latent r + rope), the latent also the value, one kv head for every query head."""
    gen = generator("mla-decode")
    P, H, r, rope = 16, 24, 64, 16
    c, pe, table, rows_c, rows_pe = paged(gen, 3, 70, P, 1, r, rope, dtype)
    q_lat = torch.randn(3, H, r, generator=gen).to(dtype).to(DEVICE)
    q_pe = torch.randn(3, H, rope, generator=gen).to(dtype).to(DEVICE)
    positions, slots = torch.tensor([69, 3, 40]).to(DEVICE), torch.tensor([1, 2, 0]).to(DEVICE)
    out = kernels.decode(q_lat, c, None, table, slots, positions, 0.1, q2=q_pe, k2=pe, v_is_k1=True)
    ref = sdpa_reference(torch.cat((q_lat, q_pe), -1), torch.cat((rows_c, rows_pe), -1)[slots], rows_c[slots],
                         positions, 0.1)
    assert out.shape == (3, H, r) and rel_err(out.float(), ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions", [[[14, 15, 16]], [[0, 1]], [[28, 29, 30, 31], [3, 4, 5, 6]]],
                         ids=["one-row-over-a-page-boundary", "one-row-from-0", "two-rows"])
def test_mla_absorbed_chunk_reads_only_its_arguments(kernels, dtype, positions):
    """The absorbed form for a chunk of S = 2..4 tokens per sequence (``mla_latent_paged``: each token a decode row,
    the rows of one sequence sharing its slot through a stride-0 view when B = 1) over a paged latent cache, every
    load and store checked against the arguments' extents under the interpreter. The kernel once read the slots
    with unit stride: row 1 read past the one-element slots tensor (an illegal memory access on the GPU,
    docs/gpu-prefill.md). Against SDPA's math backend."""
    from hetmoe.layers.attention import mla_latent_paged

    gen = generator("mla-chunk", len(positions), len(positions[0]))
    P, h, r, rope, scale = 16, 4, 64, 16, 0.2
    positions = torch.tensor(positions)
    B, S = positions.shape
    cache = KVCache(1, 3, 64, 1, r, dtype, DEVICE, v_head_dim=rope, page_size=P, initial_tokens=16)
    slots = torch.tensor([2, 0][:B])
    for slot in (1, *slots.tolist()):  # row 1 first: the chunk's rows get scattered pages
        cache.reserve(slot, 48)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(dtype))
    step = Step(positions.to(DEVICE), slots.to(DEVICE), kv_len=48)
    q_lat = torch.randn(B, S, h, r, generator=gen).to(dtype).to(DEVICE)
    q_pe = torch.randn(B, S, h, rope, generator=gen).to(dtype).to(DEVICE)
    with checked_accesses():
        out = mla_latent_paged(q_lat, q_pe, cache, 0, step, scale)
    rows_c, rows_pe = cache.rows(0, step)  # [B, 48, 1, r | rope]
    for b in range(B):
        ref = sdpa_reference(torch.cat((q_lat[b], q_pe[b]), -1), torch.cat((rows_c[b], rows_pe[b]), -1).expand(
            S, -1, -1, -1), rows_c[b].expand(S, -1, -1, -1), step.positions[b], scale)
        assert rel_err(out[b].float(), ref) < tolerance(dtype), b

def test_mla_expanded_prefill_matches_sdpa_math(kernels):
    from hetmoe.layers.attention import mla_expanded_paged

    gen = generator("mla-expanded")
    B, S, ctx, H, nope, rope, dv, P = 2, 9, 32, 4, 32, 16, 24, 16
    kv = torch.randn(B, ctx, H, nope + dv, generator=gen).to(DEVICE)
    pe = torch.randn(B, ctx, 1, rope, generator=gen).to(DEVICE)
    q_nope, q_pe = (torch.randn(B, S, H, d, generator=gen).to(DEVICE) for d in (nope, rope))
    positions = torch.stack([torch.arange(S), torch.arange(S) + 20]).to(DEVICE)
    out = mla_expanded_paged(q_nope, q_pe, kv, pe, P, Step(positions, torch.arange(B)), 0.3)
    k = torch.cat((kv[..., :nope], pe.expand(-1, -1, H, -1)), -1)
    for b in range(B):
        ref = sdpa_reference(torch.cat((q_nope[b], q_pe[b]), -1), k[b].expand(S, -1, -1, -1),
                             kv[b, ..., nope:].expand(S, -1, -1, -1), positions[b], 0.3)
        assert rel_err(out[b], ref) < 1e-4


def test_decode_splits_are_fixed_by_shapes(kernels):
    """The split count depends on the heads and the cache, not on the lengths nor the batch (a batch of mixed
    lengths needs its longest row's splits): a CUDA graph keeps it."""
    n = kernels.decode_splits(4, 2048, torch.device("cpu"))
    assert n >= 1 and n & (n - 1) == 0
    assert kernels.decode_splits(4, 2, torch.device("cpu")) <= 2  # at most the pages a row can have
    assert kernels.decode_splits(1, 2048, torch.device("cpu")) > n  # fewer programs per row: more splits


# ---------------------------------------------------------------- the paged cache's bookkeeping (no kernels)


def test_paged_cache_hands_out_grows_and_frees_pages():
    cache = KVCache(2, 3, 100, 2, 8, page_size=16, initial_tokens=32)
    assert cache.paged and cache.n_pages == 3 and cache.version == 1  # page 0 + the 2 asked for
    cache.reserve(0, 20)  # two pages
    assert cache.owned[0] == [1, 2] and cache.table[0, :2].tolist() == [1, 2] and cache.table[0, 2] == 0
    cache.reserve(1, 1)  # the pool is dry: it doubles
    assert cache.n_pages > 3 and cache.version == 2 and len(cache.owned[1]) == 1
    cache.reserve(0, 20)  # already held: nothing changes
    assert cache.owned[0] == [1, 2]
    held = cache.tokens_held()
    cache.release(0, keep=5)  # keeps the page holding positions 0..4
    assert cache.owned[0] == [1] and cache.table[0, 1] == 0 and cache.tokens_held() == held - 16
    cache.reserve(2, 16)
    assert cache.owned[2] == [2]  # the freed page is handed out again
    with pytest.raises(ValueError, match="beyond max_context"):
        cache.reserve(0, 101)


def test_paged_cache_reads_back_what_was_written_like_the_contiguous_one():
    gen = generator("paged-roundtrip")
    paged_cache = KVCache(2, 2, 64, 2, 8, page_size=16, initial_tokens=16)
    flat = KVCache(2, 2, 64, 2, 8)
    positions = torch.tensor([[3, 4, 5, 6, 7], [30, 31, 32, 33, 34]])
    step = Step(positions, torch.tensor([1, 0]), kv_len=48)
    for cache in (paged_cache, flat):
        cache.reserve(1, 8), cache.reserve(0, 35)
    k, v = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)
    for layer in range(2):
        for cache in (paged_cache, flat):
            cache.write(layer, step, k + layer, v - layer)
        (pk, pv), (fk, fv) = paged_cache.rows(layer, step), flat.rows(layer, step)
        assert pk.shape == (2, 48, 2, 8) and fk.shape == (2, 48, 2, 8)
        for b, row in enumerate(positions):
            assert torch.equal(pk[b, row], fk[b, row]) and torch.equal(pk[b, row], k[b] + layer)
            assert torch.equal(pv[b, row], fv[b, row])


def test_contiguous_cache_grows_its_capacity_and_keeps_the_data():
    cache = KVCache(1, 2, 1000, 1, 4, initial_tokens=64)
    assert cache.capacity == 64
    step = Step(torch.tensor([[5]]), torch.tensor([1]))
    cache.write(0, step, torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    cache.reserve(1, 65)
    assert cache.capacity == 128 and cache.version == 2 and cache.k[0, 1, 5].eq(1).all()
    cache.reserve(0, 999)
    assert cache.capacity == 1000  # never past max_context


def test_a_pool_that_cannot_grow_says_so(monkeypatch):
    cache = KVCache(1, 2, 64, 1, 4, page_size=16, initial_tokens=16)

    def no_memory(*shape):
        raise torch.OutOfMemoryError("no memory")

    monkeypatch.setattr(cache, "_alloc", no_memory)
    cache.reserve(0, 16)  # the page it has
    with pytest.raises(KVCacheFull, match="KV cache cannot grow"):
        cache.reserve(1, 16)


# ---------------------------------------------------------------- whole models: paged kernels == contiguous SDPA


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_model_on_the_paged_kernels_matches_the_contiguous_cache(kernels, checkpoints, arch):
    """Prefill two sequences (one in two chunks: a cached prefix), then decode both at different lengths, then
    chunks of 2 to 4 tokens (deepseek_v3: the absorbed form, one decode row per token; one over a page boundary,
    one of a whole new prompt, one of two sequences): the logits of the paged cache with the Triton kernels equal
    those of SDPA over the contiguous cache (fp32), every kernel access inside its arguments (the interpreter)."""
    pytest.importorskip("transformers")
    from hetmoe.models.deepseek_v2 import DeepseekV3ForCausalLM
    from hetmoe.models.qwen3_moe import Qwen3MoeForCausalLM
    from hetmoe.moe import TorchExperts
    from parity import load_ours, max_rel

    def experts(*weights):  # fp32, on the device the model runs on
        return TorchExperts(*(w.to(DEVICE) for w in weights))

    cls = {"qwen3_moe": Qwen3MoeForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}[arch]
    model = load_ours(checkpoints(arch, {"num_hidden_layers": 2}, seed=5, dtype="float32"), cls, experts)
    model = model.to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    caches = [model.make_cache(2, 96, device=DEVICE, page_size=16, initial_tokens=16),
              model.make_cache(2, 96, device=DEVICE)]
    # (positions [B, S], slots): a prompt in two chunks (the second over a cached prefix), a second prompt, single
    # decode steps, then both sequences in one decode batch at different lengths
    calls = [(torch.arange(0, 21)[None], [0]), (torch.arange(21, 40)[None], [0]), (torch.arange(0, 7)[None], [1])]
    calls += [(torch.tensor([[40 + i]]), [0]) for i in range(3)] + [(torch.tensor([[7 + i]]), [1]) for i in range(2)]
    calls += [(torch.tensor([[43], [9]]), [0, 1]), (torch.tensor([[44], [10]]), [0, 1])]
    calls += [(torch.arange(11, 13)[None], [1]), (torch.arange(13, 17)[None], [1]), (torch.arange(0, 3)[None], [0])]
    calls += [(torch.tensor([[3, 4], [17, 18]]), [0, 1])]
    with torch.no_grad(), checked_accesses():
        for positions, slots in calls:
            ids = torch.randint(0, model.config.vocab_size, positions.shape, generator=gen).to(DEVICE)
            outs = []
            for cache in caches:
                for b, slot in enumerate(slots):
                    cache.reserve(slot, int(positions[b, -1]) + 1)
                step = Step(positions.to(DEVICE), torch.tensor(slots, device=DEVICE), kv_len=96,
                            start=int(positions[0, 0]) if len(slots) == 1 else None)
                outs.append(model.logits(model(ids, step, cache)))
            assert max_rel(outs[0], outs[1]) < 1e-4, (arch, positions.tolist())


# ---------------------------------------------------------------- the runner: KV memory for the positions in use


def test_a_long_context_runner_holds_kv_for_the_positions_in_use(checkpoints):
    """16 slots of a 128K context: the cache starts small and grows with what the sequences hold (paged on a GPU with
    Triton: pages per sequence; else one capacity for the longest), and a prompt longer than the context is refused."""
    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    ctx = 131072
    loaded = load_model(checkpoints("qwen3_moe", {"max_position_embeddings": ctx}),
                        EngineOptions(device=DEVICE, dtype="fp32", max_batch=16, max_context=ctx),
                        expert_cache=None, log=lambda m: None)
    runner = Runner(loaded)
    cache = runner.cache
    full = 17 * ctx * cache.elems_per_token * 4  # every row's whole context, fp32
    assert cache.bytes_allocated < full / 100
    runner.prefill(list(range(3, 300)), slot=0)
    runner.prefill(list(range(3, 40)), slot=5)
    for _ in range(3):
        runner.decode_batch([7, 8], [0, 5])
    held = cache.tokens_held()
    if cache.paged:
        assert held == (-(-300 // 64) + -(-40 // 64)) * 64  # pages of the two sequences only
        runner.prefill(list(range(3, 20)), slot=0)  # slot 0 starts over: its pages go back
        assert cache.tokens_held() == (1 + 1) * 64
    else:
        assert held == 16 * 320  # every row holds the longest sequence's capacity, rounded up to 64
    assert cache.bytes_allocated < full / 100
    with pytest.raises(ValueError, match="context holds"):
        runner.prefill([1] * (ctx + 1), slot=1)
