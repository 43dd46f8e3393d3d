"""``hetmoe tune``: which engine options decode fastest on this machine, within an accuracy bound, measured.

Stages, each over a small candidate set, each stage's winner kept for the next (coordinate descent: minutes, not a
grid search over hours):

    threads       the expert threads: physical cores, one and two fewer (with a GPU), half    new pool: rebuilt
    dense format  CPU alone: the dense formats that run on the CPU (bf16, int8, int4)          rebuilt
    gpu experts   with a GPU: 0 .. N_max resident experts per MoE layer, N_max the planner's    one build, set on it
                  ``--gpu-experts auto`` (else the most that fit)
    deferral      with a GPU: Expert Deferral d = 0 .. top_k - 1                                 set on the same build
    gpu prefill   with a GPU: the layerwise prefill's threshold, measured at load (hetmoe/moe/streamed/layerwise.py)

A candidate's speed is decode tok/s at batch 1 (``hetmoe.bench.e2e.time_decode``: the median of ``repeats`` runs of
``steps`` steps after a ``prompt``-token prefill). A candidate that changes the model's numbers (a dense format, a
deferral) is accepted only when its perplexity on the calibration text (``hetmoe.tools.evaluation``) is within
``max_ppl_change`` of the exact configuration's (bf16 dense; d = 0); deferrals are tried in increasing d and the
first over the bound ends the stage. Options named in ``fixed`` (the flags the user gave) are not tuned.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from hetmoe.bench.e2e import DECODE_WARMUP, time_decode
from hetmoe.config.formats import DENSE_FORMATS
from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.calibration import calibration_text, place_gpu_experts
from hetmoe.load.loader import LoadedModel, moe_blocks
from hetmoe.moe import defer_experts
from hetmoe.plan.placement import resolve_device
from hetmoe.tools.evaluation import evaluate

TUNED = ("threads", "dense_format", "gpu_experts", "defer_experts", "gpu_prefill")  # the options tune chooses
BUILD_ERRORS = (ValueError, RuntimeError, MemoryError, ImportError, NotImplementedError, TypeError)


@dataclass(frozen=True)
class Budget:
    """How much one tune run measures: decode steps per run, runs per candidate, the calibration tokens scored."""

    prompt: int = 32
    steps: int = 16
    repeats: int = 3
    ppl_tokens: int = 512
    window: int = 256


FULL, QUICK = Budget(), Budget(prompt=8, steps=4, repeats=3, ppl_tokens=128, window=64)


@dataclass
class Row:
    """One candidate measured (or not: ``note`` says why)."""

    stage: str
    option: str  # the EngineOptions field
    value: object
    tok_s: Optional[float] = None
    ppl_change: Optional[float] = None  # ppl / reference ppl - 1, where the candidate changes the model's numbers
    note: str = ""
    chosen: bool = False
    exact: bool = False  # the perplexity reference itself (bf16 dense, d = 0): always within the bound


@dataclass
class TuneResult:
    options: EngineOptions  # the chosen options (what the written config file gives back)
    tuned: dict  # option -> chosen value, for the options this run chose
    rows: list = field(default_factory=list)
    placement: str = "cpu"
    budget: Budget = FULL
    calibration: str = ""  # the text the perplexities were measured on
    tokens: int = 0  # its tokens scored
    bound: float = 0.01  # the largest perplexity change accepted (a fraction)
    seconds: float = 0.0


class Source:
    """The model tune builds again for each candidate that needs it: a checkpoint directory or GGUF file
    (``load_model``; the expert cache makes the rebuilds cheap), or a named shape with random weights."""

    def __init__(self, model=None, shape: Optional[str] = None, layers: Optional[int] = None,
                 expert_cache: Optional[str] = "auto", seed: int = 0):
        from hetmoe.load.loader import check_model_dir, load_tokenizer
        from hetmoe.load.random_weights import shape_config, shape_tokenizer
        from hetmoe.models import MODEL_TYPES

        self.model, self.shape, self.layers, self.cache, self.seed = model, shape, layers, expert_cache, seed
        if shape is not None:
            if model is not None:
                raise ValueError("give --model or --shape, not both")
            cfg = shape_config(shape, layers)
            self.tokenizer = shape_tokenizer(cfg.vocab_size)
            self.name = f"{shape} (random weights, {cfg.num_hidden_layers} layers)"
        else:
            if layers is not None:
                raise ValueError("--layers applies to --shape models only (a checkpoint is loaded whole)")
            cfg = check_model_dir(model)
            if cfg.get("model_type") not in MODEL_TYPES:
                raise ValueError(f"hetmoe tune runs hetmoe's own model types ({', '.join(sorted(MODEL_TYPES))}); "
                                 f"{model} is a {cfg.get('model_type')}")
            self.tokenizer = load_tokenizer(model, cfg)
            self.name = str(model)
        self.config = cfg

    def build(self, options: EngineOptions) -> LoadedModel:
        quiet = lambda msg: None  # noqa: E731  (tune prints its own lines)
        if self.shape is not None:
            from hetmoe.load.random_weights import build_random_model

            return build_random_model(self.shape, self.layers, options, seed=self.seed, log=quiet)
        from hetmoe.load.loader import load_model

        return load_model(self.model, options, expert_cache=self.cache, progress=False, log=quiet)


def thread_candidates(cores: int, gpu: bool, quick: bool) -> list:
    """Expert thread counts to try on ``cores`` physical cores: all, one fewer, two fewer with a GPU (its
    launching thread needs a core: BENCHMARKS.md#reserved-cores), half; ``quick``: all and the GPU default."""
    default = max(1, cores - 2 if gpu else cores)  # the engine's own default (hetmoe/load/loader.py new_experts)
    picks = [default, cores - 1] if quick else [cores, cores - 1, default, cores // 2]
    return sorted({c for c in picks if c >= 1} | {default}, reverse=True)


def choose(rows: list, bound: float) -> Optional[Row]:
    """The fastest of ``rows`` that was timed and whose perplexity change (where measured) is at most ``bound``;
    None when there is none. Ties: the earlier row (the candidate sets list the engine's default first)."""
    ok = [r for r in rows if r.tok_s is not None and (r.exact or r.ppl_change is None or r.ppl_change <= bound)]
    return max(ok, key=lambda r: r.tok_s) if ok else None


def decode_rate(loaded: LoadedModel, budget: Budget, seed: int = 0) -> float:
    """Batch-1 decode tok/s: the median over ``budget.repeats`` runs of ``budget.steps`` steps."""
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(seed)
    runs = [time_decode(runner, budget.prompt, budget.steps, gen) for _ in range(budget.repeats)]
    return statistics.median(len(r) / sum(r) for r in runs)


def perplexity(loaded: LoadedModel, ids: list, window: int) -> float:
    return evaluate(Runner(loaded), ids, window).summary()["perplexity"]


def _free() -> None:
    """Give back what the last build held (its pinned pool stays: shared_pool keeps one per thread count)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Tuner:
    """One tune run; ``run()`` -> TuneResult. ``candidates``: option -> values to try instead of the default set
    (``hetmoe tune --try``); ``on_row``: called with each Row as it is measured (the progress bar)."""

    def __init__(self, source: Source, base: EngineOptions, *, fixed=(), max_ppl_change: float = 0.01,
                 quick: bool = False, candidates: Optional[dict] = None, seed: int = 0,
                 on_row: Callable[[Row], None] = lambda row: None):
        self.source, self.fixed, self.bound, self.quick = source, set(fixed), max_ppl_change, quick
        self.candidates, self.seed, self.on_row = dict(candidates or {}), seed, on_row
        self.budget = QUICK if quick else FULL
        unknown = set(self.candidates) - set(TUNED)
        if unknown:
            raise ValueError(f"--try: {', '.join(sorted(unknown))} is not tuned; tune chooses {', '.join(TUNED)}")
        self.device = resolve_device(base.device)
        self.gpu = self.device.type == "cuda"
        text, self.calibration = calibration_text(base.calibration_file)
        self.ids = source.tokenizer.encode(text)[:self.budget.ppl_tokens]
        if len(self.ids) < 2:
            raise ValueError(f"the {self.calibration} gives {len(self.ids)} token(s): nothing to score")
        need = max(self.budget.window, self.budget.prompt + DECODE_WARMUP + self.budget.steps)
        if base.max_context is not None and base.max_context < need:
            raise ValueError(f"--max-context {base.max_context}: tune needs {need} positions")
        self.base = base
        self.work = replace(base, max_context=base.max_context or need)  # what every build uses
        self.rows, self.tuned = [], {}

    # ------------------------------------------------------------------------------------------ helpers

    def _row(self, row: Row) -> Row:
        self.rows.append(row)
        self.on_row(row)
        return row

    def _values(self, option: str, default: list) -> list:
        return list(self.candidates.get(option, default))

    def _build(self, stage: str, option: str, value, **changes) -> Optional[LoadedModel]:
        """The model built with ``changes``; None (and a row saying why) where it cannot be."""
        try:
            return self.source.build(replace(self.work, **changes))
        except BUILD_ERRORS as err:
            self._row(Row(stage, option, value, note=f"not built: {err}".splitlines()[0][:160]))
            return None

    def _choose(self, option: str, rows: list) -> None:
        """Mark the fastest accepted row of ``rows`` and keep its value."""
        best = choose(rows, self.bound)
        if best is None:
            return
        best.chosen = True
        self.tuned[option] = best.value
        self.work = replace(self.work, **{option: best.value})

    def _tuning(self, option: str) -> bool:
        return option not in self.fixed

    # ------------------------------------------------------------------------------------------ stages

    def tune_threads(self) -> None:
        """Each thread count in its own build (a pool per count; one model in memory at a time)."""
        from hetmoe.cpu import cpu_info

        if not self._tuning("threads"):
            return
        cores = cpu_info()["physical_cores"]
        rows = []
        for t in self._values("threads", thread_candidates(cores, self.gpu, self.quick)):
            loaded = self._build("threads", "threads", t, threads=t)
            if loaded is None:
                continue
            rows.append(self._row(Row("threads", "threads", t, tok_s=decode_rate(loaded, self.budget, self.seed))))
            del loaded
            _free()
        self._choose("threads", rows)

    def tune_dense(self) -> None:
        """CPU alone: each dense format that runs on the CPU, bf16 (the exact weights) first as the reference."""
        if self.gpu or not self._tuning("dense_format"):
            return
        default = [n for n, f in DENSE_FORMATS.items() if "cpu" in f.devices]
        formats = self._values("dense_format", default[:2] if self.quick else default)
        formats = sorted(formats, key=lambda f: f != "bf16")
        reference, rows = None, []
        for fmt in formats:
            loaded = self._build("dense format", "dense_format", fmt, dense_format=fmt)
            if loaded is None:
                continue
            row = Row("dense format", "dense_format", fmt, tok_s=decode_rate(loaded, self.budget, self.seed))
            ppl = perplexity(loaded, self.ids, self.budget.window)
            if fmt == "bf16":
                reference, row.exact = ppl, True
            if reference is not None:
                row.ppl_change = ppl / reference - 1
            else:
                row.note = "no bf16 reference: accuracy not compared"
            rows.append(self._row(row))
            del loaded
            _free()
        if reference is None:  # nothing to compare with: keep only what is exact
            rows = [r for r in rows if r.value == "bf16"]
        self._choose("dense_format", rows)

    def gpu_upper(self) -> Optional[LoadedModel]:
        """The build with the most GPU experts the plan allows: the planner's auto where it has one, else the
        largest of E, E/2, E/4, ... that fits."""
        try:
            replace(self.work, gpu_experts="auto")
            tries = ["auto"]
        except ValueError:
            n = max((b.num_experts for _, b in self._blocks_meta()), default=0)
            tries = [n >> i for i in range(6) if n >> i]
        for n in tries:
            try:
                return self.source.build(replace(self.work, gpu_experts=n))
            except MemoryError:
                continue
        return None

    def _blocks_meta(self) -> list:
        from hetmoe.load.loader import build_meta

        return moe_blocks(build_meta(self.source.config))

    def tune_gpu_experts(self, loaded: LoadedModel) -> None:
        """0 .. N_max resident experts per layer, set on one build (the most routed on the calibration text)."""
        blocks = moe_blocks(loaded.model)
        top = max((len(b.gpu.expert_ids) for _, b in blocks if b.gpu is not None), default=0)
        default = [0, top] if self.quick else [0, top // 4, top // 2, top]
        rows = []
        for n in sorted({v for v in self._values("gpu_experts", default) if 0 <= v <= top}):
            self.set_gpu_experts(loaded, n)
            rows.append(self._row(Row("gpu experts", "gpu_experts", n,
                                      tok_s=decode_rate(loaded, self.budget, self.seed))))
        self._choose("gpu_experts", rows)
        self.set_gpu_experts(loaded, self.work.gpu_experts)

    def set_gpu_experts(self, loaded: LoadedModel, n: int) -> None:
        blocks = moe_blocks(loaded.model)
        for _, b in blocks:
            if b.gpu is not None:
                b.set_gpu_experts(None)
        if n:
            place_gpu_experts(loaded.model, blocks, n, loaded.plan.dtype, loaded.plan.device, self.ids,
                              self.calibration, log=lambda m: None,
                              storage=[lp.gpu_format for lp in loaded.plan.layers] or "auto")

    def tune_deferral(self, loaded: LoadedModel) -> None:
        """d = 0, 1, ... on one build; the first d over the perplexity bound ends the stage."""
        k = loaded.config.num_experts_per_tok
        default = [0, 1] if self.quick else list(range(k))
        ds = sorted({d for d in self._values("defer_experts", default) if 0 <= d < k} | {0})
        rows, reference = [], None
        for i, d in enumerate(ds):
            defer_experts(loaded.model, d)
            row = Row("deferral", "defer_experts", d, tok_s=decode_rate(loaded, self.budget, self.seed))
            ppl = perplexity(loaded, self.ids, self.budget.window)
            reference = ppl if d == 0 else reference
            row.ppl_change, row.exact = ppl / reference - 1, d == 0
            rows.append(self._row(row))
            if not row.exact and row.ppl_change > self.bound:
                for later in ds[i + 1:]:
                    self._row(Row("deferral", "defer_experts", later, note=f"not tried: d={d} is over the bound"))
                break
        defer_experts(loaded.model, 0)
        self._choose("defer_experts", rows)

    def tune_prefill(self, loaded: LoadedModel) -> None:
        """The threshold the layerwise prefill measured when ``loaded`` was built (``--gpu-prefill auto``): a count,
        or off where the CPU was faster at every length. Where the path could not run at all (no room on the GPU,
        experts split over NUMA subpools) the option is left to the next load."""
        report = loaded.info.get("gpu_prefill") or {}
        measured = report.get("chosen_by") == "measured"
        value = report.get("min_tokens") if report.get("enabled") else "off"
        row = self._row(Row("gpu prefill", "gpu_prefill", value if measured else "-",
                            note="measured at load" if measured else f"not measured: {report.get('why', '?')}"))
        if measured:
            row.chosen = True
            self.tuned["gpu_prefill"] = value
            self.work = replace(self.work, gpu_prefill=value)

    def tune_gpu(self) -> None:
        """GPU experts, deferral and the prefill threshold on one build (the one with the most GPU experts)."""
        loaded = None
        if self._tuning("gpu_experts"):
            loaded = self.gpu_upper()
            if loaded is None:
                self._row(Row("gpu experts", "gpu_experts", 0, note="not built: no GPU experts fit"))
            else:
                self.tune_gpu_experts(loaded)
        loaded = loaded or self.source.build(self.work)
        if self._tuning("defer_experts"):
            self.tune_deferral(loaded)
        if self._tuning("gpu_prefill"):
            self.tune_prefill(loaded)

    def run(self) -> TuneResult:
        t0 = time.perf_counter()
        self.tune_threads()
        if self.gpu:
            self.tune_gpu()
        else:
            self.tune_dense()
        _free()
        chosen = replace(self.base, **self.tuned)
        return TuneResult(chosen, dict(self.tuned), self.rows, "hybrid" if self.gpu else "cpu", self.budget,
                          self.calibration, len(self.ids), self.bound, time.perf_counter() - t0)


def fmt_rows(rows: list) -> list:
    """The table of every candidate: stage, value, decode tok/s, perplexity change, chosen mark, note."""
    lines = [f"{'stage':<13} {'candidate':>10} {'decode tok/s':>13} {'ppl change':>11}  {'':6}  note"]
    for r in rows:
        tok = f"{r.tok_s:.2f}" if r.tok_s is not None else "-"
        ppl = f"{100 * r.ppl_change:+.2f}%" if r.ppl_change is not None else "-"
        lines.append(f"{r.stage:<13} {str(r.value):>10} {tok:>13} {ppl:>11}  {'chosen' if r.chosen else '':6}  "
                     f"{r.note}".rstrip())
    return lines


def summary(result: TuneResult) -> list:
    """One line per stage for the written file's header: the candidates and what they measured."""
    out = {}
    for r in result.rows:
        what = f"{r.value}" + (f" {r.tok_s:.2f} tok/s" if r.tok_s is not None else "")
        what += f" ppl {100 * r.ppl_change:+.2f}%" if r.ppl_change is not None else ""
        what += " (chosen)" if r.chosen else ("" if r.tok_s is not None else f" ({r.note})" if r.note else "")
        out.setdefault(r.stage, []).append(what)
    return [f"{stage}: " + "; ".join(v) for stage, v in out.items()]
