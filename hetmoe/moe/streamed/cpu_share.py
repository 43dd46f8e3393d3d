"""The CPU's share of a layerwise GPU prefill (hetmoe/moe/streamed/layerwise.py): while the PCIe link is the bottleneck
of that path (chunks below a few thousand tokens), the GPU waits for each layer's copy and the CPU engine would idle.
So the last c experts of every layer are left out of the copy and computed by the CPU engine instead, on the same
layer input, at the same time; their bytes are the ones copied last, the ones the GPU would wait on. Per MoE layer:

    main stream: route
    side stream: wait for the main stream; copy x, topk_ids, topk_weights -> pinned buffers; SUBMIT the CPU job
                 (experts [E - c, E)); SYNC (the CPU job done)
    main stream: wait for the slot's copy (experts [0, E - c) only); unpack and compute them (the ids of the CPU's
                 experts set to -1); the shared experts; wait for the side stream; add the job's fp32 output, read
                 from pinned memory, to the GPU's fp32 part (``add_rows``); combine

(A partly resident layer streams only its S non-resident experts; the CPU takes the last ~c·S/E of those: the job is
given the list of its experts.)

SUBMIT and SYNC are the stream-ordered host functions of the hybrid decode step (``WorkerPool.submit_on_stream`` /
``sync_on_stream``, hetmoe/moe/stream.py): nothing waits on the host, and the staging copies and the SYNC, which
blocks its stream, sit on a side stream, so the main stream keeps computing. The CPU job is prepared once per (layer, c)
over static pinned buffers of ``capacity`` tokens; T is read when it runs from a pinned int64 set in stream order, and
the GPU's experts are the job's skip mask (the engine's own mask of GPU-resident experts does not apply: this path
computes every expert from the streamed weights).

The share c is chosen per chunk from the rates the layerwise path measures at load (hetmoe/moe/streamed/choice.py,
``choose_cpu_share``): per layer the GPU side takes (E - c) / E of max(the layer's copy, its GPU compute); the CPU
side starts when the layer's input exists, so the GPU's work comes before its c / E of the whole-layer CPU time,
stretched by the DRAM the DMA shares with it. Where the share does not promise ``MIN_GAIN`` of the layer's time
(long chunks, where the GPU path's rate is far above the CPU's), c = 0. The sum of the two fp32 parts is the all-GPU
path's within the formats' cross-path bound (the CPU engine rounds its activations;
tests/moe/streamed/test_cpu_share.py).

``--gpu-prefill-cpu-share``: ``auto`` (default), ``off``, or a fixed number of experts.

Shape letters: T tokens, E experts, k experts per token, H hidden size, C capacity.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence, Union

import torch

from hetmoe.config.options import parse_cpu_share
from hetmoe.cpu.host_funcs import HostFuncs
from hetmoe.moe.streamed.choice import choose_cpu_share
from hetmoe.ops.triton import grouped as grouped_triton


class CPUShare:
    """The CPU engine's part of each layer of a layerwise prefill: static pinned buffers for ``capacity`` tokens of
    hidden size ``hidden``, top-k ``top_k`` and activations in ``dtype``, jobs prepared per (layer, share).

    ``mode``: "auto" (``choose_cpu_share`` from ``rates``), "off", or a fixed number of experts. On a CPU ``device``
    (tests) the host functions run on a ``_C.FakeStream``, the stand-in for a CUDA stream."""

    def __init__(self, hidden: int, top_k: int, dtype: torch.dtype, device, capacity: int,
                 mode: Union[str, int] = "auto", rates: Optional[dict] = None):
        self.hidden, self.top_k, self.dtype = int(hidden), int(top_k), dtype
        self.device, self.capacity = torch.device(device), int(capacity)
        self.mode, self.rates = parse_cpu_share(mode), rates
        self.cuda = self.device.type == "cuda"
        self.fake = None
        if not self.cuda:
            from hetmoe import _C

            self.fake = _C.FakeStream()
        self.host_funcs = HostFuncs()
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self._bufs = None  # (x, ids, weights, out, n_tokens, n_tokens on the device): allocated at first use
        self._jobs: dict = {}  # (layer index, the CPU's experts) -> EngineJob
        self._masks: dict = {}  # (E, the CPU's experts) -> bool [E]: the experts the CPU skips (the GPU's)

    def experts_for(self, n_tokens: int, num_experts: int) -> int:
        """The CPU's share (a count of experts, the last ones) of a chunk of ``n_tokens`` tokens."""
        if self.mode == "off" or n_tokens > self.capacity or n_tokens < 1:
            return 0
        if isinstance(self.mode, int):
            return min(self.mode, num_experts - 1)
        return choose_cpu_share(self.rates, n_tokens, num_experts) if self.rates else 0

    @property
    def pinned_bytes(self) -> int:
        return 0 if self._bufs is None else sum(t.numel() * t.element_size() for t in self._bufs[:5])

    def start(self, n_tokens: int) -> None:
        """A forward call of ``n_tokens`` tokens with a share begins: the jobs' token count, in stream order (the
        previous call's jobs may not have run yet)."""
        if self._bufs is None:
            C, pin = self.capacity, self.cuda
            self._bufs = (torch.zeros(C, self.hidden, dtype=self.dtype, pin_memory=pin),
                          torch.full((C, self.top_k), -1, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(C, self.top_k, dtype=torch.float32, pin_memory=pin),
                          torch.zeros(C, self.hidden, dtype=torch.float32, pin_memory=pin),
                          torch.zeros(1, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(1, dtype=torch.int64, device=self.device) if self.cuda else None)
        n_host, n_dev = self._bufs[4], self._bufs[5]
        if self.cuda:
            n_dev.fill_(n_tokens)
            n_host.copy_(n_dev, non_blocking=True)
        else:
            n_host.fill_(n_tokens)

    def _job(self, index: int, engine, experts: tuple):
        key = (index, experts)
        if key not in self._jobs:
            E = engine.num_experts
            if (E, experts) not in self._masks:
                mask = torch.ones(E, dtype=torch.bool)
                mask[list(experts)] = False
                self._masks[E, experts] = mask
            x, ids, w, out, n_host, _ = self._bufs
            self._jobs[key] = engine.prepare(x, ids, w, out, n_tokens=n_host, skip_mask=self._masks[E, experts])
        return self._jobs[key]

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else self.fake

    def submit(self, index: int, engine, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               cpu_experts: Union[int, Sequence[int]], done=None) -> None:
        """Stage layer ``index``'s input x [T, H] and routing [T, k], queue its CPU job (the experts of ``engine``
        listed in ``cpu_experts``, or, a count c, its last c experts) and its sync, all on the side stream once the
        current stream has computed the inputs (``done``, a CUDA event, is recorded after the sync: profiling). The
        main stream goes on at once: the staging copies run on the device-to-host copy engine, beside its compute
        and the host-to-device copy."""
        T, k = ids.shape
        if T > self.capacity or k != self.top_k or x.shape[1] != self.hidden:
            raise ValueError(f"the CPU share holds [{self.capacity}, {self.hidden}] inputs with top-{self.top_k}, "
                             f"got x {tuple(x.shape)} and ids {tuple(ids.shape)}")
        E = engine.num_experts
        experts = tuple(range(E - cpu_experts, E)) if isinstance(cpu_experts, int) else tuple(cpu_experts)
        if not experts or min(experts) < 0 or max(experts) >= E:
            raise ValueError(f"the CPU share's experts must be a non-empty set in [0, {E}), got {cpu_experts!r}")
        job = self._job(index, engine, experts)
        stream = self.fake
        if self.cuda:
            stream = self.side
            stream.wait_stream(self._stream())
            for t in (x, ids, weights):  # read on the side stream: not reused by the main stream's allocations before
                t.record_stream(stream)
        xb, ib, wb = self._bufs[:3]
        with torch.cuda.stream(stream) if self.cuda else nullcontext():
            xb[:T].copy_(x, non_blocking=True)
            ib[:T].copy_(ids, non_blocking=True)
            wb[:T].copy_(weights, non_blocking=True)
        engine.pool.submit_on_stream(job, stream, host_funcs=self.host_funcs)
        engine.pool.sync_on_stream(0, stream, host_funcs=self.host_funcs)
        if done is not None:
            done.record(stream)

    def add(self, y: torch.Tensor) -> torch.Tensor:
        """The CPU job's output added to the GPU's part y [T, H] fp32 (both fp32, as ``combine`` adds a layer's
        parts), once the job is done: the main stream waits for the side stream's sync here."""
        out = self._bufs[3][:y.shape[0]]
        if not self.cuda:
            self.fake.synchronize()  # the host stands in for the stream: the read below follows the sync
            return out + y
        self._stream().wait_stream(self.side)
        if not grouped_triton.available():
            return out.to(y.device, non_blocking=True) + y
        from hetmoe.ops.triton.fused import add_rows

        return add_rows(out, y)

    def close(self) -> None:
        self.host_funcs.close()
        self._jobs.clear()
