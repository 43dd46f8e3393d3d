"""The KV cache: keys and values of every layer for ``rows`` sequences of up to ``max_context`` positions, held
for the positions in use, not for every row's full context.

Two layouts, one interface (``reserve`` / ``release`` / ``write`` / ``rows``):

* **paged** (``page_size`` given; on a GPU with Triton, read by ops/triton/attention.py): a pool of pages
  [layers, n_pages, P, kv_heads, D] and a page table [rows, pages_per_row] int32 on the device. ``reserve(row, n)``
  hands the row pages for positions < n from the pool, which grows (doubling, up to every row's full context) when
  it runs dry. Page 0 is never handed out: table entries not yet assigned point at it, so a padding row or the
  decoder's scratch row writes there and harms no sequence.
* **contiguous** (CPU, or a GPU without Triton): [layers, rows, capacity, kv_heads, D]; ``reserve`` grows the
  capacity every row shares (doubling, up to ``max_context``).

Growing reallocates the storage: ``version`` counts reallocations, and whoever captured the old tensors in a CUDA
graph (engine/cuda_graph.py) drops those graphs. A pool that cannot grow raises ``KVCacheFull``.

A model with recurrent layers (linear attention: layers/linear_attention.py) gives its cache ``states``
(``RecurrentStates``): per slot and recurrent layer a fixed-size state, whatever the sequence's length, beside the
keys and values of its attention layers (``n_layers`` counts those only; each model maps its layers to rows of
either). A slot released whole (``release(row, 0)``) has its states zeroed with its positions. A state cannot be
rewound: a slot continues from its end, or starts over from position 0.

A model with DeepSeek Sparse Attention (layers/sparse_attention.py) gives its cache ``indexer`` = (layers, D): the
lightning indexer's key, one vector of D per position and indexer layer, kept beside the latents in the same layout
(pages or rows, reserved, grown and released with them), written from the first token on (``write_index``) and read
by ``index_rows``.
"""

from __future__ import annotations

from typing import Optional

import torch

GROW_ALIGN = 64  # contiguous capacity grows in multiples of this many positions


class KVCacheFull(MemoryError):
    """The cache cannot hold more positions (its device is out of memory)."""


class RecurrentStates:
    """The fixed-size states of a model's recurrent layers for ``rows`` slots, allocated once: ``conv``
    [layers, rows, channels, width] in the model dtype (the last ``width`` inputs of a causal convolution) and
    ``recurrent`` [layers, rows, heads, k_dim, v_dim] fp32 (a linear-attention state). Zero is the state of a
    sequence that has not started."""

    def __init__(self, n_layers: int, rows: int, conv_channels: int, conv_width: int, heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        self.n_layers, self.n_rows = n_layers, rows
        device = torch.device(device)
        try:
            self.conv = torch.zeros(n_layers, rows, conv_channels, conv_width, dtype=dtype, device=device)
            self.recurrent = torch.zeros(n_layers, rows, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        except torch.OutOfMemoryError as e:
            need = n_layers * rows * (conv_channels * conv_width * dtype.itemsize + heads * k_dim * v_dim * 4)
            raise KVCacheFull(f"the recurrent states of {rows} slots ({need / 2**30:.2f} GiB) do not fit the "
                              f"{device.type} memory; use a smaller --max-batch") from e

    @property
    def bytes_per_row(self) -> int:
        """Bytes one slot's states take over all recurrent layers (the same at any context length)."""
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())

    @property
    def bytes_allocated(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()

    def reset(self, row: int) -> None:
        """Slot ``row`` holds no sequence: its states are zero."""
        self.conv[:, row].zero_()
        self.recurrent[:, row].zero_()


class KVCache:
    def __init__(self, n_layers: int, rows: int, max_context: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", v_head_dim: Optional[int] = None, *,
                 page_size: Optional[int] = None, initial_tokens: Optional[int] = None,
                 states: Optional[RecurrentStates] = None, indexer: Optional[tuple] = None):
        """``initial_tokens``: positions allocated up front (paged: in the pool; contiguous: per row; default
        ``max_context`` per row for contiguous, a few pages per row for paged). ``states``: the recurrent layers'
        states of the same ``rows`` (module docstring), or None. ``indexer``: (layers, D) of the sparse-attention
        indexer's keys (module docstring), or None."""
        if states is not None and states.n_rows != rows:
            raise ValueError(f"recurrent states of {states.n_rows} rows for a cache of {rows}")
        self.states = states
        self.n_layers, self.n_rows, self.max_context = n_layers, rows, max_context
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim  # 0: keys only (NoPE MLA's latent)
        self.dtype, self.device = dtype, torch.device(device)
        self.index_layers, self.index_dim = indexer or (0, 0)
        self.ik = None  # the indexer's keys: [index_layers, *layout, index_dim] (module docstring), or None
        self.paged = page_size is not None
        self.page_size = page_size or max_context
        self.version = 0
        self.k = self.v = None
        if self.paged:
            P = page_size
            self.pages_per_row = -(-max_context // P)
            self.max_pages = rows * self.pages_per_row + 1
            want = -(-(initial_tokens or rows * 4 * P) // P) + 1
            self.table = torch.zeros(rows, self.pages_per_row, dtype=torch.int32, device=self.device)
            self.owned = [[] for _ in range(rows)]  # the pages each row holds, in position order
            self.free: list = []
            self.n_pages = 1
            self._grow_pool(min(self.max_pages, max(2, want)))
        else:
            self.capacity = 0
            self._grow_rows(min(max_context, initial_tokens or max_context))

    # ------------------------------------------------------------------ sizes
    @property
    def elems_per_token(self) -> int:
        """Elements one position takes over all layers, keys and values (and the indexer's keys)."""
        return self.n_layers * self.kv_heads * (self.head_dim + self.v_head_dim) + self.index_layers * self.index_dim

    @property
    def bytes_allocated(self) -> int:
        states = self.states.bytes_allocated if self.states is not None else 0
        index = self.ik.numel() * self.ik.element_size() if self.ik is not None else 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size() + states + index

    def _alloc(self, *shape_tail) -> tuple:
        k = torch.zeros(self.n_layers, *shape_tail, self.kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros(self.n_layers, *shape_tail, self.kv_heads, self.v_head_dim, dtype=self.dtype,
                        device=self.device)
        ik = (torch.zeros(self.index_layers, *shape_tail, self.index_dim, dtype=self.dtype, device=self.device)
              if self.index_layers else None)
        return k, v, ik

    def _alloc_or_full(self, what: str, *shape_tail) -> tuple:
        try:
            return self._alloc(*shape_tail)
        except torch.OutOfMemoryError as e:
            need = self.elems_per_token * torch.Size(shape_tail).numel() * self.dtype.itemsize
            raise KVCacheFull(f"the KV cache cannot grow to {what} ({need / 2**30:.2f} GiB): the {self.device.type} "
                              "memory is full; use a smaller --max-batch or --max-context, or shorter prompts") from e

    def _realloc(self, what: str, dim: int, *shape_tail) -> None:
        """Storage of ``shape_tail`` ([layers, *shape_tail, heads, D]), the old contents at the start of ``dim``."""
        k, v, ik = self._alloc_or_full(what, *shape_tail)
        if self.k is not None:
            k.narrow(dim, 0, self.k.shape[dim]).copy_(self.k)
            v.narrow(dim, 0, self.v.shape[dim]).copy_(self.v)
            if ik is not None:
                ik.narrow(dim, 0, self.ik.shape[dim]).copy_(self.ik)
        self.k, self.v, self.ik = k, v, ik
        self.version += 1

    def _grow_pool(self, n_pages: int) -> None:
        self._realloc(f"{n_pages - 1} pages of {self.page_size} positions", 1, n_pages, self.page_size)
        self.free.extend(range(n_pages - 1, self.n_pages - 1, -1))  # pop() hands out the lowest first
        self.n_pages = n_pages

    def _grow_rows(self, capacity: int) -> None:
        self._realloc(f"{capacity} positions per row", 2, self.n_rows, capacity)
        self.capacity = capacity

    # ------------------------------------------------------------------ positions in use
    def reserve(self, row: int, length: int) -> None:
        """Make positions [0, length) of ``row`` writable (KVCacheFull when the memory is not there)."""
        if length > self.max_context:
            raise ValueError(f"position {length - 1} is beyond max_context={self.max_context}")
        if not self.paged:
            if length > self.capacity:
                grown = max(length, min(self.max_context, 2 * self.capacity))
                self._grow_rows(min(self.max_context, -(-grown // GROW_ALIGN) * GROW_ALIGN))
            return
        owned = self.owned[row]
        need = -(-length // self.page_size) - len(owned)
        if need <= 0:
            return
        if need > len(self.free):
            short = need - len(self.free)
            target = min(self.max_pages, max(self.n_pages + short, 2 * self.n_pages))
            try:
                self._grow_pool(target)
            except KVCacheFull:
                if target == self.n_pages + short:
                    raise
                self._grow_pool(self.n_pages + short)  # doubling did not fit: just what this row needs
        new = [self.free.pop() for _ in range(need)]
        first = len(owned)
        owned.extend(new)
        self.table[row, first:first + need] = torch.tensor(new, dtype=torch.int32).to(self.device)

    def release(self, row: int, keep: int = 0) -> None:
        """Positions >= ``keep`` of ``row`` are no longer needed (paged: their pages return to the pool); with
        ``keep`` 0 its recurrent states are zeroed too (a state cannot be cut at another length)."""
        if keep == 0 and self.states is not None:
            self.states.reset(row)
        if not self.paged:
            return
        owned = self.owned[row]
        keep_pages = -(-keep // self.page_size)
        if len(owned) > keep_pages:
            self.free.extend(reversed(owned[keep_pages:]))
            del owned[keep_pages:]
            self.table[row, keep_pages:] = 0

    def tokens_held(self) -> int:
        """Positions allocated for sequences (paged: pages handed out x page size; contiguous: rows x capacity)."""
        if self.paged:
            return sum(len(o) for o in self.owned) * self.page_size
        return self.n_rows * self.capacity

    # ------------------------------------------------------------------ reads and writes
    def write(self, layer: int, step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [B, S, kv_heads, D] at the step's positions of its rows (``step.slots``)."""
        if not self.paged:
            if step.kv_len is None and int(step.positions.max()) >= self.capacity:
                raise ValueError(f"position {int(step.positions.max())} is beyond the {self.capacity} positions "
                                 f"reserved (max_context={self.max_context})")
            rows = step.slots.unsqueeze(1).expand_as(step.positions)
            self.k[layer].index_put_((rows, step.positions), k.to(self.k.dtype))
            self.v[layer].index_put_((rows, step.positions), v.to(self.v.dtype))
            return
        P = self.page_size
        page = self.table[step.slots.unsqueeze(1), step.positions // P].long()  # [B, S]
        flat = (page * P + step.positions % P).reshape(-1)
        self.k[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(
            0, flat, k.reshape(-1, self.kv_heads, self.head_dim).to(self.dtype))
        self.v[layer].flatten(0, 1).index_copy_(0, flat, v.flatten(0, 1).to(self.dtype))  # (flatten: Dv may be 0)

    def rows(self, layer: int, step) -> tuple:
        """This layer's keys and values of the step's rows, [B, ctx, kv_heads, D] each: ctx = step.kv_len (or all
        positions held), rounded up to whole pages when paged (then a gathered copy; contiguous: views when
        step.first_slot is given). Positions past a row's own are stale or zero: attention masks them."""
        if not self.paged:
            n = min(step.kv_len or self.capacity, self.capacity)
            if step.first_slot is not None:
                b = slice(step.first_slot, step.first_slot + step.slots.shape[0])
                return self.k[layer, b, :n], self.v[layer, b, :n]
            return self.k[layer][step.slots, :n], self.v[layer][step.slots, :n]
        n_pages = min(-(-(step.kv_len or self.max_context) // self.page_size), self.pages_per_row)
        pages = self.table[step.slots, :n_pages].long()  # [B, n_pages]
        B = pages.shape[0]
        k = self.k[layer][pages].view(B, n_pages * self.page_size, self.kv_heads, self.head_dim)
        v = self.v[layer][pages].view(B, n_pages * self.page_size, self.kv_heads, self.v_head_dim)
        return k, v

    def rows_at(self, layer: int, step, index: torch.Tensor) -> tuple:
        """This layer's keys and values at cache positions ``index`` [B, S, k] of the step's rows -> [B, S, k,
        kv_heads, D] each: only those positions read (through the page table when paged), no host read, so a CUDA
        graph can capture it. Positions past a row's own are stale or zero (the caller masks them)."""
        B = step.slots.shape[0]
        slots = step.slots.view(B, 1, 1)
        if self.paged:
            P = self.page_size
            flat = self.table[slots, index // P].long() * P + index % P  # [B, S, k]
        else:
            flat = slots * self.k.shape[2] + index
        return (self.k[layer].view(-1, self.kv_heads, self.head_dim)[flat],
                self.v[layer].view(-1, self.kv_heads, self.v_head_dim)[flat])

    def write_index(self, layer: int, step, keys: torch.Tensor) -> None:
        """Store the indexer's keys [B, S, index_dim] of indexer layer ``layer`` at the step's positions of its rows,
        as ``write`` stores keys and values."""
        if not self.paged:
            if step.kv_len is None and int(step.positions.max()) >= self.capacity:
                raise ValueError(f"position {int(step.positions.max())} is beyond the {self.capacity} positions "
                                 f"reserved (max_context={self.max_context})")
            rows = step.slots.unsqueeze(1).expand_as(step.positions)
            self.ik[layer].index_put_((rows, step.positions), keys.to(self.dtype))
            return
        P = self.page_size
        page = self.table[step.slots.unsqueeze(1), step.positions // P].long()  # [B, S]
        flat = (page * P + step.positions % P).reshape(-1)
        self.ik[layer].view(-1, self.index_dim).index_copy_(0, flat, keys.reshape(-1, self.index_dim).to(self.dtype))

    def index_rows(self, layer: int, step) -> torch.Tensor:
        """The indexer's keys of indexer layer ``layer`` for the step's rows, [B, ctx, index_dim], ctx as ``rows``
        gives it for the same step (positions aligned with the latents')."""
        if not self.paged:
            n = min(step.kv_len or self.capacity, self.capacity)
            if step.first_slot is not None:
                return self.ik[layer, step.first_slot:step.first_slot + step.slots.shape[0], :n]
            return self.ik[layer][step.slots, :n]
        n_pages = min(-(-(step.kv_len or self.max_context) // self.page_size), self.pages_per_row)
        pages = self.table[step.slots, :n_pages].long()  # [B, n_pages]
        return self.ik[layer][pages].view(pages.shape[0], n_pages * self.page_size, self.index_dim)

    def layout(self, layer: int) -> tuple:
        """What a kernel that writes this layer's keys and values needs (ops/triton/fused.py): (k, v, table,
        P) with k/v [pages, P, kv_heads, D(v)]. Paged: the pools and the page table; contiguous: row r is page r
        of P = capacity positions, table None."""
        if self.paged:
            return self.k[layer], self.v[layer], self.table, self.page_size
        return self.k[layer], self.v[layer], None, self.capacity

    def pages(self, layer: int) -> tuple:
        """The paged layout's pools of one layer: k [n_pages, P, kv_heads, D], v [n_pages, P, kv_heads, Dv]."""
        return self.k[layer], self.v[layer]
