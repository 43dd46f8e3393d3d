"""Dense weights in a dense format on the CPU (``--dense-format``; hetmoe/load/dense.py, hetmoe/cpu/linear.py):
the loader packs every model_type's attention projections, shared experts, dense MLPs and lm_head into the engine,
keeps the routers and MLA's kv_b_proj in the dtype, and the packed model computes what its own dequantized weights
compute.

Paths: the CPU engine's avx2 row-block kernels (forced), and for one model the emulated AMX GEMM (every call on
the tiles: bf16 / int8 activation rows); the bf16 experts keep the expert error out of the comparison.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hetmoe.config.formats import DENSE_FORMATS  # noqa: E402
from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.cpu import CPULinear  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.load.dense import KEEP, PackedPart, dense_linears  # noqa: E402
from hetmoe.load.loader import build_meta, load_model  # noqa: E402

MODELS = {  # model_type -> checkpoint overrides (3 layers: a dense MLP layer where the architecture has one)
    "qwen3_moe": {"num_hidden_layers": 3},
    "qwen2_moe": {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {"num_hidden_layers": 3},
    "deepseek_v3": {"num_hidden_layers": 3},
}
PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 33]
DECODE = [7, 19, 4]

# Whole-model logits, max |packed - dequantized reference| / max |reference| over a prefill and 3 decode steps.
# The two compute with the same weights; they differ by the engine's activation rounding (int16 rows for int8
# weights, int8 rows for int4 weights), MEASURED on the avx2 row blocks: int8 <= 5.1e-5, int4 <= 1.4e-2.
KERNEL_TOL = {"int8": 2e-4, "int4": 3e-2}
# Against the unquantized (fp32) model: what the format costs. MEASURED on these tiny random models (N(0, 0.02)
# weights; errors compound over 3 layers and lm_head): int8 <= 1.6e-2, int4 <= 2.1e-1.
FORMAT_TOL = {"int8": 5e-2, "int4": 5e-1}


def logits(loaded) -> torch.Tensor:
    runner = Runner(loaded)
    out = [runner.prefill(PROMPT).reshape(1, -1).float()]
    out += [runner.decode(t).reshape(1, -1).float() for t in DECODE]
    return torch.cat(out)


def load(path, fmt: str, isa: str = "avx2", amx_min_tokens=None):
    """Forced onto one path: the row blocks (every x86-64 CI machine has AVX2), or amx-emulated's GEMM."""
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", max_context=64, dense_format=fmt,
                         isa=isa, amx_min_tokens=amx_min_tokens)
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


class _Dequantized(nn.Module):
    """A packed linear's dequantized weights in plain fp32 matmuls (the reference)."""

    def __init__(self, packed: CPULinear):
        super().__init__()
        self.weight = packed.dequantized_weight()
        self.bias = packed.bias
        self.sizes = list(packed.sizes)

    def forward(self, x):
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def parts(self, x):
        return self(x).split(self.sizes, dim=-1)


def dequantize_all(model: nn.Module) -> list:
    """Replaces every packed linear by its dequantized weights; returns (module, name, packed) to undo it."""
    undo = []
    for module in list(model.modules()):
        for name, value in list(module.named_children()):
            if isinstance(value, CPULinear):
                setattr(module, name, _Dequantized(value))
                undo.append((module, name, value))
    return undo


@pytest.fixture(scope="module")
def loaded_models(checkpoints):
    return {arch: {fmt: load(checkpoints(arch, over, seed=7), fmt) for fmt in ("bf16", "int8", "int4")}
            for arch, over in MODELS.items()}


@pytest.mark.parametrize("arch", MODELS)
def test_the_loader_packs_the_dense_linears_and_keeps_the_rest(loaded_models, arch):
    model = loaded_models[arch]["int8"].model
    packed = {n for n, m in model.named_modules() if isinstance(m, CPULinear)}
    assert "lm_head" in packed
    assert any(n.endswith("o_proj") for n in packed)
    kept = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert kept and all(n.rsplit(".", 1)[-1] in KEEP for n in kept), kept  # routers (and MLA's kv_b_proj) only
    # every linear the plan counts was packed, with its shape
    meta = build_meta(loaded_models[arch]["int8"].config)
    meta.fuse_projections()
    for name, n_out, n_in in dense_linears(meta):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(name)
        if isinstance(module, PackedPart):
            module = module._group[0]
        assert isinstance(module, CPULinear), name
        assert (module.out_features, module.in_features) == (n_out, n_in), name
    # nothing left in bf16/fp32 of what was packed: the model's parameters are the kept modules' only
    big = [n for n, p in model.named_parameters() if p.dim() == 2 and n.rsplit(".", 2)[-2] not in KEEP
           and "embed_tokens" not in n]
    assert not big, big
    assert loaded_models[arch]["bf16"].plan.dense_format == "bf16"
    assert not any(isinstance(m, CPULinear) for m in loaded_models[arch]["bf16"].model.modules())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("arch", MODELS)
def test_packed_model_equals_its_dequantized_weights(loaded_models, arch, fmt):
    loaded = loaded_models[arch][fmt]
    got = logits(loaded)
    undo = dequantize_all(loaded.model)
    try:
        assert undo
        ref = logits(loaded)
    finally:  # the fixture is shared: put the packed modules back
        for module, name, packed in undo:
            setattr(module, name, packed)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= KERNEL_TOL[fmt], err
    full = logits(loaded_models[arch]["bf16"])  # dtype fp32: the unquantized model
    err = ((got - full).abs().max() / full.abs().max()).item()
    assert err <= FORMAT_TOL[fmt], err
    assert 0 < err  # the format did quantize


def test_dense_bytes_shrink_by_the_format(loaded_models):
    from hetmoe.load.dense import packed_bytes

    for arch in MODELS:
        sizes = {fmt: packed_bytes(loaded_models[arch][fmt].model) for fmt in ("int8", "int4")}
        assert sizes["int4"] < sizes["int8"]
        meta = build_meta(loaded_models[arch]["int8"].config)
        meta.fuse_projections()
        want = sum(DENSE_FORMATS["int8"].nbytes(n, k) for _, n, k in dense_linears(meta))
        assert want <= sizes["int8"] <= 1.3 * want  # the engine pads rows to 16 and K to the group


def test_fp8_on_the_cpu_is_refused():
    from hetmoe.load.random_weights import build_random_model

    with pytest.raises(ValueError, match="fp8"):
        build_random_model("qwen3-30b-a3b", 1, EngineOptions(device="cpu", dense_format="fp8"), log=lambda m: None)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_model_on_the_amx_gemm(checkpoints, fmt):
    """The emulated AMX GEMM (any CPU) for every packed call, prefill and decode: the same weights, activations
    rounded to int8 rows. MEASURED against the dequantized reference: int8 1.2e-2, int4 1.6e-2 (qwen3_moe)."""
    path = checkpoints("qwen3_moe", MODELS["qwen3_moe"], seed=7)
    loaded = load(path, fmt, isa="amx-emulated", amx_min_tokens=1)
    got = logits(loaded)
    dequantize_all(loaded.model)
    ref = logits(loaded)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err <= 5e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_gpu_placement_packs_the_dense_linears(checkpoints, fmt):
    """GPU (hybrid placement): the dense linears become GPULinear (hetmoe/layers/gpu_linear.py) in ``fmt``; logits
    stay within the whole-model format bound of the bf16 model, and the CUDA-graph decode equals the eager one."""
    from hetmoe.layers.gpu_linear import GPULinear

    path = checkpoints("qwen3_moe", MODELS["qwen3_moe"], seed=7)

    def run(dense, graph):
        opts = EngineOptions(device="cuda", dtype="bf16", experts_format="bf16", max_context=64, dense_format=dense,
                             cuda_graph=graph)
        loaded = load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)
        return loaded, logits(loaded)

    packed, eager = run(fmt, False)
    assert isinstance(packed.model.lm_head, GPULinear) and packed.plan.dense_format == fmt
    _, graph = run(fmt, True)
    _, full = run("bf16", False)
    assert ((graph - eager).abs().max() / eager.abs().max()).item() <= 1e-2  # bf16 rounding of graph vs eager
    err = ((eager - full).abs().max() / full.abs().max()).item()
    assert 0 < err <= FORMAT_TOL.get(fmt, 0.2), err


def test_cpu_bf16_runs_on_the_engine_with_the_weights_as_given(checkpoints):
    """A bf16 dtype on the CPU: every dense linear and the router run on the engine in its bf16 format (PyTorch's
    bf16 matmuls are slow without bf16 arithmetic), holding exactly the bf16 weights; kv_b_proj and the embedding
    stay in PyTorch. Logits stay within bf16 rounding of the fp32 model (MEASURED 8.6e-3 on qwen3_moe)."""
    path = checkpoints("qwen3_moe", MODELS["qwen3_moe"], seed=7)
    opts = EngineOptions(device="cpu", dtype="bf16", experts_format="bf16", max_context=64, dense_format="bf16",
                         isa="avx2")
    loaded = load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)
    model = loaded.model
    router = model.model.layers[0].mlp.gate
    assert isinstance(router, CPULinear) and router.format.name == "bf16"
    assert isinstance(model.lm_head, CPULinear) and model.lm_head.format.name == "bf16"
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    from safetensors import safe_open

    files = {}
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            files.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith(("mlp.gate.weight", "lm_head.weight"))})
    assert torch.equal(router.dequantized_weight(), files["model.layers.0.mlp.gate.weight"].bfloat16().float())
    assert torch.equal(model.lm_head.dequantized_weight(), files["lm_head.weight"].bfloat16().float())
    got = logits(loaded)
    full = logits(load(path, "bf16"))
    err = ((got - full).abs().max() / full.abs().max()).item()
    assert err <= 3e-2, err
