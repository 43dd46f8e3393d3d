"""The engine's runner interface over a Transformers model (hetmoe/engine/scheduler.py drives it like
``hetmoe.engine.runner.Runner``): ``hetmoe generate/chat/serve --model DIR`` for a model_type that hetmoe has no
model file for but Transformers implements with the experts interface.

Each of the ``max_batch`` slots keeps its own Transformers cache (whatever the model makes: attention KV,
linear-attention state) and the tokens it holds. Prefill and decode are eager forward calls, one slot at a time
(no CUDA graphs, no Expert Deferral: those belong to the native runner). A prefix reused from a slot's cache is
cropped to where the cache holds attention KV only, else the slot is recomputed from its kept tokens. The cache goes
in and comes back under the name the installed Transformers gives it: ``cache`` (5.24 on) or ``past_key_values``
(5.7 to 5.23).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from hetmoe.transformers.backend import SUPPORTED

DEFAULT_CONTEXT = 4096
CACHE_NAMES = ("cache", "past_key_values")  # the forward keyword and output field, newest name first
# a recurrent state, or a compressor's running state (DeepSeek-V4's compressed KV): its crop leaves it stale
STATE_ATTRS = ("conv_states", "recurrent_states", "ssm_states", "linear_cache", "compressed_kv", "buffer_kv")


def transformers_class(model_type: Optional[str]) -> Optional[str]:
    """The Transformers causal-LM class name for ``model_type`` when its experts go through the experts interface
    (so the hetmoe backend can run it), else None. Imports the model's module."""
    if not model_type:
        return None
    try:
        import importlib

        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        return None
    try:
        import transformers

        cls = getattr(transformers, name)
        module = importlib.import_module(cls.__module__)
    except (AttributeError, ImportError):
        return None
    source = Path(module.__file__).read_text(encoding="utf-8") if module.__file__ else ""
    return name if "@use_experts_implementation" in source else None


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache under: ``cache`` (Transformers 5.24 on, where
    ``past_key_values`` is a deprecated alias) or ``past_key_values`` (5.7 to 5.23)."""
    import inspect

    params = inspect.signature(model.forward).parameters  # through deprecate_kwarg's wrapper (functools.wraps)
    for name in CACHE_NAMES:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither of {', '.join(CACHE_NAMES)}: the hetmoe "
                    f"runner cannot keep its cache (supported: transformers {SUPPORTED})")


def returned_cache(out):
    """The cache a forward call returned: ``out.cache`` (5.24 on; there ``past_key_values`` is a deprecated alias),
    else ``out.past_key_values`` (the output classes of 5.7 to 5.23 have no ``cache``)."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError(f"{type(out).__name__} holds no cache (neither .cache nor .past_key_values) although "
                           "use_cache=True was passed")
    return cache


def croppable(cache) -> bool:
    """Whether ``cache.crop`` can roll ``cache`` back: attention KV only. A cache or cache layer keeping a recurrent
    state (linear attention, SSM) is recomputed instead: its crop raises (Transformers 5.17 on: it rolls back only a
    state whose past it recorded) or leaves the state as it was without a word (5.7's linear-attention layer), and a
    stale state would be a wrong answer."""
    if cache is None or not hasattr(cache, "crop"):
        return False
    for part in (cache, *getattr(cache, "layers", ())):
        if any(hasattr(part, a) for a in STATE_ATTRS) or \
                any(c.__name__.startswith("LinearAttention") for c in type(part).__mro__):
            return False
    return True


@dataclass
class _Plan:
    """What the CLI and server read of ``LoadedModel.plan``."""

    device: torch.device
    dtype: torch.dtype
    experts_format: str
    group_size: int
    max_context: int
    dense_format: str = "bf16"  # of the dense linears (hetmoe/transformers/dense.py)


@dataclass
class TransformersLoaded:
    """``LLM.loaded`` for a model run through Transformers: the model, its config and the placement."""

    model: object
    config: dict
    plan: _Plan
    options: object
    path: Optional[Path] = None
    info: dict = field(default_factory=dict)
    layerwise: None = None

    @property
    def device(self) -> torch.device:
        return self.plan.device


class TransformersRunner:
    """prefill / prefill_batch / decode_batch / score over a Transformers causal LM, ``max_batch`` slots."""

    def __init__(self, model, max_batch: int = 1, max_context: Optional[int] = None, prefill_chunk: int = 1024):
        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        limit = getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT
        self.max_context = int(max_context or min(DEFAULT_CONTEXT, limit))
        self.max_batch = int(max_batch)
        self.prefill_chunk = int(prefill_chunk)
        self.vocab_size = int(cfg.vocab_size)
        self.device = next(p.device for p in model.parameters())
        self.cache_keyword = cache_keyword(model)
        self.caches: list = [None] * self.max_batch
        self.tokens: list = [[] for _ in range(self.max_batch)]  # what each slot's cache holds

    @property
    def lengths(self) -> list:
        return [len(t) for t in self.tokens]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_batch:
            raise ValueError(f"slot {slot} is outside [0, {self.max_batch}) (max_batch)")

    def _check_ids(self, ids: Sequence[int]) -> list:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[0]}")
        return ids

    @torch.inference_mode()
    def _forward(self, slot: int, ids: list, all_logits: bool = False) -> torch.Tensor:
        """Append ``ids`` to ``slot``'s cache -> fp32 logits of the last token [V] (all: [n, V], on the CPU)."""
        if len(self.tokens[slot]) + len(ids) > self.max_context:
            raise ValueError(f"{len(self.tokens[slot]) + len(ids)} tokens do not fit the context of "
                             f"{self.max_context} (--max-context)")
        rows = []
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            out = self.model(input_ids=torch.tensor([chunk], device=self.device),
                             **{self.cache_keyword: self.caches[slot]}, use_cache=True,
                             logits_to_keep=0 if all_logits else 1)
            self.caches[slot] = returned_cache(out)
            self.tokens[slot] += chunk
            rows.append(out.logits[0].float().cpu() if all_logits else out.logits[0, -1].float())
        return torch.cat(rows) if all_logits else rows[-1]

    def _keep(self, slot: int, start: int) -> list:
        """Make ``slot`` hold its first ``start`` tokens; -> the tokens still to recompute (none when cropped)."""
        held = self.tokens[slot]
        if not 0 <= start <= len(held):
            raise ValueError(f"start {start} is beyond the {len(held)} tokens cached in slot {slot}")
        if start == len(held):
            return []
        cache = self.caches[slot]
        if start > 0 and croppable(cache):
            try:
                cache.crop(start - len(held))  # minus the number of tokens to remove (every 5.x reads it so)
                if cache.get_seq_length() == start:
                    self.tokens[slot] = held[:start]
                    return []
            except (RuntimeError, NotImplementedError, ValueError, AttributeError, TypeError):
                pass  # e.g. a sliding window already past its size
        self.caches[slot], self.tokens[slot] = None, []
        return held[:start]

    def prefill(self, token_ids: Sequence[int], slot: int = 0, start: int = 0,
                all_logits: bool = False) -> torch.Tensor:
        """Write a prompt into ``slot`` after its first ``start`` cached tokens -> fp32 logits [vocab]
        (``all_logits``: after each of ``token_ids``, [n, vocab])."""
        self._check_slot(slot)
        ids = self._check_ids(token_ids)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if start + len(ids) > self.max_context:
            raise ValueError(f"the prompt is {start + len(ids)} tokens; the context holds {self.max_context} "
                             "(--max-context)")
        redo = self._keep(slot, start)
        if all_logits:
            return self._forward(slot, redo + ids, all_logits=True)[len(redo):]
        return self._forward(slot, redo + ids)

    def prefill_batch(self, chunks: Sequence[Sequence[int]], slots: Sequence[int],
                      starts: Sequence[int]) -> torch.Tensor:
        if len(set(slots)) != len(slots) or len(chunks) != len(slots) or len(starts) != len(slots):
            raise ValueError("prefill_batch needs one chunk and one start per distinct slot")
        return torch.stack([self.prefill(c, s, st) for c, s, st in zip(chunks, slots, starts)])

    def decode(self, token_id: int, slot: int = 0) -> torch.Tensor:
        return self.decode_batch([token_id], [slot])[0]

    def decode_batch(self, token_ids: Sequence[int], slots: Sequence[int],
                     meanwhile: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """One token for each of several slots -> fp32 [B, vocab] (one forward call per slot). ``meanwhile()``:
        the scheduler's host work for the step (run first: these calls are not overlapped with it)."""
        token_ids, slots = self._check_ids(token_ids), [int(s) for s in slots]
        if not slots or len(token_ids) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"decode_batch needs one token per distinct slot, got {len(token_ids)} tokens for "
                             f"slots {slots}")
        for s in slots:
            self._check_slot(s)
        if meanwhile is not None:
            meanwhile()
            if len(self.tokens[s]) >= self.max_context:
                raise ValueError(f"slot {s} is full ({self.max_context} tokens, --max-context)")
        return torch.stack([self._forward(s, [t]) for t, s in zip(token_ids, slots)])

    def score(self, token_ids: Sequence[int], slot: int = 0) -> torch.Tensor:
        """``token_ids`` written into ``slot`` from position 0 -> fp32 logits after every token [n, vocab]."""
        self._check_slot(slot)
        ids = self._check_ids(token_ids)
        if not ids:
            raise ValueError("nothing to score (no tokens)")
        self.caches[slot], self.tokens[slot] = None, []
        return self._forward(slot, ids, all_logits=True)


def open_transformers(path, options, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)):
    """(TransformersLoaded, TransformersRunner) of the checkpoint directory ``path`` under EngineOptions
    ``options`` (device, experts format, dense format, group size, threads, ISA, NUMA, dtype, max_batch, max_context,
    prefill_chunk; the native runner's deferral, GPU experts and GPU prefill do not apply and are refused)."""
    from hetmoe.config.options import EngineOptions
    from hetmoe.transformers.loading import from_pretrained

    options = options or EngineOptions()
    for name, off in (("defer_experts", 0), ("gpu_experts", 0)):
        if getattr(options, name) != off:
            raise ValueError(f"--{name.replace('_', '-')} is not available for a model run through Transformers "
                             "(native model types only)")
    model = from_pretrained(path, getattr(options, "rules", None), experts_format=options.experts_format,
                            device=options.device, threads=options.threads, group_size=options.group_size,
                            dtype=options.dtype, isa=options.isa, numa=options.numa,
                            dense_format=getattr(options, "dense_format", "auto"), log=log)
    info = model.hetmoe_info
    runner = TransformersRunner(model, options.max_batch, options.max_context, options.prefill_chunk)
    plan = _Plan(runner.device, info["dtype"], info["experts_format"], info["group_size"], runner.max_context,
                 info["dense_format"])
    from hetmoe.load.checkpoint import read_config

    return TransformersLoaded(model, read_config(Path(path)), plan, options, Path(path), info), runner
