"""GPU-resident experts (``--gpu-experts N``): an experts backend of route -> dispatch -> experts -> combine.

Per MoE layer, N of the E routed experts are kept on the GPU as well as in the CPU engine; the CPU engine skips
them through its static skip mask (``MoELayer.set_gpu_experts``) and ``GpuExperts`` computes every (token, slot)
routed to them, on the main stream, while the CPU computes the rest. The weights are the values the CPU format
holds, stored (``storage``, hetmoe/moe/gpu_resident/format.py) in bf16 (the model dtype: ``CPUExperts.dequantized`` cast
to it) or int8/int4 (weight-only, a fp32 scale per group; of the CPU's own format: its very codes and scales, so
the same fp32 values, at ~1/3.5 of bf16's bytes for int4). A hybrid run with resident experts matches the all-CPU
placement up to summation order (and, with int8/int4, the CPU engine's activation rounding, which the GPU does not
do).

Three paths, one result:
  routed (T <= dense_max_tokens while a CUDA graph is being captured, on a GPU with Triton: the decode graph; in
         eager calls too with decode="routed"):
         Triton kernels over the T*k (token, slot) pairs that read only the weights of the resident experts the
         tokens routed to, each once (hetmoe/ops/triton/experts.py: routed, int8/int4 routed_int,
         dequantized in the K loop): the cost follows the hits, not N. Fixed shapes, no host sync: capturable.
         int8/int4 on a GPU take them in eager calls too (the dense path would dequantize all N experts per call).
  dense  (the same T where Triton is absent: CPU tensors, tests): every resident expert runs over all T tokens,
         weighted by a combine matrix C [T, N] built on the device from (topk_ids, topk_weights) (0 where a token
         did not route to that expert). Two GEMMs: [T, H] x [H, N*2I] (gate and up of all N experts), then
         [T, N*I] x [N*I, H] (down, which also sums over N). Capturable too, but reads all N experts' weights.
  grouped (larger T: prefill, always eager): the weights of the resident experts the chunk routes to unpacked into
         the model-dtype scratch the layerwise prefill uses too (int8/int4/lut4: one Triton pass,
         hetmoe/ops/triton/experts.py ``unpack_rows``, the rows of unrouted experts skipped on the device; bf16: gate/up
         read in place, down copied into the [N, H, I] layout), then the same grouped GEMMs (hetmoe/moe/grouped.py):
         tokens sorted by expert once, one grouped GEMM per projection, no loop over experts, no host sync on a
         GPU with grouped GEMMs. So a partly resident layer's GPU part runs while the CPU engine computes the rest
         (MoELayer stages the CPU's inputs first), and the layerwise prefill computes a partly resident layer's
         resident experts from this storage rather than streaming them (``unpack_into``).
The dense path (and the grouped one on CPU tensors) dequantizes int8/int4 weights to the dtype with torch ops.

Shape letters: T tokens, E experts, k experts per token, N resident experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from hetmoe import envs
from hetmoe.moe import grouped
from hetmoe.moe.gpu_resident import format as rf

DENSE_MAX_TOKENS = 32  # up to here a fixed-shape path (routed or dense) costs less than N gathers
DECODE_PATHS = ("auto", "routed", "dense")
TORCH_UNPACK_EXPERTS = 16  # experts dequantized at once by torch ops (CPU tensors): bounds the temporaries


def combine_matrix(topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_of: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 [T, N]: C[t, r] = the weight token t gives resident expert r (0 where it did not route to it).

    topk_ids [T, k] (-1 = empty slot), topk_weights [T, k], slot_of [E + 1] int64: the resident index of each
    expert, -1 for the others and at index E (where empty slots point). No host sync, fixed shapes."""
    ids = topk_ids.long()
    ids = ids.masked_fill(ids < 0, slot_of.shape[0] - 1)
    slots = slot_of[ids]  # [T, k], -1 = not resident
    onehot = slots.unsqueeze(-1) == torch.arange(n, device=slots.device)  # [T, k, N]; a token's ids are distinct
    return (onehot * topk_weights.float().unsqueeze(-1)).sum(dim=1)


class GpuExperts:
    """N routed experts of one MoE layer on a device, an ``ExpertsBackend`` (hetmoe/moe/experts.py) that computes only
    the slots routed to its own experts: ``forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> fp32 [T, H]``.

    Args:
        expert_ids: the N experts kept here (distinct, in [0, num_experts)).
        gate, up: [N, I, H]; down: [N, H, I] (Hugging Face out x in), any float dtype, any device.
        num_experts: E of the layer.
        dtype, device: where and in what precision the weights are kept and computed (fp32 accumulation).
        decode: the fixed-shape path for T <= dense_max_tokens: "routed" (Triton kernels, the weights of routed
            experts only; CPU tensors run them in Triton's interpreter), "dense" (torch, all N experts), "auto"
            (routed on a GPU where the triton package is installed, else dense).
        storage: how the weights are kept: a resident_format.Storage, a format name ("bf16", "int8", "int4": the
            weights quantized here, group 64), or None (bf16: the dtype). ``from_cpu`` keeps a CPU engine's codes.
    """

    def __init__(self, expert_ids: Sequence[int], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 num_experts: int, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 dense_max_tokens: int = DENSE_MAX_TOKENS, decode: str = "auto", storage=None):
        if gate.dim() != 3 or gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(f"expert weights must be gate/up [N, I, H] and down [N, H, I]; got {tuple(gate.shape)}, "
                             f"{tuple(up.shape)}, {tuple(down.shape)}")
        n, I, H = gate.shape
        if len(list(expert_ids)) != n:
            raise ValueError(f"{len(list(expert_ids))} expert ids for {n} experts' weights")
        self._setup(expert_ids, num_experts, H, I, dtype, device, dense_max_tokens, decode, storage)
        st = self.storage
        if st.gate_up_affine or st.down_affine:
            raise ValueError("affine resident storage only holds a CPU engine's codes (GpuExperts.from_cpu)")
        if not st.quantized:
            # [N*2I, H]: rows of expert r are gate_r then up_r, so x @ W^T viewed [T, N, 2, I] splits them.
            self.w_gate_up = torch.stack((gate, up), dim=1).reshape(n * 2 * I, H).to(self.device, dtype).contiguous()
            # [H, N*I]: columns of expert r are down_r's, so h [T, N*I] @ W^T sums the N experts' outputs.
            self.w_down = down.permute(1, 0, 2).reshape(H, n * I).to(self.device, dtype).contiguous()
            return
        gu = torch.stack((gate, up), dim=1).reshape(n * 2 * I, H).float()
        self.w_gate_up, self.s_gate_up = (t.to(self.device) for t in rf.quantize(gu, st.gate_up, st.group))
        self.w_down, self.s_down = (t.to(self.device) for t in rf.quantize(down.reshape(n * H, I).float(), st.down,
                                                                               st.down_group))

    def _setup(self, expert_ids, num_experts, H, I, dtype, device, dense_max_tokens, decode, storage) -> None:
        if decode not in DECODE_PATHS:
            raise ValueError(f"decode must be one of {DECODE_PATHS}, got {decode!r}")
        ids = [int(e) for e in expert_ids]
        n = len(ids)
        if n < 1:
            raise ValueError("GpuExperts needs at least one expert (attach none instead)")
        if len(set(ids)) != n or min(ids) < 0 or max(ids) >= num_experts:
            raise ValueError(f"resident expert ids must be distinct and in [0, {num_experts}); got {ids}")
        self.storage = rf.Storage.of(storage) if isinstance(storage, str) else storage or rf.Storage()
        self.expert_ids, self.num_experts, self.n = ids, int(num_experts), n
        self.hidden_size, self.intermediate_size = H, I
        self.dtype, self.device = dtype, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # with its index, as x.device reads
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dense_max_tokens = int(dense_max_tokens)
        self.s_gate_up = self.s_down = None  # int8/int4: the fp32 scales beside the codes
        self.m_gate_up = self.m_down = None  # affine int8/int4: the fp32 mins beside the scales
        self._scratch = None  # the prefill's model-dtype weights (grouped.weight_scratch), at first use
        # lut4: the (gate/up, down) codebooks on the device, made here once (never inside a graph capture)
        self.luts = None
        if "lut4" in (self.storage.gate_up, self.storage.down):
            from hetmoe.moe.streamed.packed import codebook_values

            self.luts = tuple(codebook_values(b, self.device) if b else None
                              for b in (self.storage.gate_up_codebook, self.storage.down_codebook))
        slot_of = torch.full((num_experts + 1,), -1, dtype=torch.int64)
        slot_of[torch.tensor(ids)] = torch.arange(n)
        self.slot_of = slot_of.to(self.device)  # [E + 1]
        if decode == "routed" and importlib.util.find_spec("triton") is None:
            raise ValueError("decode='routed' needs the triton package, which is not installed")
        if decode == "routed" and self.device.type != "cuda" and not envs.TRITON_INTERPRET:
            raise ValueError(f"decode='routed' on {self.device} needs Triton's interpreter (TRITON_INTERPRET=1 "
                             "before triton is imported); use decode='dense' or 'auto'")
        # auto: the routed kernels inside CUDA-graph capture (the decode graph, verified on the GPU machine against
        # the all-CPU model), the dense path in eager calls (as before the routed kernels; an explicit "routed"
        # takes them in eager calls too). int8/int4 on a GPU take the routed kernels in eager calls as well: the
        # dense path would dequantize all N experts per call.
        routed_here = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.eager_routed = decode == "routed" or (decode == "auto" and routed_here and self.storage.quantized)
        if decode == "auto":
            decode = "routed" if routed_here else "dense"
        self.decode = decode

    @classmethod
    def from_cpu(cls, cpu_experts, expert_ids: Sequence[int], dtype: torch.dtype, device, storage="bf16",
                 **kwargs) -> "GpuExperts":
        """The resident copy of ``expert_ids`` of a ``CPUExperts``: the values its kernels multiply by. ``storage``:
        a resident_format.Storage, or a format name (``auto``: the engine's own, ``bf16``, ``int8``, ``int4``;
        resident_format.storage_for); int8/int4/lut4 matrices of the engine's format and group keep its codes and
        scales (the same values exactly; scales widened to fp32), others are quantized from its values. One expert at
        a time (at most one fp32 copy on the host at once)."""
        glu, bias = getattr(cpu_experts, "glu", None), getattr(cpu_experts, "bias", False)
        if (glu is not None and glu.kind != "swiglu") or bias:  # the kernels compute plain SwiGLU without biases
            raise ValueError(f"GPU-resident experts compute plain SwiGLU without biases; these experts are "
                             f"{glu.kind}{' with biases' if bias else ''} (they run on the CPU engine only)")
        n, I, H = len(expert_ids), cpu_experts.intermediate_size, cpu_experts.hidden_size
        st = rf.storage_for(cpu_experts, storage) if isinstance(storage, str) else storage
        if not st.quantized:
            gate, up = (torch.empty(n, I, H, dtype=dtype, device=device) for _ in range(2))
            down = torch.empty(n, H, I, dtype=dtype, device=device)
            for r, e in enumerate(expert_ids):
                for dst, src in zip((gate, up, down), cpu_experts.dequantized(int(e))):  # fp32 [I, H], [I, H], [H, I]
                    dst[r].copy_(src)
            return cls(expert_ids, gate, up, down, cpu_experts.num_experts, dtype, device, storage=st, **kwargs)
        self = cls.__new__(cls)
        self._setup(expert_ids, cpu_experts.num_experts, H, I, dtype, device, kwargs.pop("dense_max_tokens",
                                                                                         DENSE_MAX_TOKENS),
                    kwargs.pop("decode", "auto"), st)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        from hetmoe.moe.streamed.packed import expert_ranges

        ranges = expert_ranges(cpu_experts) if cpu_experts.info().get("numa_subpools", 1) == 1 else None
        for r, e in enumerate(expert_ids):  # each expert's rows copied into place: no second copy on the device
            own = rf.cpu_codes(cpu_experts, int(e), st, ranges, self.device) if ranges is not None else (None, None)
            for part, affine in zip(own, (st.gate_up_affine, st.down_affine)):
                if affine and part is None:
                    raise ValueError(f"affine resident storage {st} holds only the CPU engine's own codes, which "
                                     "these experts do not have")
            g, u, d = (t.to(self.device) for t in cpu_experts.dequantized(int(e))) if None in own else (None,) * 3
            # (codes, scales[, mins]): [2I, .], [2I, G] and [H, .], [H, G] on the device
            gu = own[0] or rf.quantize(torch.cat((g, u)), st.gate_up, st.group)
            dn = own[1] or rf.quantize(d, st.down, st.down_group)
            if r == 0:
                self.w_gate_up, self.s_gate_up, self.w_down, self.s_down = (
                    torch.empty((n * t.shape[0], t.shape[1]), dtype=t.dtype, device=self.device)
                    for t in gu[:2] + dn[:2])
                if st.gate_up_affine:
                    self.m_gate_up = torch.empty_like(self.s_gate_up)
                if st.down_affine:
                    self.m_down = torch.empty_like(self.s_down)
            for dst, src in zip((self.w_gate_up, self.s_gate_up, self.m_gate_up), gu):
                dst[r * 2 * I:(r + 1) * 2 * I].copy_(src)
            for dst, src in zip((self.w_down, self.s_down, self.m_down), dn):
                dst[r * H:(r + 1) * H].copy_(src)
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w_gate_up, self.w_down, self.s_gate_up, self.s_down, self.m_gate_up,
                                      self.m_down) if t is not None)

    def skip_mask(self) -> torch.Tensor:
        """bool [E] on the host, True for the resident experts: what the CPU engine must skip."""
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        mask[torch.tensor(self.expert_ids)] = True
        return mask

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None, *, accumulate: bool = False,
                skip_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Their part, fp32 [T, H] (written or, ``accumulate``, added into ``out`` when given). ``skip_mask`` bool [E]:
        experts not computed in this call."""
        y = self._part(x, topk_ids, topk_weights, skip_mask)
        if out is None:
            return y
        if accumulate:
            y = y + out.float()
        out.copy_(y)
        return out

    __call__ = forward

    def _part(self, x, topk_ids, topk_weights, skip_mask) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                             f"both be [T={x.shape[0]}, k]")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}; these resident experts are on {self.device}")
        if skip_mask is not None and skip_mask.shape != (self.num_experts,):
            raise ValueError(f"skip_mask must be [E={self.num_experts}], got {tuple(skip_mask.shape)}")
        skip = skip_mask.to(self.device, torch.bool) if skip_mask is not None else None
        capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        T = x.shape[0]
        if T > self.dense_max_tokens and not capturing:
            return self._grouped(x, topk_ids, topk_weights, skip)
        if self.decode == "routed" and (capturing or self.eager_routed) and T <= _routed().MAX_ROWS:
            return self._routed(x, topk_ids, topk_weights, skip)
        return self._dense(x, self._skipped(topk_ids, skip), topk_weights)

    @staticmethod
    def _skipped(topk_ids, skip):
        """topk_ids with the slots of skipped experts set to -1."""
        if skip is None:
            return topk_ids
        return topk_ids.masked_fill(skip[topk_ids.long().clamp(min=0)] & (topk_ids >= 0), -1)

    def _routed(self, x, topk_ids, topk_weights, skip) -> torch.Tensor:
        if self.storage.quantized:
            gate_up = self._stored(self.w_gate_up, self.s_gate_up, self.m_gate_up)
            down = self._stored(self.w_down, self.s_down, self.m_down)
            return _routed().routed_int(x, topk_ids, topk_weights, gate_up, down, self.storage, self.slot_of, skip,
                                        self.num_experts, self.intermediate_size, luts=self.luts)
        return _routed().routed(x, topk_ids, topk_weights, self.w_gate_up, self.w_down, self.slot_of, skip,
                                self.num_experts, self.intermediate_size)

    @staticmethod
    def _stored(codes, scales, mins) -> tuple:
        """(codes, scales), or (codes, scales, mins) of an affine matrix: as routed_int takes them."""
        return (codes, scales) if mins is None else (codes, scales, mins)

    def _dense_weights(self) -> tuple:
        """(w_gate_up [N*2I, H], w_down [H, N*I]) in the dtype; int8/int4 dequantized for this call."""
        if not self.storage.quantized:
            return self.w_gate_up, self.w_down
        st, N, H, I = self.storage, self.n, self.hidden_size, self.intermediate_size
        gu = rf.dequantize(self.w_gate_up, self.s_gate_up, st.gate_up, st.group, H, self.dtype, st.gate_up_codebook,
                           self.m_gate_up)
        d = rf.dequantize(self.w_down, self.s_down, st.down, st.down_group, I, self.dtype, st.down_codebook,
                          self.m_down)
        return gu, d.view(N, H, I).permute(1, 0, 2).reshape(H, N * I)

    def _expert_weights(self, r0: int, r1: int) -> tuple:
        """(gate_up [n, 2I, H], down [n, H, I]) of resident experts r0 .. r1 - 1 in the dtype (int8/int4
        dequantized, all n at once: a few kernels, not a few per expert)."""
        st, H, I, n = self.storage, self.hidden_size, self.intermediate_size, r1 - r0
        if not st.quantized:
            return (self.w_gate_up[2 * r0 * I:2 * r1 * I].view(n, 2 * I, H),
                    self.w_down[:, r0 * I:r1 * I].view(H, n, I).transpose(0, 1))
        rows, drows = slice(2 * r0 * I, 2 * r1 * I), slice(r0 * H, r1 * H)
        mgu, md = (m[sl] if m is not None else None for m, sl in ((self.m_gate_up, rows), (self.m_down, drows)))
        return (rf.dequantize(self.w_gate_up[rows], self.s_gate_up[rows], st.gate_up, st.group, H, self.dtype,
                              st.gate_up_codebook, mgu).view(n, 2 * I, H),
                rf.dequantize(self.w_down[drows], self.s_down[drows], st.down, st.down_group, I, self.dtype,
                              st.down_codebook, md).view(n, H, I))

    def _dense(self, x, topk_ids, topk_weights) -> torch.Tensor:
        T, N, I = x.shape[0], self.n, self.intermediate_size
        w_gate_up, w_down = self._dense_weights()
        c = combine_matrix(topk_ids, topk_weights, self.slot_of, N)  # [T, N]
        gu = F.linear(x.to(self.dtype), w_gate_up).view(T, N, 2, I)
        h = F.silu(gu[:, :, 0]) * gu[:, :, 1]  # [T, N, I]
        h = (h.float() * c.unsqueeze(-1)).to(self.dtype)  # weighted before down (linear): one GEMM sums over N
        return F.linear(h.view(T, N * I), w_down).float()

    def slots(self, topk_ids: torch.Tensor, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, k] int64: each slot's resident index, -1 where it is empty, not resident or in ``skip`` (bool [E] on
        the device). No host sync."""
        ids = topk_ids.long()
        slots = self.slot_of[ids.masked_fill(ids < 0, self.num_experts)]
        if skip is not None:
            slots = slots.masked_fill(skip[ids.clamp(min=0)] & (ids >= 0), -1)
        return slots

    def used(self, slots: torch.Tensor) -> torch.Tensor:
        """bool [N] on the device: the resident experts that ``slots`` [T, k] (resident indices, -1) route to."""
        flat = torch.where(slots >= 0, slots, self.n).reshape(-1)
        return grouped.counts_of(flat, self.n + 1)[:self.n] > 0

    def unpack_into(self, w_gu: torch.Tensor, w_down: torch.Tensor, used: Optional[torch.Tensor] = None,
                    first: int = 0) -> None:
        """The weights of resident experts first .. first+n-1 (all N by default) in the scratch's dtype into ``w_gu``
        [n, 2I, H] (gate rows, then up rows) and ``w_down`` [n, H, I] (both contiguous): the experts ``used`` marks
        (bool [n] on the device; None: all); the others' rows may be left as they are. The layout of
        ``grouped.grouped_swiglu`` (the layerwise prefill takes a group of them at a time: ``first``)."""
        H, I = self.hidden_size, self.intermediate_size
        n = w_gu.shape[0]
        if (first < 0 or first + n > self.n or w_gu.shape != (n, 2 * I, H) or w_down.shape != (n, H, I)
                or not (w_gu.is_contiguous() and w_down.is_contiguous())):
            raise ValueError(f"unpack_into takes contiguous [n, {2 * I}, {H}] and [n, {H}, {I}] buffers of resident "
                             f"experts {first} .. {first} + n - 1 of {self.n}, got "
                             f"{tuple(w_gu.shape)} and {tuple(w_down.shape)}")
        st, last = self.storage, first + n
        if not st.quantized:
            w_gu.copy_(self.w_gate_up.view(self.n, 2 * I, H)[first:last])
            w_down.copy_(self.w_down.view(H, self.n, I).transpose(0, 1)[first:last])
            return
        if self.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            used = torch.ones(n, dtype=torch.bool, device=self.device) if used is None else used
            lut_gu, lut_d = self.luts or (None, None)
            gu_rows, d_rows = slice(first * 2 * I, last * 2 * I), slice(first * H, last * H)
            mgu, md = (m[sl] if m is not None else None for m, sl in ((self.m_gate_up, gu_rows), (self.m_down, d_rows)))
            _routed().unpack_rows(self.w_gate_up[gu_rows], self.s_gate_up[gu_rows], st.gate_up, st.group,
                                  w_gu.view(n * 2 * I, H), used, 2 * I, lut_gu, mgu)
            _routed().unpack_rows(self.w_down[d_rows], self.s_down[d_rows], st.down, st.down_group,
                                  w_down.view(n * H, I), used, H, lut_d, md)
            return
        for r0 in range(first, last, TORCH_UNPACK_EXPERTS):  # torch ops, a few experts at a time (bounded temporaries)
            r1 = min(last, r0 + TORCH_UNPACK_EXPERTS)
            gu, d = self._expert_weights(r0, r1)
            w_gu[r0 - first:r1 - first].copy_(gu)
            w_down[r0 - first:r1 - first].copy_(d)

    def _grouped(self, x, topk_ids, topk_weights, skip) -> torch.Tensor:
        """The prefill path: the routed resident experts' weights in the shared scratch, one grouped GEMM per
        projection over the tokens sorted by resident expert."""
        N, H, I = self.n, self.hidden_size, self.intermediate_size
        slots = self.slots(topk_ids, skip)  # [T, k]
        if self._scratch is None:
            self._scratch = grouped.weight_scratch(self.device, self.dtype, H, I)
        w_gu, w_down = self._scratch.reserve(N)
        if not self.storage.quantized:  # gate/up as stored already: [N * 2I, H] is [N, 2I, H]
            w_gu = self.w_gate_up.view(N, 2 * I, H)
            w_down.copy_(self.w_down.view(H, N, I).transpose(0, 1))
        else:
            self.unpack_into(w_gu, w_down, self.used(slots))
        return grouped.grouped_swiglu(x, slots, topk_weights, w_gu, w_down)


def _routed():
    """hetmoe.ops.triton.experts, imported when first used (it needs the triton package)."""
    from hetmoe.ops.triton import experts as gpu_experts_triton

    return gpu_experts_triton


def first_experts(num_experts: int, n: int) -> list:
    """The resident set when no calibration is run: experts 0 .. n-1."""
    return list(range(min(n, num_experts)))
