"""Expert Deferral (hetmoe/moe/deferral.py: DeferralChain; hetmoe/moe/dispatch.py: MoELayer.set_deferral,
defer_experts; --defer-experts): d = 0 is the undeferred model bit for bit; d > 0 is
y_l = S_l(x_l) + R_imm_l(x_l) + R_def_{l-1}(x_{l-1}) as written out layer by layer in plain PyTorch below; the first
MoE layer has no deferred input and the last defers nothing; the CPU engine's overlapped jobs give the synchronous
result bit for bit; bad d is refused (and deferring again replaces, never stacks); nothing leaks from one forward
call to the next. Checkpoints: synthetic.write_checkpoint, fp32, with three MoE layers (first, middle, last) and top-4.

Engine paths (tests/paths.py): the bitwise properties (d = 0, overlapped == synchronous, first/middle/last, no
leaks) hold within one path, and the formula test compares the engine with the fp32 reference under the bf16
bound. Each loads and runs whole models, the costliest tests of this folder, so to keep the per-commit tier short
they run on TWO_PATHS, not on every path of PATHS: one row-block path (the best this machine runs; the row-block
paths give the same bits as each other, tests/cpu) and one AMX path (the tile unit where there is one, else
amx-emulated: the AMX logic on any CPU)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.layers.rope import cos_sin  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.load.random_weights import build_random_model  # noqa: E402
from hetmoe.models import model_class  # noqa: E402
from hetmoe.models.config import ModelConfig  # noqa: E402
from hetmoe.moe import (  # noqa: E402
    DeferralChain,
    MoELayer,
    RouterSpec,
    TorchExperts,
    defer_experts,  # noqa: E402
    route_deepseek_v3,
    route_softmax,
    split_deferred,
)
from parity import load_ours, max_rel, torch_fp32  # noqa: E402
from paths import CLASS_PATHS  # noqa: E402
from paths import ids as path_ids  # noqa: E402

ARCHS = ("deepseek_v3", "qwen3_moe")
# Three MoE layers each (DeepSeek: one dense layer first), four experts per token so that d = 1 and 2 both apply.
CONFIGS = {
    "deepseek_v3": dict(num_hidden_layers=4, num_experts_per_tok=4, topk_group=2),
    "qwen3_moe": dict(num_hidden_layers=3, num_experts_per_tok=4),
}
PROMPT = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]
FED = [7, 300, 12, 99]  # decode steps feed fixed tokens, so every run sees the same inputs
CPU = dict(device="cpu", dtype="fp32", max_context=64, experts_format="bf16")
TWO_PATHS = list(CLASS_PATHS)
on_two_paths = pytest.mark.parametrize("engine_path", TWO_PATHS, ids=path_ids(TWO_PATHS))


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    """The shared session checkpoints (tests/conftest.py)."""
    return {a: checkpoints(a, CONFIGS[a], seed=3 + i, dtype="float32") for i, a in enumerate(ARCHS)}


def load(path, engine_path=None, **opts):
    """``path`` loaded into the CPU engine, on ``engine_path`` (tests/paths.py) or the default isa="auto"."""
    opts = {**CPU, **(engine_path.options if engine_path else {}), **opts}
    return load_model(path, EngineOptions(**opts), expert_cache=None, progress=False, log=lambda m: None)


def torch_model(path):
    """Our model class with fp32 TorchExperts backends (tests/parity.load_ours)."""
    return load_ours(path, model_class(ModelConfig.from_file(path / "config.json")), torch_fp32)


def run_runner(loaded, prompt=PROMPT, fed=FED):
    runner = Runner(loaded)
    return torch.stack([runner.prefill(prompt)] + [runner.decode(t) for t in fed])


@torch.no_grad()
def run_model(model, forward=None, prompt=PROMPT, fed=FED):
    """Prefill then decode ``fed`` on a bare model (or through ``forward(model, ids, step, cache)``) -> logits
    of each call's last token [1 + len(fed), V]."""
    forward = forward or (lambda m, ids, step, cache: m.logits(m(ids, step, cache)))
    cache, slot = model.make_cache(1, 64), torch.tensor([0])
    out = [forward(model, torch.tensor([prompt]), Step(torch.arange(len(prompt))[None], slot), cache)[0, -1]]
    for i, t in enumerate(fed):
        out.append(forward(model, torch.tensor([[t]]), Step(torch.tensor([[len(prompt) + i]]), slot), cache)[0, -1])
    return torch.stack(out).float()


# ---------------------------------------------------------------- the formula, written out in plain PyTorch

def _rope(inner, step, dtype):
    if hasattr(inner, "attention_scaling"):  # DeepSeek: half-size cos/sin times the YaRN attention factor
        freqs = step.positions.float().unsqueeze(-1) * inner.inv_freq
        return (freqs.cos() * inner.attention_scaling).to(dtype), (freqs.sin() * inner.attention_scaling).to(dtype)
    return cos_sin(step.positions, inner.inv_freq, dtype)


def _route(mlp, flat):
    """(weights, ids) from the block's router logits, by the route function of its kind, with the block's own
    parameters (its MoE layer's RouterSpec fields)."""
    spec, logits = mlp.moe.router, mlp.gate(flat)
    if spec.kind == "softmax":  # Qwen3-MoE: softmax top-k
        return route_softmax(logits, spec.top_k, spec.norm_topk_prob)
    assert spec.kind == "sigmoid_grouped", spec.kind  # DeepSeek-V3
    return route_deepseek_v3(logits, mlp.gate.e_score_correction_bias, spec.top_k, spec.n_group, spec.topk_group,
                             spec.norm_topk_prob, spec.routed_scaling_factor)


def reference_deferral(model, ids, step, cache, d):
    """Logits of ``model`` (its MoE blocks holding TorchExperts, whose fp32 weights are all this reads of them)
    with Expert Deferral, one (token, expert) at a time:

        y_l = S_l(x_l) + R_imm_l(x_l) + R_def_{l-1}(x_{l-1})

    Per token the d slots with the lowest (weight, slot index) are deferred — ascending weight, and among equal
    weights the earlier slot first — except in the last MoE layer, whose whole top-k is immediate."""
    inner = model.model
    x = inner.embed_tokens(ids)  # [B, S, H]
    rope = _rope(inner, step, x.dtype)
    moe = [i for i, layer in enumerate(inner.layers) if hasattr(layer.mlp, "moe")]
    carried = None  # [T, H]: the deferred experts of the previous MoE layer, on its input
    for i, layer in enumerate(inner.layers):
        x = x + layer.self_attn(layer.input_layernorm(x), rope, step, cache)
        h = layer.post_attention_layernorm(x)
        if i not in moe:
            x = x + layer.mlp(h)
            continue
        ex = layer.mlp.moe.experts
        flat = h.reshape(-1, h.shape[-1])  # [T, H]
        weights, top = _route(layer.mlp, flat)  # [T, k]
        n_defer = 0 if i == moe[-1] else d
        immediate, deferred = torch.zeros_like(flat), torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            order = sorted(range(top.shape[1]), key=lambda j: (weights[t, j].item(), j))
            for rank, j in enumerate(order):
                e = int(top[t, j])
                y = (F.silu(ex.gate[e] @ flat[t]) * (ex.up[e] @ flat[t])) @ ex.down[e].T * weights[t, j]
                if rank < n_defer:
                    deferred[t] += y
                else:
                    immediate[t] += y
        routed = immediate if carried is None else immediate + carried
        carried = deferred if n_defer else None
        out = routed.view_as(h)
        if getattr(layer.mlp, "shared_experts", None) is not None:
            out = out + layer.mlp.shared_experts(h)
        x = x + out
    return model.logits(inner.norm(x))


# ---------------------------------------------------------------- (1) d = 0 is the undeferred model

@on_two_paths
@pytest.mark.parametrize("arch", ARCHS)
def test_d0_is_the_undeferred_model_bit_for_bit(ckpt, arch, engine_path):
    plain = load(ckpt[arch], engine_path)
    assert all(b.defer == 0 and b.chain is None and b.position == "only" for _, b in moe_blocks(plain.model))
    want = run_runner(plain)
    blocks = moe_blocks(plain.model)
    chain = DeferralChain(len(blocks))
    for i, (_, block) in enumerate(blocks):  # the deferral setting itself at d = 0, given a chain
        block.set_deferral(0, chain, i)
        assert block.defers_now(4) == 0
    assert torch.equal(run_runner(plain), want)
    assert torch.equal(run_runner(load(ckpt[arch], engine_path, defer_experts=0)), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_d0_is_the_undeferred_torch_model_bit_for_bit(ckpt, arch):
    """TorchExperts backends, on the bare model (no engine path)."""
    model = torch_model(ckpt[arch])
    want = run_model(model)
    assert defer_experts(model, 0) is None
    assert torch.equal(run_model(model), want)


# ---------------------------------------------------------------- (2) d > 0 is the formula

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [1, 2])
def test_deferral_equals_the_plain_pytorch_formula(ckpt, arch, d):
    ref = run_model(torch_model(ckpt[arch]), lambda m, ids, step, cache: reference_deferral(m, ids, step, cache, d))
    undeferred = run_model(torch_model(ckpt[arch]))
    ours = torch_model(ckpt[arch])
    chain = defer_experts(ours, d)
    assert isinstance(chain, DeferralChain) and chain.n_layers == 3
    got = run_model(ours)
    err, moved = max_rel(got, ref), max_rel(undeferred, ref)
    print(f"{arch} d={d}: TorchExperts fp32 vs reference {err:.1e}; undeferred vs reference {moved:.1e}")
    assert err < 1e-5, err
    assert moved > 1e-3, moved  # deferral changes the logits: the comparison above could fail
    # The CPU engine (bf16 experts, overlapped jobs) against the fp32 reference: bf16 rounding only. The reference
    # costs more than the engine runs, so one test covers TWO_PATHS. MEASURED max rel. error (d=1 / d=2):
    #                 row blocks (scalar, avx2, avx512: the same bits)   amx-emulated (bf16 activations too)
    #   deepseek_v3   4.9e-4 / 5.1e-4                                    6.4e-4 / 6.1e-4
    #   qwen3_moe     1.2e-4 / 1.1e-4                                    2.0e-4 / 1.6e-4
    for engine_path in TWO_PATHS:
        engine = run_runner(load(ckpt[arch], engine_path, defer_experts=d))
        engine_err = max_rel(engine, ref)
        print(f"{arch} d={d}: CPU engine bf16 on {engine_path} vs reference {engine_err:.2e}")
        assert engine_err < 1.3e-3, (engine_path.name, engine_err)  # ~2x the max over the paths
        assert engine_err < moved / 5, (engine_path.name, engine_err, moved)


def test_split_deferred_ties_and_complement():
    ids = torch.tensor([[4, 7, 1, 2], [0, 5, 6, 3], [9, 8, 7, 6]])
    w = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25], [0.5, 0.2, 0.2, 0.1]])
    imm, dfr = split_deferred(ids, w, 2)
    assert dfr.tolist() == [[4, -1, -1, 2], [0, 5, -1, -1], [-1, 8, -1, 6]]  # ties: the earlier slot is deferred
    assert imm.tolist() == [[-1, 7, 1, -1], [-1, -1, 6, 3], [9, -1, 7, -1]]
    assert torch.equal(torch.where(imm >= 0, imm, dfr), ids)


# ---------------------------------------------------------------- (3) first, middle, last

class _Outputs:
    """Stands in for a block's MoE layer: records the layer's routed output (without the shared experts, which it
    adds afterwards as the layer's combine does) and passes everything through."""

    def __init__(self, layer, log):
        self.layer, self.log = layer, log

    def __call__(self, x, logits, shared=None, correction_bias=None):
        y = self.layer(x, logits, correction_bias=correction_bias)
        self.log.append(y.clone())
        return y if shared is None else y + shared(x)


@on_two_paths
@pytest.mark.parametrize("arch", ARCHS)
def test_first_layer_has_no_deferred_input_and_last_defers_nothing(ckpt, arch, engine_path, monkeypatch):
    d = 2
    loaded = load(ckpt[arch], engine_path, defer_experts=d)
    named = moe_blocks(loaded.model)
    blocks = [b for _, b in named]
    assert [b.position for b in blocks] == ["first", "middle", "last"]
    engines = [b.engine for b in blocks]
    pool = engines[0].pool
    assert all(e.pool is pool for e in engines)
    events = []
    for layer, engine in enumerate(engines):
        def submit(x, ids, weights, out=None, *args, _layer=layer, _submit=engine.submit, **kwargs):
            events.append(("submit", _layer, ids.clone(), weights.clone(), out))
            return _submit(x, ids, weights, out, *args, **kwargs)
        monkeypatch.setattr(engine, "submit", submit)
    real_sync = pool.sync
    monkeypatch.setattr(pool, "sync", lambda allow_pending=0: (events.append(("sync", allow_pending)),
                                                               real_sync(allow_pending))[1])
    outputs = []
    for name, b in named:
        monkeypatch.setattr(loaded.model.get_submodule(name), "moe", _Outputs(b, outputs))

    runner = Runner(loaded)
    for call in (lambda: runner.prefill(PROMPT), lambda: runner.decode(FED[0])):
        events.clear()
        outputs.clear()
        call()
        # the jobs in pool order: layer 0 immediate + deferred, wait for all but one; layer 1 the same; layer 2 whole
        assert [(e[0], e[1]) if e[0] == "submit" else e for e in events] == [
            ("submit", 0), ("submit", 0), ("sync", 1), ("submit", 1), ("submit", 1), ("sync", 1),
            ("submit", 2), ("sync", 0)], events
        subs = [e for e in events if e[0] == "submit"]
        for layer in (0, 1):
            (_, _, imm, w, _), (_, _, dfr, w2, _) = subs[2 * layer], subs[2 * layer + 1]
            assert torch.equal(w, w2)
            assert ((imm >= 0) != (dfr >= 0)).all()  # every slot is immediate or deferred, never both
            assert ((dfr >= 0).sum(-1) == d).all() and ((imm >= 0).sum(-1) == 4 - d).all()
            # the deferred slots are the lowest-weighted ones
            assert (w.masked_fill(dfr < 0, -1).amax(-1) <= w.masked_fill(imm < 0, 2).amin(-1)).all()
        last_ids = subs[4][2]
        assert (last_ids >= 0).all() and last_ids.shape[1] == 4  # the last layer defers nothing
        out = [s[4] for s in subs]  # imm0, def0, imm1, def1, all2 (fp32)
        assert torch.equal(outputs[0], out[0])  # no deferred input at the first layer
        assert torch.equal(outputs[1], out[2] + out[1])  # immediate, then the previous layer's deferred
        assert torch.equal(outputs[2], out[4] + out[3])
        assert out[1].abs().sum() > 0 and out[3].abs().sum() > 0  # the deferred parts were computed
        assert blocks[0].chain.pending is None  # the last layer consumed it


def _torch_layer(d=0, chain=None, index=0, k=2):
    """A MoE layer of 4 TorchExperts (H 16, I 8), softmax top-``k``, deferring ``d`` as layer ``index`` of ``chain``."""
    layer = MoELayer(RouterSpec("softmax", k), 4)
    layer.attach(TorchExperts(torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)))
    layer.set_deferral(d, chain, index)
    return layer


def test_layers_must_run_in_order():
    chain = DeferralChain(3)
    middle = _torch_layer(1, chain, 1)
    x, logits = torch.randn(2, 16), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="MoE layer 1 expected the experts deferred by layer 0, found nothing"):
        middle(x, logits)
    _torch_layer(1, chain, 0)(x, logits)
    with pytest.raises(RuntimeError, match="MoE layer 1 has 1 tokens; layer 0 deferred experts for 2"):
        middle(x[:1], logits[:1])


# ---------------------------------------------------------------- (4) overlapped jobs == synchronous jobs

@on_two_paths
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", [1, 2])
def test_overlapped_engine_jobs_equal_synchronous_ones(ckpt, arch, d, engine_path):
    overlapped = load(ckpt[arch], engine_path, defer_experts=d)
    assert all(b.overlap and b.engine is not None and b.defer == d for _, b in moe_blocks(overlapped.model))
    synchronous = load(ckpt[arch], engine_path)
    defer_experts(synchronous.model, d, overlap=False)
    assert not any(b.overlap for _, b in moe_blocks(synchronous.model))
    a, b = run_runner(overlapped), run_runner(synchronous)
    assert torch.equal(a, b)
    assert not torch.equal(a, run_runner(load(ckpt[arch], engine_path)))  # and both differ from the undeferred model


# ---------------------------------------------------------------- (5) bad d

def test_bad_d_is_refused(ckpt, capsys):
    with pytest.raises(ValueError, match="defer-experts must be an integer >= 0, got -1"):
        EngineOptions(defer_experts=-1)
    with pytest.raises(ValueError, match="defer-experts must be an integer >= 0"):
        EngineOptions(defer_experts=1.5)
    with pytest.raises(ValueError, match=r"--defer-experts 4: each token has 4 routed experts \(top-4\); at most 3"):
        load(ckpt["qwen3_moe"], defer_experts=4)
    with pytest.raises(ValueError, match="at most 7 can be deferred"):  # refused before any weight is made
        build_random_model("qwen3-30b-a3b", 1, EngineOptions(device="cpu", defer_experts=8), log=lambda m: None)
    with pytest.raises(ValueError, match="integer >= 0"):
        _torch_layer().set_deferral(-1, DeferralChain(2), 0)
    with pytest.raises(ValueError, match="cannot defer 2 of the top-2"):
        _torch_layer(2, DeferralChain(2), 0)(torch.randn(1, 16), torch.randn(1, 4))
    # Deferring a deferred model again replaces its deferral (one chain, d as asked), never stacks a second one:
    # the same logits as a model loaded with that d (the wrappers' "already deferred" refusal guarded the same).
    loaded = load(ckpt["qwen3_moe"], defer_experts=1)
    old = moe_blocks(loaded.model)[0][1].chain
    chain = defer_experts(loaded.model, 2)
    assert chain is not old and all(b.chain is chain and b.defer == 2 for _, b in moe_blocks(loaded.model))
    assert torch.equal(run_runner(loaded), run_runner(load(ckpt["qwen3_moe"], defer_experts=2)))
    assert defer_experts(loaded.model, 0) is None
    assert all(b.chain is None and b.defer == 0 for _, b in moe_blocks(loaded.model))
    assert torch.equal(run_runner(loaded), run_runner(load(ckpt["qwen3_moe"])))

    from hetmoe.cli import main

    code = main(["generate", "--model", str(ckpt["qwen3_moe"]), "--device", "cpu", "--expert-cache", "off",
                 "--defer-experts", "4", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "hetmoe generate: error: --defer-experts 4: each token has 4 routed experts" in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------- (6) nothing crosses forward calls

@on_two_paths
@pytest.mark.parametrize("arch", ARCHS)
def test_no_state_leaks_across_calls(ckpt, arch, engine_path, monkeypatch):
    other = [300, 2, 2, 41, 7, 7, 7, 100, 5]
    loaded = load(ckpt[arch], engine_path, defer_experts=2, prefill_chunk=4)  # several forward calls per prompt
    chain = moe_blocks(loaded.model)[0][1].chain
    alone = run_runner(loaded, prompt=other)
    first = run_runner(loaded)
    assert chain.pending is None
    assert torch.equal(run_runner(loaded, prompt=other), alone)
    assert torch.equal(run_runner(loaded), first)
    # a call interrupted after the first MoE layer deferred its experts leaves them pending; the next call drops them
    attn = loaded.model.model.layers[-1].self_attn

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(attn, "forward", boom)
    with pytest.raises(KeyboardInterrupt):
        run_runner(loaded)
    assert chain.pending is not None
    monkeypatch.undo()
    assert torch.equal(run_runner(loaded, prompt=other), alone)


def test_eval_compares_deferral_with_the_undeferred_reference(ckpt, capsys, tmp_path):
    import json

    from hetmoe.cli import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    common = ["eval", "--model", str(ckpt["qwen3_moe"]), "--text", str(text), "--device", "cpu", "--window", "16",
              "--expert-cache", "off", "--experts-format", "bf16"]
    assert main(common + ["--defer-experts", "1", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["defer_experts"] == 1 and result["config"]["label"] == "bf16, defer 1"
    assert result["reference"]["defer_experts"] == 0 and result["kl"] > 1e-6
    assert main(common + ["--defer-experts", "1", "--drop-experts", "1"]) == 1
    assert "one at a time" in capsys.readouterr().err


# ---------------------------------------------------------------- the hybrid placement (GPU machine)

@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_deferral_matches_cpu(ckpt, arch):
    hybrid = load(ckpt[arch], device="cuda", defer_experts=2)
    assert all(b.engine is not None and b.staging is not None and b.defer == 2 for _, b in moe_blocks(hybrid.model))
    gpu = run_runner(hybrid).cpu()
    cpu = run_runner(load(ckpt[arch], defer_experts=2))
    err = max_rel(gpu, cpu)
    print(f"{arch} d=2: hybrid vs cpu max rel. logit error {err:.2e}")
    assert err < 2e-3, err
    synchronous = load(ckpt[arch], device="cuda")
    defer_experts(synchronous.model, 2, overlap=False)
    assert torch.equal(run_runner(synchronous).cpu(), gpu)
