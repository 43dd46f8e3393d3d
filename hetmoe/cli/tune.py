"""``hetmoe tune``: measure which engine options decode fastest on this machine (threads; with a GPU the GPU experts,
the Expert Deferral depth and the prefill threshold; on the CPU alone the dense format), within a perplexity bound,
and write them as a ``--config`` file. The stages and what each measures: hetmoe/tools/tune.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetmoe.cli.options import add_shape_options
from hetmoe.config.flags import TYPES, add_engine_options, engine_fields, engine_options, expert_cache

DEFAULT_OUT = "hetmoe-tune.yaml"


def percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value < 1000:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, e.g. 1 or 0.5, got {text}")
    return value


def candidates(text: str) -> tuple:
    """``--try threads=8,12,14``: an option tune chooses and the values to try, each parsed as its flag parses it."""
    from hetmoe.tools.tune import TUNED

    name, _, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if name not in TUNED or not values.strip():
        raise argparse.ArgumentTypeError(f"expected OPTION=V1,V2,... with OPTION one of {', '.join(TUNED)}, "
                                         f"got {text}")
    meta = next(f.metadata for f in engine_fields() if f.name == name)
    parse = TYPES[meta["type"]] if "type" in meta else str
    out = []
    for v in filter(None, (v.strip() for v in values.split(","))):
        try:
            value = parse(v)
        except (argparse.ArgumentTypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{name}: {v} is not a value of {meta['flag']}") from None
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise argparse.ArgumentTypeError(f"{name}: expected {', '.join(map(str, meta['choices']))}, got {v}")
        out.append(value)
    return name, out


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune", help="measure the fastest threads, GPU experts, deferral, prefill threshold, dense format here; "
        "write them as a --config file",
        description="Builds the model (--model, --shape or the built-in one) for each candidate that needs it and "
        "times batch-1 decode (median of repeated runs, the candidates interleaved): expert threads; with a GPU "
        "the number of GPU-resident experts, the Expert Deferral depth (among those whose perplexity on the "
        "calibration text moves by at most --max-ppl-change) and the layerwise prefill threshold; on the CPU alone "
        "the dense format (same bound). "
        "A stage keeps its default unless a candidate is faster by more than the noise its runs measured (at "
        "least 3%). Prints every candidate measured and what each stage chose and why, and writes the choice to "
        "--out, which --config loads (docs/running.md#hetmoe-tune). Engine flags given here are kept as given, "
        "not tuned.")
    p.add_argument("--out", metavar="FILE", default=DEFAULT_OUT, help=f"the config file written (default: "
                   f"{DEFAULT_OUT})")
    p.add_argument("--max-ppl-change", type=percent, default=1.0, metavar="PCT",
                   help="the most a deferral or dense format may change the perplexity, in percent (default: 1)")
    p.add_argument("--quick", action="store_true", help="the smallest candidate sets and the shortest timings")
    p.add_argument("--try", dest="candidates", type=candidates, action="append", default=[],
                   metavar="OPTION=V1,V2", help="try these values of one option instead of tune's own set "
                   "(repeatable), e.g. --try threads=8,12,14")
    p.add_argument("--seed", type=int, default=0, help="random prompts of the timings and --shape weights")
    add_engine_options(p)
    add_shape_options(p)
    p.set_defaults(handler=run)
    return p


def _header(result, source, machine: dict, fixed: list, out: Path) -> list:
    from hetmoe import __version__
    from hetmoe.tools.tune import NOISE_FLOOR, summary

    b = result.budget
    return [
        f"hetmoe tune: the engine options measured fastest on this machine; load them with --config {out.name}",
        f"machine: {machine['host']}, {machine['cpu']} ({machine['cores']} physical cores)"
        + (f", {machine['gpu']}" if machine["gpu"] else ", no GPU"),
        f"date: {machine['date']}, hetmoe {__version__}, commit {machine['commit'] or '?'}",
        f"model: {source.name}; placement {result.placement}",
        f"measured: decode tok/s at batch 1, median of {b.repeats} runs of {b.steps} steps after a prompt of "
        f"{b.prompt} tokens ({b.rounds} passes over each stage's candidates, every other one reversed, {b.runs} runs "
        f"each; ±: the farthest run from the median); perplexity change on {result.tokens} tokens of the "
        f"{result.calibration} (windows of {b.window})",
        f"chosen: a stage's default unless a candidate is faster by more than the noise (9 in 10 of the stage's runs "
        f"within it of their median; at least {100 * NOISE_FLOOR:g}%)",
        f"accepted: a perplexity change of at most {100 * result.bound:g}%; {result.seconds:.0f} s in all"
        + (f"; kept as given: {', '.join(fixed)}" if fixed else ""),
        *summary(result),
    ]


def run(args: argparse.Namespace) -> int:
    import datetime
    import socket

    import torch
    from tqdm import tqdm

    from hetmoe.bench.machine import cpu_model, git_commit
    from hetmoe.config import file as config_file
    from hetmoe.cpu import cpu_info
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tools.tune import TUNED, Source, Tuner, fmt_rows

    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give the path of the config file to write")
    base = engine_options(args)
    given = getattr(args, "engine_flags_given", set())
    fixed = [f.name for f in engine_fields() if f.name in TUNED and f.metadata["flag"][2:].replace("-", "_") in given]
    model = None if args.shape else (args.model or default_model_path())
    source = Source(model, args.shape, args.layers, expert_cache(args), args.seed)
    progress = sys.stderr.isatty()
    bar = tqdm(total=None, desc="tune", unit="pass", file=sys.stderr, disable=not progress, leave=False)

    def on_row(row):
        bar.update(1)
        bar.set_postfix_str(f"{row.stage} {row.value}" + (f": {row.tok_s:.1f} tok/s" if row.tok_s else ""))

    tuner = Tuner(source, base, fixed=fixed, max_ppl_change=args.max_ppl_change / 100, quick=args.quick,
                  candidates=dict(args.candidates), seed=args.seed, on_row=on_row)
    print(f"hetmoe tune: {source.name}, {'hybrid (GPU + CPU experts)' if tuner.gpu else 'CPU alone'}; "
          f"{'quick' if args.quick else 'full'} candidate sets", file=sys.stderr)
    try:
        result = tuner.run()
    finally:
        bar.close()
    for line in fmt_rows(result.rows):
        print(line)
    for decision in result.decisions:
        print(decision.line())
    info = cpu_info()
    machine = {"host": socket.gethostname(), "cpu": cpu_model() or "CPU", "cores": info["physical_cores"],
               "gpu": torch.cuda.get_device_name(0) if tuner.gpu else None, "commit": git_commit(),
               "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    values = config_file.options_values(result.options, keep=tuple(result.tuned))
    text = config_file.render(values, _header(result, source, machine, fixed, out))
    out.write_text(text)
    back = config_file.read(out, TYPES)  # the file must give the choice back
    chosen = ", ".join(f"{k} {v}" for k, v in result.tuned.items()) or "nothing (every tuned option was given)"
    print(f"chosen: {chosen}")
    print(f"wrote {out} (use it with --config {out}; {len(back)} option(s))")
    return 0
