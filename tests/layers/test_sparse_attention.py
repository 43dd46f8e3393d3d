"""DeepSeek Sparse Attention (hetmoe/layers/sparse_attention.py) and the indexer's keys in the KV cache
(hetmoe/layers/kv_cache.py ``indexer``), against naive per-query loops in float64 written from the math:

* ``select``: the indexer's top-k per query (causal), for decode rows at mixed positions and prefill chunks after a
  cached prefix, top-k below and above the context, query blocks split small;
* ``sparse_latent_attention`` (MLA's absorbed form over the gathered latents) and ``sparse_masked_attention`` (the
  expanded form with a mask of the selected positions): attention restricted to the selected positions; with every
  position selected, dense causal attention;
* ``LightningIndexer`` against Transformers' own DeepseekV32Indexer (half-split RoPE) and GlmMoeDsaIndexer
  (interleaved) with the same weights: the same positions per query;
* the cache keeps the indexer's keys beside the latents, contiguous and paged, through growth and release.

Paths: PyTorch on the CPU, fp32. ``select``'s choice must be a top-k of the float64 scores: no position left out
scores more than 1e-5 (relative) above the lowest kept. Attention against the float64 loop, MEASURED ||out - ref|| /
||ref||: latent form <= 1.6e-7, masked form <= 2.0e-7 (bound 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from cases import generator
from hetmoe.layers import sparse_attention as sa
from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import KVCache
from reference import rel_err


def naive_scores(q, w, keys, positions, scale) -> list:
    """float64 index scores per (b, s): {t: score} over t <= position (module docstring's formula)."""
    B, S, H, _ = q.shape
    out = []
    for b in range(B):
        for s in range(S):
            row = {}
            for t in range(min(int(positions[b, s]) + 1, keys.shape[1])):
                dots = q[b, s].double() @ keys[b, t].double() * scale  # [H]
                row[t] = float((w[b, s].double() * dots.clamp(min=0)).sum())
            out.append(row)
    return out


def check_topk(sel: sa.Selection, scores: list, topk: int, eps: float = 1e-5) -> None:
    """Each query's valid picks are distinct positions it may see, min(topk, seen) of them, and a top-k of the
    float64 scores: none left out scores more than eps above the lowest kept."""
    B, S, _ = sel.index.shape
    for i, row in enumerate(scores):
        b, s = divmod(i, S)
        kept = sel.index[b, s][sel.valid[b, s]].tolist()
        assert len(set(kept)) == len(kept) == min(topk, len(row)), (b, s, kept)
        assert set(kept) <= set(row), (b, s, kept)
        left = [row[t] for t in row if t not in kept]
        if left:
            assert min(row[t] for t in kept) >= max(left) - eps * max(1.0, abs(max(left))), (b, s)


def _inputs(B, S, H, D, ctx, *params):
    gen = generator("dsa", B, S, H, D, ctx, *params)
    q = torch.randn(B, S, H, D, generator=gen)
    w = torch.randn(B, S, H, generator=gen)
    keys = torch.randn(B, ctx, D, generator=gen)
    return gen, q, w, keys


# (B, S, heads, ctx, positions): decode rows at mixed positions, a prompt from 0, a chunk after a cached prefix
LAYOUTS = {
    "decode-1": (1, 1, 4, 45, lambda B, S: torch.tensor([[44]])),
    "decode-3": (3, 1, 8, 45, lambda B, S: torch.tensor([[3], [44], [20]])),
    "prefill-40": (1, 40, 4, 45, lambda B, S: torch.arange(S)[None]),
    "chunk-7": (2, 7, 1, 45, lambda B, S: torch.arange(30, 37).expand(B, S)),
}


@pytest.mark.parametrize("topk", [1, 4, 16, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("block", ["whole", "split"])
def test_select_is_a_causal_top_k(monkeypatch, layout, topk, block):
    B, S, H, ctx, pos = LAYOUTS[layout]
    if block == "split":  # a few queries per block
        monkeypatch.setattr(sa, "BLOCK_ELEMS", 3 * B * H * ctx)
    _, q, w, keys = _inputs(B, S, H, 16, ctx, layout, topk)
    positions = pos(B, S)
    sel = sa.select(q, w, keys, positions, topk, 16**-0.5)
    assert sel.index.shape == (B, S, min(topk, ctx)) and sel.index.dtype == torch.int64
    check_topk(sel, naive_scores(q, w, keys, positions, 16**-0.5), topk)


def test_select_blocks_do_not_change_the_choice(monkeypatch):
    """The same choice, bit for bit, whatever the query blocks."""
    _, q, w, keys = _inputs(2, 33, 4, 16, 50, "blocks")
    positions = torch.arange(10, 43).expand(2, 33)
    whole = sa.select(q, w, keys, positions, 8, 0.25)
    monkeypatch.setattr(sa, "BLOCK_ELEMS", 5 * 2 * 4 * 50)
    split = sa.select(q, w, keys, positions, 8, 0.25)
    assert torch.equal(whole.index, split.index) and torch.equal(whole.valid, split.valid)


def _selection(B, S, ctx, positions, topk, gen) -> sa.Selection:
    """A random top-k choice per query among its positions (padding picks invalid)."""
    scores = torch.rand(B, S, ctx, generator=gen)
    scores.masked_fill_(torch.arange(ctx) > positions[..., None], float("-inf"))
    top = scores.topk(min(topk, ctx), dim=-1)
    return sa.Selection(top.indices, top.values > float("-inf"))


def naive_attention(q, k, v, sel) -> torch.Tensor:
    """float64: each query and head over its valid picks alone. q [B, S, h, D]; k [B, ctx, h, D] (or [B, ctx, D],
    shared by the heads); v likewise -> [B, S, h, Dv]."""
    B, S, h, _ = q.shape
    out = torch.zeros(B, S, h, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            picks = sel.index[b, s][sel.valid[b, s]]
            for j in range(h):
                kk = k[b, picks, j] if k.dim() == 4 else k[b, picks]
                vv = v[b, picks, j] if v.dim() == 4 else v[b, picks]
                p = torch.softmax(kk.double() @ q[b, s, j].double(), dim=0)
                out[b, s, j] = p @ vv.double()
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("topk", [1, 5, 64])
def test_latent_attention_over_the_selection(layout, topk):
    """MLA's absorbed form: scores q_lat . c + q_pe . pe over the picks, the output a mix of the latents."""
    B, S, H, ctx, pos = LAYOUTS[layout]
    gen = generator("latent", layout, topk)
    h, r, R = 3, 24, 8
    q_lat, q_pe = torch.randn(B, S, h, r, generator=gen), torch.randn(B, S, h, R, generator=gen)
    c, pe = torch.randn(B, ctx, r, generator=gen), torch.randn(B, ctx, R, generator=gen)
    positions = pos(B, S)
    sel = _selection(B, S, ctx, positions, topk, gen)
    scale = 0.2
    out = sa.sparse_latent_attention(q_lat, q_pe, c, pe, sel, scale)
    ref = naive_attention(torch.cat((q_lat, q_pe), -1) * scale, torch.cat((c, pe), -1), c, sel)
    assert out.shape == (B, S, h, r) and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("topk", [1, 5, 64])
@pytest.mark.parametrize("block", ["whole", "split"])
def test_masked_attention_over_the_selection(monkeypatch, layout, topk, block):
    """MLA's expanded form: per-head keys and values (Dv != D), each query restricted to its picks."""
    B, S, H, ctx, pos = LAYOUTS[layout]
    if block == "split":
        monkeypatch.setattr(sa, "BLOCK_ELEMS", 2 * B * 3 * ctx)
    gen = generator("masked", layout, topk)
    h, D, Dv = 3, 16, 12
    q, k, v = (torch.randn(B, n, h, d, generator=gen) for n, d in ((S, D), (ctx, D), (ctx, Dv)))
    sel = _selection(B, S, ctx, pos(B, S), topk, gen)
    out = sa.sparse_masked_attention(q, k, v, sel, 0.3)
    assert out.shape == (B, S, h, Dv) and rel_err(out, naive_attention(q * 0.3, k, v, sel)) < 1e-5


def test_selecting_every_position_is_dense_attention():
    """With top-k above every context the selection is all positions <= each query's: dense causal attention, for
    both forms."""
    from hetmoe.layers.attention import attend

    gen = generator("dense")
    B, S, h, D, ctx = 2, 9, 4, 16, 20
    positions = torch.arange(11, 20).expand(B, S)
    _, q, w, keys = _inputs(B, S, 2, D, ctx, "dense")
    sel = sa.select(q, w, keys, positions, 64, 0.25)
    assert torch.equal(sel.valid.sum(-1), positions + 1)
    qh, k, v = (torch.randn(B, n, h, D, generator=gen) for n in (S, ctx, ctx))
    dense = attend(qh, k, v, Step(positions, torch.arange(B)), 0.25)
    assert rel_err(sa.sparse_masked_attention(qh, k, v, sel, 0.25), dense) < 1e-6
    c = torch.randn(B, ctx, D, generator=gen)  # MLA: latent (12) | rope key (4), one head; the latent is the value
    dense = attend(qh, c[:, :, None], c[:, :, None, :12], Step(positions, torch.arange(B)), 0.25)
    latent = sa.sparse_latent_attention(qh[..., :12], qh[..., 12:], c[..., :12], c[..., 12:], sel, 0.25)
    assert rel_err(latent, dense) < 1e-6


# ---------------------------------------------------------------- the indexer against Transformers'


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("batch", [1, 2])
def test_indexer_picks_what_transformers_picks(family, batch):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    from hetmoe.models.deepseek_v32 import ROPE_BY_FORM

    topk, S, R, D, H = 6, 23, 8, 16, 8
    cfg_cls = {"deepseek_v32": transformers.DeepseekV32Config, "glm_moe_dsa": transformers.GlmMoeDsaConfig}[family]
    cfg = cfg_cls(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, q_lora_rank=24, qk_rope_head_dim=R,
                  index_topk=topk, index_head_dim=D, index_n_heads=H)
    hf_cls, rope_fn = {"deepseek_v32": (DeepseekV32Indexer, ROPE_BY_FORM["half"]),
                       "glm_moe_dsa": (GlmMoeDsaIndexer, ROPE_BY_FORM["interleave"])}[family]
    torch.manual_seed(4)
    hf = hf_cls(cfg, 0).eval()
    ours = sa.LightningIndexer(64, 24, H, D, R, topk, 0, rope_fn)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours.load_state_dict(hf.state_dict(), strict=True)
    gen = generator("indexer", family, batch)
    x, q_resid = torch.randn(batch, S, 64, generator=gen), torch.randn(batch, S, 24, generator=gen)
    positions = torch.arange(S).expand(batch, S)
    freqs = positions[..., None].float() / (1e4 ** (torch.arange(0, R, 2).float() / R))  # [B, S, R/2]
    cos, sin = freqs.cos(), freqs.sin()
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(batch, S, S)
    with torch.no_grad():
        want = hf(x, q_resid, (torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)), causal, positions)
        cache = KVCache(1, batch, 32, 1, 4, indexer=(1, D))
        step = Step(positions, torch.arange(batch))
        sel = ours(x, q_resid, (cos, sin), step, cache, sa.SparseCall(step, topk))
    for b in range(batch):
        for s in range(S):
            hf_set = {t for t in want[b, s].tolist() if t <= s}
            assert set(sel.index[b, s][sel.valid[b, s]].tolist()) == hf_set, (b, s)


# ---------------------------------------------------------------- the cache's indexer keys and SparseCall


@pytest.mark.parametrize("paged", [False, True])
def test_cache_keeps_indexer_keys_beside_the_latents(paged):
    gen = generator("cache", paged)
    layout = dict(page_size=16, initial_tokens=16) if paged else dict(initial_tokens=8)
    cache = KVCache(3, 2, 100, 1, 6, v_head_dim=2, indexer=(2, 5), **layout)
    assert cache.elems_per_token == 3 * (6 + 2) + 2 * 5
    assert cache.ik.shape[0] == 2 and cache.ik.shape[-1] == 5
    assert cache.bytes_allocated == 4 * (cache.k.numel() + cache.v.numel() + cache.ik.numel())
    written = {}
    for slot, (start, n) in enumerate([(0, 9), (0, 40)]):  # the second grows the storage
        cache.reserve(slot, start + n)
        step = Step(torch.arange(start, start + n)[None], torch.tensor([slot]))
        for layer in range(2):
            keys = torch.randn(1, n, 5, generator=gen)
            cache.write_index(layer, step, keys)
            written[slot, layer] = keys[0]
        cache.write(0, step, torch.randn(1, n, 1, 6, generator=gen), torch.randn(1, n, 1, 2, generator=gen))
    assert cache.version >= 2  # grown once at least: the first row's keys were copied over
    both = Step(torch.tensor([[8], [39]]), torch.tensor([0, 1]), kv_len=40)
    for layer in range(2):
        rows = cache.index_rows(layer, both)  # [2, ctx, 5]
        assert rows.shape[1] == cache.rows(0, both)[0].shape[1] >= 40
        assert torch.equal(rows[0, :9], written[0, layer]) and torch.equal(rows[1, :40], written[1, layer])
    cache.release(1, 16)
    if paged:
        assert len(cache.owned[1]) == 1


def test_sparse_call_reads_the_positions_once_and_only_when_needed():
    class Counting(torch.Tensor):
        reads = 0

        def max(self, *args, **kwargs):
            Counting.reads += 1
            return super().max(*args, **kwargs)

    positions = torch.arange(30, 33)[None].as_subclass(Counting)
    dense = sa.SparseCall(Step(positions, torch.tensor([0]), kv_len=32), topk=32)
    assert dense.dense and Counting.reads == 0  # the runner's kv_len bounds every context: no read
    call = sa.SparseCall(Step(positions, torch.tensor([0]), kv_len=4096), topk=32)
    assert not call.dense and not call.dense and Counting.reads == 1
    assert call.top == 33 and call.rows_step().kv_len == 64  # whole 64-position blocks, not the runner's 4096
    assert sa.SparseCall(Step(torch.arange(3)[None], torch.tensor([0])), topk=3).dense  # no kv_len: the positions


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_path_on_gpu(dtype):
    """The same functions on a GPU: ``select`` (fp32 scores from q and keys in ``dtype``) a top-k of the float64
    scores of the same inputs; both attention forms in ``dtype`` against the float64 loop. Bounds: fp32 1e-5, bf16
    2e-2 (bf16 products and softmax weights; the float64 reference reads the same bf16 inputs)."""
    B, S, H, ctx = 2, 24, 8, 45
    _, q, w, keys = _inputs(B, S, H, 16, ctx, "gpu")
    positions = torch.arange(21, 45).expand(B, S)
    q, keys = q.to(dtype), keys.to(dtype)
    sel = sa.select(q.cuda(), w.cuda(), keys.cuda(), positions.cuda(), 8, 0.25)
    check_topk(sa.Selection(sel.index.cpu(), sel.valid.cpu()), naive_scores(q, w, keys, positions, 0.25), 8)
    gen = generator("gpu-attention")
    h, r, R, Dv = 4, 24, 8, 12
    q_lat, q_pe = (torch.randn(B, S, h, d, generator=gen).to(dtype) for d in (r, R))
    c, pe = (torch.randn(B, ctx, d, generator=gen).to(dtype) for d in (r, R))
    sel = _selection(B, S, ctx, positions, 8, gen)
    on = sa.Selection(sel.index.cuda(), sel.valid.cuda())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = sa.sparse_latent_attention(q_lat.cuda(), q_pe.cuda(), c.cuda(), pe.cuda(), on, 0.2)
    ref = naive_attention(torch.cat((q_lat, q_pe), -1).double() * 0.2, torch.cat((c, pe), -1), c, sel)
    assert out.dtype == dtype and rel_err(out.cpu(), ref) < tol
    qh, k, v = (torch.randn(B, n, h, d, generator=gen).to(dtype) for n, d in ((S, 16), (ctx, 16), (ctx, Dv)))
    out = sa.sparse_masked_attention(qh.cuda(), k.cuda(), v.cuda(), on, 0.3)
    assert out.dtype == dtype and rel_err(out.cpu(), naive_attention(qh.double() * 0.3, k, v, sel)) < tol
