"""Decode steps as CUDA graphs (engine/cuda_graph.py) with the hybrid MoE dispatch in stream order (moe/stream.py).

GPU tests (skipped without CUDA): graph decode against the same step run eagerly (``cuda_graph=False``: host
functions, no capture) and against the synchronous path of prefill (``MoELayer`` outside a stream step: copies +
stream synchronize + CPU forward), for batches 1, 3 (padded to 4) and 8 over steps that cross a 64-position KV
bucket, with and without Expert Deferral, per architecture, fp32 and bf16; replays after routing changed; greedy
generation. Tolerances (relative max logit error): an unpadded fp32 graph in "bucket" mode runs the very kernels of
the eager step, so it must agree to 1e-6; otherwise kernel choices differ (padded GEMMs, attended length), and a
1e-7 difference upstream can flip the bf16 rounding of an activation in the CPU engine: 2e-3 in fp32 (the bound of
the other hybrid tests), 5e-2 in bf16. Measured values are printed (-s).

CPU tests (CI): the padding, bucketing and static-input logic, the shared-experts hand-over, options, and that a
CPU-only runner has no decoder.
"""

from __future__ import annotations

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.cuda_graph import bucket_len, capture_sizes, pack_inputs, padded_size
from hetmoe.moe import MoELayer, RouterSpec, TorchExperts, route_softmax, stream

HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------- CPU: the logic around the graphs


def test_capture_sizes_and_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(9) == [1, 2, 4, 8, 9]
    sizes = capture_sizes(8)
    assert [padded_size(n, sizes) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest captured size 8"):
        padded_size(9, sizes)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        capture_sizes(0)


def test_bucket_len():
    assert bucket_len(0, 4096, 64) == 64
    assert bucket_len(63, 4096, 64) == 64
    assert bucket_len(64, 4096, 64) == 128
    assert bucket_len(4090, 4096, 64) == 4096
    assert bucket_len(100, 100, 64) == 100  # never past max_context


def test_pack_inputs_pads_to_the_scratch_slot():
    C, scratch = 4, 9
    buf = torch.full((3 * C + 1,), 77, dtype=torch.int64)
    pack_inputs(buf, C, [11, 12, 13], [5, 0, 63], [2, 0, 1], scratch)
    ids, pos, slots, n = buf[:C], buf[C:2 * C], buf[2 * C:3 * C], buf[3 * C]
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [5, 0, 63, 0]
    assert slots.tolist() == [2, 0, 1, scratch] and int(n) == 3
    pack_inputs(buf, C, [1], [2], [3], scratch)  # a smaller step leaves nothing of the previous one
    assert buf[:C].tolist() == [1, 0, 0, 0] and buf[2 * C:3 * C].tolist() == [3, scratch, scratch, scratch]
    assert int(buf[3 * C]) == 1
    with pytest.raises(ValueError, match="do not fit"):
        pack_inputs(buf, C, [1] * 5, [0] * 5, list(range(5)), scratch)


class _Recorder:
    """An experts backend that logs its calls (into ``calls``, shared with the shared-experts callable)."""

    num_experts = 4

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, x, ids, w):
        self.calls.append("routed")
        return x * 2


def test_moe_layer_hands_the_shared_experts_over():
    """The layer is given its shared experts as a callable (the model never adds them itself): called once, on the
    layer's input, after the routed experts outside a stream step, its output added; None adds nothing."""
    x, logits = torch.randn(3, 8), torch.randn(3, 4)
    calls = []
    layer = MoELayer(RouterSpec("softmax", 2), 4)
    layer.attach(_Recorder(calls))

    def shared(t):
        calls.append("shared")
        assert t is x
        return t + 1

    assert torch.equal(layer(x, logits, shared=shared), x * 2 + (x + 1))
    assert calls == ["routed", "shared"]
    calls.clear()
    assert torch.equal(layer(x, logits, shared=lambda t: None), x * 2)
    assert torch.equal(layer(x, logits), x * 2) and calls == ["routed", "routed"]


def test_moe_layer_adds_shared_on_cpu():
    E, H, I = 4, 16, 8
    g = torch.Generator().manual_seed(0)
    ex = TorchExperts(torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                      torch.randn(E, H, I, generator=g))
    layer = MoELayer(RouterSpec("softmax", 2), E)
    layer.attach(ex)
    x, logits = torch.randn(3, H, generator=g), torch.randn(3, E, generator=g)
    w, ids = route_softmax(logits, 2, False)
    s = torch.randn(3, H, generator=g)
    assert stream.current() is None  # outside a stream-ordered step: the eager path
    assert torch.equal(layer(x, logits, shared=lambda t: s), ex(x, ids, w) + s)
    assert torch.equal(layer(x, logits), ex(x, ids, w))
    fixed = torch.tensor([[0, 1], [2, -1], [3, 0]])  # a -1 slot is skipped
    layer.route = lambda logits, correction_bias=None: (w, fixed)
    assert torch.equal(layer(x, logits, shared=lambda t: s), ex(x, fixed, w) + s)


def test_cuda_graph_option():
    assert EngineOptions().cuda_graph is True
    with pytest.raises(ValueError, match="cuda_graph must be True or False"):
        EngineOptions(cuda_graph=1)
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_options

    args = build_parser().parse_args(["generate", "--no-cuda-graph"])
    assert engine_options(args).cuda_graph is False
    assert engine_options(build_parser().parse_args(["generate"])).cuda_graph is True


def test_cpu_runner_has_no_decoder():
    pytest.importorskip("transformers")
    from hetmoe.engine.runner import Runner
    from hetmoe.load.random_weights import SHAPES, build_random_model

    cfg = {**SHAPES["qwen3-30b-a3b"], "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 12,
           "num_experts_per_tok": 3, "vocab_size": 300}
    loaded = build_random_model(cfg, 2, EngineOptions(device="cpu", dtype="fp32", experts_format="bf16",
                                                      max_context=32, max_batch=3), log=lambda m: None)
    runner = Runner(loaded, cuda_graph=True)
    assert runner.decoder is None and runner.hybrid is None
    assert runner.cache.k.shape[1] == 3  # no scratch slot on the CPU
    a = runner.decode_batch([5, 6], [0, 2])
    assert a.shape == (2, 300) and torch.isfinite(a).all() and runner.lengths == [1, 0, 1]


# ---------------------------------------------------------------- CPU: the stream-ordered dispatch on a FakeStream


def _fake_hybrid_setup(path, d: int):
    """A CPU model whose MoE layers (deferring d when d) are driven by a StreamDecode on a FakeStream, and a runner
    over it (max_batch 4: slot 3 is the padding rows' scratch slot)."""
    from hetmoe import _C
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model, moe_blocks
    from hetmoe.moe import StreamDecode, defer_experts

    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", max_context=96, max_batch=4)
    loaded = load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)
    layers = [layer for _, layer in moe_blocks(loaded.model)]
    assert all(layer.engine is not None for layer in layers)
    defer_experts(loaded.model, d)
    fake = _C.FakeStream()
    hybrid = StreamDecode(4, "cpu", layers, fake_stream=fake)
    return Runner(loaded), hybrid, fake


@torch.inference_mode()
def _hybrid_step(runner, hybrid, tokens, slots, pad_to):
    """One decode step of ``tokens`` through the hybrid dispatch, padded to ``pad_to`` rows (scratch slot 3)."""
    from hetmoe.layers.attention import Step

    n = len(tokens)
    ids = torch.tensor(tokens + [0] * (pad_to - n)).view(pad_to, 1)
    pos = torch.tensor([runner.lengths[s] for s in slots] + [0] * (pad_to - n)).view(pad_to, 1)
    step = Step(pos, torch.tensor(slots + [3] * (pad_to - n)), kv_len=bucket_len(int(pos.max()), 96, 64))
    with hybrid.step(torch.tensor([n])):
        hidden = runner.model(ids, step, runner.cache)[:, -1]
    for s in slots:
        runner.lengths[s] += 1
    return runner.model.logits(hidden)[:n].float()


@pytest.mark.parametrize("arch,d,host_routing", [("qwen3_moe", 0, True), ("qwen3_moe", 2, True),
                                                 ("qwen3_moe", 2, False), ("deepseek_v3", 2, True)])
def test_stream_dispatch_on_a_fake_stream(ckpt, arch, d, host_routing):
    """The host-function path of a decode step (static buffers, T through a pointer, padding rows, deferred jobs left
    pending across layers, the CPU jobs routing from the logits — softmax, or DeepSeek-V3's sigmoid group-limited
    router — or given the routing) on the CPU: the plain CPU path's logits, padded or not."""
    runner, hybrid, fake = _fake_hybrid_setup(ckpt[arch], d)
    hybrid.route_on_host = host_routing
    prompts = [_prompt(0)[:20], _prompt(1)[:23], _prompt(2)[:17]]
    slots = [0, 1, 2]
    want = []
    for s, p in zip(slots, prompts):
        runner.prefill(p, slot=s)
    for i in range(4):
        want.append(runner.decode_batch([_fed(i, s) for s in slots], slots))  # the synchronous CPU path
    for pad_to in (3, 4):
        for s, p in zip(slots, prompts):
            runner.prefill(p, slot=s)
        got = torch.stack([_hybrid_step(runner, hybrid, [_fed(i, s) for s in slots], slots, pad_to)
                           for i in range(4)])
        err = _rel(got, torch.stack(want))
        print(f"fake stream {arch} d={d} padded to {pad_to}: {err:.1e}")
        assert err < (1e-6 if pad_to == 3 else 2e-3), err  # measured 0 / 4.9e-7 (CPU GEMMs of 4 rows, not 3)
    jobs = hybrid.last_jobs
    assert len(jobs) == 3 + (2 if d else 0)  # three layers; the first two defer (the last never does)
    assert int(hybrid.n_tokens) == 3 and hybrid.host_funcs.n_captured == 0
    first = hybrid.buffers(hybrid.layers[0])
    assert (first.logits is not None) == host_routing
    if host_routing:  # the padding row: never routed nor computed
        assert (first.weights[3] == 0).all() and (first.ids[3] == -1).all()
        if arch == "qwen3_moe":
            assert (first.weights[:3].sum(-1) - 1).abs().max() < 1e-6  # qwen3 renormalises the top k
    else:  # the padding row: its routing copied, never computed
        assert (first.weights[3] > 0).all()
    assert (first.out[3] == 0).all()
    assert not hybrid.active and hybrid._pending is None and stream.current() is None
    fake.synchronize()
    hybrid.close()


def test_stream_dispatch_refuses_too_many_rows(ckpt):
    runner, hybrid, _ = _fake_hybrid_setup(ckpt["qwen3_moe"], 0)
    runner.prefill([5, 6, 7], slot=0)
    with pytest.raises(ValueError, match="holds at most 4 tokens, got 5"):
        _hybrid_step(runner, hybrid, [1] * 5, [0, 0, 0, 0, 0], 5)
    assert not hybrid.active and stream.current() is None
    with pytest.raises(RuntimeError, match="already running"):
        with hybrid.step(torch.tensor([1])):
            with hybrid.step(torch.tensor([1])):
                pass
    hybrid.close()


# ---------------------------------------------------------------- GPU: graphs against eager


ARCHS = ("qwen3_moe", "deepseek_v3")
CONFIGS = {  # three MoE layers (first, middle, last), top-4: deferral of 1 and 2 both apply
    "qwen3_moe": dict(num_hidden_layers=3, num_experts_per_tok=4),
    "deepseek_v3": dict(num_hidden_layers=4, num_experts_per_tok=4, topk_group=2),
}
MAX_BATCH, MAX_CONTEXT, STEPS = 8, 128, 8
BATCHES = (1, 3, 8)


def _prompt(i: int) -> list:
    n = 57 + i % 7  # 57..63 tokens: every batch's STEPS decode steps cross the 64-position bucket
    return [(37 * i + 11 * j) % 250 + 3 for j in range(n)]


def _fed(step: int, slot: int) -> int:
    return (13 * step + 29 * slot) % 250 + 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from hetmoe.load.random_weights import write_checkpoint

    root = tmp_path_factory.mktemp("graph")
    return {a: write_checkpoint(root / a, a, CONFIGS[a], seed=7 + i, dtype="float32") for i, a in enumerate(ARCHS)}


def _load(path, dtype, d=0, **kw):
    from hetmoe.load.loader import load_model

    # gpu_prefill off: each load measures its own prefill rates, and where the layerwise path's threshold or the
    # CPU's share of it is a close call two loads can prefill differently (GPU vs CPU expert numerics, then a routing
    # near-tie apart); the prefill path is not what these tests compare
    opts = EngineOptions(device="cuda", dtype=dtype, experts_format="bf16", max_context=MAX_CONTEXT,
                         max_batch=MAX_BATCH, defer_experts=d, **{"gpu_prefill": "off", **kw})
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


def _decode(loaded, batch: int, mode: str, record_ids: bool = False):
    """(logits [STEPS, batch, V] of ``batch`` sequences decoded STEPS steps after their prompts, the keys (B, attended
    length, cpu) of the graphs captured, the first MoE layer's immediate ids after each step when ``record_ids``).
    mode: "graph-full", "graph-bucket", "eager" (same step, no capture) or "sync" (the synchronous prefill path)."""
    from hetmoe.engine.runner import Runner

    graph = mode.startswith("graph")
    runner = Runner(loaded, cuda_graph=graph, kv_mode=mode.split("-")[1] if graph else None)
    if mode == "sync":
        runner.decoder = None
    slots = list(range(batch))
    for s in slots:
        runner.prefill(_prompt(s), slot=s)
    out, routings = [], []
    for i in range(STEPS):
        out.append(runner.decode_batch([_fed(i, s) for s in slots], slots).cpu())
        if record_ids:
            first = runner.hybrid.layers[0]
            routings.append(runner.hybrid.buffers(first).ids[:batch].clone())
    keys = set(runner.decoder.graphs) if runner.decoder is not None else set()
    if runner.decoder is not None:
        runner.decoder.close()
    return torch.stack(out), keys, routings


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("d", [0, 2])
@pytest.mark.gpu
@pytest.mark.gpu
def test_graph_matches_eager(ckpt, arch, dtype, d):
    """The contiguous cache's two graph modes (SDPA), and the paged cache's one graph per batch size (the Triton
    kernels, where they run), against the eager step."""
    from hetmoe.layers.attention import paged_kernels

    loaded = _load(ckpt[arch], dtype, d, attention="sdpa")
    paged = _load(ckpt[arch], dtype, d, attention="triton") if paged_kernels("cuda") else None
    tol = 2e-3 if dtype == "fp32" else 5e-2
    for batch in BATCHES:
        eager, _, _ = _decode(loaded, batch, "eager")
        sync, _, _ = _decode(loaded, batch, "sync")
        full, keys, _ = _decode(loaded, batch, "graph-full")
        bucket, keys_b, _ = _decode(loaded, batch, "graph-bucket")
        errs = {"eager~sync": _rel(eager, sync), "full~eager": _rel(full, eager), "bucket~eager": _rel(bucket, eager)}
        if paged is not None:
            paged_graph, keys_p, _ = _decode(paged, batch, "graph-full")
            paged_eager, _, _ = _decode(paged, batch, "eager")
            errs.update({"paged~eager": _rel(paged_graph, eager), "paged~paged eager": _rel(paged_graph, paged_eager)})
            assert keys_p == {(padded_size(batch, capture_sizes(MAX_BATCH)), MAX_CONTEXT, True)}
        print(f"{arch} {dtype} d={d} batch {batch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert all(torch.isfinite(t).all() for t in (eager, sync, full, bucket))
        for name, err in errs.items():
            # paged~eager crosses attention kernels (Triton vs SDPA, ~1e-7 apart in fp32); with deferral that can
            # move a near-tie between the deferred and the immediate experts, one expert's share of a layer late:
            # measured 7.8e-3 (qwen3_moe fp32 d=2 batch 1, H200); the graph-vs-eager pairs stay at 2e-3
            bound = max(tol, 2e-2) if d and name == "paged~eager" else tol
            assert err < bound, (name, err)
        if dtype == "fp32" and batch in (1, MAX_BATCH):  # unpadded, same attended length: the eager kernels
            assert errs["bucket~eager"] < 1e-6, errs
        padded = padded_size(batch, capture_sizes(MAX_BATCH))
        assert keys == {(padded, MAX_CONTEXT, True)}  # captured once, replayed every step
        assert keys_b == {(padded, 64, True), (padded, 128, True)}  # one per bucket crossed


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.gpu
@pytest.mark.gpu
def test_replays_follow_new_routing(ckpt, arch):
    """One captured graph, replayed with different tokens: the routing the CPU jobs see changes every step and the
    logits still follow the eager step."""
    loaded = _load(ckpt[arch], "fp32", 1)
    graph, keys, routings = _decode(loaded, 3, "graph-full", record_ids=True)
    eager, _, _ = _decode(loaded, 3, "eager")
    assert keys == {(4, MAX_CONTEXT, True)}
    distinct = {tuple(r.flatten().tolist()) for r in routings}
    assert len(distinct) >= STEPS // 2, "the fed tokens should route differently from step to step"
    assert (routings[0][:, 0] >= 0).all()
    assert _rel(graph, eager) < 2e-3


@pytest.mark.gpu
@pytest.mark.gpu
def test_capture_is_timed_and_logged_once(ckpt, capsys):
    from hetmoe.engine.runner import Runner

    loaded = _load(ckpt["qwen3_moe"], "bf16")
    runner = Runner(loaded)
    runner.decoder.log = lambda msg: print(msg, file=__import__("sys").stderr)
    runner.prefill([5, 6, 7], slot=0)
    runner.prefill([8, 9], slot=1)
    runner.decode(10, slot=0)
    runner.decode_batch([11, 12], [0, 1])
    runner.decode_batch([13, 14], [0, 1])
    err = capsys.readouterr().err
    assert err.count("captured the decode step as a CUDA graph") == 1
    assert len(runner.decoder.capture_s) == 2 and all(s > 0 for s in runner.decoder.capture_s.values())
    with pytest.raises(ValueError, match="one token per slot"):
        runner.decode_batch([1, 2], [0])
    runner.decoder.close()


@pytest.mark.gpu
@pytest.mark.gpu
def test_gpu_experts_in_the_graph(ckpt):
    """GPU-resident experts (computed on the main stream during the CPU part) inside the captured step."""
    loaded = _load(ckpt["qwen3_moe"], "fp32", 1, gpu_experts=2)
    graph, _, _ = _decode(loaded, 3, "graph-full")
    eager, _, _ = _decode(loaded, 3, "eager")
    sync, _, _ = _decode(loaded, 3, "sync")
    print(f"gpu experts: graph~eager {_rel(graph, eager):.1e}, eager~sync {_rel(eager, sync):.1e}")
    assert _rel(graph, eager) < 2e-3 and _rel(eager, sync) < 2e-3


@pytest.mark.gpu
@pytest.mark.gpu
def test_generate_graph_equals_eager():
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    texts = []
    for graph in (True, False):
        llm = LLM(None, EngineOptions(device="cuda", dtype="fp32", cuda_graph=graph, defer_experts=1),
                  expert_cache=None, progress=False, log=lambda m: None)
        r = llm.generate("def forward(self, x):", SamplingParams(max_tokens=24), chat=False)
        assert llm.runner.decoder is not None and llm.runner.decoder.cuda_graph is graph
        assert bool(llm.runner.decoder.graphs) is graph
        texts.append(r.text)
        llm.runner.decoder.close()
    print(f"generated: {texts[0]!r}")
    assert texts[0] == texts[1]
