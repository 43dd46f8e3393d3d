"""Trains the demo MoE meant to ship inside hetmoe: a small DeepSeek-V3-architecture model (MLA, a dense first
layer, sigmoid group-limited router, 16 routed experts + 1 shared, top-4) trained from scratch with
transformers' ``DeepseekV3ForCausalLM`` on a corpus that exists offline on every machine: the Python standard
library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``; test suites and site-packages left out).

    python tools/train_demo_moe.py --out OUT --time-budget 240          # the real run (on a GPU)
    python tools/train_demo_moe.py --smoke --out /tmp/smoke             # tiny model, 2 steps, a few seconds (CI)

Corpus: the files in sorted order; a file is held out when sha256(its path) % 50 == 0 (~2%, independent of the
Python version's file list) and used for validation when it is 1 (another ~2%). Every ``--val-every`` seconds the
validation loss is measured and the best weights so far are kept; those are the ones saved (early stopping), so the
held-out loss is never used for a choice. The training documents are the train files plus chat-formatted examples made
from their documented public functions (user: "Write a Python function `name`: <docstring summary>", assistant: the
function's source), so that a chat-wrapped prompt gets code back. Documents are separated by <|endoftext|>.
Tokenizer: byte-level BPE trained on the train files (hetmoe.load.random_weights.train_bpe, its special tokens and
chat template). Training: AdamW, bf16 autocast on CUDA, warmup then cosine decay over ``--steps`` or
``--time-budget`` (whichever ends first), random windows of ``--seq-len`` tokens, plus a switch-style load-balancing
loss per MoE layer, E * sum_e f_e * P_e (f_e: fraction of the layer's token-expert choices that went to e,
recomputed with V3's routing rule from the router logits; P_e: the mean over tokens of e's normalised sigmoid
score; 1 when balanced), summed over the MoE layers, times ``--aux-coef``. The final train loss is measured on the
first ``--eval-tokens`` of the train stream, the held-out loss on the held-out files, both in windows of
``--seq-len`` (so they differ from ``hetmoe eval`` on heldout.txt, which joins the files with newlines).

OUT receives: config.json, model*.safetensors (bf16, shards <= 10 MB, with an index), generation_config.json,
tokenizer.json, tokenizer_config.json, heldout.txt (<= 200 KB of held-out files, for ``hetmoe eval``),
training.json (config, steps, tokens, wall time, losses, per-layer expert load on held-out text, corpus, the
hetmoe engine's logits vs transformers' on the saved weights, sample completions) and README.md.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the hetmoe command does: idle OpenMP threads must not spin
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hetmoe.load.random_weights import tokenizer_config, train_bpe  # noqa: E402
from hetmoe.moe.router import route_deepseek_v3  # noqa: E402

MODEL = dict(  # 11.6 M parameters (5.9 M in routed experts), 23 MB in bf16
    vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=6,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024,
)
SMOKE_MODEL = dict(MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                   q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                   max_position_embeddings=128)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
HELDOUT_MODULUS = 50
HELDOUT_TEXT_BYTES = 200_000
SAMPLE_PROMPTS = [("raw", "import os\n\n\ndef read_config(path):\n"),
                  ("chat", "Write a Python function `count_lines`: Return the number of lines in a text file.")]


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ corpus

def stdlib_files() -> list:
    """Relative paths of the stdlib's .py files, sorted; excluded folders are not even walked."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        found += [(Path(folder) / f).relative_to(root).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def read_corpus(smoke: bool) -> tuple:
    """(train, validation, held-out, description) of the stdlib's .py files; each split a list of (path, text).
    Validation chooses the checkpoint kept (early stopping); held-out is only measured, never used for choices."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, heldout, train_bytes = [], [], [], 0
    for rel in stdlib_files():
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_MODULUS
        split = heldout if bucket == 0 else val if bucket == 1 else train
        if smoke and (len(split) >= 2 if split is not train else train_bytes >= 150_000):
            continue  # a small slice: the first ~150 KB of train files, two validation and two held-out files
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            split.append((rel, text))
            train_bytes += len(text) if split is train else 0
    if not train or not val or not heldout:
        raise SystemExit(f"no usable .py files under {root}")
    desc = {
        "source": "Python standard library .py files (sysconfig stdlib path), test suites and site-packages excluded",
        "python": sys.version.split()[0], "stdlib": str(root), "train_files": len(train),
        "heldout_files": len(heldout), "validation_files": len(val),
        "validation_rule": f"sha256(relative path) % {HELDOUT_MODULUS} == 1",
        "train_bytes": sum(len(t.encode()) for _, t in train),
        "heldout_bytes": sum(len(t.encode()) for _, t in heldout),
        "heldout_rule": f"sha256(relative path) % {HELDOUT_MODULUS} == 0",
        "heldout_list_sha256": hashlib.sha256("\n".join(r for r, _ in heldout).encode()).hexdigest(),
        "heldout_list": [r for r, _ in heldout],
    }
    return train, val, heldout, desc


def chat_examples(files: list, max_bytes: int, seed: int) -> list:
    """Chat-formatted (user asks for a documented public function, assistant answers with its source)
    documents from ``files``, a deterministic sample of at most ``max_bytes``."""
    import jinja2

    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        tokenizer_config(0)["chat_template"])
    found = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            source = textwrap.dedent("".join(lines[first - 1:node.end_lineno]))
            if len(summary) >= 12 and len(source) <= 2000:
                found.append(template.render(messages=[
                    {"role": "user", "content": f"Write a Python function `{node.name}`: {summary}"},
                    {"role": "assistant", "content": source.rstrip()}], add_generation_prompt=False))
    random.Random(seed).shuffle(found)
    out, total = [], 0
    for doc in found:
        if total + len(doc) > max_bytes:
            break
        out.append(doc)
        total += len(doc)
    return out


def encode_stream(tok, docs: list) -> torch.Tensor:
    """All documents' token ids, each followed by <|endoftext|>, as one int64 tensor."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int64)


def heldout_text(heldout: list) -> str:
    """The held-out files one after another, cut at a line end to at most HELDOUT_TEXT_BYTES bytes."""
    text = "\n".join(t for _, t in heldout)
    raw = text.encode()[:HELDOUT_TEXT_BYTES]
    if len(raw) == HELDOUT_TEXT_BYTES:
        raw = raw[:raw.rfind(b"\n") + 1]
    return raw.decode("utf-8", errors="ignore")


# ------------------------------------------------------------------------------------------------ routing

class RouterStats:
    """Forward hooks on every MoE layer's ``mlp.gate``: the router logits are recomputed in fp32 from the gate's
    input (so the aux loss does not depend on what the gate returns in a given transformers version), the experts
    V3 routing picks are recomputed from them, and per layer the load-balancing loss and the expert counts are
    kept for the step."""

    def __init__(self, model, cfg: dict):
        self.cfg, self.aux, self.counts = cfg, [], {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            if i >= cfg["first_k_dense_replace"]:
                self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), module.weight.float())  # [T, E]
                scores = torch.sigmoid(logits)
                with torch.no_grad():
                    c = self.cfg
                    _, ids = route_deepseek_v3(logits, module.e_score_correction_bias, c["num_experts_per_tok"],
                                               c["n_group"], c["topk_group"], c["norm_topk_prob"], 1.0)
                    counts = torch.bincount(ids.flatten(), minlength=logits.shape[1]).float()  # [E]
                f = counts / ids.numel()
                p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)  # [E]
                self.aux.append(logits.shape[1] * (f * p).sum())
                self.counts[layer] = self.counts.get(layer, 0) + counts
        return hook

    def take_aux(self) -> torch.Tensor:
        aux, self.aux = sum(self.aux), []
        return aux

    def load(self) -> dict:
        """Per MoE layer: the fraction of token-expert choices each expert got since the last reset."""
        return {f"layer {i}": [round(v, 5) for v in (c / c.sum()).tolist()] for i, c in sorted(self.counts.items())}


# ------------------------------------------------------------------------------------------------ training

def lr_at(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@torch.no_grad()
def mean_loss(model, stream: torch.Tensor, seq: int, batch: int, max_tokens: int, device, stats=None) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of ``stream`` (at most max_tokens)."""
    model.eval()
    n_win = max(1, min((len(stream) - 1) // seq, max(1, max_tokens // seq)))
    total, count = 0.0, 0
    for b in range(0, n_win, batch):
        starts = torch.arange(b, min(n_win, b + batch)) * seq
        win = stream[starts[:, None] + torch.arange(seq + 1)].to(device)  # [B, seq + 1]
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum"))
        count += win[:, 1:].numel()
        if stats is not None:
            stats.take_aux()
    model.train()
    return total / count


def train(args) -> None:
    import transformers

    t_start = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = dict(SMOKE_MODEL if args.smoke else MODEL)
    train_files, val_files, heldout_files, corpus = read_corpus(args.smoke)
    log(f"corpus: {corpus['train_files']} train files ({corpus['train_bytes'] / 1e6:.1f} MB), "
        f"{corpus['heldout_files']} held out ({corpus['heldout_bytes'] / 1e3:.0f} KB), Python {corpus['python']}")
    tok = train_bpe((t for _, t in train_files), cfg["vocab_size"])
    chats = chat_examples(train_files, int(args.chat_fraction * corpus["train_bytes"]), args.seed)
    train_ids = encode_stream(tok, [t for _, t in train_files] + chats)
    heldout_ids = encode_stream(tok, [t for _, t in heldout_files])
    val_ids = encode_stream(tok, [t for _, t in val_files])
    corpus.update(chat_examples=len(chats), chat_bytes=sum(len(c.encode()) for c in chats),
                  train_tokens=len(train_ids), heldout_tokens=len(heldout_ids), validation_tokens=len(val_ids))
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_ids)} tokens ({len(chats)} chat examples), "
        f"held out {len(heldout_ids)} ({time.time() - t_start:.1f} s)")
    seq = min(args.seq_len, cfg["max_position_embeddings"], len(heldout_ids) - 1, len(val_ids) - 1, len(train_ids) - 1)

    config = transformers.DeepseekV3Config(**cfg, bos_token_id=None, eos_token_id=0, pad_token_id=0,
                                           tie_word_embeddings=False)
    model = transformers.DeepseekV3ForCausalLM(config).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    n_routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_routed / 1e6:.2f} M in routed experts) on {device}, "
        f"experts implementation {getattr(model.config, '_experts_implementation', '?')}")
    stats = RouterStats(model, cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    train_dev = train_ids.to(device)
    offsets = torch.arange(seq + 1, device=device)
    steps = args.steps or (10**9 if args.time_budget else 2000)
    t0, step, next_val = time.time(), 0, args.val_every
    best, curve = None, []  # (validation loss, step, CPU copy of the weights); [(step, seconds, validation loss)]

    def validate() -> None:
        nonlocal best
        loss = mean_loss(model, val_ids, seq, args.batch_size, args.val_tokens, device)
        curve.append((step, round(time.time() - t0, 1), loss))
        kept = best is None or loss < best[0]
        if kept:
            best = (loss, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        log(f"step {step}: validation loss {loss:.4f}" + (" (best so far, kept)" if kept else f" (best {best[0]:.4f} "
                                                          f"at step {best[1]})"))

    while step < steps:
        elapsed = time.time() - t0
        if args.time_budget and elapsed >= args.time_budget:
            break
        if elapsed >= next_val:
            validate()
            next_val = elapsed + args.val_every
        progress = max(step / steps, elapsed / args.time_budget if args.time_budget else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, min(progress, 1.0), args)
        starts = torch.randint(0, len(train_ids) - seq - 1, (args.batch_size,), generator=gen).to(device)
        win = train_dev[starts[:, None] + offsets]  # [B, seq + 1]
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        lm = F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten())
        aux = stats.take_aux()
        loss = lm + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == steps or step == 1:
            dt, aux_v = time.time() - t0, float(aux.detach()) if torch.is_tensor(aux) else 0.0
            log(f"step {step}: loss {lm.item():.4f} aux {aux_v:.4f} (sum over MoE layers) "
                f"lr {opt.param_groups[0]['lr']:.2e} {step * args.batch_size * seq / dt:,.0f} tok/s {dt:.0f} s")
    validate()
    train_s = time.time() - t0
    model.load_state_dict(best[2])  # early stopping: the weights with the lowest validation loss
    log(f"keeping the weights of step {best[1]} (validation loss {best[0]:.4f})")
    stats.counts.clear()
    heldout_loss = mean_loss(model, heldout_ids, seq, args.batch_size, args.eval_tokens, device, stats)
    load = stats.load()
    train_loss = mean_loss(model, train_ids, seq, args.batch_size, args.eval_tokens, device, stats)
    log(f"done: {step} steps, {step * args.batch_size * seq:,} tokens in {train_s:.0f} s; train loss "
        f"{train_loss:.4f}, held-out loss {heldout_loss:.4f} (ppl {math.exp(heldout_loss):.2f})")
    for name, fractions in load.items():
        log(f"expert load (held-out), {name}: " + " ".join(f"{v:.3f}" for v in fractions))
    for h in stats.handles:
        h.remove()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).cpu().eval()
    model.save_pretrained(out, max_shard_size="10MB")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg["max_position_embeddings"]), indent=1))
    (out / "heldout.txt").write_text(heldout_text(heldout_files), encoding="utf-8")
    record = {
        "command": " ".join(sys.argv), "args": vars(args), "config": cfg, "parameters": n_params,
        "routed_expert_parameters": n_routed, "steps": step, "seq_len": seq, "batch_size": args.batch_size,
        "tokens_seen": step * args.batch_size * seq, "epochs": step * args.batch_size * seq / len(train_ids),
        "train_seconds": train_s, "kept_step": best[1], "validation_loss": best[0],
        "validation_curve": [{"step": s_, "seconds": t_, "loss": l_} for s_, t_, l_ in curve],
        "wall_seconds": time.time() - t_start, "train_loss": train_loss,
        "heldout_loss": heldout_loss, "heldout_perplexity": math.exp(heldout_loss), "expert_load_heldout": load,
        "corpus": corpus, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    record.update(check_with_hetmoe(out, heldout_ids[: min(128, seq)], 8 if args.smoke else 64))
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "README.md").write_text(readme(record))
    size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
    log(f"wrote {out}: safetensors {size / 1e6:.1f} MB, total {time.time() - t_start:.0f} s")


def check_with_hetmoe(out: Path, ids: torch.Tensor, new_tokens: int) -> dict:
    """Load the saved checkpoint with hetmoe's engine (CPU, bf16 experts, fp32 dense) and with transformers (fp32;
    a fresh load, so the RoPE tables are fp32 again): their logits on ``ids``, and sample completions."""
    import transformers

    from hetmoe.config.options import EngineOptions
    from hetmoe.cpu import cpu_info
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    limit = json.loads((out / "config.json").read_text())["max_position_embeddings"]  # the smoke model's is 128
    llm = LLM(out, EngineOptions(device="cpu", experts_format="bf16", dtype="fp32", max_context=min(512, limit)),
              expert_cache=None, progress=False, log=lambda m: None)
    ours = llm.runner.score(ids.tolist())
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=ids[None], use_cache=False).logits[0].float()
    rel = float((ours - ref).norm() / ref.norm())
    log(f"hetmoe engine vs transformers on the saved weights: rel. logit error {rel:.2e}")
    samples = []
    for mode, prompt in SAMPLE_PROMPTS:
        result = llm.generate(prompt, SamplingParams(max_tokens=new_tokens), chat=mode == "chat")
        samples.append({"mode": mode, "prompt": prompt, "completion": result.text})
        log(f"sample ({mode}) {prompt!r} -> {result.text!r}")
    # which numerical class computed the experts (tests/paths.py): on AMX their activations are rounded to bf16
    return {"hetmoe_vs_transformers_rel_logit_error": rel, "hetmoe_isa": cpu_info()["best_isa"], "samples": samples}


def readme(r: dict) -> str:
    c, corpus = r["config"], r["corpus"]
    return (f"# hetmoe demo MoE\n\nA DeepSeek-V3-architecture MoE ({c['num_hidden_layers']} layers, hidden "
            f"{c['hidden_size']}, {c['n_routed_experts']} routed experts + {c['n_shared_experts']} shared, "
            f"top-{c['num_experts_per_tok']}, MLA, sigmoid group-limited router; {r['parameters'] / 1e6:.1f} M "
            f"parameters) trained from scratch by `tools/train_demo_moe.py` on the Python {corpus['python']} standard "
            f"library's own source ({corpus['train_files']} files, {corpus['train_tokens']:,} tokens with the chat "
            f"examples; {corpus.get('validation_files', 0)} files for validation; {corpus['heldout_files']} held out, "
            f"in heldout.txt). It writes Python in the standard library's style; ask it in chat form for a function "
            f"(\"Write a Python function `name`: what it does\") or give it the start of a file with `--raw`. "
            f"It is a demo, not a useful coding model.\n\n"
            f"{r['command']}\n\n"
            f"{r['steps']} steps, {r['tokens_seen']:,} tokens, {r['train_seconds']:.0f} s on {r['device']}; the "
            f"weights kept are those of step {r.get('kept_step', r['steps'])} (lowest validation loss, "
            f"{r.get('validation_loss', float('nan')):.3f}): train loss {r['train_loss']:.3f}, held-out loss "
            f"{r['heldout_loss']:.3f} (perplexity {r['heldout_perplexity']:.2f}), measured in windows of "
            f"{r['seq_len']} tokens. Everything else (validation curve, per-layer expert load on held-out text, "
            f"versions) is in training.json.\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop training after this many seconds (then evaluate and save)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: 2000 without "
                   "--time-budget, else only the time budget ends training)")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cuda or cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model, small corpus slice, 2 steps (CI)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 64; smoke 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; smoke 32)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 100; smoke 1)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--chat-fraction", type=float, default=0.2,
                   help="chat-formatted function examples, as a fraction of the train files' bytes")
    p.add_argument("--eval-tokens", type=int, default=None, help="max tokens for the final losses (default 262144)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--val-every", type=float, default=None, metavar="SECONDS",
                   help="validation loss every this many seconds of training; the best weights are kept (default 15)")
    p.add_argument("--val-tokens", type=int, default=None, help="validation tokens per check (default 65536)")
    args = p.parse_args(argv)
    smoke = args.smoke
    for name, full, tiny in (("batch_size", 64, 2), ("seq_len", 512, 32), ("warmup", 100, 1),
                             ("eval_tokens", 262144, 256), ("steps", None, 2),
                             ("val_every", 15.0, 1e9), ("val_tokens", 65536, 256)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if smoke else full)
    if args.time_budget is not None and args.time_budget <= 0 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--time-budget must be > 0, --batch-size >= 1 and --seq-len >= 2")
    train(args)


if __name__ == "__main__":
    main()
