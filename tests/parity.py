"""Shared harness for model parity tests: the same checkpoint in transformers' class and in ours, compared
logit by logit over a prefill and cached decode steps; and a config a model refuses before reading any weight
(``assert_refused_before_weights``). The routed experts go into a backend builder
``(gate, up, down) -> experts``: ``torch_fp32``, or ``engine_bf16(path)`` for the CPU engine forced onto one of
the numerical paths of tests/paths.py."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.cpu.experts import SWIGLU
from hetmoe.layers.attention import Step
from hetmoe.load.checkpoint import Checkpoint, CheckpointError
from hetmoe.moe import TorchExperts

# Routed-expert tensors on disk: mlp.experts.E.{gate,up,down}_proj (Qwen, DeepSeek) or, in Mixtral checkpoints,
# block_sparse_moe.experts.E.{w1,w3,w2} (gate, up, down).
EXPERT_KEY = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
DECODE_STEPS = 8


def torch_fp32(gate, up, down):
    return TorchExperts(gate, up, down, torch.float32)


def engine_bf16(path):
    """The builder of bf16 experts in the CPU engine on ``path`` (a tests/paths.EnginePath; every expert on that
    path, whatever its token count)."""

    def build(gate, up, down):
        ex = CPUExperts(gate.shape[0], gate.shape[2], gate.shape[1], "bf16", **path.options)
        ex.load(gate, up, down)
        return ex

    return build


def load_ours(path, model_cls, experts_backend=None):
    """Our model from a checkpoint directory through hetmoe's Checkpoint (a multimodal checkpoint: its language model
    under the model's names, the rest left unread): every tensor but the routed experts by name (strict), those
    stacked per layer into ``experts_backend(gate, up, down)`` — with the layer's activation as a fourth argument
    where it is not plain SwiGLU (a clamped SwiGLU) — or fp32 TorchExperts where there is no backend or it returns
    None."""
    ckpt = Checkpoint(path)
    model = model_cls(ckpt.config)
    tensors, experts = {}, {}
    for name in ckpt.names():
        m = EXPERT_KEY.fullmatch(name)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(PROJ[m[3]], {})[int(m[2])] = ckpt.get(name).float()
        else:
            tensors[name] = ckpt.get(name).float()
    model.load_state_dict(tensors, strict=True)
    model.fuse_projections()  # as the loader does: q/k/v and gate/up as one matmul each
    for layer, mats in experts.items():
        gate, up, down = (torch.stack([mats[w][e] for e in sorted(mats[w])]) for w in ("gate", "up", "down"))
        moe = model.model.layers[layer].mlp.moe
        glu = () if moe.glu == SWIGLU else (moe.glu,)
        built = experts_backend(gate, up, down, *glu) if experts_backend is not None else None
        moe.attach(built if built is not None else TorchExperts(gate, up, down, glu=moe.glu))
    ckpt.close()  # after the copies: fp32 tensors are views of the mapped file
    return model.eval()


def step_logits(model, ids: torch.Tensor, start: int, slots: torch.Tensor, cache) -> torch.Tensor:
    """Our model's logits [B, S, vocab] for ``ids`` [B, S] at positions ``start``..., over ``cache``, with the hidden
    states' and the logits' shapes and dtype asserted."""
    B, S = ids.shape
    hidden = model(ids, Step(positions=torch.arange(start, start + S).expand(B, S), slots=slots), cache)
    assert hidden.shape == (B, S, model.config.hidden_size) and hidden.dtype == model.model.embed_tokens.weight.dtype
    logits = model.logits(hidden)
    assert logits.shape == (B, S, model.config.vocab_size) and logits.dtype == hidden.dtype
    return logits


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32 on the CPU (either may be bf16 or on the GPU)."""
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


_HF_TRACES = {}


def hf_trace(transformers, checkpoint, batch: int, prompt_len: int) -> tuple:
    """transformers' logits for a random prompt (seeded by ``batch``) and DECODE_STEPS greedy steps: (prompt ids,
    the tokens it fed, its logits per call). Computed once per checkpoint and shape: every backend compared with
    it (one per engine path) reads the same trace."""
    key = (str(checkpoint), batch, prompt_len)
    if key not in _HF_TRACES:
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, hf.config.vocab_size, (batch, prompt_len), generator=gen)
        with torch.no_grad():
            out = hf(ids, use_cache=True)
            logits, fed = [out.logits], []
            for _ in range(DECODE_STEPS):
                fed.append(out.logits[:, -1:].argmax(-1))
                out = hf(fed[-1], past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits)
        _HF_TRACES[key] = ids, fed, logits
    return _HF_TRACES[key]


def trace_ours(model, ids: torch.Tensor, fed: list) -> list:
    """Our logits over the prefill of ``ids`` [B, S] and the cached steps feeding ``fed`` (one [B, 1] each)."""
    B, S = ids.shape
    cache = model.make_cache(B, S + len(fed) + 4)
    slots = torch.arange(B)
    with torch.no_grad():
        out = [model.logits(model(ids, Step(positions=torch.arange(S).expand(B, S), slots=slots), cache))]
        for i, nxt in enumerate(fed):
            out.append(model.logits(model(nxt, Step(positions=torch.full((B, 1), S + i), slots=slots), cache)))
    return out


def parity_errors(transformers, checkpoint, model_cls, experts_backend, batch: int, prompt_len: int = 11) -> list:
    """Max relative logit error of ours vs transformers for the prefill and each of DECODE_STEPS greedy steps
    (transformers' greedy tokens fed to both)."""
    ids, fed, hf_logits = hf_trace(transformers, checkpoint, batch, prompt_len)
    ours = trace_ours(load_ours(checkpoint, model_cls, experts_backend), ids, fed)
    return [max_rel(a, b) for a, b in zip(ours, hf_logits)]


def assert_refused_before_weights(source, dest, monkeypatch, changes: dict, message: str, options: dict) -> None:
    """A copy at ``dest`` of the checkpoint ``source`` whose config.json takes ``changes`` (a None value drops the
    key) is refused by the loader, given EngineOptions(**options), with CheckpointError ``message`` (a regex after
    the config's path), before any weight is read."""
    from hetmoe.load.loader import load_model

    path = Path(shutil.copytree(source, dest))
    cfg = json.loads((path / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **changes}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))

    def no_weight(self, name):
        raise AssertionError(f"weight {name} was read")

    monkeypatch.setattr(Checkpoint, "get", no_weight)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path / 'config.json'))}(: | ){message}"):
        load_model(path, EngineOptions(**options), expert_cache=None, progress=False, log=lambda m: None)


GENERATE_PROMPTS = ("def f(x):\n    return x * 2 + 1 if x else 3", "Hello there, how are you today? Fine, thanks.")


def generate_like_transformers(llm, hf, max_tokens: int, check_ids=lambda ids: None):
    """``LLM`` greedy over GENERATE_PROMPTS (each longer than 12 tokens; ``check_ids`` sees their ids), alone and two
    at once, gives Transformers' ``generate`` tokens; then a prompt extending the first does too. Returns that last
    result (the caller checks its cached tokens: prefix reuse on or off)."""
    from hetmoe.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def reference(prompt):
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) > 12
        check_ids(ids)
        with torch.inference_mode():
            return hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist()

    alone = [llm.generate(p, params, chat=False) for p in GENERATE_PROMPTS]
    for prompt, out in zip(GENERATE_PROMPTS, alone):
        assert out.token_ids == reference(prompt)
    both = llm.generate(list(GENERATE_PROMPTS), params, chat=False)
    assert [r.token_ids for r in both] == [r.token_ids for r in alone]
    longer = GENERATE_PROMPTS[0] + " + f(x - 1)"
    out = llm.generate(longer, params, chat=False)
    assert out.token_ids == reference(longer)
    return out
