"""The fused decode kernels (hetmoe/ops/triton/fused.py) against the unfused PyTorch code they replace, fp32 and
bf16, and the fused decode path of each architecture against the unfused one.

Kernel tests run wherever the kernels run: Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests/conftest.py),
the GPU otherwise; paths covered: the interpreter here, the GPU on the GPU machine. The kernels round to the model
dtype at the unfused code's rounding points (RNE; by the bits, which the interpreter's own casts would truncate), so
they differ from it only by the order of a sum of squares. Measured under the interpreter (max |fused - unfused| /
max |unfused|, -s prints them): fp32 <= 2e-7 for every kernel; bf16 0 (bitwise) for every kernel and case here.
Bounds: fp32 1e-5; bf16 1.6e-2 (two bf16 ulps at the largest magnitude: on the GPU a sum of squares in another
order can move a normalised value across a rounding boundary).

Model tests: one decode step of each architecture's tiny config with ``Step.fused`` against the same step
unfused (CPU fp32, interpreter: the layer boundaries, the qkv/MLA epilogues, the SwiGLU MLPs; measured 1.2e-7 to
1.9e-7, bound 1e-5), and the CUDA graph decode with the fused path on against off and against the fused eager step
(GPU, bf16, batch sizes 1, 3, 8, paged and contiguous caches; bound 5e-2). Without a GPU, every kernel variant is
also compiled for sm_90 (the interpreter accepts code that compiled Triton refuses).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cases import generator
from decode_steps import graph_decode
from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.rope import apply_rope, cos_sin, inv_frequencies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def tf():
    from triton_interp import triton_module

    return triton_module("hetmoe.ops.triton.fused")  # (the interpreter patched for the router GEMM's loop)


@pytest.fixture(scope="module")
def tm():
    from triton_interp import triton_module

    return triton_module("hetmoe.ops.triton.mla")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()  # (a pinned host buffer beside a GPU result)
    return ((a - b).abs().max() / b.abs().max()).item()


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------- residual add + RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (3, 300), (8, 2048), (5, 7168)])
def test_add_rms_norm(tf, dtype, T, N):
    gen = generator("add_rms_norm", T, N, str(dtype))
    x, d = randn(gen, T, 1, N, dtype=dtype), randn(gen, T, 1, N, dtype=dtype, scale=0.5)
    w = (1 + randn(gen, N, scale=0.1)).to(dtype)
    res, out = tf.add_rms_norm(x, d, w, 1e-6)
    r = x + d
    ref = w * F.rms_norm(r, (N,), eps=1e-6)
    assert torch.equal(res, r)  # one rounding of the sum, as torch's add
    assert res.shape == out.shape == x.shape and out.dtype == dtype
    print(f"add_rms_norm {dtype} T={T} N={N}: {rel(out, ref):.1e}")
    assert rel(out, ref) <= BOUND[dtype]
    if DEVICE == "cuda":  # delta in pinned host memory, read over PCIe (a MoE layer's CPU output): the same bits
        res_h, out_h = tf.add_rms_norm(x, d.cpu().pin_memory(), w, 1e-6)
        assert torch.equal(res_h, res) and torch.equal(out_h, out)
    same, out2 = tf.add_rms_norm(x, None, w, 1e-6)  # no delta: the norm alone, x is the residual
    assert same is x and rel(out2, w * F.rms_norm(x, (N,), eps=1e-6)) <= BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (3, 300), (5, 2880)])
def test_add_rms_norm_rounded_once(tf, dtype, T, N):
    """``round_normed=False``: gpt-oss's norm (hetmoe/models/gpt_oss.py GptOssRMSNorm), the fp32 weight times the
    fp32 normalised sum, rounded once; an fp32 weight beside bf16 activations too."""
    gen = generator("add_rms_norm_once", T, N, str(dtype))
    x, d = randn(gen, T, N, dtype=dtype), randn(gen, T, N, dtype=dtype, scale=0.5)
    for w in ((1 + randn(gen, N, scale=0.1)).to(dtype), 1 + randn(gen, N, scale=0.1)):
        res, out = tf.add_rms_norm(x, d, w, 1e-5, round_normed=False)
        r = x + d
        ref = (w.float() * F.rms_norm(r.float(), (N,), eps=1e-5)).to(dtype)
        assert torch.equal(res, r) and out.dtype == dtype
        print(f"add_rms_norm rounded once {dtype} T={T} N={N} weight {w.dtype}: {rel(out, ref):.1e}")
        assert rel(out, ref) <= BOUND[dtype]


# ---------------------------------------------------------------- GQA: q/k norm + RoPE + KV write


def _cache(B, K, D, P, dtype, paged: bool, ctx=96):
    cache = KVCache(2, B + 1, ctx, K, D, dtype, DEVICE, page_size=P if paged else None, initial_tokens=None)
    for row in range(B + 1):
        cache.reserve(row, ctx)
    return cache


def _step(gen, B, S, ctx, P):
    """Positions across page boundaries (P - 1, P, 2P + 1, ...), slots in a shuffled order."""
    start = torch.tensor([(P - 1 + 17 * b) % (ctx - S) for b in range(B)])
    positions = (start[:, None] + torch.arange(S)[None]).to(DEVICE)
    slots = torch.randperm(B, generator=gen).to(DEVICE)
    return Step(positions, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("B,S,H,K,D,norm", [(1, 1, 4, 4, 16, True), (3, 1, 8, 2, 32, True), (8, 1, 6, 1, 64, False),
                                            (2, 3, 12, 4, 128, True), (3, 2, 4, 2, 24, False)])
def test_qkv_epilogue(tf, dtype, paged, B, S, H, K, D, norm):
    gen = generator("qkv", B, S, H, K, D, norm, paged, str(dtype))
    P, layer = 16, 1
    step = _step(gen, B, S, 96, P)
    qkv = randn(gen, B, S, (H + 2 * K) * D, dtype=dtype)
    qw, kw = ((1 + randn(gen, D, scale=0.2)).to(dtype) for _ in range(2)) if norm else (None, None)
    rope = cos_sin(step.positions, inv_frequencies(D, 10000.0), dtype)
    # the unfused code of GQAAttention.forward
    ref_cache, cache = _cache(B, K, D, P, dtype, paged), _cache(B, K, D, P, dtype, paged)
    qk = qkv[..., :(H + K) * D].view(B, S, H + K, D)
    v = qkv[..., (H + K) * D:].view(B, S, K, D)
    if norm:
        qk = torch.cat((qw.expand(H, D), kw.expand(K, D))) * F.rms_norm(qk, (D,), eps=1e-6)
    q_ref, k_ref = apply_rope(qk, *rope).split((H, K), dim=2)
    ref_cache.write(layer, step, k_ref, v)
    k_pool, v_pool, table, page = cache.layout(layer)
    q = tf.qkv_epilogue(qkv, H, K, qw, kw, 1e-6, *rope, k_pool, v_pool, table, page, step.slots, step.positions)
    assert q.shape == (B, S, H, D) and q.dtype == dtype
    print(f"qkv {dtype} {B, S, H, K, D} norm={norm} paged={paged}: q {rel(q, q_ref):.1e} "
          f"k {rel(cache.k, ref_cache.k):.1e}")
    assert rel(q, q_ref) <= BOUND[dtype]
    assert rel(cache.k, ref_cache.k) <= BOUND[dtype]
    assert torch.equal(cache.v, ref_cache.v)  # v is copied
    assert torch.equal(cache.k != 0, ref_cache.k != 0)  # the very same cache entries written, no others


# ---------------------------------------------------------------- MLA: latent norm + RoPE + latent cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["complex", "interleave", "half"])
@pytest.mark.parametrize("B,S,h,r,rope,paged", [(1, 1, 4, 16, 8, True), (3, 1, 16, 512, 64, True),
                                                (8, 1, 3, 40, 16, False), (2, 2, 5, 24, 8, True)])
def test_mla_epilogue(tf, dtype, form, B, S, h, r, rope, paged):
    from hetmoe.models.deepseek_v2 import _rope_complex, _rope_half, _rope_interleave

    rope_fn = {"complex": _rope_complex, "interleave": _rope_interleave, "half": _rope_half}[form]
    gen = generator("mla", B, S, h, r, rope, paged, form, str(dtype))
    P, layer, nope = 16, 0, 8
    step = _step(gen, B, S, 96, P)
    kv_a = randn(gen, B, S, r + rope, dtype=dtype)
    q = randn(gen, B, S, h, nope + rope, dtype=dtype)
    w = (1 + randn(gen, r, scale=0.2)).to(dtype)
    freqs = step.positions.float().unsqueeze(-1) * inv_frequencies(rope, 10000.0).to(DEVICE)
    cos, sin = (freqs.cos() * 1.1).to(dtype), (freqs.sin() * 1.1).to(dtype)  # times a YaRN attention factor
    ref_cache = KVCache(1, B + 1, 96, 1, r, dtype, DEVICE, v_head_dim=rope, page_size=P if paged else None)
    cache = KVCache(1, B + 1, 96, 1, r, dtype, DEVICE, v_head_dim=rope, page_size=P if paged else None)
    for c in (ref_cache, cache):
        for row in range(B + 1):
            c.reserve(row, 96)
    # the unfused code of DeepseekV2Attention.forward
    c_kv, k_pe = kv_a.split([r, rope], dim=-1)
    c_kv = (w * F.rms_norm(c_kv, (r,), eps=1e-6)).view(B, S, 1, r)
    cs, sn = cos.unsqueeze(2), sin.unsqueeze(2)
    q_pe_ref = rope_fn(q[..., nope:], cs, sn)
    ref_cache.write(layer, step, c_kv, rope_fn(k_pe.reshape(B, S, 1, rope), cs, sn))
    c_pool, pe_pool, table, page = cache.layout(layer)
    q_pe = tf.mla_epilogue(kv_a, q, nope, w, 1e-6, cos, sin, form, c_pool, pe_pool, table, page, step.slots,
                           step.positions)
    assert q_pe.shape == (B, S, h, rope) and q_pe.dtype == dtype
    print(f"mla {dtype} {form} {B, S, h, r, rope} paged={paged}: q_pe {rel(q_pe, q_pe_ref):.1e} "
          f"c {rel(cache.k, ref_cache.k):.1e} pe {rel(cache.v, ref_cache.v):.1e}")
    assert rel(q_pe, q_pe_ref) <= BOUND[dtype]
    assert rel(cache.k, ref_cache.k) <= BOUND[dtype] and rel(cache.v, ref_cache.v) <= BOUND[dtype]
    assert torch.equal(cache.k != 0, ref_cache.k != 0)
    with pytest.raises(ValueError, match="rope form must be one of"):
        tf.mla_epilogue(kv_a, q, nope, w, 1e-6, cos, sin, "yarn", c_pool, pe_pool, table, page, step.slots,
                        step.positions)


# ---------------------------------------------------------------- MLA's absorbed per-head products


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,h,K,N,layout", [(1, 4, 128, 512, "kn"), (3, 5, 512, 128, "nk"), (8, 2, 40, 24, "kn"),
                                             (2, 3, 600, 20, "nk"), (5, 2, 24, 300, "kn")])
def test_head_gemv(tm, dtype, T, h, K, N, layout):
    """Per head x_t @ w_h (MLA's W_uk / W_uv absorption) against torch.einsum in fp32, for w with unit stride along
    N ("kn": W_uk, a view of kv_b_proj's weight) or along K ("nk": W_uv transposed), x a strided view as the
    model passes it; sizes off the tiles (masks) and K over several tiles. Measured (interpreter): fp32 <= 2e-7,
    bf16 one rounding of the fp32 sum."""
    gen = generator("head_gemv", T, h, K, N, layout, str(dtype))
    x = randn(gen, T, h, K + 8, dtype=dtype)[..., 8:]  # a strided view, as q[..., :nope] is
    base = randn(gen, h, N, K, dtype=dtype, scale=0.1) if layout == "nk" else randn(gen, h, K, N, dtype=dtype,
                                                                                     scale=0.1)
    w = base.transpose(1, 2) if layout == "nk" else base
    out = tm.head_gemv(x, w)
    ref = torch.einsum("thk,hkn->thn", x.float(), w.float())
    print(f"head_gemv {dtype} {T, h, K, N} {layout}: {rel(out, ref):.1e}")
    assert out.shape == (T, h, N) and out.dtype == dtype
    assert rel(out, ref) <= (1e-6 if dtype == torch.float32 else 4e-3)
    with pytest.raises(ValueError, match="at most"):
        tm.head_gemv(randn(gen, tm.HEAD_GEMV_ROWS + 1, h, K, dtype=dtype), w)
    with pytest.raises(ValueError, match="expected w"):
        tm.head_gemv(x, w[:, :K - 1])


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 32), (3, 1408), (8, 37)])
def test_silu_mul(tf, dtype, T, I):
    gen = generator("silu_mul", T, I, str(dtype))
    gu = randn(gen, T, 1, 2 * I, dtype=dtype, scale=2.0)
    out = tf.silu_mul(gu)
    gate, up = gu.split(I, dim=-1)
    print(f"silu_mul {dtype} T={T} I={I}: {rel(out, F.silu(gate) * up):.1e}")
    assert out.shape == (T, 1, I) and rel(out, F.silu(gate) * up) <= BOUND[dtype]


# ---------------------------------------------------------------- router GEMM into the staging buffers, combine


def _host(*shape, dtype):
    """A pinned host tensor on a GPU machine (the kernels write it over PCIe), a plain one here."""
    return torch.zeros(*shape, dtype=dtype, pin_memory=torch.cuda.is_available())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N,E,fp32_logits", [(1, 64, 8, False), (3, 300, 37, True), (8, 2048, 128, False),
                                               (17, 96, 20, True)])
def test_router_stage(tf, dtype, T, N, E, fp32_logits):
    """logits = x @ W.T into a (pinned) host buffer in the model dtype or fp32, and x copied beside them, against
    F.linear. Measured (interpreter): fp32 <= 4e-7; bf16 logits equal to F.linear's, fp32 logits of bf16 inputs
    1e-7 from the fp32 product (F.linear rounds to bf16, the kernel does not)."""
    gen = generator("router_stage", T, N, E, str(dtype))
    x, w = randn(gen, T, N, dtype=dtype), randn(gen, E, N, dtype=dtype, scale=0.05)
    out_dtype = torch.float32 if fp32_logits else dtype
    logits, xh = _host(T, E, dtype=out_dtype), _host(T, N, dtype=dtype)
    tf.router_stage(x, w, logits, xh)
    ref = torch.mm(x.float(), w.float().t())
    print(f"router_stage {dtype} T={T} N={N} E={E} -> {out_dtype}: {rel(logits, ref):.1e}")
    assert torch.equal(xh, x.cpu())
    assert rel(logits, ref) <= (1e-5 if out_dtype == torch.float32 else BOUND[dtype])
    with pytest.raises(ValueError, match="expected weight"):
        tf.router_stage(x, w[:, :-1], logits, xh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rows(tf, dtype):
    gen = generator("add_rows", str(dtype))
    a, b = randn(gen, 3, 1100, dtype=dtype), randn(gen, 3, 1100, dtype=dtype)
    host = _host(3, 1100, dtype=dtype)
    host.copy_(a)
    out = tf.add_rows(host, b)
    assert out.device == b.device and torch.equal(out, a + b)  # one rounding of the sum, as torch's add


# ---------------------------------------------------------------- the models' fused decode path


def _tiny(arch: str, dtype: str = "fp32", device: str = "cpu", **opts):
    from hetmoe.config.options import EngineOptions
    from hetmoe.load.random_weights import _config, build_random_model

    cfg = _config(arch, None, 300).to_dict()
    return build_random_model(cfg, None, EngineOptions(device=device, dtype=dtype, experts_format="bf16",
                                                       max_context=96, max_batch=8, **opts), log=lambda m: None)


def _decode_once(model, cache, tokens: list, positions: list, fused: bool) -> torch.Tensor:
    dev = cache.device
    step = Step(torch.tensor(positions, device=dev).view(-1, 1), torch.arange(len(tokens), device=dev), fused=fused)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens, device=dev).view(-1, 1), step, cache)
        return model.logits(hidden[:, -1]).float()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter; on a GPU machine "
                    "test_graph_decode_fused_matches_unfused covers the models")
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2"])
def test_model_fused_step_matches_unfused(tf, arch):
    pytest.importorskip("transformers")
    """One decode step of 3 sequences at positions across a 16-position page boundary, fused against unfused, on
    the CPU in fp32 (Triton's interpreter; the CPU engine's experts and attention): the logits within 1e-5 and the
    cache entries the step wrote equal to fp32 rounding. Paths: interpreter + CPU engine."""
    loaded = _tiny(arch)
    model = loaded.model
    cache = model.make_cache(4, 96, torch.float32, "cpu", page_size=None, initial_tokens=96)
    gen = generator("model_fused", arch)
    lengths = [15, 16, 31]
    with torch.inference_mode():
        for slot, n in enumerate(lengths):  # prefill (unfused, as always) each slot's prompt
            ids = torch.randint(3, 300, (1, n), generator=gen)
            model(ids, Step(torch.arange(n).view(1, n), torch.tensor([slot]), kv_len=n), cache)
    tokens = [7, 11, 13]
    ref = _decode_once(model, cache, tokens, lengths, fused=False)
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    out = _decode_once(model, cache, tokens, lengths, fused=True)
    err = rel(out, ref)
    print(f"{arch}: fused~unfused logits {err:.1e}, cache {rel(cache.k, k_ref):.1e} {rel(cache.v, v_ref):.1e}")
    assert err < 1e-5
    assert rel(cache.k, k_ref) < 1e-5 and rel(cache.v, v_ref) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in of a stream; on a GPU machine "
                    "test_graph_decode_fused_matches_unfused covers the mapped staging")
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2"])
def test_mapped_staging_matches_copies(tf, arch):
    """A hybrid decode step (the CPU jobs through stream host functions on a FakeStream, hetmoe/moe/stream.py),
    fused, with the mapped staging (the router GEMM into the pinned buffers, the jobs' output read in place) against
    the staging copies (batch 1 and 3) and against the unfused step (batch 3), CPU fp32 (interpreter + CPU engine):
    logits within 1e-5 (measured 0 to 3e-7 at batch 1, 3 and 8). DeepSeek-V2's router keeps the copies (routed on
    the device); Mixtral's layer is Qwen3's. Nothing is copied back: the device twins of the outputs stay zero."""
    pytest.importorskip("transformers")
    from hetmoe import _C
    from hetmoe.load.loader import moe_blocks
    from hetmoe.moe import StreamDecode

    model = _tiny(arch).model
    layers = [m for _, m in moe_blocks(model)]
    fake = _C.FakeStream()
    hybrid = StreamDecode(8, "cpu", layers, fake_stream=fake)
    cache = model.make_cache(8, 96, torch.float32, "cpu", page_size=16, initial_tokens=96)
    gen = generator("mapped", arch)
    lengths = [15 + (5 * s) % 11 for s in range(8)]
    with torch.inference_mode():
        for slot, n in enumerate(lengths):
            ids = torch.randint(3, 300, (1, n), generator=gen)
            model(ids, Step(torch.arange(n).view(1, n), torch.tensor([slot]), kv_len=n), cache)

    def decode(batch, fused, mapped):
        step = Step(torch.tensor(lengths[:batch]).view(batch, 1), torch.arange(batch), kv_len=96, fused=fused)
        with torch.inference_mode(), hybrid.step(torch.tensor([batch]), mapped=mapped):
            out = model.logits(model(torch.tensor(tokens[:batch]).view(batch, 1), step, cache)[:, -1])
        fake.synchronize()
        return out

    tokens = torch.randint(3, 300, (8,), generator=gen).tolist()
    for batch in (1, 3):
        ref = decode(batch, False, False) if batch == 3 else None
        copies = decode(batch, True, False)
        with torch.inference_mode():
            for layer in layers:
                hybrid.buffers(layer).dev.zero_()
        mapped = decode(batch, True, True)
        errs = (rel(mapped, ref) if ref is not None else 0.0, rel(mapped, copies))
        print(f"{arch} batch {batch}: mapped~unfused {errs[0]:.1e}, mapped~copies {errs[1]:.1e}")
        assert max(errs) < 1e-5
        for layer in layers:
            buf = hybrid.buffers(layer)
            assert (buf.dev == 0).all() != (arch == "deepseek_v2")  # V2 routes on the device: copies
            if buf.logits is not None:  # the staged logits are the router's on the staged x
                gate = next(m for m in model.modules() if getattr(m, "moe", None) is layer).gate
                want = F.linear(buf.x[:batch], gate.weight.float())
                assert rel(buf.logits[:batch], want) < 1e-5
    hybrid.close()


def test_fused_decode_option():
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_options
    from hetmoe.config.options import EngineOptions

    assert EngineOptions().fused_decode == "on"
    with pytest.raises(ValueError, match="fused-decode must be on or off"):
        EngineOptions(fused_decode="yes")
    assert engine_options(build_parser().parse_args(["generate", "--fused-decode", "off"])).fused_decode == "off"
    assert engine_options(build_parser().parse_args(["generate"])).fused_decode == "on"


def test_cpu_steps_are_never_fused():
    """The switch is the GPU decoder's: a CPU runner's steps keep the unfused ops (Step.fused False)."""
    pytest.importorskip("transformers")
    from hetmoe.engine.runner import Runner

    runner = Runner(_tiny("qwen3_moe"), fused_decode=True)
    seen = []
    attn = runner.model.model.layers[0].self_attn
    original = attn.forward
    attn.forward = lambda x, rope, step, cache: seen.append(step.fused) or original(x, rope, step, cache)
    runner.lean = None  # the torch decode path, where a Step is built
    runner.prefill([5, 6, 7])
    runner.decode(8)
    assert runner.decoder is None and seen == [False, False]  # prefill, decode


# ---------------------------------------------------------------- GPU: graph decode, fused against unfused


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_graph_decode_fused_matches_unfused(arch, attention):
    """The CUDA graph decode with the fused path on against off, bf16, batch sizes 1, 3 (padded to 4) and 8, over
    the paged cache (Triton attention) and the contiguous one (SDPA). Paths: GPU. Bound 5e-2 relative max logit
    error, the bf16 graph tests' bound (tests/engine/test_cuda_graph.py); measured values printed (-s)."""
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    loaded = _tiny(arch, "bf16", "cuda", attention=attention)
    for batch in (1, 3, 8):
        on, off = graph_decode(loaded, batch, True), graph_decode(loaded, batch, False)
        eager_on = graph_decode(loaded, batch, True, graph=False)
        errs = {"fused~unfused": rel(on, off), "fused graph~fused eager": rel(on, eager_on)}
        print(f"{arch} {attention} batch {batch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert torch.isfinite(on).all() and all(v < 5e-2 for v in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.parametrize("arch,dense", [("qwen3_moe", "int8"), ("deepseek_v3", "fp8"), ("qwen2_moe", "int4")])
def test_graph_decode_pdl_is_exact(arch, dense, monkeypatch):
    """Programmatic dependent launch (hetmoe/ops/triton/pdl.py) changes when kernels start, never what they
    compute: the graph decode with it equals the one without it bitwise, with the quantized dense GEMVs, the fused
    kernels, the attention and the CPU experts' host functions in the graph. Paths: GPU."""
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    from hetmoe.ops.triton import pdl as triton_pdl

    if not triton_pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 (HETMOE_PDL=0 turns it off)")
    loaded = _tiny(arch, "bf16", "cuda", dense_format=dense)
    for batch in (1, 3):
        with_pdl = graph_decode(loaded, batch, True)
        monkeypatch.setenv("HETMOE_PDL", "0")
        monkeypatch.setattr(triton_pdl, "_CAPABLE", {})
        without = graph_decode(loaded, batch, True)
        monkeypatch.setenv("HETMOE_PDL", "1")
        monkeypatch.setattr(triton_pdl, "_CAPABLE", {})
        assert torch.isfinite(with_pdl).all() and torch.equal(with_pdl, without), rel(with_pdl, without)


# ---------------------------------------------------------------- compiled for a GPU, without one

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hetmoe.ops.triton import fused as tf
from hetmoe.ops.triton import mla as tm
from hetmoe.ops.triton import attention as ta

def sig(ptrs, ints, scalars, consts, **types):
    consts = dict(consts, PDL=True)  # griddepcontrol (hetmoe/ops/triton/pdl.py) exists from sm_90
    s = {n: types.get(n, "*bf16") for n in ptrs.split()}
    s.update({n: "i64" for n in ints.split()}, **scalars, **{n: "constexpr" for n in consts})
    return s, consts

idx = dict(TABLE="*i32", SLOTS="*i64", POS="*i64")
cases = [
    (tf._add_rms_norm, *sig("X DELTA W RES OUT", "sx sd sr so", dict(N="i32", eps="fp32"),
                            dict(BLOCK=8192, HAS_DELTA=True, DELTA_HOST=False, ROUND_NORMED=True))),
    (tf._add_rms_norm, *sig("X DELTA W RES OUT", "sx sd sr so", dict(N="i32", eps="fp32"),
                            dict(BLOCK=8192, HAS_DELTA=True, DELTA_HOST=True, ROUND_NORMED=True))),
    (tf._add_rms_norm, *sig("X DELTA W RES OUT", "sx sd sr so", dict(N="i32", eps="fp32"),
                            dict(BLOCK=4096, HAS_DELTA=True, DELTA_HOST=True, ROUND_NORMED=False), W="*fp32")),
    (tf._silu_mul, *sig("GU OUT", "s_gu s_o", dict(N="i32"), dict(BLOCK=1024, ROUND_SILU=True))),
    (tf._add_rows, *sig("A B OUT", "sa sb so", dict(N="i32"), dict(BLOCK=1024))),
]
for logits in ("*bf16", "*fp32"):
    cases.append((tf._router_stage, *sig("X W LOGITS XH", "sx sw sl sxh", dict(T="i32", N="i32", E="i32"),
                                         dict(BT=4, BE=2, BK=512, STAGE_X=True),
                                         LOGITS=logits)))
for cache in ("*bf16", "*fp32"):
    for norm in (True, False):
        for paged in (True, False):
            cases.append((tf._qkv_epilogue, *sig(
                "QKV QW KW COS SIN Q KC VC TABLE SLOTS POS",
                "s_qkv s_cs sq_t sq_h skc_p skc_t skc_h svc_p svc_t svc_h st_r",
                dict(S="i32", H="i32", K="i32", P="i32", eps="fp32"), dict(D=128, BH=64, NORM=norm, PAGED=paged),
                KC=cache, VC=cache, **idx)))
for in_il, out_il, rnd in tf.ROPE_LAYOUTS.values():
    for cache in ("*bf16", "*fp32"):
        cases.append((tf._mla_epilogue, *sig(
            "KVA W COS SIN Q QPE CC PC TABLE SLOTS POS",
            "s_kva s_cs sq_t sq_h sqpe_t sqpe_h scc_p scc_t spc_p spc_t st_r",
            dict(S="i32", P="i32", R="i32", NOPE="i32", eps="fp32"),
            dict(BR=512, HALF=32, BHALF=32, IN_IL=in_il, OUT_IL=out_il, ROUND=rnd, PAGED=True),
            CC=cache, PC=cache, **idx)))
for bk, bn in ((128, 128), (512, 32)):  # MLA's W_uk and W_uv tiles
    cases.append((tm._head_gemv, *sig("X W OUT", "", dict(T="i32", K="i32", N="i32", sx_t="i32", sx_h="i32",
                                                          sw_h="i32", sw_k="i32", sw_n="i32", so_t="i32",
                                                          so_h="i32"), dict(BT=8, BK=bk, BN=bn))))
# the paged decode kernel (GQA: a window; with and without sinks in the reduce, bf16 and fp32 sinks)
cases.append((ta._decode_split, *sig(
    "Q1 Q2 K1 K2 V TABLE SLOTS POS PART_O PART_L",
    "sq1_n sq1_h sq2_n sq2_h sk1_p sk1_t sk1_h sk2_p sk2_t sk2_h sv_p sv_t sv_h st_r ss_n spos_n spo_n spo_h spo_s "
    "spl_n spl_h", dict(scale="fp32", G="i32", HEAD_BLOCKS="i32", WINDOW="i32"),
    dict(D1=64, D2=16, DV=64, BD1=64, BD2=16, BDV=64, BLOCK_G=16, P=64, NSPLIT=8, HAS_Q2=False, V_IS_K1=False,
         IEEE=False), PART_O="*fp32", PART_L="*fp32", **idx)))
s, c = sig("Q1 Q2 K1 K2 V TABLE SLOTS POS OUT SINKS",
           "sq1_b sq1_s sq1_h sq2_b sq2_s sq2_h sk1_p sk1_t sk1_h sk2_p sk2_t sk2_h sv_p sv_t sv_h st_r ss_b sp_b so_b "
           "so_s so_h", dict(S="i32", H="i32", G="i32", qk_scale="fp32", WINDOW="i32"),
           dict(D1=64, D2=16, DV=64, BD1=64, BD2=16, BDV=64, BLOCK_M=64, P=64, HAS_Q2=False, IEEE=False,
                HAS_SINKS=True), **idx)
c.pop("PDL")  # (the prefill kernel has no PDL switch)
cases.append((ta._prefill, s, c))
for sinks in ("*bf16", "*fp32"):
    for has in (True, False):
        cases.append((ta._decode_reduce, *sig("PART_O PART_L SINKS OUT", "spo_n spo_h spo_s spl_n spl_h so_n so_h",
                                              dict(H="i32"), dict(DV=64, BDV=64, NSPLIT=8, HAS_SINKS=has),
                                              PART_O="*fp32", PART_L="*fp32", SINKS=sinks)))
for fn, s, c in cases:
    triton.compile(ASTSource(fn=fn, signature={n: s[n] for n in fn.arg_names}, constexprs=c),
                   target=GPUTarget("cuda", 90, 32))
print("compiled", len(cases))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every other test compiles the kernels")
def test_kernels_compile_for_a_gpu(tf):
    """Triton's interpreter runs code that compiled Triton refuses (a pointer chosen across a runtime branch must
    have one type, ...): compile every kernel variant for sm_90 (bf16 activations, bf16 and fp32 caches, paged and
    contiguous, each RoPE form, the router GEMM into bf16 and fp32 logits, both norm roundings; the paged decode
    kernel with a window and its reduce with and without sinks, the prefill kernel with both) in a process without
    TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "compiled 29" in out.stdout, out.stderr[-3000:]
