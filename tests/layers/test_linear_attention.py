"""The gated delta rule (hetmoe/layers/linear_attention.py) against a naive per-token fp64 reference written from the
recurrence S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t (S as Dv x Dk, explicit matrices);
the Gated DeltaNet layer's states in the cache (chunked prefill, batches of right-padded rows, decode, new sequences
in used slots); the kernel choice; flash-linear-attention's kernels against the torch form (GPU, marked).

Paths: the torch chunked and recurrent forms on the CPU, fp32. Tolerances (relative error ||out - ref|| / ||ref||):
fp32 against the fp64 reference measured <= 7.1e-7 (outputs and states, lengths up to 300, decays down to 0.37 per
token; bound 1e-5); chunked against recurrent <= 7.1e-7, one call against the same tokens over several calls
<= 5.6e-7 (bound 1e-5: the same math in another fp32 order). bf16 q/k/v: the forms compute in fp32 from the same
bf16 values, measured <= 3.5e-7 against the reference on those values (bound 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import KVCache, RecurrentStates
from hetmoe.layers.linear_attention import (
    CHUNK,
    TORCH,
    GatedDeltaNet,
    channel_decayed_products,
    chunk_delta_rule,
    delta_rule_kernels,
    depthwise_conv,
    recurrent_delta_rule,
    unit_lower_inverse,
    use_kernels,
)
from reference import rel_err

TOL = 1e-5


def naive(q, k, v, g, beta, state) -> tuple:
    """fp64, token by token: q/k L2-normalised (eps 1e-6 inside the root), q scaled by Dk^-1/2, value head h reading
    key head h // (Hv / Hk); S [Dv, Dk] per head, S <- g S (I - b k k^T) + b v k^T, o = S q. ``state`` is M = S^T
    [B, Hv, Dk, Dv] (the layout of the forms under test)."""
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    r = Hv // Hk
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / Dk**0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = state.double().transpose(-1, -2).clone()  # [B, Hv, Dv, Dk]
    out = torch.zeros(B, T, Hv, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(Dk, dtype=torch.float64)
    for b in range(B):
        for h in range(Hv):
            for t in range(T):
                kt, qt, vt = k[b, t, h // r], q[b, t, h // r], v[b, t, h]
                bt, gt = beta[b, t, h], torch.exp(g[b, t, h])
                S[b, h] = gt * S[b, h] @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
                out[b, t, h] = S[b, h] @ qt
    return out, S.transpose(-1, -2)


def inputs(B, T, Hk, Hv, Dk, Dv, seed, dtype=torch.float32, state_scale=0.3) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=gen).to(dtype)
    k = torch.randn(B, T, Hk, Dk, generator=gen).to(dtype)
    v = torch.randn(B, T, Hv, Dv, generator=gen).to(dtype)
    g = -torch.rand(B, T, Hv, generator=gen)  # decays exp(g) in (0.37, 1]
    beta = torch.rand(B, T, Hv, generator=gen).to(dtype)
    state = torch.randn(B, Hv, Dk, Dv, generator=gen) * state_scale
    return q, k, v, g, beta, state


SHAPES = [  # (B, T, Hk, Hv, Dk, Dv): odd lengths, one chunk exactly, across chunk boundaries, grouped value heads
    (1, 1, 1, 1, 8, 8), (2, 3, 1, 2, 8, 6), (1, 7, 2, 2, 16, 16), (2, CHUNK - 1, 2, 4, 8, 12),
    (1, CHUNK, 1, 3, 8, 8), (1, CHUNK + 1, 2, 2, 8, 8), (2, 130, 1, 2, 16, 8), (1, 300, 2, 4, 8, 8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_Hk{}_Hv{}_Dk{}_Dv{}".format(*s))
def test_chunked_and_recurrent_equal_the_naive_rule(shape):
    q, k, v, g, beta, state = inputs(*shape, seed=sum(shape))
    ref_o, ref_s = naive(q, k, v, g, beta, state)
    for name, form in (("chunked", chunk_delta_rule), ("recurrent", recurrent_delta_rule)):
        o, s = form(q, k, v, g, beta, state)
        assert o.dtype == s.dtype == torch.float32 and o.shape == ref_o.shape and s.shape == state.shape
        errs = rel_err(o, ref_o), rel_err(s, ref_s)
        print(f"{shape} {name}: out {errs[0]:.1e}, state {errs[1]:.1e}")
        assert max(errs) < TOL, (name, errs)
    o_c, s_c = chunk_delta_rule(q, k, v, g, beta, state)
    o_r, s_r = recurrent_delta_rule(q, k, v, g, beta, state)
    assert rel_err(o_c, o_r) < TOL and rel_err(s_c, s_r) < TOL


def test_input_state_is_not_written():
    q, k, v, g, beta, state = inputs(1, 9, 1, 1, 8, 8, seed=3)
    before = state.clone()
    chunk_delta_rule(q, k, v, g, beta, state)
    recurrent_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(state, before)


@pytest.mark.parametrize("cuts", [(1,), (CHUNK,), (5, 70), (CHUNK - 1, CHUNK + 1, 2 * CHUNK), (1, 2, 3)])
def test_state_carried_across_calls(cuts):
    """The tokens split over several calls (each starting from the state the previous returned) give the outputs and
    final state of one call: chunk boundaries inside and between calls, single-token calls (the recurrent form)."""
    T = 150
    q, k, v, g, beta, state = inputs(2, T, 2, 4, 8, 8, seed=len(cuts))
    whole_o, whole_s = chunk_delta_rule(q, k, v, g, beta, state)
    outs, s, start = [], state, 0
    for end in (*cuts, T):
        part = slice(start, end)
        o, s = TORCH(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], s)
        outs.append(o)
        start = end
    assert rel_err(torch.cat(outs, dim=1), whole_o) < TOL and rel_err(s, whole_s) < TOL


def test_padding_tokens_leave_the_state():
    """Tokens with b = 0 and log g = 0 change nothing: the masking of right-padded rows."""
    q, k, v, g, beta, state = inputs(1, 20, 1, 2, 8, 8, seed=9)
    _, s12 = chunk_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12], state)
    g, beta = g.clone(), beta.clone()
    g[:, 12:], beta[:, 12:] = 0, 0
    _, s20 = chunk_delta_rule(q, k, v, g, beta, state)
    assert rel_err(s20, s12) < TOL


def test_bf16_inputs_are_computed_in_fp32():
    q, k, v, g, beta, state = inputs(2, 70, 2, 2, 16, 16, seed=4, dtype=torch.bfloat16)
    ref_o, ref_s = naive(q, k, v, g, beta, state)
    for form in (chunk_delta_rule, recurrent_delta_rule):
        o, s = form(q, k, v, g, beta, state)
        assert o.dtype == torch.float32 and rel_err(o, ref_o) < TOL and rel_err(s, ref_s) < TOL


# ---------------------------------------------------------------- the layer and its states in the cache


class _Layer(GatedDeltaNet):
    """The layer with plain projections (the models' subclasses lay theirs out otherwise)."""

    def __init__(self, hidden=32, Hk=2, Hv=4, Dk=8, Dv=8, width=4, state_index=1):
        super().__init__(hidden, Hk, Hv, Dk, Dv, width, 1e-6, state_index)
        self.proj = torch.nn.Linear(hidden, self.conv_dim + self.value_dim + 2 * Hv, bias=False)

    def project(self, x):
        B, S, _ = x.shape
        mixed, z, b, a = self.proj(x).split((self.conv_dim, self.value_dim, self.n_v, self.n_v), dim=-1)
        return mixed, z.reshape(B, S, self.n_v, self.v_dim), b, a


def _layer(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = _Layer()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return layer.to(dtype).eval()


def _cache(layer, rows, dtype=torch.float32):
    states = RecurrentStates(3, rows, layer.conv_dim, layer.conv1d.kernel_size[0] - 1, layer.n_v, layer.k_dim,
                             layer.v_dim, dtype)
    return KVCache(0, rows, 512, 1, 8, dtype, states=states)


def _run(layer, cache, x, start, slots, lengths=None):
    B, S, _ = x.shape
    step = Step(torch.arange(start, start + S).expand(B, S), torch.as_tensor(slots), lengths=lengths)
    return layer(x, step, cache)


@pytest.mark.parametrize("C", [1, 16, 37, 64])
def test_unit_lower_inverse(C):
    """(I + strictly lower A)^-1 against float64 inversion, for sizes that are and are not whole 16-row blocks; the
    diagonal and upper triangle of A (filled with noise here) are not read."""
    g = torch.Generator().manual_seed(C)
    A = torch.randn(3, 2, C, C, generator=g) * 0.3
    want = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.double().tril(-1))
    got = unit_lower_inverse(A)
    assert got.dtype == torch.float32 and got.shape == A.shape
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(got, unit_lower_inverse(A.tril(-1) + torch.randn(C, C, generator=g).triu()))


@pytest.mark.parametrize("C", [16, 20, 64])
@pytest.mark.parametrize("decay", [1.0, 30.0])
def test_channel_decayed_products(C, decay):
    """KDA's intra-chunk products sum_c a[t, c] b[s, c] exp(G[t, c] - G[s, c]) (s <= t, else 0) against float64
    pairwise exponents, in chunks of whole 16-row blocks and not (20), with decays that underflow fp32's exp
    across a chunk (log decay up to -30 a token): the block factorisation neither overflows nor loses them."""
    g = torch.Generator().manual_seed(C)
    G = (-decay * torch.rand(2, 3, C, 8, generator=g)).cumsum(2)
    a, a2, b = (torch.randn(2, 3, C, 8, generator=g) for _ in range(3))
    diff = (G.double().unsqueeze(3) - G.double().unsqueeze(2)).masked_fill(~torch.ones(C, C).tril().bool()[:, :, None],
                                                                          float("-inf"))
    for got, x in zip(channel_decayed_products(G, b, a, a2), (a, a2)):
        want = torch.einsum("bhtc,bhsc,bhtsc->bhts", x.double(), b.double(), diff.exp())
        assert got.dtype == torch.float32 and got.shape == (2, 3, C, C)
        assert torch.isfinite(got).all() and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got.triu(1) == 0).all()


@pytest.mark.parametrize("S", [1, 5, 67])
def test_depthwise_conv_equals_torch_conv1d(S):
    """The short convolution's tap loop against F.conv1d(groups=C): bitwise in bf16 (both sum in fp32 and round
    once), within fp32 rounding in fp32 (another summation order); two rows, 96 channels, 4 taps."""
    g = torch.Generator().manual_seed(S)
    seq, weight = torch.randn(2, 96, 3 + S, generator=g), torch.randn(96, 1, 4, generator=g)
    want = torch.nn.functional.conv1d(seq, weight, groups=96)
    got = depthwise_conv(seq, weight)
    assert got.shape == want.shape == (2, 96, S)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    bf_seq, bf_w = seq.bfloat16(), weight.bfloat16()
    assert torch.equal(depthwise_conv(bf_seq, bf_w), torch.nn.functional.conv1d(bf_seq, bf_w, groups=96))


@torch.inference_mode()
def test_layer_chunked_prefill_and_decode_equal_one_call():
    """A prompt in one call; the same prompt in chunks (the convolution's and the recurrence's states carried); the
    same token by token: equal outputs and equal states in the cache."""
    layer = _layer()
    x = torch.randn(1, 90, 32, generator=torch.Generator().manual_seed(1))
    one, chunks, steps = _cache(layer, 2), _cache(layer, 2), _cache(layer, 2)
    ref = _run(layer, one, x, 0, [1])
    parts = [_run(layer, chunks, x[:, a:b], a, [1]) for a, b in ((0, 1), (1, 3), (3, 70), (70, 90))]
    tokens = [_run(layer, steps, x[:, t:t + 1], t, [1]) for t in range(90)]
    for got, cache in ((torch.cat(parts, 1), chunks), (torch.cat(tokens, 1), steps)):
        assert rel_err(got, ref) < TOL
        assert rel_err(cache.states.recurrent, one.states.recurrent) < TOL
        assert rel_err(cache.states.conv, one.states.conv) < TOL
    assert one.states.recurrent[layer.state_index, 0].abs().max() == 0  # slot 0 untouched, other layers too
    assert one.states.recurrent[0].abs().max() == 0 and one.states.recurrent[layer.state_index, 1].abs().max() > 0


@torch.inference_mode()
def test_layer_batch_of_padded_rows_equals_each_alone():
    """Two sequences of different lengths, right-padded in one call (``Step.lengths``), then decoded together: each
    row's outputs and states as its sequence alone; the padding changes neither of its states."""
    layer = _layer(seed=2)
    gen = torch.Generator().manual_seed(2)
    lens = [13, 6]
    x = torch.randn(2, 13, 32, generator=gen)
    nxt = torch.randn(2, 1, 32, generator=gen)
    both = _cache(layer, 3)
    out = _run(layer, both, x, 0, [2, 0], lengths=torch.tensor(lens))
    steps = layer(nxt, Step(torch.tensor([[13], [6]]), torch.tensor([2, 0])), both)
    for b, (slot, n) in enumerate(zip([2, 0], lens)):
        alone = _cache(layer, 1)
        ref = _run(layer, alone, x[b:b + 1, :n], 0, [0])
        ref_step = layer(nxt[b:b + 1], Step(torch.tensor([[n]]), torch.tensor([0])), alone)
        assert rel_err(out[b, :n], ref[0]) < TOL and rel_err(steps[b], ref_step[0]) < TOL
        assert rel_err(both.states.recurrent[:, slot], alone.states.recurrent[:, 0]) < TOL
        assert rel_err(both.states.conv[:, slot], alone.states.conv[:, 0]) < TOL


@torch.inference_mode()
def test_a_new_sequence_ignores_what_its_slot_held():
    """A row whose positions start at 0 starts from zero states, whatever its slot held (no release needed); release
    of the whole slot zeroes its states, a partial release keeps them."""
    layer = _layer(seed=3)
    gen = torch.Generator().manual_seed(3)
    old, new = torch.randn(1, 20, 32, generator=gen), torch.randn(1, 9, 32, generator=gen)
    used, fresh = _cache(layer, 1), _cache(layer, 1)
    _run(layer, used, old, 0, [0])
    assert torch.equal(_run(layer, used, new, 0, [0]), _run(layer, fresh, new, 0, [0]))
    assert torch.equal(used.states.recurrent, fresh.states.recurrent)
    used.release(0, keep=5)
    assert torch.equal(used.states.recurrent, fresh.states.recurrent)
    used.release(0)
    assert used.states.recurrent.abs().max() == 0 and used.states.conv.abs().max() == 0


def test_states_are_fixed_bytes_per_slot():
    states = RecurrentStates(36, 4, 8192, 3, 32, 128, 128, torch.bfloat16, "meta")  # Qwen3-Next-80B's
    assert states.bytes_per_row == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert states.bytes_allocated == 4 * states.bytes_per_row
    with pytest.raises(ValueError, match="recurrent states of 4 rows for a cache of 5"):
        KVCache(1, 5, 64, 1, 8, states=states)


def test_kernel_choice_is_said():
    """The torch form on the CPU and for fp32 weights; flash-linear-attention on a GPU in bf16 where it imports."""
    kernels, why = delta_rule_kernels("cpu", torch.bfloat16)
    assert kernels is TORCH and "CPU" in why
    kernels, why = delta_rule_kernels("cuda", torch.float32)
    assert kernels is TORCH and "needs bf16/fp16" in why
    kernels, why = delta_rule_kernels("cuda", torch.bfloat16)
    try:
        import fla  # noqa: F401
        assert kernels.name == "fla" and "flash-linear-attention" in why
    except ImportError:
        assert kernels is TORCH and "not importable" in why
    layer = _layer()
    assert use_kernels(layer, "cpu", torch.float32) == "the PyTorch chunked/recurrent form (CPU)"
    assert use_kernels(torch.nn.Linear(2, 2), "cpu", torch.float32) is None


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 200])
def test_fla_kernels_equal_the_torch_form(T):
    """flash-linear-attention's kernels (bf16 q/k/v, fp32 state; GPU) against the torch form on the same values, one
    call of T tokens from a nonzero state. Bound 2e-2: fla computes in bf16 where the torch form keeps fp32."""
    pytest.importorskip("fla")
    from hetmoe.layers.linear_attention import FlaDeltaRule

    q, k, v, g, beta, state = inputs(2, T, 2, 4, 64, 64, seed=T, dtype=torch.bfloat16)
    q, k, v, g, beta, state = (x.cuda() for x in (q, k, v, g, beta, state))
    o_ref, s_ref = TORCH(q, k, v, g, beta, state)
    o, s = FlaDeltaRule()(q, k, v, g, beta, state)
    errs = rel_err(o, o_ref), rel_err(s, s_ref)
    print(f"fla~torch T={T}: out {errs[0]:.1e}, state {errs[1]:.1e}")
    assert o.dtype == s.dtype == torch.float32 and max(errs) < 2e-2, errs
