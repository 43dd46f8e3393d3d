"""The MoE layer's own pieces (hetmoe/moe/): the combine's one addition order (combine.py), RouterSpec against the
route functions it names (router.py), MoELayer's refusals (dispatch.py) and the stream-ordered decode driver's
context (stream.py: which layers it drives, ``current()`` after a step, a failed one included).

Paths: PyTorch only (combine, routers, TorchExperts layers), and the CPU engine (isa="auto", bf16 experts) driven
through stream host functions on a ``_C.FakeStream`` (tests/conftest.py), the CPU stand-in for a CUDA stream. The
combine and the routers are compared bitwise (the same operations in the same order); a stream-ordered layer against
the same layer's eager call under the bound of tests/engine/test_cuda_graph.py's unpadded fake-stream step.

Shape letters: T tokens, E experts, k experts per token, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cases import generator
from hetmoe.cpu import CPUExperts
from hetmoe.moe import (
    DeferralChain,
    GpuExperts,
    HostStaging,
    MoELayer,
    RouterSpec,
    StreamDecode,
    TorchExperts,
    combine,
    defer_experts,
    route_deepseek_v2,
    route_deepseek_v3,
    route_softmax,
)
from hetmoe.moe.stream import current
from reference import rel_err

E, H, I = 12, 32, 24  # E not a power of two, divisible into 4 groups


def _weights(seed, e=E):
    gen = generator("moe-layer-weights", seed, e)
    gate, up = (torch.randn(e, I, H, generator=gen) * 0.1 for _ in range(2))
    return gate, up, torch.randn(e, H, I, generator=gen) * 0.1


def _torch_layer(k=3, seed=0, dtype=torch.float32) -> MoELayer:
    layer = MoELayer(RouterSpec("softmax", k, norm_topk_prob=True), E)
    layer.attach(TorchExperts(*_weights(seed), dtype=dtype))
    return layer


# ---------------------------------------------------------------- combine: one addition order


def test_combine_adds_in_fp32_casts_once_then_adds_shared():
    gen = generator("combine")
    T = 64
    main = torch.randn(T, H, generator=gen)  # fp32 parts, as the CPU engine, GPU experts and deferral give them
    resident = torch.randn(T, H, generator=gen)
    deferred = torch.randn(T, H, generator=gen)
    shared = torch.randn(T, H, generator=gen).bfloat16()  # the model's shared experts, in the model dtype
    got = combine(main, resident, deferred, torch.bfloat16, shared)
    want = ((main + resident) + deferred).to(torch.bfloat16) + shared
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # each alternative gives other bits somewhere, so the equality above could fail
    others = {
        "a cast per part": main.bfloat16() + resident.bfloat16() + deferred.bfloat16() + shared,
        "shared before the cast": (((main + resident) + deferred) + shared.float()).to(torch.bfloat16),
    }
    for name, other in others.items():
        assert not torch.equal(got, other), name
    # the fp32 sum runs main, then resident, then deferred: only that order gives 1 here (-1e8 + 1 == -1e8 in fp32)
    big, one = torch.full((1, 4), 1e8), torch.ones(1, 4)
    assert torch.equal(combine(big, -big, one, torch.float32, None), one)
    assert not torch.equal(big + (-big + one), one) and not torch.equal((big + one) - big, one)


def test_combine_without_parts():
    gen = generator("combine-parts")
    main = torch.randn(5, H, generator=gen)
    part = torch.randn(5, H, generator=gen)
    shared = torch.randn(5, H, generator=gen).bfloat16()
    assert torch.equal(combine(main, None, None, torch.float32, None), main)
    assert torch.equal(combine(main, None, part, torch.bfloat16, None), (main + part).bfloat16())
    assert torch.equal(combine(main, part, None, torch.bfloat16, shared), (main + part).bfloat16() + shared)
    # a main part already in the model dtype (the CPU engine's output without deferral) is promoted, not rounded
    half = main.bfloat16()
    assert torch.equal(combine(half, part, None, torch.bfloat16, None), (half.float() + part).bfloat16())


def test_deferring_layer_combines_immediate_then_previous_deferred():
    """Two bf16 layers with d = 1: the second returns (R_imm_1(x_1) + R_def_0(x_0)) in fp32, cast once, + S_1(x_1)."""
    k, d, T = 3, 1, 9
    chain = DeferralChain(2)
    layers = [_torch_layer(k, seed=i) for i in range(2)]
    for i, layer in enumerate(layers):
        layer.set_deferral(d, chain, i)
    gen = generator("deferring-layer")
    xs = [torch.randn(T, H, generator=gen).bfloat16() for _ in range(2)]
    logits = [torch.randn(T, E, generator=gen) for _ in range(2)]
    s = torch.randn(T, H, generator=gen).bfloat16()
    layers[0](xs[0], logits[0])
    got = layers[1](xs[1], logits[1], shared=lambda t: s)

    def part(layer, x, ids, w):
        return layer.experts.forward(x, ids, w, torch.empty(x.shape, dtype=torch.float32))

    w0, ids0 = route_softmax(logits[0], k, True)
    lowest = w0.argsort(dim=-1, stable=True)[:, :d]
    deferred0 = torch.full_like(ids0, -1).scatter(1, lowest, ids0.gather(1, lowest))  # the d lowest-weighted slots
    w1, ids1 = route_softmax(logits[1], k, True)  # the last layer: its whole top-k now
    want = (part(layers[1], xs[1], ids1, w1) + part(layers[0], xs[0], deferred0, w0)).to(torch.bfloat16) + s
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert chain.pending is None


# ---------------------------------------------------------------- RouterSpec


def _logits(T=37, e=E, seed=0):
    return torch.randn(T, e, generator=generator("router-logits", T, e, seed))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_softmax_spec_is_route_softmax(k, norm):
    spec = RouterSpec("softmax", k, norm_topk_prob=norm)
    for dtype in (torch.float32, torch.bfloat16):
        logits = _logits(seed=k).to(dtype)
        w, ids = spec.route(logits)
        rw, rids = route_softmax(logits, k, norm)
        assert torch.equal(ids, rids) and torch.equal(w, rw) and w.dtype == torch.float32 and ids.dtype == torch.int64
    assert spec.host_routable


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_spec_is_route_deepseek_v2(method):
    spec = RouterSpec("deepseek_v2", 3, n_group=4, topk_group=2, routed_scaling_factor=1.5, topk_method=method)
    logits = _logits(seed=2)
    w, ids = spec.route(logits)
    rw, rids = route_deepseek_v2(logits, 3, method, 4, 2, 1.5)
    assert torch.equal(ids, rids) and torch.equal(w, rw)
    assert not spec.host_routable  # routed on the device only
    with pytest.raises(ValueError, match="unknown DeepSeek-V2 topk_method 'nope'"):
        RouterSpec("deepseek_v2", 3, topk_method="nope").route(logits)


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_grouped_spec_is_route_deepseek_v3(norm):
    bias = torch.randn(E, generator=generator("bias")) * 0.1
    spec = RouterSpec("sigmoid_grouped", 4, norm_topk_prob=norm, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    logits = _logits(seed=3)
    rw, rids = route_deepseek_v3(logits, bias, 4, 4, 2, norm, 2.5)
    for w, ids in (spec.with_bias(bias).route(logits), spec.route(logits, bias)):
        assert torch.equal(ids, rids) and torch.equal(w, rw)
    other = torch.randn(E, generator=generator("other bias"))
    ow, oids = spec.with_bias(bias).route(logits, other)  # the call's bias overrides the spec's
    want_w, want_ids = route_deepseek_v3(logits, other, 4, 4, 2, norm, 2.5)
    assert torch.equal(oids, want_ids) and torch.equal(ow, want_w) and not torch.equal(oids, rids)
    assert spec.host_routable and spec.correction_bias is None  # with_bias made a copy
    assert spec.with_bias(bias).key() == spec.key()
    with pytest.raises(ValueError, match="needs its correction_bias"):
        spec.route(logits)


def test_router_spec_validates_its_kind():
    with pytest.raises(ValueError, match="unknown router kind 'sigmoid'; expected one of softmax, deepseek_v2, "
                                         "sigmoid_grouped"):
        RouterSpec("sigmoid", 2)
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        RouterSpec("softmax", 0)
    keys = {RouterSpec(kind, 2).key() for kind in ("softmax", "deepseek_v2", "sigmoid_grouped")}
    assert len(keys) == 3


# ---------------------------------------------------------------- MoELayer's refusals


def test_layer_without_experts_refuses_to_run():
    layer = MoELayer(RouterSpec("softmax", 2), E)
    with pytest.raises(RuntimeError, match=r"no experts are attached to this MoE layer \(MoELayer.attach\)"):
        layer(torch.randn(2, H), _logits(2))
    assert layer.engine is None and layer.position == "only"
    with pytest.raises(ValueError, match="10 experts attached to a layer of 12"):
        layer.attach(TorchExperts(*_weights(1, e=10)))
    assert layer.experts is None


def test_gpu_experts_need_a_hybrid_placement(pool):
    gate, up, down = _weights(2)
    engine = CPUExperts(E, H, I, "bf16", pool=pool)
    engine.load(gate, up, down)
    gpu = GpuExperts([1, 4], gate[[1, 4]], up[[1, 4]], down[[1, 4]], E, torch.float32)
    for experts, staging in ((engine, None), (TorchExperts(gate, up, down), HostStaging(H, 2, torch.float32))):
        layer = MoELayer(RouterSpec("softmax", 2), E)
        layer.attach(experts, staging)
        with pytest.raises(TypeError, match=r"need the CPU engine behind a GPU model \(a hybrid placement\)"):
            layer.set_gpu_experts(gpu)
        assert layer.gpu is None and engine.skip_mask is None
    layer = MoELayer(RouterSpec("softmax", 2), E)
    layer.attach(engine, HostStaging(H, 2, torch.float32))
    other = GpuExperts([1], gate[:1], up[:1], down[:1], E + 1, torch.float32)
    with pytest.raises(ValueError, match="13 experts on the GPU side, 12 on the CPU side"):
        layer.set_gpu_experts(other)
    layer.set_gpu_experts(gpu)
    assert layer.gpu is gpu and engine.skip_mask.nonzero().flatten().tolist() == [1, 4]
    layer.set_gpu_experts(None)
    assert layer.gpu is None and engine.skip_mask is None


def test_deferral_refuses_d_of_k_or_more():
    x, logits = torch.randn(2, H), _logits(2)
    for position, index, n in (("first", 0, 3), ("middle", 1, 3), ("last", 2, 3)):
        chain = DeferralChain(n)
        layer = _torch_layer(k=2)
        layer.set_deferral(2, chain, index)
        assert layer.position == position
        with pytest.raises(ValueError, match=r"cannot defer 2 of the top-2 experts of each token \(at most 1\)"):
            layer.defers_now(2)
        if index == 0:
            with pytest.raises(ValueError, match="cannot defer 2 of the top-2"):
                layer(x, logits)
            assert chain.pending is None  # refused before any job
    only = _torch_layer(k=2)
    only.set_deferral(2, DeferralChain(1), 0)  # a chain of one layer defers nothing: no refusal
    assert only.position == "only" and only.defers_now(2) == 0
    assert torch.equal(only(x, logits), _torch_layer(k=2)(x, logits))
    chain = DeferralChain(3)
    assert [_set(_torch_layer(k=4), 2, chain, i).defers_now(4) for i in range(3)] == [2, 2, 0]  # the last: none


def _set(layer, d, chain, index):
    layer.set_deferral(d, chain, index)
    return layer


def test_deferral_and_drop_settings_are_checked():
    layer = _torch_layer()
    for bad in (-1, 1.5, "1"):
        with pytest.raises(ValueError, match="defer must be an integer >= 0"):
            layer.set_deferral(bad, DeferralChain(2), 0)
        with pytest.raises(ValueError, match="drop must be an integer >= 0"):
            layer.set_drop(bad)
    with pytest.raises(ValueError, match="deferring experts needs the model's DeferralChain"):
        layer.set_deferral(1)
    with pytest.raises(ValueError, match="layer index 2 is outside the chain's 2 MoE layers"):
        layer.set_deferral(1, DeferralChain(2), 2)
    assert (layer.defer, layer.chain, layer.drop) == (0, None, 0)  # nothing half set
    layer.set_deferral(0, DeferralChain(2), 1)
    assert layer.chain is None and layer.position == "only"  # d = 0 keeps no chain
    with pytest.raises(ValueError, match="cannot defer 1 experts: the model has no MoE blocks"):
        defer_experts(nn.Linear(2, 2), 1)
    assert defer_experts(nn.Linear(2, 2), 0) is None


# ---------------------------------------------------------------- StreamDecode: its own layers, one step at a time


@pytest.fixture
def engine_layers(pool):
    """Two MoE layers (softmax top-3, renormalised) over bf16 CPU engines on the module's pool."""
    layers = []
    for seed in range(2):
        engine = CPUExperts(E, H, I, "bf16", pool=pool)
        engine.load(*_weights(10 + seed))
        layer = MoELayer(RouterSpec("softmax", 3, norm_topk_prob=True), E)
        layer.attach(engine)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("on_host", [True, False])
def test_stream_decode_drives_only_its_own_layers(engine_layers, stream, on_host):
    mine, other = engine_layers
    T = 3
    gen = generator("stream-decode", on_host)
    x, logits = torch.randn(T, H, generator=gen), torch.randn(T, E, generator=gen)
    eager_mine, eager_other = mine(x, logits), other(x, logits)
    driver = StreamDecode(4, "cpu", [mine], fake_stream=stream)
    driver.route_on_host = on_host
    assert current() is None and not driver.drives(mine, x)  # outside a step: nothing is driven
    with driver.step(torch.tensor([T])):
        assert current() is driver
        assert driver.drives(mine, x) and not driver.drives(other, x)
        assert not driver.drives(mine, x.to("meta"))  # a call on another device type stays eager
        got_mine = mine(x, logits)
        got_other = other(x, logits)
    stream.synchronize()
    assert current() is None and not driver.active
    assert driver.buffers(mine) is not None and driver.buffers(other) is None
    assert (driver.buffers(mine).logits is not None) == on_host
    assert [job for _, job in driver.last_jobs] == [driver.buffers(mine).job]  # one CPU job, the driven layer's
    assert torch.equal(got_other, eager_other)  # the other layer ran its eager path, untouched
    err = rel_err(got_mine, eager_mine)
    assert err < 1e-6, err  # the same engine call, routed on the host or given the routing: measured 0
    driver.close()


def test_stream_decode_leaves_no_step_behind_after_an_exception(engine_layers, stream):
    mine, _ = engine_layers
    driver = StreamDecode(4, "cpu", [mine], fake_stream=stream)
    x, logits = torch.randn(3, H), _logits(3)
    with pytest.raises(KeyError, match="boom"):
        with driver.step(torch.tensor([3])):
            mine(x, logits)
            raise KeyError("boom")  # an exception of the model, mid-step
    assert current() is None and not driver.active
    with pytest.raises(ValueError, match="holds at most 4 tokens, got 5"):  # a refusal inside a layer's stream run
        with driver.step(torch.tensor([5])):
            mine(torch.randn(5, H), _logits(5))
    assert current() is None and not driver.active
    # a step that ends with a deferred part pending refuses at its end, and is over all the same
    chain = DeferralChain(2)
    mine.set_deferral(1, chain, 0)
    with pytest.raises(RuntimeError, match="the last MoE layer of the step deferred experts"):
        with driver.step(torch.tensor([3])):
            mine(x, logits)
    assert current() is None and not driver.active and driver._pending is None
    stream.synchronize()
    mine.engine.pool.sync(0)
    mine.set_deferral(0)
    with driver.step(torch.tensor([3])):  # and the next step runs: nothing was left "already running"
        out = mine(x, logits)
    stream.synchronize()
    assert torch.isfinite(out).all() and rel_err(out, mine(x, logits)) < 1e-6
    driver.close()


def test_nested_steps_restore_the_outer_driver(engine_layers, stream):
    """The active step is a context, not state written into layers: an inner driver's step ends with the outer one
    current again, and each drives only its own layers."""
    a, b = engine_layers
    outer, inner = StreamDecode(4, "cpu", [a], fake_stream=stream), StreamDecode(4, "cpu", [b], fake_stream=stream)
    x = torch.randn(2, H)
    with outer.step(torch.tensor([2])):
        with inner.step(torch.tensor([2])):
            assert current() is inner and not inner.drives(a, x) and inner.drives(b, x)
        assert current() is outer and outer.drives(a, x) and not outer.drives(b, x)
    assert current() is None
    with pytest.raises(RuntimeError, match="a hybrid decode step is already running"):
        with outer.step(torch.tensor([1])):
            with outer.step(torch.tensor([1])):
                pass
    assert current() is None and not outer.active
    outer.close()
    inner.close()
