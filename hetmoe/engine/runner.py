"""The runner: a loaded model, its KV cache, and the forward calls of prefill and decode.

The cache holds ``max_batch`` sequences ("slots") of up to ``max_context`` positions each, on the model's device,
with memory for the positions in use (layers/kv_cache.py: pages on a GPU with Triton; ``reserve`` before each
call, ``release`` when a slot starts over). Prefill writes a prompt into one slot in chunks of ``prefill_chunk``
tokens (bounding activation memory for long prompts); decode advances one or several slots by one token each.
Every call builds the one ``Step`` (positions, slots) the model sees; the model itself keeps no state.

On a GPU, decode steps go through ``engine/cuda_graph.py`` (one CUDA graph per batch size, replayed every token;
``EngineOptions.cuda_graph=False`` runs the same step eagerly) and the MoE layers whose experts run on the CPU
through ``moe/stream.py`` (CPU jobs in CUDA stream order). Prefill stays eager; chunks of at least
``layerwise.min_tokens`` tokens compute their routed experts on the GPU (``moe/streamed/layerwise.py``).

A model with recurrent layers (linear attention: Qwen3-Next, Qwen3.5-MoE) keeps fixed-size states per slot beside
its KV cache (``recurrent``; layers/kv_cache.py ``RecurrentStates``). A state folds in every token it has seen and
cannot be cut back: a slot is continued from its end or written from position 0 (``prefill``'s ``start``), never
from a shorter prefix; chunked prefill carries it from chunk to chunk; a right-padded batch tells the layers each
row's length (``Step.lengths``). A call that fails inside the model may have advanced some layers' states and not
others: its slots are marked lost, and only a prefill from position 0 takes them again. On a GPU their decode steps
take the CUDA graph (whose capture runs the step twice: engine/cuda_graph.py puts the states back in between); on the
CPU they run the eager forward (said once at load): the lean CPU step does not cover them yet. DeepSeek-V4's
compressed attention (windows and compressor states of another kind) decodes eagerly, and so do models with sparse
attention (DeepSeek-V3.2, GLM-5: their indexer's keys sit in the KV cache, ``KVCache.indexer``), whose layers pick
the dense or the sparse form per step.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from typing import Callable, Optional, Sequence

import torch

from hetmoe import cpu
from hetmoe.engine.cpu_decode import CPUDecode
from hetmoe.engine.cuda_graph import GraphDecoder
from hetmoe.layers.attention import Step, paged_kernels
from hetmoe.layers.kv_cache import KVCacheFull, RecurrentStates
from hetmoe.layers.linear_attention import use_kernels
from hetmoe.load.loader import LoadedModel, moe_blocks
from hetmoe.moe import StreamDecode

KV_BUCKET = 64


def _say(msg: str) -> None:
    print(f"hetmoe: {msg}", file=sys.stderr, flush=True)


class Runner:
    def __init__(self, loaded: LoadedModel, *, cuda_graph: Optional[bool] = None, kv_mode: Optional[str] = None,
                 lean: bool = True, fused_decode: Optional[bool] = None):
        """``cuda_graph`` (default: ``loaded.options.cuda_graph``), ``kv_mode`` ("full" / "bucket", see
        engine/cuda_graph.py) and ``fused_decode`` (default: ``loaded.options.fused_decode`` is "on"; the fused
        kernels need Triton) apply to decode steps on a GPU only. ``lean``: one-token steps on the CPU take the
        lean decode step (engine/cpu_decode.py) where it covers the model; False keeps them eager."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.plan.device
        self.dtype = loaded.plan.dtype
        self.max_context = loaded.plan.max_context
        self.max_batch = loaded.options.max_batch
        self.prefill_chunk = loaded.plan.prefill_chunk  # larger when the plan holds the layerwise GPU prefill
        self.layerwise = loaded.layerwise
        if self.device.type == "cuda":
            # cuDNN's SDPA builds an execution graph on the CPU for every new shape, and decode changes the attended
            # length every step, so leave attention to the other kernels (BENCHMARKS.md#omp-wait-policy).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.decoder: Optional[GraphDecoder] = None
        self.hybrid: Optional[StreamDecode] = None
        rows = self.max_batch + (1 if self.device.type == "cuda" else 0)  # + the decoder's scratch slot
        paged = loaded.plan.kv_paged
        # KV memory (layers/kv_cache.py): on a GPU with the Triton kernels, pages for the positions in use; on the
        # CPU a capacity that grows with the longest sequence; the GPU's SDPA fallback holds every position up front
        # (growing there would re-capture the decode graphs)
        initial = rows * 4 * KV_BUCKET if paged else KV_BUCKET if self.device.type == "cpu" else None
        self.cache = self.model.make_cache(rows, self.max_context, self.dtype, self.device,
                                           page_size=KV_BUCKET if paged else None, initial_tokens=initial)
        self.reclaim: Optional[Callable[[], bool]] = None  # frees idle slots' caches when the KV memory runs out
        self.lengths = [0] * self.max_batch  # tokens in each slot's cache
        self.vocab_size = loaded.config.vocab_size
        self.recurrent = getattr(self.cache, "states", None) is not None  # recurrent layers: states per slot
        self.sparse = getattr(self.cache, "index_layers", 0) > 0  # DeepSeek Sparse Attention: indexer keys per slot
        self.sparse_topk: Optional[int] = None  # its dense positions where decode steps are captured (GraphDecoder)
        self.lost: set = set()  # slots whose recurrent states a failed call left half updated
        # what keeps those states, for the messages (a cache may say: DeepSeek-V4's compressed attention)
        self.state_owner = getattr(self.cache, "state_owner", "linear-attention layers")
        self.state_what = getattr(self.cache, "state_what", "recurrent states")
        kernels = use_kernels(self.model, self.device, self.dtype)
        if kernels is not None:
            _say(f"linear attention runs {kernels}")
        self.lean: Optional[CPUDecode] = None
        if self.device.type == "cpu" and lean:
            self.lean = None if self.recurrent else CPUDecode.build(self.model, self.cache)
            if self.recurrent:
                _say(f"decode steps run the eager forward: the lean CPU decode step does not cover {self.state_owner}")
        if self.device.type == "cuda":
            fused = loaded.options.fused_decode == "on" if fused_decode is None else fused_decode
            graph = loaded.options.cuda_graph if cuda_graph is None else cuda_graph
            if self.recurrent and not isinstance(self.cache.states, RecurrentStates) and (graph or fused):
                _say("decode steps run without CUDA graphs or the fused kernels: their capture does not cover the "
                     f"{self.state_owner}' {self.state_what} yet")
                graph = fused = False
            captures = getattr(self.model, "sparse_steps_captured", False)
            if self.sparse and not captures and (graph or fused):
                _say("decode steps run without CUDA graphs or the fused kernels: these sparse-attention layers choose "
                     "between dense and indexer-selected attention by context length on the host, which a graph "
                     "cannot")
                graph = fused = False
            if self.sparse and fused:
                _say("decode steps run without the fused kernels: the sparse-attention layers have no fused step")
                fused = False
            self.sparse_topk = self.model.dense_positions if self.sparse and captures else None
            why = getattr(self.model, "eager_decode", None)  # e.g. attention the graphs' kernels do not compute
            if why and (graph or fused):
                _say(f"decode steps run without CUDA graphs or the fused kernels: {why}")
                graph = fused = False
            self._setup_decoder(graph, kv_mode, fused and paged_kernels(self.device))

    def _setup_decoder(self, cuda_graph: bool, kv_mode: Optional[str], fused: bool) -> None:
        offloaded = [layer for _, layer in moe_blocks(self.model) if layer.staging is not None]
        decoder_kwargs = {"kv_mode": kv_mode} if kv_mode else {}
        if offloaded:
            if not cpu.cuda_hooks_available():  # no cuLaunchHostFunc: decode keeps the synchronous path
                print(f"hetmoe: decode without CUDA graphs: {cpu._C.cuda_hooks_error()}", file=sys.stderr)
                return
            self.hybrid = StreamDecode(GraphDecoder.capacity_for(self.max_batch), self.device, offloaded)
        self.decoder = GraphDecoder(self.model, self.cache, self.max_batch, self.max_context, self.device,
                                    self.hybrid, cuda_graph, fused=fused, sparse_topk=self.sparse_topk,
                                    **decoder_kwargs)

    def reserve(self, slot: int, length: int) -> None:
        """KV positions [0, length) of ``slot`` held; when the memory is out, ``reclaim`` (the scheduler's: drop
        idle slots' cached prefixes) runs once and the reservation is tried again, else KVCacheFull."""
        try:
            self.cache.reserve(slot, length)
        except KVCacheFull:
            if self.reclaim is None or not self.reclaim():
                raise
            self.cache.reserve(slot, length)

    def release(self, slot: int, keep: int = 0) -> None:
        """``slot`` keeps only its first ``keep`` cached positions (the rest of its KV memory is freed). A model with
        recurrent states keeps all of a slot's tokens or none (ValueError otherwise); none zeroes its states."""
        self._check_slot(slot)
        if self.recurrent and 0 < keep < self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} tokens in recurrent states, which cannot be cut "
                             f"back to {keep}: keep all of them or none (0)")
        self.cache.release(slot, keep)
        self.lengths[slot] = min(self.lengths[slot], keep)
        if keep == 0:
            self.lost.discard(slot)

    def synchronize(self) -> None:
        """Wait for the work queued on the model's device (timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                last_only: bool = True, last: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids, positions [B, S] and slots [B] -> logits of each sequence's last token, fp32 [B, vocab]
        (``last``: the index in S of each row's last real token, for right-padded rows; ``last_only=False``:
        logits of every token, [B, S, vocab])."""
        kv_len = int(positions.max()) + 1
        if kv_len > self.max_context:
            raise ValueError(f"position {kv_len - 1} is beyond max_context={self.max_context}")
        # attend over a length rounded up to KV_BUCKET (positions past a token's own are masked): few distinct shapes
        kv_len = min(self.max_context, -(-kv_len // KV_BUCKET) * KV_BUCKET)
        first = int(slots[0])
        consecutive = bool((slots == torch.arange(first, first + len(slots))).all())
        for s, top in zip(slots.tolist(), positions.max(dim=1).values.tolist()):
            self.reserve(s, top + 1)
        start = int(positions[0, 0]) if len(slots) == 1 else None  # one row: its positions are consecutive
        lengths = (last + 1).to(self.device) if last is not None and self.recurrent else None
        step = Step(positions.to(self.device), slots.to(self.device), kv_len=kv_len,
                    first_slot=first if consecutive else None, start=start, lengths=lengths)
        layerwise = self.layerwise is not None and self.layerwise.wants(ids.numel())
        if self.lean is not None and ids.shape[1] == 1 and not layerwise:
            logits = self.lean(ids, step.positions, step.slots)  # [B, vocab] fp32: the one token of each row
            return logits if last is not None or last_only else logits[:, None]
        with self._states_of(slots.tolist()):
            with self.layerwise.prefill(ids.numel()) if layerwise else nullcontext():  # routed experts on the GPU
                hidden = self.model(ids.to(self.device), step, self.cache)
        if last is not None:
            hidden = hidden[torch.arange(len(last), device=hidden.device), last.to(hidden.device)]  # [B, H]
        elif last_only:
            hidden = hidden[:, -1]
        return self.model.logits(hidden).float()

    @contextmanager
    def _states_of(self, slots: list):
        """Around a call that advances the recurrent states of ``slots``: an exception marks them lost."""
        try:
            yield
        except BaseException:
            if self.recurrent:
                self.lost.update(slots)
            raise

    def _check_continuation(self, slot: int, start: int) -> None:
        """A model with recurrent states continues ``slot`` from position ``start`` only where its states stand."""
        if not self.recurrent or start == 0:
            return
        if slot in self.lost:
            raise ValueError(f"the recurrent states of slot {slot} were lost when an earlier call on it failed: write "
                             "its sequence again from position 0")
        if start != self.lengths[slot]:
            raise ValueError(f"start {start}: slot {slot}'s recurrent states hold its {self.lengths[slot]} tokens and "
                             f"cannot be rewound; continue from {self.lengths[slot]} or start over from 0")

    def _check_prompt(self, token_ids: Sequence[int], slot: int, start: int) -> torch.Tensor:
        self._check_slot(slot)
        n = len(token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (no tokens)")
        if start + n > self.max_context:
            raise ValueError(f"the prompt is {start + n} tokens; the context holds {self.max_context} (--max-context)")
        if not 0 <= start <= self.lengths[slot]:
            raise ValueError(f"start {start} is beyond the {self.lengths[slot]} tokens cached in slot {slot}")
        self._check_continuation(slot, start)
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {int(ids.min())}..{int(ids.max())}")
        return ids

    def prefill(self, token_ids: Sequence[int], slot: int = 0, start: int = 0,
                all_logits: bool = False) -> torch.Tensor:
        """Write a prompt into ``slot`` from position ``start`` (0: replace what it held; > 0: keep the first
        ``start`` cached tokens, a shared prefix); logits after its last token, fp32 [vocab] (``all_logits``: after
        every one of ``token_ids``, fp32 [n, vocab] on the model's device: prompt log-probabilities)."""
        ids = self._check_prompt(token_ids, slot, start)
        n = len(ids)
        self.cache.release(slot, start)  # pages past the kept prefix go back (a longer earlier sequence's)
        if start == 0:
            self.lost.discard(slot)  # (position 0: the recurrent layers start from zero states)
        slots = torch.tensor([slot])
        rows = []
        for i in range(0, n, self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            logits = self.forward(chunk[None], torch.arange(start + i, start + i + len(chunk))[None], slots,
                                  last_only=not all_logits)
            rows.append(logits[0])
        self.lengths[slot] = start + n
        return torch.cat(rows) if all_logits else rows[-1]

    def score(self, token_ids: Sequence[int], slot: int = 0) -> torch.Tensor:
        """Write ``token_ids`` into ``slot`` from position 0, as prefill does, and return the logits after every
        token, fp32 [n, vocab] (row i predicts token i + 1): what perplexity and evaluation need."""
        self._check_slot(slot)
        n = len(token_ids)
        if n == 0:
            raise ValueError("nothing to score (no tokens)")
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if n > self.max_context:
            raise ValueError(f"{n} tokens do not fit the context of {self.max_context} (--max-context)")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {int(ids.min())}..{int(ids.max())}")
        out = torch.empty(n, self.vocab_size, dtype=torch.float32)
        self.cache.release(slot, 0)
        self.lost.discard(slot)
        for i in range(0, n, self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            logits = self.forward(chunk[None], torch.arange(i, i + len(chunk))[None], torch.tensor([slot]), False)
            out[i:i + len(chunk)] = logits[0].cpu()
        self.lengths[slot] = n
        return out

    def prefill_batch(self, chunks: Sequence[Sequence[int]], slots: Sequence[int],
                      starts: Sequence[int]) -> torch.Tensor:
        """Prompt chunks of several slots in one forward call (each written from its ``start``, at most
        ``prefill_chunk`` tokens) -> logits after each chunk's last token, fp32 [B, vocab].

        Rows are right-padded to the longest chunk; a padding token sits past its row's real tokens, so they
        never attend to it, and it writes only cache positions the sequence overwrites later. A row whose padding
        would run past max_context is refused (ValueError): prefill it alone."""
        if len(set(slots)) != len(slots) or len(chunks) != len(slots) or len(starts) != len(slots):
            raise ValueError("prefill_batch needs one chunk and one start per distinct slot")
        rows = [self._check_prompt(c, s, st) for c, s, st in zip(chunks, slots, starts)]
        S = max(len(r) for r in rows)
        if S > self.prefill_chunk:
            raise ValueError(f"a chunk of {S} tokens is longer than prefill_chunk={self.prefill_chunk}")
        if max(st for st in starts) + S > self.max_context:
            raise ValueError("the padded batch runs past max_context: prefill these rows one by one")
        ids = torch.zeros(len(rows), S, dtype=torch.int64)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = r
        positions = torch.tensor(list(starts)).unsqueeze(1) + torch.arange(S)
        last = torch.tensor([len(r) - 1 for r in rows])
        self.lost.difference_update(s for s, st in zip(slots, starts) if st == 0)
        logits = self.forward(ids, positions, torch.tensor(list(slots)), last=last)
        for s, st, r in zip(slots, starts, rows):
            self.lengths[s] = st + len(r)
        return logits

    def decode(self, token_id: int, slot: int = 0) -> torch.Tensor:
        """Append one token to ``slot``; logits after it, fp32 [vocab]."""
        return self.decode_batch([token_id], [slot])[0]

    def decode_batch(self, token_ids: Sequence[int], slots: Sequence[int],
                     meanwhile: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """One token for each of several slots (their positions may differ) -> fp32 [B, vocab]. ``meanwhile()``:
        host work (the scheduler's constraint masks) run while the GPU computes the step (on the CPU: before it)."""
        token_ids, slots = [int(t) for t in token_ids], [int(s) for s in slots]
        if not slots or len(token_ids) != len(slots):
            raise ValueError(
                f"decode_batch needs one token per slot, got {len(token_ids)} tokens for {len(slots)} slots")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} repeat a slot (one token per slot and step)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[0]}")
        for s in slots:
            self._check_slot(s)
            if self.lengths[s] >= self.max_context:
                raise ValueError(f"slot {s} is full ({self.max_context} tokens, --max-context)")
            self._check_continuation(s, self.lengths[s])
        for s in slots:
            self.reserve(s, self.lengths[s] + 1)
        if self.decoder is not None:
            with self._states_of(slots):
                logits = self.decoder.step(token_ids, [self.lengths[s] for s in slots], slots, meanwhile=meanwhile)
        else:
            if meanwhile is not None:
                meanwhile()
            positions = torch.tensor([[self.lengths[s]] for s in slots])
            logits = self.forward(torch.tensor([[int(t)] for t in token_ids]), positions, torch.tensor(list(slots)))
        for s in slots:
            self.lengths[s] += 1
        return logits

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot} is outside [0, {self.max_batch}) (max_batch)")
