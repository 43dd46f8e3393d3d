"""The Transformers experts backend (hetmoe/transformers/): tiny random checkpoints of Transformers MoE families,
written by the test with Transformers itself (tests/transformers_tiny.py), loaded by ``hetmoe.transformers.
from_pretrained`` and compared with the same checkpoint under Transformers' eager experts; the fallback of a variant
the engine cannot compute; the runner adapter and ``hetmoe generate --model DIR`` for a model_type without a hetmoe
model file.

Paths: the experts on the CPU engine's best row-block path (BEST_ROW_PATH: fp32 activations with bf16 weights, so
bf16-rounded fp32 checkpoints are computed without any rounding of the weights) or isa=auto; the dense part in
Transformers' fp32 PyTorch on the CPU. GPU-marked: dense on the GPU, experts on the CPU.
"""

import json
import warnings

import pytest
import torch
from transformers_tiny import FAMILIES, save_tiny

import hetmoe.transformers as ht
from hetmoe.transformers.backend import engine_of, hetmoe_experts_forward, is_experts_module
from hetmoe.transformers.runner import TransformersRunner, transformers_class
from paths import BEST_ROW_PATH

ENGINE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "olmoe", "glm4_moe", "qwen3_next")
IDS = [[5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]]
# ‖logits - eager‖ / ‖eager‖ with bf16 experts holding the checkpoint's (bf16-rounded) weights exactly: fp32
# summation order only. Measured max over the six families: 4.0e-7.
BF16_BOUND = 5e-6
# The quantized formats against the eager fp32 model (the format's accuracy on these tiny random models: Gaussian
# weights of std 0.08, int8 group 128 / int4 group 64, BEST_ROW_PATH). MEASURED (AVX-512 machine), max over the six
# families: one experts module's output against the exact float64 layer (64 tokens, top-2): int8 1.1e-2, int4
# 1.75e-1; whole-model logits: int8 1.0e-2 (qwen3_next), int4 1.6e-1 (qwen3_next). Bounds about 1.5-2x.
MODULE_BOUND = {"int8": 2e-2, "int4": 0.25}
LOGITS_BOUND = {"int8": 2e-2, "int4": 0.3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> checkpoint directory (written once per module, sharded, with a tokenizer)."""
    dirs = {}

    def get(family):
        if family not in dirs:
            dirs[family] = save_tiny(family, tmp_path_factory.mktemp(family), tokenizer=True)
        return dirs[family]

    return get


def eager(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager").eval()


def load(path, fmt="bf16", **kw):
    return ht.from_pretrained(path, experts_format=fmt, device="cpu", dtype="fp32", isa=BEST_ROW_PATH.isa, **kw)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def logits(model, ids=IDS):
    return model(torch.tensor(ids)).logits


def test_importing_registers_the_backend():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["hetmoe"] is hetmoe_experts_forward
    assert set(ENGINE_FAMILIES) | {"gpt_oss"} == set(FAMILIES)  # every family of the list exists in 5.24


@pytest.mark.parametrize("order", ["hetmoe first", "transformers first"])
def test_importing_hetmoe_has_no_side_effects(order):
    """``import hetmoe`` registers nothing and hooks no import (fresh processes: before or after Transformers is
    imported); ``import hetmoe.transformers`` registers "hetmoe" explicitly; the command line's imports load no
    Transformers."""
    import subprocess
    import sys

    hetmoe = "hooks = list(sys.meta_path)\nimport hetmoe\nassert sys.meta_path == hooks, sys.meta_path"
    first, second = (hetmoe, "import transformers") if order == "hetmoe first" else ("import transformers", hetmoe)
    code = ("import sys\n"
            f"{first}\n{second}\nfrom transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
            "assert 'hetmoe' not in ALL_EXPERTS_FUNCTIONS\n"
            "import hetmoe.transformers\nimport hetmoe.transformers.backend as b\n"
            "assert ALL_EXPERTS_FUNCTIONS['hetmoe'] is b.hetmoe_experts_forward\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-1500:]
    cli = subprocess.run([sys.executable, "-c", "import sys, hetmoe, hetmoe.cli; hetmoe.cli.build_parser(); "
                          "print('transformers' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert cli.stdout.strip() == "False", cli.stderr[-1500:]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_matches_eager_experts(tiny, family):
    from transformers import PreTrainedModel

    path = tiny(family)
    ref = eager(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ht.FallbackWarning)  # every experts module of these runs on the engine
        model = load(path)
    assert isinstance(model, PreTrainedModel) and model.config._experts_implementation == "hetmoe"
    experts = [m for m in model.modules() if is_experts_module(m)]
    assert experts and all(engine_of(m) is not None for m in experts)
    assert not [k for k in model.state_dict() if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert rel(logits(model), logits(ref)) < BF16_BOUND
    ids = torch.tensor(IDS)
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_quantized_formats_within_their_bound(tiny, family, fmt):
    from reference import moe_reference, rel_err

    path = tiny(family)
    ref = eager(path)
    model = load(path, fmt)  # the row-block path: the same bits on AVX2, AVX-512 and AMX machines
    assert model.hetmoe_info["experts_format"] == fmt
    name, module = next((n, m) for n, m in model.named_modules() if engine_of(m) is not None)
    theirs = ref.get_submodule(name)
    E, I2, H = theirs.gate_up_proj.shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(64)])
    w = torch.rand(64, 2, generator=g)
    gu, down = theirs.gate_up_proj.detach(), theirs.down_proj.detach()
    exact = moe_reference(x, gu[:, :I2 // 2], gu[:, I2 // 2:], down, ids, w)
    assert 0 < rel_err(hetmoe_experts_forward(module, x, ids, w), exact) < MODULE_BOUND[fmt]
    assert 0 < rel(logits(model), logits(ref)) < LOGITS_BOUND[fmt]


def test_bf16_model_on_bf16_experts(tiny):
    """A bf16 dense part (bf16 activations into the engine): within bf16 rounding of the eager bf16 model."""
    from transformers import AutoModelForCausalLM

    path = tiny("qwen3_moe")
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=torch.bfloat16).eval()
    model = ht.from_pretrained(path, experts_format="bf16", device="cpu", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert rel(logits(model), logits(ref)) < 3e-2  # measured 6e-3: bf16 activations rounded at different points


def test_gpt_oss_falls_back_with_one_warning(tiny):
    path = tiny("gpt_oss")
    with pytest.warns(ht.FallbackWarning) as record:
        model = load(path)
    assert len([w for w in record if issubclass(w.category, ht.FallbackWarning)]) == 1
    text = str(record[0].message)
    assert "GptOssExperts" in text and "expert biases" in text and "_apply_gate" in text
    assert model.hetmoe_info["engine_modules"] == []
    assert torch.equal(logits(model), logits(eager(path)))  # Transformers' own eager experts, same weights



def test_deepseek_v4_loads_with_transformers_experts(tmp_path):
    """A DeepSeek-V4 checkpoint as Transformers writes it: its final norm is saved as ``model.norm.weight``, which
    V4's renaming ``.norm.`` -> ``.kv_norm.`` (for the original release's names) would send nowhere; Transformers'
    rule keeps the key as it is. The experts' clamped SwiGLU keeps Transformers' implementation (one warning); the
    rest (hash routing, CSA/HCA, hyper-connections) is the model's own code. A 20-token prompt passes the window of 8,
    the HCA rate of 8 and the indexer's top 3 of the CSA entries."""
    import transformers

    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4")
    path = save_tiny("deepseek_v4", tmp_path / "v4", tokenizer=True)
    ref = eager(path)
    with pytest.warns(ht.FallbackWarning) as record:
        model = load(path)
    text = str(next(w for w in record if issubclass(w.category, ht.FallbackWarning)).message)
    assert "DeepseekV4Experts" in text and "_apply_gate" in text and "clamped SwiGLU" in text
    assert model.hetmoe_info["engine_modules"] == []
    assert set(model.hetmoe_info["fallback_modules"]) == {f"model.layers.{i}.mlp.experts" for i in range(3)}
    assert torch.equal(model.model.norm.weight, ref.model.norm.weight)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(table, ref.model.layers[0].mlp.gate.tid2eid) and table.unique().numel() > 1
    ids = torch.tensor([IDS[0] + [200, 31, 8, 99, 150, 250, 19, 2, 7]])
    assert torch.equal(logits(model, ids.tolist()), logits(ref, ids.tolist()))
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=12, do_sample=False))
    # the compressors' running state cannot be cropped: a reused prefix is recomputed, same logits (cropped inside
    # the window, the CSA entry written from the other slot's tokens was kept: 15% off)
    runner = TransformersRunner(model, max_batch=2, max_context=64, prefill_chunk=4)
    for n, start in ((7, 2), (20, 12)):
        fresh = runner.prefill(ids[0, :n].tolist(), slot=0)
        runner.prefill(ids[0, :start].tolist() + [1, 2, 3, 4], slot=1)
        assert rel(runner.prefill(ids[0, start:n].tolist(), slot=1, start=start), fresh) < 1e-5
    # the released checkpoints' MXFP4 experts (FP8 elsewhere): refused by name before any weight is read
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'fp4' .*expert_dtype"):
        load(path)

def test_other_activation_falls_back(tmp_path):
    """A gated activation other than SiLU (GELU here): Transformers computes it, named in the warning."""
    from transformers import AutoModelForCausalLM
    from transformers_tiny import make_config

    cfg = make_config("qwen3_moe")
    cfg.hidden_act = "gelu"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with pytest.warns(ht.FallbackWarning, match="activation"):
        model = load(tmp_path)
    assert rel(logits(model), logits(eager(tmp_path))) < 1e-6


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: lm_head is not in the checkpoint; it is the embedding, tied after loading."""
    from transformers import AutoModelForCausalLM
    from transformers_tiny import make_config

    cfg = make_config("qwen3_moe")
    cfg.tie_word_embeddings = True
    torch.manual_seed(2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert rel(logits(model), logits(eager(tmp_path))) < 1e-3  # weights not bf16-rounded here: measured 1.8e-4


def test_dense_routing_weights_are_gathered(tiny):
    """top_k_weights given as [T, E] (one dense row per token) equals the same weights as [T, k]."""
    model = load(tiny("olmoe"))
    module = next(m for m in model.modules() if engine_of(m) is not None)
    E = engine_of(module).num_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, model.config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    dense = torch.zeros(5, E).scatter(1, ids, w)
    assert torch.equal(hetmoe_experts_forward(module, x, ids, dense), hetmoe_experts_forward(module, x, ids, w))
    with pytest.raises(ValueError, match="top_k_weights"):
        hetmoe_experts_forward(module, x, ids, torch.rand(5, 3))


def test_fused_checkpoint_tensors(tiny, tmp_path):
    """A checkpoint holding the model's own fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import shutil

    from safetensors.torch import save_file

    path = tiny("qwen3_moe")
    ref = eager(path)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert rel(logits(load(tmp_path)), logits(ref)) < BF16_BOUND


@pytest.mark.parametrize("layout", ["fused", "fused-transposed", "per-expert-transposed"])
def test_expert_layouts_read_as_out_x_in(tmp_path, layout):
    """Fused [E, 2I, H] / [E, H, 2I] (``is_transposed``) stacks and per-expert matrices stored in x out all give the
    engine gate, up [I, H] and down [H, I]."""
    import json
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from hetmoe.load.checkpoint import Checkpoint
    from hetmoe.transformers.loading import _expert_mats, _Sources

    E, H, I = 3, 16, 24
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    src, tensors = _Sources(), {}
    if layout.startswith("fused"):
        t = layout.endswith("transposed")
        gu = torch.cat([gate, up], 1)  # [E, 2I, H]
        tensors = {"e.gate_up_proj": gu.transpose(1, 2).contiguous() if t else gu,
                   "e.down_proj": down.transpose(1, 2).contiguous() if t else down}
        src.add("gate_up_proj", "e.gate_up_proj")
        src.add("down_proj", "e.down_proj")
    else:
        t = False
        for e in range(E):
            for name, w in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                key = f"e.{e}.{name}.weight"
                tensors[key] = w.t().contiguous()
                src.add(f"{e}.{name}.weight", key)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "test"}))
    ckpt = Checkpoint(tmp_path)
    module = SimpleNamespace(is_transposed=t)
    for e in range(E):
        got = _expert_mats(ckpt, src, module, e, E, H, I, "e")
        for a, b in zip(got, (gate[e], up[e], down[e])):
            assert torch.equal(a, b)
    ckpt.close()


def test_truncated_checkpoint_is_refused(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tiny("mixtral")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]  # Mixtral's original names
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down projection of expert 3"):
        load(tmp_path)


def test_fp8_checkpoint_equals_its_dequantized_weights(tiny, tmp_path):
    """DeepSeek FP8 (e4m3 weights, one weight_scale_inv per 128 x 128 block, quantization_config fp8): dequantized by
    the checkpoint reader, so the model equals the one loaded from the dequantized weights, bit for bit."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny("deepseek_v3")
    fp8, deq = tmp_path / "fp8", tmp_path / "deq"
    for d in (fp8, deq):
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
    q_all, d_all = {}, {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if t.dim() == 2 and name.endswith("proj.weight") and ".mlp.gate." not in name:
                scale = t.abs().max().clamp_min(1e-12).reshape(1, 1) / 448  # one block: these matrices are small
                q = (t / scale).to(torch.float8_e4m3fn)
                q_all[name], q_all[name + "_scale_inv"] = q, scale
                d_all[name] = q.float() * scale
            else:
                q_all[name] = d_all[name] = t
    save_file(q_all, str(fp8 / "model.safetensors"))
    save_file(d_all, str(deq / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(logits(load(fp8)), logits(load(deq)))


# ---------------------------------------------------------------- the runner adapter and the commands


@pytest.mark.parametrize("family", ["olmoe", "qwen3_next"])  # an attention KV cache that crops; one that cannot
def test_runner_prefix_reuse_equals_a_fresh_prefill(tiny, family):
    model = load(tiny(family))
    runner = TransformersRunner(model, max_batch=2, max_context=64, prefill_chunk=4)
    ids = IDS[0]
    fresh = runner.prefill(ids, slot=0)
    runner.prefill(ids[:6] + [1, 2, 3], slot=1)
    reused = runner.prefill(ids[6:], slot=1, start=6)
    assert rel(reused, fresh) < 1e-5 and runner.lengths[:2] == [len(ids), len(ids)]
    step = runner.decode_batch([7, 7], [0, 1])
    assert rel(step[1], step[0]) < 1e-5
    scored = runner.score(ids + [7], slot=0)
    assert scored.shape == (len(ids) + 1, model.config.vocab_size) and rel(scored[-1], step[0]) < 1e-5
    with pytest.raises(ValueError, match="max_batch"):
        runner.prefill(ids, slot=2)
    with pytest.raises(ValueError, match="context"):
        runner.prefill(list(range(65)), slot=0)


def test_transformers_class_of_a_model_type():
    assert transformers_class("olmoe") == "OlmoeForCausalLM"
    assert transformers_class("llama") is None  # no experts interface: not a MoE model
    assert transformers_class("no_such_model") is None


def test_llm_routes_a_type_without_model_file(tiny):
    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.runner import Runner
    from hetmoe.engine.sampler import SamplingParams

    said = []
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", isa=BEST_ROW_PATH.isa, max_context=64)
    llm = LLM(tiny("olmoe"), opts, expert_cache=None, log=said.append)
    assert isinstance(llm.runner, TransformersRunner) and any("through Transformers" in m for m in said)
    out = llm.generate("def f(x):", SamplingParams(max_tokens=6), chat=False)
    ids = llm.tokenizer.encode("def f(x):")
    ref = eager(tiny("olmoe")).generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):]
    assert out.token_ids == ref[:len(out.token_ids)].tolist() and out.completion_tokens >= 1
    native = LLM(tiny("qwen3_moe"), opts, expert_cache=None, log=said.append)
    assert isinstance(native.runner, Runner)  # a type with a hetmoe model file keeps the native runner


def test_scheduler_batches_over_the_slots(tiny):
    """Two prompts at once through the engine's scheduler (what the server runs), on two slots: the same greedy
    tokens as each alone."""
    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", isa=BEST_ROW_PATH.isa, max_context=64,
                         max_batch=2)
    llm = LLM(tiny("qwen3_next"), opts, expert_cache=None, log=lambda m: None)
    params = SamplingParams(max_tokens=5)
    both = llm.generate(["def f(x):", "Hello there"], params, chat=False)
    alone = [llm.generate(p, params, chat=False) for p in ("Hello there", "def f(x):")]
    assert [r.token_ids for r in both] == [r.token_ids for r in alone[::-1]]


def test_generate_command_on_a_type_without_model_file(tiny, capsys):
    import json

    from hetmoe.cli import main as cli_main

    code = cli_main(["generate", "--model", str(tiny("olmoe")), "--expert-cache", "off", "--device", "cpu",
                     "--max-tokens", "5", "--raw", "--prompt", "Hello", "--json"])
    out = capsys.readouterr()
    assert code == 0 and "has no hetmoe model file" in out.err and "OlmoeForCausalLM" in out.err
    result = json.loads(out.out)
    assert 1 <= result["completion_tokens"] <= 5


def test_eval_command_on_a_type_without_model_file(tiny, tmp_path, capsys):
    """``hetmoe eval`` scores such a model through the backend, against its bf16-experts reference: int8 experts
    cost a little, and the numbers are finite."""
    import json

    from hetmoe.cli import main as cli_main

    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n\nprint(f(2))\n" * 8)
    code = cli_main(["eval", "--model", str(tiny("olmoe")), "--text", str(text), "--window", "32", "--device", "cpu",
                     "--experts-format", "int8", "--expert-cache", "off", "--json", "-"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "has no hetmoe model file" in out.err
    report = json.loads(out.out)
    assert report["config"]["experts_format"] == "int8" and report["reference"]["experts_format"] == "bf16"
    assert report["tokens"] > 0 and report["perplexity"] > 1
    print(f"olmoe int8 vs bf16 experts: KL {report['kl']:.2e}, top-1 agreement {report['top1_agreement']:.3f}")
    # int8 against bf16 experts, a small cost: measured KL 1.1e-6, top-1 agreement 0.968
    assert 0 < report["kl"] < 1e-3 and report["top1_agreement"] > 0.9
    code = cli_main(["eval", "--model", str(tiny("olmoe")), "--text", str(text), "--window", "32",
                     "--drop-experts", "1", "--expert-cache", "off", "--device", "cpu"])
    assert code == 1 and "--drop-experts is not available" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_gpu_dense_cpu_experts(tiny, family):
    """Dense part on the GPU (fp32), experts on the CPU engine: the same logits and greedy tokens as on the CPU."""
    path = tiny(family)
    cpu = load(path)
    gpu = ht.from_pretrained(path, experts_format="bf16", device="cuda", dtype="fp32", isa=BEST_ROW_PATH.isa)
    assert gpu.model.embed_tokens.weight.is_cuda and gpu.hetmoe_info["device"] == "cuda"
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        a, b = gpu(ids.cuda()).logits.cpu(), cpu(ids).logits
    assert rel(a, b) < 1e-4  # fp32 GPU matmuls (TF32 off by default) against fp32 CPU ones
    out = gpu.generate(ids.cuda(), max_new_tokens=8, do_sample=False).cpu()
    assert torch.equal(out, cpu.generate(ids, max_new_tokens=8, do_sample=False))


# ---------------------------------------------------------------- placement rules (hetmoe/config/rules.py)


def test_rules_set_formats_per_layer(tiny, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: 'model\\.layers\\.0\\.mlp\\.experts'\n  experts_format: int8\n  group_size: 32\n"
                     "- match: 'model\\.layers\\..*\\.mlp\\.experts'\n  experts_format: int4\n")
    model = load(tiny("olmoe"), rules=str(rules))
    formats = model.hetmoe_info["formats"]
    assert formats == {"model.layers.0.mlp.experts": ("int8", 32), "model.layers.1.mlp.experts": ("int4", 64)}
    assert engine_of(model.model.layers[0].mlp.experts).weight_format == "int8"
    assert 0 < rel(logits(model), logits(eager(tiny("olmoe")))) < LOGITS_BOUND["int4"]


@pytest.mark.parametrize("text, match", [
    ("- match: 'model\\.layers\\.0\\.mlp\\.experts'\n  defer_experts: 1\n", "rules.yaml:2.*native runner"),
    ("- match: lm_head\n  dtype: bf16\n", "rules.yaml:2.*one dtype"),
    ("- match: 'model\\.layers\\.0\\.mlp\\.experts'\n  device: cuda\n", "CPU-only"),
    ("- match: 'nothing\\.here'\n  device: cpu\n", "matches no module"),
])
def test_bad_rules_are_refused_at_their_line(tiny, tmp_path, text, match):
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    with pytest.raises(ValueError, match=match):
        load(tiny("olmoe"), rules=str(rules))


@pytest.mark.gpu
def test_gpu_rules_put_the_first_layer_on_the_gpu(tiny, tmp_path):
    """The shipped shape of rules: the first layer's experts on the GPU (Transformers' own), the rest int4 on the
    CPU, lm_head on the GPU; the same greedy tokens as the CPU-only bf16 model up to int4's error."""
    rules = tmp_path / "rules.yaml"
    rules.write_text("- match: 'model\\.layers\\.0\\.mlp\\.experts'\n  device: cuda\n"
                     "- match: 'model\\.layers\\..*\\.mlp\\.experts'\n  experts_format: bf16\n"
                     "- match: lm_head\n  device: cuda\n")
    path = tiny("qwen3_moe")
    gpu = ht.from_pretrained(path, rules=str(rules), device="cuda", dtype="fp32", isa=BEST_ROW_PATH.isa)
    assert gpu.model.layers[0].mlp.experts.down_proj.is_cuda and engine_of(gpu.model.layers[1].mlp.experts)
    with torch.inference_mode():
        a = gpu(torch.tensor(IDS).cuda()).logits.cpu()
    assert rel(a, logits(load(path))) < 1e-4


# ---------------------------------------------------------------- peak memory while loading

@pytest.mark.slow
def test_peak_rss_while_loading(tmp_path):
    """Experts streamed from the mapped shards: the load's peak stays near what it keeps (the packed experts)."""
    from rss import peak_rss
    from transformers import AutoModelForCausalLM
    from transformers_tiny import make_config

    cfg = make_config("qwen3_moe")
    cfg.update(dict(hidden_size=256, moe_intermediate_size=512, num_experts=32, num_hidden_layers=8, head_dim=64))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50MB")
    m = peak_rss("import warnings, torch, hetmoe.transformers as ht, transformers.models.qwen3_moe.modeling_qwen3_moe",
                 'model = ht.from_pretrained(sys.argv[1], experts_format="bf16", device="cpu", dtype="fp32")\n'
                 'engines = [m._hetmoe_experts for m in model.modules() if "_hetmoe_experts" in m.__dict__]',
                 "sum(e.nbytes for e in engines)", tmp_path)
    assert m["final"] - m["baseline"] >= m["expert_bytes"] * 0.95  # the experts really are resident
    # Measured: 1.11 (baseline 419 MiB, final +223 MiB of which 192 MiB packed experts, peak +248 MiB).
    assert m["ratio"] <= 1.3
