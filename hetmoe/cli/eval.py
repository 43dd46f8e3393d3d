"""``hetmoe eval``: perplexity of one configuration of a model on a text, and the KL divergence and top-1
agreement of its next-token distributions against the same model with ``--reference-format`` experts (bf16 by
default, nothing dropped or deferred), both run over identical windows of tokens. The math and the windowing are
in hetmoe/tools/evaluation.py.

Both configurations are loaded at once (the reference's dense part and experts too): meant for models whose
two copies fit in memory; ``--reference-format none`` loads one copy and reports perplexity only. A configuration
that is the reference (its experts in the reference format in every layer, dense weights in the dtype, nothing
dropped, deferred or on the GPU) is loaded and scored once and compared with itself.

``--reference-model`` takes the reference from another checkpoint instead (the original of a quantized file: a GGUF
file made by llama.cpp's quantizer against the Hugging Face checkpoint it came from), which must split the text into
the same tokens and have the same vocabulary; its experts are then in ``--reference-format`` too, and its dense
weights in the dtype.

Without ``--model`` (the built-in model) ``--text`` defaults to the model's held-out text (``heldout.txt``, text
it was not trained on); with ``--model`` it is required.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from hetmoe.config.flags import add_engine_options, engine_options, expert_cache, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval", help="perplexity of a configuration, and its KL divergence / top-1 agreement against bf16 experts",
        description="Scores --text in consecutive, non-overlapping windows of --window tokens (each from an empty "
        "cache; the first token of a window is context, never scored) with the engine options given, and the same "
        "windows with the model's --reference-format experts (default bf16; the dtype's own dense weights, nothing "
        "dropped or deferred): perplexity of both, mean KL(reference || configuration) per token and the fraction "
        "of positions whose most likely next token agrees. Both configurations are loaded at once (once, when the "
        "configuration is the reference).")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="UTF-8 text to score ('-' reads stdin); required with --model (default for the built-in "
                   "model: its held-out text, heldout.txt)")
    p.add_argument("--window", type=int, default=512, help="tokens per window, >= 2 and <= the context (default: 512)")
    p.add_argument("--text-tokens", "--max-tokens", dest="text_tokens", type=positive_int, default=None, metavar="N",
                   help="score only the first N tokens of the text (--max-tokens: its old name)")
    p.add_argument("--drop-experts", type=int, default=0, metavar="D",
                   help="per token, do not compute the D lowest-weighted of its top-k routed experts (weights not "
                   "renormalised; default: 0)")
    p.add_argument("--reference-format", choices=("bf16", "int8", "int4", "none"), default="bf16",
                   help="experts format of the reference run ('none': perplexity only; default: bf16)")
    p.add_argument("--reference-model", metavar="DIR|FILE.gguf", default=None,
                   help="take the reference from this checkpoint instead of --model (e.g. the original of a quantized "
                   "file); it must tokenize the text the same way and have the same vocabulary")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON ('-' = stdout only)")
    add_engine_options(p)
    p.set_defaults(handler=run)
    return p


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """--text is required with --model (the built-in model has a default)."""
    if getattr(args, "command", None) == "eval" and args.text is None and args.model is not None:
        return ("--text FILE is required with --model: the text to score (only the built-in model, without --model, "
                "has a default: its held-out text)")
    return None


def _read_text(name: str) -> str:
    if name == "-":
        text = sys.stdin.read()
    else:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text file {path} is not UTF-8 ({e})") from None
    if not text.strip():
        raise ValueError(f"the text {'on stdin' if name == '-' else f'file {name}'} is empty")
    return text


def _describe(plan, drop: int = 0, defer: int = 0) -> dict:
    label = plan.experts_format
    if plan.experts_format != "bf16":
        label += f" g{plan.group_size}" if plan.group_size else " per-row"
    layers = getattr(plan, "layers", None) or ()
    formats = {(lp.experts_format, lp.down_format or lp.experts_format) for lp in layers}
    if len(formats) > 1 or any(gu != down for gu, down in formats):  # per layer / projection (--cpu-memory's mix)
        label = "/".join(sorted({f for pair in formats for f in pair})) + " mix"
    dense = getattr(plan, "dense_format", "bf16")
    if dense != "bf16":
        label += f", dense {dense}"
    if drop:
        label += f", drop {drop}"
    if defer:
        label += f", defer {defer}"
    mix = {}
    if label.endswith(" mix"):
        from hetmoe.plan.lowbit import describe as describe_mix

        mix = {"layers": describe_mix(plan)}
    return {"label": label, **mix, "experts_format": plan.experts_format, "group_size": plan.group_size,
            "dense_format": dense, "drop_experts": drop, "defer_experts": defer, "device": plan.device.type,
            "dtype": str(plan.dtype).replace("torch.", "")}


def _table(report: dict) -> str:
    lines = [f"hetmoe eval: {report['text']}: {report['tokens']} tokens scored in {report['windows']} windows of "
             f"{report['window']} ({report['seconds']:.1f} s)",
             f"{'configuration':<24} {'perplexity':>10} {'change':>8} {'KL(ref||test)':>14} {'top-1':>8}"]
    if report["reference"] is not None:
        if "model" in report["reference"]:  # --reference-model: two checkpoints
            lines[1:1] = [f"configuration: {report['model']}", f"reference: {report['reference']['model']}"]
        lines.append(f"{report['reference']['label'] + ' (reference)':<24} {report['reference_perplexity']:>10.4f}")
        lines.append(f"{report['config']['label']:<24} {report['perplexity']:>10.4f} "
                     f"{100 * report['perplexity_change']:>+7.2f}% {report['kl']:>14.3e} "
                     f"{100 * report['top1_agreement']:>7.2f}%")
    else:
        lines.append(f"{report['config']['label']:<24} {report['perplexity']:>10.4f}")
    return "\n".join(lines)


def same_as_reference(plan, reference_format: str, drop: int) -> bool:
    """Whether a configuration planned as ``plan`` computes what the reference would: ``reference_format`` experts
    at their default group in every MoE layer, none deferred or on the GPU, none dropped, dense weights in the
    dtype (the reference keeps the configuration's dtype, device and threads)."""
    from hetmoe.plan.placement import layer_group

    group = layer_group(reference_format, None)
    if drop or getattr(plan, "dense_format", None) != "bf16":
        return False
    layers = getattr(plan, "layers", None)
    if not layers:  # a model without routed experts, or run through Transformers (one format, no deferral)
        return plan.experts_format == reference_format and layer_group(plan.experts_format, plan.group_size) == group
    return all((lp.experts_format, lp.group_size, lp.defer_experts, lp.gpu_experts) == (reference_format, group, 0, 0)
               for lp in layers)


def _native_opener(cache, progress: bool):
    from hetmoe.load.loader import load_model

    def open_native(path, opts):
        return load_model(path, opts, expert_cache=cache, progress=progress), None
    return open_native


def _transformers_opener(cfg, drop: int):
    """A model type without a hetmoe model file, through Transformers with the hetmoe experts backend."""
    from hetmoe.transformers.runner import open_transformers, transformers_class

    name = transformers_class(cfg.get("model_type"))
    if name is None:
        return _native_opener(None, False)  # the native loader names what is wrong with the model type
    if drop:
        raise ValueError("--drop-experts is not available for a model run through Transformers (native model "
                         "types only)")
    print(f"hetmoe: model_type {cfg.get('model_type')!r} has no hetmoe model file: evaluating {name} through "
          "Transformers with the hetmoe experts backend", file=sys.stderr)
    return lambda path, opts: open_transformers(path, opts, lambda m: print(m, file=sys.stderr))


def run(args: argparse.Namespace) -> int:
    from hetmoe.engine.llm import default_model_path
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import check_model_dir, load_tokenizer, moe_blocks
    from hetmoe.models import MODEL_TYPES, context_limit
    from hetmoe.plan.placement import normalize_options
    from hetmoe.tools.evaluation import evaluate

    drop = args.drop_experts
    if drop < 0:
        raise ValueError(f"--drop-experts must be >= 0, got {drop}")
    if args.window < 2:
        raise ValueError(f"--window must be at least 2 tokens, got {args.window}")
    model = Path(args.model) if args.model is not None else default_model_path()
    text_name = args.text
    if text_name is None:
        if args.model is not None:  # (the usage check says so first on the command line)
            raise ValueError(usage_error(args))
        text_name = str(model / "heldout.txt")
        print(f"hetmoe: scoring the built-in model's held-out text, {text_name} (--text FILE scores another)",
              file=sys.stderr)
    text = _read_text(text_name)
    cfg = check_model_dir(model)  # the directory, config.json and the tokenizer, before any weight is read
    tokenizer = load_tokenizer(model, cfg, lambda m: print(m, file=sys.stderr))
    top_k = cfg.get("num_experts_per_tok")
    if drop and not top_k:
        raise ValueError("--drop-experts: this model has no routed experts")
    if top_k and drop >= top_k:
        raise ValueError(f"--drop-experts {drop}: each token has {top_k} experts; at most {top_k - 1} can be dropped")
    limit, why = context_limit(cfg)
    if limit and args.window > limit:
        raise ValueError(f"--window {args.window} is beyond the model's {limit} positions ({why})")
    # capped once here, so that the reference's load does not say it again
    opts = normalize_options(engine_options(args), lambda m: print(m, file=sys.stderr))
    if drop and opts.defer_experts:
        raise ValueError("--drop-experts and --defer-experts go one at a time (each is compared with the reference)")
    if opts.max_context is None:
        opts.max_context = args.window
    elif args.window > opts.max_context:
        raise ValueError(f"--window {args.window} does not fit --max-context {opts.max_context}")
    cache = expert_cache(args)
    progress = True  # a bar on a terminal, a plain line now and then in a log (config/units.py show_progress)

    def opener(config):
        if config.get("model_type") not in MODEL_TYPES:  # no hetmoe model file: Transformers' own, if it has one
            return _transformers_opener(config, drop)
        return _native_opener(cache, progress)

    ref_model = ref_open = None
    if args.reference_model is not None:
        if args.reference_format == "none":
            raise ValueError("--reference-model with --reference-format none: no reference is scored")
        ref_model = Path(args.reference_model)
        ref_cfg = check_model_dir(ref_model)
        ref_tokenizer = load_tokenizer(ref_model, ref_cfg, lambda m: print(m, file=sys.stderr))
        ref_open = opener(ref_cfg)
    open_model = opener(cfg)
    test, test_runner = open_model(model, opts)
    blocks = moe_blocks(test.model) if test_runner is None else []
    if drop and test_runner is None and not blocks:
        raise ValueError("--drop-experts: this model has no routed experts")
    for _, layer in blocks:
        layer.set_drop(drop)
    ids = tokenizer.encode(text)
    if args.text_tokens is not None:
        ids = ids[:args.text_tokens]
    if ref_model is not None:
        ref_ids = ref_tokenizer.encode(text)[:len(ids)]
        if ref_ids != ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
            raise ValueError(f"--reference-model {ref_model} splits the text into other tokens than --model {model} "
                             f"(first difference at token {at}): their log-probabilities cannot be compared")
    reference = ref_runner = None
    itself = (ref_model is None and args.reference_format != "none"
              and same_as_reference(test.plan, args.reference_format, drop))
    if itself:
        reference = test
        print(f"hetmoe: the configuration is the reference ({_describe(test.plan)['label']} experts, dense weights "
              "in the dtype, nothing dropped or deferred): loaded and scored once, compared with itself",
              file=sys.stderr)
    elif args.reference_format != "none":
        # a uniform reference; --cpu-memory sizes the configuration (e.g. the auto mix of low-bit formats it picks),
        # not the reference, which takes what the machine has
        ref_opts = dataclasses.replace(opts, experts_format=args.reference_format, group_size=None, defer_experts=0,
                                       gpu_experts=0, rules=None, dense_format="bf16", cpu_memory=None)
        reference, ref_runner = (ref_open or open_model)(ref_model or model, ref_opts)

    test_runner = test_runner or Runner(test)
    if reference is not None and not itself:
        ref_runner = ref_runner or Runner(reference)
    result = evaluate(test_runner, ids, args.window, ref_runner, progress)
    if itself:
        result = result.against_itself()
    report = {"model": str(test.path), "text": "<stdin>" if text_name == "-" else text_name,
              "window": args.window, "config": _describe(test.plan, drop, opts.defer_experts),
              "reference": _describe(reference.plan) if reference else None, **result.summary()}
    if ref_model is not None:
        report["reference"]["model"] = str(reference.path)
    if args.json == "-":
        print(json.dumps(report))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(_table(report))
    return 0
