"""The routed decode path of GPU-resident experts (hetmoe/ops/triton/experts.py, ``GpuExperts(decode="routed")``):
Triton kernels that read only the weights of the resident experts the tokens routed to.

References: the torch dense path (``decode="dense"``, every resident expert over every token) and the naive float64
layer (tests/reference.py ``moe_reference``, the non-resident and skipped experts masked out).
Paths: Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py; skipped without the triton
package), with the interpreter's wide tiles and with the tiles the GPU takes (``plan(T, on_gpu=True)``); the GPU
(marked gpu): bf16 weights, eager and captured in a CUDA graph.

Measured, ||out - ref|| / ||ref|| (fp32 weights, interpreter): routed vs dense <= 3.5e-7, vs float64 <= 2.5e-7
(bound 1e-5). bf16 weights, interpreter (fp32 products of the bf16 values): vs dense <= 5.3e-3 -- the dense path
rounds its gate/up outputs, the hidden activations and its output to bf16, the routed path keeps them in fp32
(bound 1.5e-2; on the GPU the routed dots round the hidden activations to bf16 too).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interp import triton_module

from cases import generator, make_routing
from hetmoe.moe.gpu_resident.experts import GpuExperts
from reference import moe_reference, rel_err

HAS_CUDA = torch.cuda.is_available()
E, H, I = 10, 48, 40  # E not a power of two; H, I not multiples of the kernels' blocks
RESIDENT = [9, 1, 4, 5]  # any order: resident index = position
FP32_BOUND = 1e-5  # summation order only (measured <= 3e-7)
BF16_VS_DENSE = 1.5e-2  # the dense path's bf16 roundings (measured <= 5.3e-3 in the interpreter)


@pytest.fixture(scope="module")
def kernels():
    return triton_module("hetmoe.ops.triton.experts", on_cpu=True)


def _weights(*params):
    gen = generator("routed experts", *params)
    return tuple(torch.randn(*shape, generator=gen) * 0.3 for shape in ((E, I, H), (E, I, H), (E, H, I)))


def _experts(w, resident, dtype=torch.float32, device="cpu", decode="routed"):
    gate, up, down = w
    return GpuExperts(resident, gate[resident], up[resident], down[resident], E, dtype, device, decode=decode)


def _reference(w, x, ids, wts, resident, skip=None):
    """float64 layer over the resident experts only (minus ``skip``)."""
    mask = torch.ones(E, dtype=torch.bool)
    mask[resident] = False
    if skip is not None:
        mask |= skip.cpu()
    return moe_reference(x.cpu().float(), *w, ids.cpu(), wts.cpu(), skip_mask=mask)


def _case(T, k, *params):
    x = torch.randn(T, H, generator=generator("routed x", T, k, *params))
    ids, wts = make_routing(T, k, E, "routed", *params)
    if not any(e in RESIDENT for e in ids[0].tolist()):
        ids[0, 0] = RESIDENT[-1]  # token 0 routes to a resident expert: the output is never all zero
    return x, ids, wts


CASES = [(T, k) for T in (1, 3, 7, 32) for k in (1, 2, 8)]


@pytest.mark.parametrize("T,k", [pytest.param(*c, marks=pytest.mark.slow) if c == (32, 8) else c for c in CASES])
def test_routed_matches_dense_and_reference(kernels, T, k):
    w = _weights(T, k)
    x, ids, wts = _case(T, k)
    out = _experts(w, RESIDENT)(x, ids, wts)
    dense = _experts(w, RESIDENT, decode="dense")(x, ids, wts)
    ref = _reference(w, x, ids, wts, RESIDENT)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert ref.abs().max() > 0
    assert rel_err(out, dense) < FP32_BOUND, rel_err(out, dense)
    assert rel_err(out, ref) < FP32_BOUND, rel_err(out, ref)


@pytest.mark.parametrize("T,k,defer", [(1, 8, False), (1, 8, True), (2, 2, False), (5, 3, False)])
def test_gpu_tiles_in_the_interpreter(kernels, T, k, defer):
    """The tiles plan() gives a GPU (narrow row blocks, several programs per expert and K steps) in the interpreter:
    the GEMV form at T <= 4 (also with the reduction deferred after the K loop), the dot form above."""
    w = _weights("tiles", T, k)
    x, ids, wts = _case(T, k, "tiles")
    g = _experts(w, RESIDENT)
    launch = dataclasses.replace(kernels.plan(T, on_gpu=True), defer=defer)
    assert launch.gemv == (T <= kernels.GEMV_ROWS)
    out = kernels.routed(x, ids, wts, g.w_gate_up, g.w_down, g.slot_of, None, E, I, launch=launch)
    ref = _reference(w, x, ids, wts, RESIDENT)
    assert rel_err(out, ref) < FP32_BOUND, rel_err(out, ref)


def test_no_resident_hit_gives_zeros(kernels):
    w = _weights("none")
    x = torch.randn(3, H, generator=generator("none x"))
    ids = torch.tensor([[0, 2], [3, -1], [-1, -1]])  # none of RESIDENT, and empty slots
    wts = torch.rand(3, 2, generator=generator("none w")) + 0.1
    g = _experts(w, RESIDENT)
    assert torch.equal(g(x, ids, wts), torch.zeros(3, H))
    out = torch.full((3, H), 2.5)
    g(x, ids, wts, out, accumulate=True)  # accumulate: nothing added
    assert torch.equal(out, torch.full((3, H), 2.5))


@pytest.mark.parametrize("T", [1, 5])
def test_every_slot_a_hit(kernels, T):
    """All experts resident, no empty slot: every pair computed; tokens sharing experts are computed by each
    expert's first token (its leader)."""
    w = _weights("all", T)
    x = torch.randn(T, H, generator=generator("all x", T))
    ids = torch.stack([torch.randperm(E, generator=generator("all ids", T, t))[:8] for t in range(T)])
    wts = torch.rand(T, 8, generator=generator("all w", T)) + 0.05
    everything = list(range(E))[::-1]
    out = _experts(w, everything)(x, ids, wts)
    ref = moe_reference(x, *w, ids, wts)
    assert rel_err(out, ref) < FP32_BOUND, rel_err(out, ref)


@pytest.mark.parametrize("T", [3, 7])
def test_same_expert_many_tokens(kernels, T):
    """One leader computes every token routed to its expert: identical tokens with identical routing get the same
    rows (bitwise in the GEMV form, T <= 4, where each row is its own dot product), and two calls the same bits."""
    w = _weights("dup")
    x = torch.randn(1, H, generator=generator("dup x")).repeat(T, 1)
    ids = torch.tensor([[9, 4, -1]]).repeat(T, 1)
    wts = torch.tensor([[0.5, 0.25, 0.25]]).repeat(T, 1)
    g = _experts(w, RESIDENT)
    out = g(x, ids, wts)
    assert torch.equal(out, g(x, ids, wts))
    if T <= kernels.GEMV_ROWS:
        assert torch.equal(out, out[:1].expand(T, H))
    assert rel_err(out, _reference(w, x, ids, wts, RESIDENT)) < FP32_BOUND


@pytest.mark.parametrize("T", [1, 5])
def test_skip_mask_and_zero_weights(kernels, T):
    w = _weights("skip", T)
    x, ids, wts = _case(T, 4, "skip")
    j = [e in RESIDENT for e in ids[0].tolist()].index(True)  # token 0's first resident slot
    skip = torch.zeros(E, dtype=torch.bool)
    skip[[int(ids[0, j]), 7]] = True  # a resident expert routed to, and another
    g = _experts(w, RESIDENT)
    out = g(x, ids, wts, skip_mask=skip)
    ref = _reference(w, x, ids, wts, RESIDENT, skip)
    if not ref.abs().max():  # T = 1: the skip removed the token's only resident expert
        assert torch.equal(out, ref)
    else:
        assert rel_err(out, _experts(w, RESIDENT, decode="dense")(x, ids, wts, skip_mask=skip)) < FP32_BOUND
        assert rel_err(out, ref) < FP32_BOUND
    # a resident slot of weight 0 is skipped like an empty one: the same bits
    zero = wts.clone()
    zero[0, j] = 0.0
    cut = ids.clone()
    cut[0, j] = -1
    assert torch.equal(g(x, ids, zero), g(x, cut, wts))


def test_int32_ids_bf16_routing_weights_strided_x(kernels):
    """What routers hand over: int32 or int64 ids, fp32 or bf16 weights; x a row-strided view."""
    w = _weights("dtypes")
    x, ids, wts = _case(3, 2, "dtypes")
    wide = torch.zeros(3, 2 * H)
    wide[:, :H] = x
    g = _experts(w, RESIDENT)
    out = g(wide[:, :H], ids.int(), wts.bfloat16())
    ref = _reference(w, x, ids, wts.bfloat16().float(), RESIDENT)
    assert rel_err(out, ref) < FP32_BOUND, rel_err(out, ref)


def test_bf16_weights_against_dense(kernels):
    w = _weights("bf16")
    x, ids, wts = _case(3, 8, "bf16")
    out = _experts(w, RESIDENT, torch.bfloat16)(x.bfloat16(), ids, wts)
    dense = _experts(w, RESIDENT, torch.bfloat16, decode="dense")(x.bfloat16(), ids, wts)
    assert out.dtype == torch.float32
    assert rel_err(out, dense) < BF16_VS_DENSE, rel_err(out, dense)


def test_paths_chosen_and_bad_input(kernels):
    w = _weights("choice")
    assert _experts(w, RESIDENT, decode="auto").decode == ("routed" if HAS_CUDA else "dense")
    with pytest.raises(ValueError, match="decode must be one of"):
        _experts(w, RESIDENT, decode="sparse")
    g = _experts(w, RESIDENT)
    x, ids, wts = _case(3, 2, "choice")
    with pytest.raises(ValueError, match="skip_mask must be"):
        g(x, ids, wts, skip_mask=torch.zeros(E + 1, dtype=torch.bool))
    big = kernels.MAX_ROWS + 1
    with pytest.raises(ValueError, match="at most"):
        kernels.routed(torch.zeros(big, H), torch.zeros(big, 2, dtype=torch.long), torch.ones(big, 2), g.w_gate_up,
                       g.w_down, g.slot_of, None, E, I)
    # the bytes a call reads: each distinct resident expert routed to, once
    ids = torch.tensor([[9, 1], [9, 0], [-1, 3]])
    assert kernels.weight_bytes_read(ids, g.slot_of, H, I, 2) == 2 * 3 * H * I * 2


# ---------------------------------------------------------------- GPU (bf16, eager and graph)


@pytest.mark.gpu
@pytest.mark.parametrize("T,k", [(1, 8), (3, 2), (7, 8), (32, 8)])
def test_cuda_routed_matches_dense_and_reference(T, k):
    pytest.importorskip("triton")
    w = _weights("cuda", T, k)
    x, ids, wts = (t.cuda() for t in _case(T, k, "cuda"))
    xb = x.bfloat16()
    g = _experts(w, RESIDENT, torch.bfloat16, "cuda", decode="routed")  # eager: auto takes it in graphs only
    assert g.decode == "routed"
    out = g(xb, ids, wts)
    dense = _experts(w, RESIDENT, torch.bfloat16, "cuda", decode="dense")(xb, ids, wts)
    bw = tuple(t.bfloat16().float() for t in w)  # the bf16 weights, exactly
    ref = _reference(bw, xb.float(), ids, wts, RESIDENT)
    print(f"T={T} k={k}: routed vs dense {rel_err(out, dense):.2e}, vs float64 {rel_err(out.cpu(), ref):.2e}")
    # GEMV (T <= 4): fp32 products of the bf16 values; dots: h rounded to bf16 for the tensor cores, like dense
    assert rel_err(out, dense) < BF16_VS_DENSE
    assert rel_err(out.cpu(), ref) < BF16_VS_DENSE
    fp32 = _experts(w, RESIDENT, torch.float32, "cuda")(x, ids, wts)  # IEEE fp32 dots
    assert rel_err(fp32.cpu(), _reference(w, x, ids, wts, RESIDENT)) < FP32_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 8, 32])
def test_cuda_graph_replay_equals_eager(T):
    pytest.importorskip("triton")
    w = _weights("graph", T)
    g = _experts(w, RESIDENT, torch.bfloat16, "cuda")
    x, ids, wts = _case(T, 8, "graph", 0)
    x, ids, wts = x.cuda().bfloat16(), ids.cuda(), wts.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g(x, ids, wts)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g(x, ids, wts)
    for seed in range(1, 4):  # new inputs and routing each replay
        nx, nids, nwts = _case(T, 8, "graph", seed)
        x.copy_(nx.bfloat16())
        ids.copy_(nids)
        wts.copy_(nwts)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, g(x, ids, wts)), seed  # the same kernels and launches: the same bits
