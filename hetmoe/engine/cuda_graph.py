"""Decode steps on a GPU: one CUDA graph per (batch size, attended length), captured on first use and replayed every
token — or, with ``cuda_graph=False``, the very same forward run eagerly.

A step reads its inputs from static device buffers (``inputs``: token ids, positions, cache slots, number of real
rows), filled by one host-to-device copy before each replay. A batch of n sequences runs as the next captured size
B >= n (1, 2, 4, ... max_batch): the B - n padding rows feed token 0 at position 0 of a scratch cache slot (row
``max_batch`` of a cache allocated one row larger), so their KV writes touch no sequence, and the CPU experts read
the real row count n through a pointer (``hetmoe.moe.StreamDecode``), so padding costs no expert work.

With the paged KV cache (a GPU with Triton; layers/kv_cache.py) attention reads each row's length from the
positions on the device and splits its pages over the GPU: one graph per batch size serves every context length.
When the cache reallocates its pool to grow (``cache.version`` changes), the graphs captured over the old one are
dropped and captured again when next needed.

Without it, attention over the contiguous cache must not change shape between replays. Two ways (``kv_mode``):
  "full"    every step attends over all max_context cache positions (later ones masked on the device from the
            positions): one graph per batch size.
  "bucket"  the attended length is rounded up to KV_BUCKET as in eager runs: one graph per (batch size, length
            bucket), each captured the first time a step needs it.
The default is "bucket": a step well short of
max_context attends far fewer positions, and a bucket's capture (once every 64 tokens) costs less than the 64 steps
it shortens (BENCHMARKS.md#kv-buckets).

Shape letters: n real rows, B padded batch (a captured size), C the largest captured size, V vocabulary.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional, Sequence

import torch

from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import RecurrentStates
from hetmoe.layers.sparse_attention import sparse_kv_len

KV_MODES = ("full", "bucket")
DEFAULT_KV_MODE = "bucket"


@contextmanager
def kept_states(cache, rows: torch.Tensor):
    """The recurrent states (``RecurrentStates``: convolution inputs and linear-attention states) of cache ``rows``
    (a device index tensor; repeats allowed) as they are on entry, put back on exit; nothing for a cache without
    them. Padding rows all name the scratch slot, whose states nobody reads. The copies are kept in host memory, a
    layer at a time, so that a capture needs no device memory beyond the states' own (tens of MB per row)."""
    states = getattr(cache, "states", None)
    if not isinstance(states, RecurrentStates):
        yield
        return
    saved = [(t[layer], t[layer].index_select(0, rows).cpu()) for t in (states.conv, states.recurrent)
             for layer in range(t.shape[0])]  # [B, ...] each
    try:
        yield
    finally:
        for t, rows_before in saved:
            t.index_copy_(0, rows, rows_before.to(t.device))


def capture_sizes(max_batch: int) -> list:
    """The batch sizes graphs are captured for: powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def padded_size(n: int, sizes: Sequence[int]) -> int:
    """The smallest captured size holding n rows."""
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"a decode batch of {n} sequences exceeds the largest captured size {sizes[-1]} (max_batch)")


def bucket_len(max_position: int, max_context: int, bucket: int) -> int:
    """Attended length for positions up to ``max_position``: rounded up to ``bucket``, at most max_context."""
    return min(max_context, -(-(max_position + 1) // bucket) * bucket)


def pack_inputs(buf: torch.Tensor, capacity: int, token_ids: Sequence[int], positions: Sequence[int],
                slots: Sequence[int], scratch_slot: int) -> None:
    """Write one step's inputs into ``buf`` (int64 [3C + 1]): ids | positions | slots (padding rows: token 0,
    position 0, the scratch slot) | n."""
    n, C = len(token_ids), capacity
    if n > C:
        raise ValueError(f"{n} rows do not fit the static inputs of capacity {C}")
    buf.zero_()
    buf[:n] = torch.as_tensor(token_ids, dtype=torch.int64)
    buf[C:C + n] = torch.as_tensor(positions, dtype=torch.int64)
    buf[2 * C:3 * C] = scratch_slot
    buf[2 * C:2 * C + n] = torch.as_tensor(slots, dtype=torch.int64)
    buf[3 * C] = n


class GraphDecoder:
    """Decode steps of ``model`` over ``cache`` (max_batch + 1 rows: the last is the scratch slot).

    ``hybrid``: the model's StreamDecode (None when no routed experts are offloaded). ``cuda_graph``: capture and
    replay, or run the same forward eagerly (no padding, attended length bucketed). ``fused``: the steps take the
    models' fused decode path (``Step.fused``, ops/triton/fused.py) and the MoE layers' mapped staging
    (``StreamDecode.step(mapped=True)``: no copies between the GPU and the CPU jobs)."""

    def __init__(self, model, cache, max_batch: int, max_context: int, device: torch.device, hybrid=None,
                 cuda_graph: bool = True, kv_mode: str = DEFAULT_KV_MODE, kv_bucket: int = 64, fused: bool = False,
                 sparse_topk: Optional[int] = None, log=lambda msg: print(msg, file=sys.stderr, flush=True)):
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
        self.model, self.cache, self.hybrid = model, cache, hybrid
        self.max_batch, self.max_context, self.device = max_batch, max_context, device
        self.cuda_graph, self.kv_mode, self.kv_bucket, self.fused, self.log = cuda_graph, kv_mode, kv_bucket, fused, log
        self.sparse_topk = sparse_topk  # a sparse-attention model's dense positions: kv_len from sparse_kv_len
        self.sizes = capture_sizes(max_batch)
        self.capacity = self.sizes[-1]
        self.scratch_slot = max_batch
        C = self.capacity
        self.inputs = torch.zeros(3 * C + 1, dtype=torch.int64, device=device)  # ids | positions | slots | n
        self.inputs_host = torch.zeros(3 * C + 1, dtype=torch.int64, pin_memory=True)
        self.graphs: dict = {}  # (B, kv_len, cpu) -> (CUDAGraph, logits [B, V] fp32)
        self.capture_s: dict = {}  # the same keys -> seconds the warm-up and capture took
        self.mempool = torch.cuda.graph_pool_handle() if cuda_graph else None
        self.cache_version = cache.version

    @staticmethod
    def capacity_for(max_batch: int) -> int:
        """Rows of the static buffers (inputs, host staging): the largest captured size."""
        return capture_sizes(max_batch)[-1]

    def kv_len(self, positions: Sequence[int]) -> int:
        top = max(positions)
        if self.sparse_topk is not None:  # the sparse layers read kv_len rows and choose dense or sparse by it
            return sparse_kv_len(top, self.sparse_topk, self.max_context)
        if self.cache.paged:  # the kernels read the lengths on the device; kv_len only bounds eager fallbacks
            return self.max_context
        if self.cuda_graph and self.kv_mode == "full":
            return self.cache.capacity
        return bucket_len(top, self.cache.capacity, self.kv_bucket)

    @torch.inference_mode()
    def step(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             cpu: bool = True, meanwhile: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """One token for each of n sequences (validated by the runner) -> logits fp32 [n, V] (a fresh tensor).
        ``cpu=False``: leave the CPU experts out (benchmark time split; the outputs are then meaningless).
        ``meanwhile()``: host work run after the step is launched and before it is waited for."""
        n = len(token_ids)
        B = padded_size(n, self.sizes) if self.cuda_graph else n
        kv_len = self.kv_len(positions)
        pack_inputs(self.inputs_host, self.capacity, token_ids, positions, slots, self.scratch_slot)
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        if not self.cuda_graph:
            logits = self._forward(B, kv_len, cpu)
        else:
            if self.cache.version != self.cache_version:  # the cache reallocated: its graphs read freed memory
                torch.cuda.current_stream(self.device).synchronize()
                self.graphs.clear()
                self.mempool = torch.cuda.graph_pool_handle()  # the old pool went with its last graph
                self.cache_version = self.cache.version
            key = (B, kv_len, cpu)
            if key not in self.graphs:
                self._capture(key)
            graph, logits = self.graphs[key]
            graph.replay()
        out = logits[:n].clone()
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            self.finish()
        return out

    def finish(self) -> None:
        """Wait for the step and raise what a CPU job of it raised (jobs run on the driver's thread)."""
        torch.cuda.current_stream(self.device).synchronize()  # also: inputs_host may be rewritten now
        if self.hybrid is not None:
            for pool in self.hybrid.pools:
                pool.sync()

    def _forward(self, B: int, kv_len: int, cpu: bool = True) -> torch.Tensor:
        """The decode forward over the static inputs' first B rows -> logits fp32 [B, V]."""
        C = self.capacity
        ids = self.inputs[:B].view(B, 1)
        step = Step(self.inputs[C:C + B].view(B, 1), self.inputs[2 * C:2 * C + B], kv_len=kv_len, fused=self.fused,
                    captured=self.cuda_graph)
        n = self.inputs[3 * C:3 * C + 1]
        ctx = self.hybrid.step(n, cpu, mapped=self.fused) if self.hybrid is not None else nullcontext()
        with ctx:
            hidden = self.model(ids, step, self.cache)[:, -1]  # [B, H]
        return self.model.logits(hidden).float()

    def _capture(self, key: tuple) -> None:
        B, kv_len, cpu = key
        t0 = time.perf_counter()
        # Warm-up, eagerly on a side stream (lazy initialisations, the hybrid layers' buffers and jobs): it computes
        # this very step, so the replay that follows rewrites the same KV entries with the same values.
        # Recurrent states (linear attention) are not rewritten but advanced: the rows of this step are put back as
        # they were before the warm-up, so the replay advances them once.
        main = torch.cuda.current_stream(self.device)
        warm = torch.cuda.Stream(self.device)
        with kept_states(self.cache, self.inputs[2 * self.capacity:2 * self.capacity + B]):
            warm.wait_stream(main)  # (after the states' copy)
            with torch.cuda.stream(warm):
                self._forward(B, kv_len, cpu)
            main.wait_stream(warm)
            self.finish()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self._forward(B, kv_len, cpu)
        self.graphs[key] = (graph, logits)
        self.capture_s[key] = time.perf_counter() - t0
        if len(self.capture_s) == 1:
            self.log(f"hetmoe: captured the decode step as a CUDA graph (batch {B}, attending {kv_len} positions) "
                     f"in {1e3 * self.capture_s[key]:.0f} ms; other batch sizes"
                     f"{' and lengths' if self.kv_mode == 'bucket' else ''} are captured when first needed")

    def close(self) -> None:
        """Drop the graphs, then the host functions captured in them."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        if self.hybrid is not None:
            self.hybrid.close()

    def stats(self) -> dict:
        return {"cuda_graph": self.cuda_graph, "kv_mode": self.kv_mode, "fused": self.fused, "sizes": self.sizes,
                "graphs": len(self.graphs),
                "capture_ms": {f"B{b}_kv{kv}{'' if cpu else '_gpu_only'}": 1e3 * s
                               for (b, kv, cpu), s in self.capture_s.items()}}
