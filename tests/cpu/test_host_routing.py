"""The CPU job's own router (``CPUExperts.prepare(route=HostRoute(logits, router))``, used by hybrid decode steps so the
GPU runs no top-k) against ``route_softmax`` and ``route_deepseek_v3``, and the job's ``addend`` (the previous layer's
deferred output added on the CPU).

Engine paths (tests/paths.py): each comparison is between two runs of one engine (the job routing vs the same
experts given the ids), so it holds on every path; the tests that compute experts run on each path this machine
runs (``engine_path``), the AMX logic through amx-emulated on any CPU."""

import pytest
import torch

from hetmoe.cpu import CPUExperts, HostRoute, Slots
from hetmoe.moe.router import RouterSpec, route_deepseek_v3, route_softmax

H, I = 64, 32


def make_experts(E: int, numa=None, seed: int = 0, path=None) -> CPUExperts:
    """bf16 experts on ``path`` (a tests/paths.EnginePath; None: the default isa="auto")."""
    gen = torch.Generator().manual_seed(seed)
    kw = {**(path.options if path else {}), **({"numa": numa} if numa else {})}
    ex = CPUExperts(E, H, I, "bf16", threads=2, **kw)
    ex.load(*(0.1 * torch.randn(E, *s, generator=gen) for s in ((I, H), (I, H), (H, I))))
    return ex


def run(ex, x, ids, w, out, **kw):
    ex.submit(ex.prepare(x, ids, w, out, **kw))
    ex.sync()
    return out


def split_deferred(ids: torch.Tensor, w: torch.Tensor, d: int) -> tuple:
    """Reference of the deferral split: (immediate ids, deferred ids), the other part's slots -1; the d lowest weights
    by a stable ascending sort are deferred (among equal weights the earlier slot is the lower)."""
    lowest = w.argsort(dim=-1, stable=True)[:, :d]
    deferred = torch.zeros(ids.shape, dtype=torch.bool).scatter_(1, lowest, True)
    return ids.masked_fill(deferred, -1), ids.masked_fill(~deferred, -1)


@pytest.mark.parametrize("E,k", [(16, 4), (128, 8)])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_job_routes_like_route_softmax(E, k, logits_dtype, norm, ids_dtype, engine_path):
    gen = torch.Generator().manual_seed(E + k)
    T = 9
    ex = make_experts(E, path=engine_path)
    x = torch.randn(T, H, generator=gen)
    logits = (3 * torch.randn(T, E, generator=gen)).to(logits_dtype)
    ids = torch.full((T, k), -7, dtype=ids_dtype)
    w = torch.full((T, k), -1.0)
    out = run(ex, x, ids, w, torch.empty(T, H), route=HostRoute(logits, RouterSpec("softmax", k, norm)))
    w_ref, ids_ref = route_softmax(logits, k, norm)
    lf = logits.float()
    chosen = lf.gather(1, ids.long())
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()  # descending by logit
    rest = lf.scatter(1, ids.long(), float("-inf"))
    assert (chosen[:, -1] >= rest.max(-1).values).all()  # no expert left out scores higher
    ties = (chosen[:, -1] == rest.max(-1).values).any()
    if logits_dtype == torch.float32:  # no ties in random fp32 logits: the very same experts as torch.topk
        assert not ties and torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-8)  # equal logits have equal weights
    if norm:
        assert (w.sum(-1) - 1).abs().max() < 1e-6
    else:
        assert (w.sum(-1) < 1).all()
    ref = ex(x, ids.long(), w_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numa", [None, "2"])
@pytest.mark.parametrize("E,k,n_group,topk_group", [(16, 4, 4, 2), (64, 8, 8, 4), (32, 6, 1, 1), (16, 2, 8, 3)])
@pytest.mark.parametrize("norm", [True, False])
def test_job_routes_like_route_deepseek_v3(E, k, n_group, topk_group, norm, numa, engine_path):
    """DeepSeek-V3's sigmoid scores, correction bias and group-limited choice, routed by the job."""
    gen = torch.Generator().manual_seed(E + k + n_group)
    T = 11
    ex = make_experts(E, numa=numa, path=engine_path)
    x = torch.randn(T, H, generator=gen)
    logits = 2 * torch.randn(T, E, generator=gen)
    bias = 0.1 * torch.randn(E, generator=gen)  # large enough to change choices (the test below checks it does)
    router = RouterSpec("sigmoid_grouped", k, norm, n_group, topk_group, 2.5, correction_bias=bias)
    ids, w = torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k)
    out = run(ex, x, ids, w, torch.empty(T, H), route=HostRoute(logits, router))
    w_ref, ids_ref = route_deepseek_v3(logits, bias, k, n_group, topk_group, norm, 2.5)
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)  # torch.topk may return the chosen set in any order
    assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out, ex(x, ids_ref, w_ref), rtol=1e-5, atol=1e-6)
    no_bias = RouterSpec("sigmoid_grouped", k, norm, n_group, topk_group, 2.5)
    ids0 = torch.zeros(T, k, dtype=torch.int64)
    run(ex, x, ids0, torch.zeros(T, k), torch.empty(T, H), route=HostRoute(logits, no_bias))
    assert torch.equal(ids0.sort(-1).values, route_deepseek_v3(logits, torch.zeros(E), k, n_group, topk_group, norm,
                                                              2.5)[1].sort(-1).values)
    if n_group > 1:
        assert not torch.equal(ids0.sort(-1).values, ids.sort(-1).values)  # the bias changed some choice


@pytest.mark.parametrize("numa", [None, "2"])
def test_job_routing_ties_and_non_finite_rows(numa, engine_path):
    E, k = 8, 3
    ex = make_experts(E, numa=numa, path=engine_path)
    logits = torch.tensor([
        [0.0, 1.0, 1.0, 0.5, 1.0, -2.0, 0.0, 0.0],  # a three-way tie at the top: the lower ids first
        [0.0] * 8,  # all equal: ids 0, 1, 2
        [0.0, float("nan"), 0, 0, 0, 0, 0, 0],  # NaN: weights NaN (the output must not be silently finite)
        [float("inf"), 0, 0, 0, 0, 0, 0, 0],
        [-1.0, 2.0, -3.0, 4.0, 0.0, 0.0, 5.0, -9.0],
    ])
    T = logits.shape[0]
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    ids, w = torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k)
    out = run(ex, x, ids, w, torch.empty(T, H), route=HostRoute(logits, RouterSpec("softmax", k, True)))
    assert ids[0].tolist() == [1, 2, 4] and ids[1].tolist() == [0, 1, 2] and ids[4].tolist() == [6, 3, 1]
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3))
    assert torch.isnan(w[2]).all() and torch.isnan(w[3]).all()
    assert torch.isnan(out[2]).all() and torch.isnan(out[3]).all()
    assert torch.isfinite(out[[0, 1, 4]]).all()


def test_deferral_parts_route_from_logits(engine_path):
    """An immediate and a deferred job routing from the same logits split each token like split_deferred."""
    E, k, d, T = 16, 4, 2, 7
    gen = torch.Generator().manual_seed(3)
    ex = make_experts(E, path=engine_path)
    x, logits = torch.randn(T, H, generator=gen), torch.randn(T, E, generator=gen)
    parts = []
    for deferred in (False, True):
        ids, w = torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k)
        slots = Slots.deferred(d) if deferred else Slots.immediate(d)
        parts.append(run(ex, x, ids, w, torch.empty(T, H), route=HostRoute(logits, RouterSpec("softmax", k, True)),
                         slots=slots))
    w_ref, ids_ref = route_softmax(logits, k, True)
    imm_ids, def_ids = split_deferred(ids_ref, w_ref, d)
    torch.testing.assert_close(parts[0], ex(x, imm_ids, w_ref), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts[1], ex(x, def_ids, w_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numa", [None, "2"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_addend_is_added_after_the_experts(numa, out_dtype, engine_path):
    E, k, T = 16, 4, 5
    gen = torch.Generator().manual_seed(4)
    ex = make_experts(E, numa=numa, path=engine_path)
    x = torch.randn(T, H, generator=gen)
    w, ids = route_softmax(torch.randn(T, E, generator=gen), k, True)
    ids[1, 2] = -1  # a skipped slot
    addend = torch.randn(T, H, generator=gen)
    plain = run(ex, x, ids, w, torch.empty(T, H))
    got = run(ex, x, ids, w, torch.empty(T, H, dtype=out_dtype), addend=addend)
    assert torch.equal(got, (plain + addend).to(out_dtype))  # fp32 sum, then one rounding: bitwise
    none = torch.full_like(ids, -1)  # no expert at all: out = addend
    assert torch.equal(run(ex, x, none, w, torch.empty(T, H), addend=addend), addend)


def test_bad_routing_arguments_are_refused():
    E, k, T = 16, 4, 3
    ex = make_experts(E)
    x, ids, w, out = torch.zeros(T, H), torch.zeros(T, k, dtype=torch.int64), torch.zeros(T, k), torch.zeros(T, H)

    def route(logits=None, kind="softmax", top_k=k, **kw):
        return HostRoute(torch.zeros(T, E) if logits is None else logits, RouterSpec(kind, top_k, **kw))

    with pytest.raises(ValueError, match=r"logits has shape \(3, 8\); expected \[T=3, num_experts=16\]"):
        ex.prepare(x, ids, w, out, route=route(torch.zeros(T, 8)))
    with pytest.raises(ValueError, match="logits has dtype float16"):
        ex.prepare(x, ids, w, out, route=route(torch.zeros(T, E, dtype=torch.float16)))
    with pytest.raises(ValueError, match="logits must be contiguous"):
        ex.prepare(x, ids, w, out, route=route(torch.zeros(E, T).t()))
    with pytest.raises(TypeError, match="route must be a HostRoute"):
        ex.prepare(x, ids, w, out, route=RouterSpec("softmax", k))
    with pytest.raises(ValueError, match="needs a router"):
        ex.prepare(x, ids, w, out, route=HostRoute(torch.zeros(T, E), None))
    with pytest.raises(ValueError, match="router kind 'deepseek_v2' is not host routable"):
        ex.prepare(x, ids, w, out, route=route(kind="deepseek_v2"))
    with pytest.raises(ValueError, match="top_k 3 differs from topk_ids' 4"):
        ex.prepare(x, ids, w, out, route=route(top_k=3))
    with pytest.raises(ValueError, match="n_group 3 does not divide the 16 experts"):
        ex.prepare(x, ids, w, out, route=route(kind="sigmoid_grouped", n_group=3))
    with pytest.raises(ValueError, match="topk_group must be in"):
        ex.prepare(x, ids, w, out, route=route(kind="sigmoid_grouped", norm_topk_prob=True, n_group=4, topk_group=5))
    with pytest.raises(ValueError, match="hold fewer than top-k"):
        ex.prepare(x, ids, w, out, route=route(kind="sigmoid_grouped", norm_topk_prob=True, n_group=8, topk_group=1))
    with pytest.raises(ValueError, match="correction_bias has 8 entries"):
        ex.prepare(x, ids, w, out, route=route(kind="sigmoid_grouped", correction_bias=torch.zeros(8)))
    with pytest.raises(ValueError, match="correction_bias has dtype bfloat16"):
        ex.prepare(x, ids, w, out, route=route(kind="sigmoid_grouped", correction_bias=torch.zeros(E).bfloat16()))
    with pytest.raises(ValueError, match="cannot route to the top 20 of 16"):
        ex.prepare(x, torch.zeros(T, 20, dtype=torch.int64), torch.zeros(T, 20), out, route=route(top_k=20))
    with pytest.raises(ValueError, match=r"addend has shape \(3, 32\)"):
        ex.prepare(x, ids, w, out, addend=torch.zeros(T, 32))
    with pytest.raises(ValueError, match="addend has dtype bfloat16"):
        ex.prepare(x, ids, w, out, addend=torch.zeros(T, H, dtype=torch.bfloat16))
