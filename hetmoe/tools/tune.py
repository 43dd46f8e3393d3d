"""``hetmoe tune``: which engine options decode fastest on this machine, within an accuracy bound, measured.

Stages, each over a small candidate set, each stage's winner kept for the next (coordinate descent: minutes, not a
grid search over hours):

    threads       the expert threads: physical cores, one and two fewer (with a GPU), half    new pool: rebuilt
    dense format  CPU alone: the dense formats that run on the CPU (bf16, int8, int4)          rebuilt
    gpu experts   with a GPU: 0 .. N_max resident experts per MoE layer, N_max the planner's    one build, set on it
                  ``--gpu-experts auto`` (else the most that fit)
    deferral      with a GPU: Expert Deferral d = 0 .. top_k - 1                                 set on the same build
    gpu prefill   with a GPU: the layerwise prefill's threshold, measured at load (hetmoe/moe/streamed/layerwise.py)

A candidate's speed is decode tok/s at batch 1 (``hetmoe.bench.e2e.time_decode``: runs of ``steps`` steps after a
``prompt``-token prefill). A stage times its candidates in ``rounds`` passes, every other pass in reverse order
(A B C, C B A: a drift of the machine's speed over the stage falls on every candidate alike), ``runs`` runs per
candidate per pass; a candidate's rate is the median of its runs. The stage's noise: 9 in 10 of its runs (every
candidate's pooled) lie within it of their candidate's median, and it is at least NOISE_FLOOR.

A stage moves away from its default (the engine's own value, else the first candidate) only to a candidate faster
by more than that noise; of several, the first in the stage's order (fewer GPU experts, fewer deferred, the more
precise format) within the noise of the fastest.
Otherwise the default is kept and the summary says the faster candidates are within noise (``decide``), so two
runs on one machine choose the same setting or say why they need not.

A candidate that changes the model's numbers (a dense format, a deferral) is accepted only when its perplexity on
the calibration text (``hetmoe.tools.evaluation``) is within ``max_ppl_change`` of the exact configuration's (bf16
dense; d = 0); deferrals are scored in increasing d and the first over the bound ends the stage. Options named in
``fixed`` (the flags the user gave) are not tuned.
"""

from __future__ import annotations

import gc
import itertools
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
# The least relative difference taken for a real one: two identical runs on a quiet machine measured up to 8% apart
# from 3 short runs each, so a spread measured from a few runs is not trusted below this.
NOISE_FLOOR = 0.03


@dataclass(frozen=True)
class Budget:
    """How much one tune run measures: decode steps per run, passes over a stage's candidates, runs per candidate
    per pass, the calibration tokens scored."""

    prompt: int = 32
    steps: int = 16
    rounds: int = 2
    runs: int = 3
    ppl_tokens: int = 512
    window: int = 256

    @property
    def repeats(self) -> int:
        """Timed runs per candidate."""
        return self.rounds * self.runs


FULL, QUICK = Budget(), Budget(prompt=8, steps=4, rounds=2, runs=2, ppl_tokens=128, window=64)


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
    rates: list = field(default_factory=list)  # tok/s of each timed run; tok_s is their median

    def add(self, rates: list) -> None:
        self.rates += rates
        self.tok_s = statistics.median(self.rates)

    def deviations(self) -> list:
        """|run / median - 1| of each timed run."""
        return [abs(x / self.tok_s - 1) for x in self.rates]

    @property
    def spread(self) -> float:
        """The farthest run from the median, relative to it (the ± of this candidate's runs); 0 untimed."""
        return max(self.deviations(), default=0.0)


def accepted(row: Row, bound: float) -> bool:
    """Timed, and its perplexity change (where measured) at most ``bound``."""
    return row.tok_s is not None and (row.exact or row.ppl_change is None or row.ppl_change <= bound)


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


@dataclass
class Decision:
    """One stage's choice (``decide``): the chosen row (None: no candidate accepted), the baseline it was compared
    with (the default, or the first candidate where the default was not one), the relative noise the comparison
    allowed, and the accepted rows."""

    stage: str
    chosen: Optional[Row]
    baseline: Optional[Row]
    noise: float
    is_default: bool
    rows: list = field(default_factory=list)

    @property
    def kept(self) -> bool:
        return self.chosen is not None and self.chosen is self.baseline

    @property
    def within_noise(self) -> list:
        """The accepted rows faster than the baseline by at most the noise, where the baseline is kept."""
        return [r for r in self.rows if self.kept and r is not self.baseline and r.tok_s > self.baseline.tok_s]

    def line(self) -> str:
        """What the stage chose and why, for the printed summary and the written file's comments."""
        if self.chosen is None:
            return f"{self.stage}: nothing chosen (no candidate timed within the perplexity bound)"
        base, head = self.baseline, f"{self.stage} chosen: {self.chosen.value}"
        what = "the default" if self.is_default else "the first candidate"
        noise = f"±{100 * self.noise:.1f}%"
        if len(self.rows) == 1:
            return f"{head} ({what}, the only candidate accepted)"
        if self.kept:
            near = self.within_noise
            if not near:
                return f"{head} ({what}, the fastest; noise {noise})"
            faster = ", ".join(f"{r.value} ({pct(r.tok_s / base.tok_s - 1)})" for r in near)
            return f"{head} ({what}, kept): {faster} within noise ({noise})"
        text = f"{head}, {pct(self.chosen.tok_s / base.tok_s - 1)} over {what} {base.value}, beyond the noise ({noise})"
        best = max(self.rows, key=lambda r: r.tok_s)
        if best is not self.chosen:
            text += f"; {best.value} ({pct(best.tok_s / base.tok_s - 1)}) is within noise of it"
        return text


def stage_noise(rows: list, floor: float = NOISE_FLOOR) -> float:
    """The relative noise of a stage's timings: 9 in 10 of its runs lie within it of their candidate's median (the
    runs of every candidate pooled, so one slow run does not set it alone), and at least ``floor``."""
    devs = sorted(d for r in rows if r.rates for d in r.deviations())
    if len(devs) < 2:
        return floor
    return max(floor, statistics.quantiles(devs, n=10, method="inclusive")[-1])


def decide(stage: str, rows: list, bound: float, default=None, floor: float = NOISE_FLOOR) -> Decision:
    """The choice among ``rows`` (in the stage's order) of the accepted ones (``accepted``): the baseline (the row of
    ``default``, else the first accepted) unless a row is faster than it by more than the stage's noise
    (``stage_noise``); of such rows, the first within the noise of the fastest. A difference the noise covers never
    decides, so two runs choose alike."""
    timed = [r for r in rows if r.tok_s is not None]
    noise = stage_noise(timed, floor)
    ok = [r for r in timed if accepted(r, bound)]
    if not ok:
        return Decision(stage, None, None, noise, False)
    base = next((r for r in ok if r.value == default), ok[0])
    faster = [r for r in ok if r.tok_s > base.tok_s * (1 + noise)]
    if not faster:
        return Decision(stage, base, base, noise, base.value == default, ok)
    best = max(r.tok_s for r in faster)
    pick = next(r for r in faster if r.tok_s * (1 + noise) >= best)
    return Decision(stage, pick, base, noise, base.value == default, ok)


def interleave(values: list, rounds: int) -> list:
    """The order a stage times ``values`` in: ``rounds`` passes, every other one reversed (A B C, C B A, A B C), as
    (value, passes) with back-to-back repeats merged (C, C: one build timed for both passes)."""
    order = [v for r in range(rounds) for v in (values if r % 2 == 0 else values[::-1])]
    return [(v, len(list(same))) for v, same in itertools.groupby(order)]


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
    decisions: list = field(default_factory=list)  # a Decision per stage that chose


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


def thread_candidates(cores: int, gpu: bool, quick: bool, default: Optional[int] = None) -> list:
    """Expert thread counts to try on ``cores`` physical cores: all, one fewer, two fewer with a GPU (its
    launching thread needs a core: BENCHMARKS.md#reserved-cores), half; ``quick``: all and the GPU default.
    ``default``: the engine's own count (hetmoe/load/loader.py new_experts), always a candidate."""
    default = default or max(1, cores - 2 if gpu else cores)
    picks = [default, cores - 1] if quick else [cores, cores - 1, default, cores // 2]
    return sorted({c for c in picks if c >= 1} | {default}, reverse=True)


def decode_rates(loaded: LoadedModel, budget: Budget, runs: int, seed: int = 0) -> list:
    """Batch-1 decode tok/s of each of ``runs`` runs of ``budget.steps`` steps (random prompts from ``seed``: every
    candidate decodes the same tokens)."""
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(seed)
    return [len(t) / sum(t) for t in (time_decode(runner, budget.prompt, budget.steps, gen) for _ in range(runs))]


def perplexity(loaded: LoadedModel, ids: list, window: int) -> float:
    return evaluate(Runner(loaded), ids, window).summary()["perplexity"]


def _free() -> None:
    """Give back what the last build held (its pinned pool stays: shared_pool keeps one per thread count)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Tuner:
    """One tune run; ``run()`` -> TuneResult. ``candidates``: option -> values to try instead of the default set
    (``hetmoe tune --try``); ``on_row``: called with a Row each time it is measured (the progress bar)."""

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
        self.rows, self.tuned, self.decisions = [], {}, []
        self.auto_dense: Optional[str] = None  # what --dense-format auto gave in a build of this run

    # ------------------------------------------------------------------------------------------ helpers

    def time_runs(self, row: Row, loaded: LoadedModel, runs: int) -> list:
        """tok/s of ``runs`` decode runs of ``row``'s candidate, set on ``loaded`` (the one place tune times)."""
        return decode_rates(loaded, self.budget, runs, self.seed)

    def _row(self, row: Row) -> Row:
        self.rows.append(row)
        self.on_row(row)
        return row

    def _values(self, option: str, default: list) -> list:
        return list(dict.fromkeys(self.candidates.get(option, default)))  # in order, once each

    def _build(self, row: Row, **changes) -> Optional[LoadedModel]:
        """The model built with ``changes``; None (``row.note`` says why) where it cannot be."""
        options = replace(self.work, **changes)
        try:
            loaded = self.source.build(options)
        except BUILD_ERRORS as err:
            row.note = f"not built: {err}".splitlines()[0][:160]
            return None
        if options.dense_format == "auto":
            self.auto_dense = loaded.plan.dense_format
        return loaded

    def _time(self, rows: list, prepare: Callable, first: Optional[Callable] = None, rebuilt: bool = False) -> None:
        """Time ``rows`` interleaved (``interleave``): ``prepare(row)`` -> the model with the row's candidate set
        (None: it cannot be, the row's note says why); ``first(row, loaded)``: what is measured once per
        candidate (its perplexity); ``rebuilt``: each prepare is a new build, freed after its runs."""
        by_value = {r.value: r for r in rows}
        failed = set()
        for value, passes in interleave(list(by_value), self.budget.rounds):
            row = by_value[value]
            if value in failed:
                continue
            loaded = prepare(row)
            if loaded is None:
                failed.add(value)
                continue
            if first is not None and not row.rates:
                first(row, loaded)
            row.add(self.time_runs(row, loaded, passes * self.budget.runs))
            self.on_row(row)
            if rebuilt:
                del loaded
                _free()

    def _choose(self, stage: str, option: str, rows: list, default, among: Optional[list] = None) -> None:
        """Keep the stage's choice (``decide``) among ``rows`` (or only ``among`` them); all go into the table."""
        self.rows += rows
        d = decide(stage, rows if among is None else among, self.bound, default)
        self.decisions.append(d)
        if d.chosen is None:
            return
        d.chosen.chosen = True
        noise = f"±{100 * d.noise:.1f}%"
        if d.kept and d.within_noise:
            d.chosen.note = f"faster ones within noise ({noise})"
        elif not d.kept:
            d.chosen.note = f"{pct(d.chosen.tok_s / d.baseline.tok_s - 1)} over {d.baseline.value} (noise {noise})"
        self.tuned[option] = d.chosen.value
        self.work = replace(self.work, **{option: d.chosen.value})

    def _tuning(self, option: str) -> bool:
        return option not in self.fixed

    # ------------------------------------------------------------------------------------------ stages

    def tune_threads(self) -> None:
        """Each thread count in its own build (a pool per count; one model in memory at a time), built again for
        each pass."""
        from hetmoe.cpu import HYBRID_RESERVED_CORES, cpu_info, default_threads

        if not self._tuning("threads"):
            return
        default = default_threads(HYBRID_RESERVED_CORES if self.gpu else 0)  # hetmoe/load/loader.py new_experts
        values = self._values("threads", thread_candidates(cpu_info()["physical_cores"], self.gpu, self.quick,
                                                           default))
        rows = [Row("threads", "threads", t) for t in values]
        self._time(rows, lambda row: self._build(row, threads=row.value), rebuilt=True)
        self._choose("threads", "threads", rows, default)

    def tune_dense(self) -> None:
        """CPU alone: each dense format that runs on the CPU, bf16 (the exact weights) first as the reference; the
        default is what ``auto`` gave (bf16 where no build of this run showed it)."""
        if self.gpu or not self._tuning("dense_format"):
            return
        default = [n for n, f in DENSE_FORMATS.items() if "cpu" in f.devices]
        formats = self._values("dense_format", default[:2] if self.quick else default)
        rows = [Row("dense format", "dense_format", f) for f in sorted(formats, key=lambda f: f != "bf16")]
        ppl = {}

        def score(row, loaded):
            ppl[row.value] = perplexity(loaded, self.ids, self.budget.window)

        self._time(rows, lambda row: self._build(row, dense_format=row.value), score, rebuilt=True)
        reference = ppl.get("bf16")
        for row in rows:
            if reference is None:
                row.note = row.note or "no bf16 reference: accuracy not compared"
            elif row.value in ppl:
                row.ppl_change, row.exact = ppl[row.value] / reference - 1, row.value == "bf16"
        exact = [r for r in rows if r.value == "bf16"] if reference is None else None  # nothing to compare with
        self._choose("dense format", "dense_format", rows, self.auto_dense or "bf16", among=exact)

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
        rows = [Row("gpu experts", "gpu_experts", n)
                for n in sorted({v for v in self._values("gpu_experts", default) if 0 <= v <= top})]

        def place(row):
            self.set_gpu_experts(loaded, row.value)
            return loaded

        self._time(rows, place)
        self._choose("gpu experts", "gpu_experts", rows, EngineOptions().gpu_experts)
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
        """d = 0, 1, ... on one build: scored in increasing d, the first over the perplexity bound ending the
        stage, then those scored timed interleaved."""
        k = loaded.config.num_experts_per_tok
        default = [0, 1] if self.quick else list(range(k))
        ds = sorted({d for d in self._values("defer_experts", default) if 0 <= d < k} | {0})
        rows, reference = [], None
        for i, d in enumerate(ds):
            defer_experts(loaded.model, d)
            ppl = perplexity(loaded, self.ids, self.budget.window)
            reference = ppl if d == 0 else reference
            rows.append(Row("deferral", "defer_experts", d, ppl_change=ppl / reference - 1, exact=d == 0))
            if not rows[-1].exact and rows[-1].ppl_change > self.bound:
                later = [Row("deferral", "defer_experts", e, note=f"not tried: d={d} is over the bound")
                         for e in ds[i + 1:]]
                break
        else:
            later = []

        def defer(row):
            defer_experts(loaded.model, row.value)
            return loaded

        self._time(rows, defer)
        defer_experts(loaded.model, 0)
        self._choose("deferral", "defer_experts", rows + later, EngineOptions().defer_experts)

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
                          self.calibration, len(self.ids), self.bound, time.perf_counter() - t0, self.decisions)


def fmt_rows(rows: list) -> list:
    """The table of every candidate: stage, value, decode tok/s (the median of its runs), ± half their range,
    perplexity change, chosen mark, note."""
    lines = [f"{'stage':<13} {'candidate':>10} {'decode tok/s':>13} {'runs ±':>7} {'ppl change':>11}  {'':6}  note"]
    for r in rows:
        tok = f"{r.tok_s:.2f}" if r.tok_s is not None else "-"
        spread = f"{100 * r.spread:.1f}%" if r.rates else "-"
        ppl = f"{100 * r.ppl_change:+.2f}%" if r.ppl_change is not None else "-"
        lines.append(f"{r.stage:<13} {str(r.value):>10} {tok:>13} {spread:>7} {ppl:>11}  "
                     f"{'chosen' if r.chosen else '':6}  {r.note}".rstrip())
    return lines


def summary(result: TuneResult) -> list:
    """The written file's header lines: per stage the candidates and what they measured, then what each stage
    chose and why (``Decision.line``: "within noise (±x%)" where the default was kept)."""
    out = {}
    for r in result.rows:
        what = f"{r.value}" + (f" {r.tok_s:.2f} tok/s ±{100 * r.spread:.1f}%" if r.tok_s is not None else "")
        what += f" ppl {100 * r.ppl_change:+.2f}%" if r.ppl_change is not None else ""
        what += " (chosen)" if r.chosen else ("" if r.tok_s is not None else f" ({r.note})" if r.note else "")
        out.setdefault(r.stage, []).append(what)
    return [f"{stage}: " + "; ".join(v) for stage, v in out.items()] + [d.line() for d in result.decisions]
