"""The memory a build takes on its way (the VRAM budget holds while a model is built, not only after).

A build (synthetic.build_random_model, loader.load_model) makes each decoder layer's dense weights, packs them in the
dense format and frees the source before the next layer; on a GPU in a format other than bf16 the source weights stay
in host memory (dense.on_host) and GPULinear.from_linears uploads and converts them a slab of rows at a time. So the
device holds, beyond what the model keeps, one slab's temporaries: no bf16 copy of a layer, of lm_head, of a model.

CPU tests: ``LiveBytes`` counts the bytes of live tensor storages (a dispatch mode; a storage counted once, until it
is freed) on the CPU, with GPULinear built on the CPU (its reference path) standing in for the GPU's packing.
GPU tests (marked): torch.cuda.max_memory_allocated during the build against the plan.
"""

import dataclasses
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetmoe.config.options import EngineOptions
from hetmoe.layers import gpu_linear
from hetmoe.layers.gpu_linear import GPULinear, quantize_fp8, quantize_int
from hetmoe.load import dense
from hetmoe.load import random_weights as synthetic
from hetmoe.load.dense import on_host, pack_dense
from hetmoe.load.loader import build_meta, moe_blocks, plan_model

MiB = 1 << 20


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages on ``device`` that ops made while the mode is on (not views of their inputs),
    and their peak."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = device
        self.live: dict = {}  # storage address -> bytes
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or not storage.nbytes():  # (a view, an in-place op)
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)
        return out


def _gpu_linear_on_cpu(monkeypatch):
    """pack_dense builds GPULinear (on the CPU: its reference path) where it would build the CPU engine's linear."""
    monkeypatch.setattr(dense, "_linear_factory",
                        lambda device, options: lambda linears, fmt: GPULinear.from_linears(linears, fmt, device))


def _tiny_config(arch: str, **overrides) -> dict:
    return synthetic._config(arch, overrides, 300).to_dict()


# ---------------------------------------------------------------- the cause: a walk that kept every layer alive


@pytest.mark.parametrize("arch", synthetic.ARCHITECTURES)
def test_walk_visits_what_named_modules_visits(arch):
    model = build_meta(synthetic.shape_config(_tiny_config(arch)))
    assert [(n, id(m)) for n, m in synthetic._walk(model)] == [(n, id(m)) for n, m in model.named_modules()]


def test_packed_weights_are_freed_at_each_hand_over():
    """Each layer's replaced weights are gone when the next layer is handed over: nn.Module.named_modules, which the
    fill walked before, remembers every module it visited, so every layer's bf16 weights stayed on the GPU until
    the whole model was filled (a 6-layer deepseek-v3 build once peaked 5 GiB over its plan)."""
    model = build_meta(synthetic.shape_config(_tiny_config("deepseek_v3", num_hidden_layers=4)))
    replaced, alive = [], []

    def each_layer(layer):
        alive.append(sum(r() is not None for r in replaced))
        for module in list(layer.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    replaced.append(weakref.ref(child.weight))
                    setattr(module, name, nn.Identity())

    synthetic._fill_random(model, torch.device("cpu"), torch.float32, 0, 0.02, each_layer=each_layer)
    assert len(alive) == 4 and len(replaced) > 4 * 5
    assert alive == [0, 0, 0, 0]


def test_build_holds_one_layer_of_source_weights(monkeypatch):
    """A whole build with the GPU's packing (on the CPU): beyond what the model keeps, the peak is at most one
    layer's source weights twice (fusing gate/up copies them once) plus the packing's slabs. MEASURED: 1.3 layers
    here; before the fix 4.2 (every layer's source alive until the end)."""
    _gpu_linear_on_cpu(monkeypatch)
    monkeypatch.setattr(gpu_linear, "_CHUNK_ELEMENTS", 1 << 14)
    cfg = _tiny_config("deepseek_v3", hidden_size=256, intermediate_size=1024, num_hidden_layers=5,
                       first_k_dense_replace=4, vocab_size=512, q_lora_rank=128, kv_lora_rank=64,
                       num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=16,
                       v_head_dim=32)
    meta = build_meta(synthetic.shape_config(cfg))
    layer_bytes = max(4 * sum(p.numel() for p in layer.parameters()) for layer in meta.model.layers)
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="int8", dense_format="int8", max_context=16)
    with LiveBytes() as live:
        loaded = synthetic.build_random_model(cfg, None, opts, log=lambda m: None)
    assert all(isinstance(m, GPULinear) for m in (loaded.model.lm_head, loaded.model.model.layers[0].mlp.down_proj))
    extra = live.peak - live.now
    assert layer_bytes > 3 * MiB and extra <= 2 * layer_bytes + 12 * 4 * gpu_linear._CHUNK_ELEMENTS, \
        (extra / MiB, layer_bytes / MiB)


# ---------------------------------------------------------------- packing a slab at a time


def _linears(sizes, k, dtype=torch.bfloat16, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        lin = nn.Linear(k, n, bias=bias, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        out.append(lin)
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8", "int4"])
def test_slabs_pack_what_the_whole_matrix_packs(monkeypatch, fmt):
    """Slabs of 256 rows over parts of 200, 72 and 300 rows (a slab joins parts, a part spans slabs; the last slab is
    short, the last fp8 block row too): the same bits as quantizing the stacked matrix at once."""
    monkeypatch.setattr(gpu_linear, "_CHUNK_ELEMENTS", 256 * 96)
    lins = _linears([200, 72, 300], 96, bias=True)
    packed = GPULinear.from_linears(lins, fmt, "cpu", kernel="torch" if fmt == "bf16" else "reference")
    whole = torch.cat([lin.weight.detach() for lin in lins]).float()
    assert packed.sizes == [200, 72, 300] and packed.in_features == 96
    assert torch.equal(packed.bias, torch.cat([lin.bias.detach() for lin in lins]).float())
    if fmt == "bf16":
        assert packed.scale is None and torch.equal(packed.weight, whole.bfloat16())
        return
    want_w, want_s = quantize_fp8(whole) if fmt == "fp8" else quantize_int(whole, fmt)
    assert packed.weight.dtype == want_w.dtype and torch.equal(packed.weight.view(torch.uint8),
                                                               want_w.view(torch.uint8))
    assert torch.equal(packed.scale, want_s)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_packing_temporaries_are_a_few_slabs(monkeypatch, fmt):
    """Packing a fused group of 8100 x 1024 takes the packed result plus about 5 fp32 slabs of temporaries
    (MEASURED 4.0 fp8, 4.8 int8, 4.7 int4), never a stacked copy of the group nor a second packed copy: with the
    GPU's slab of 1 << 22 elements that is about 80 MiB (BUILD_SLACK below allows 256)."""
    monkeypatch.setattr(gpu_linear, "_CHUNK_ELEMENTS", 1 << 18)
    lins = _linears([3000, 1000, 4100], 1024)
    with LiveBytes() as live:
        packed = GPULinear.from_linears(lins, fmt, "cpu", kernel="reference")
    slabs = (live.peak - packed.nbytes) / (4 * gpu_linear._CHUNK_ELEMENTS)
    assert slabs <= 6, slabs
    source = sum(lin.weight.numel() for lin in lins) * 2
    assert live.peak < source / 2 + packed.nbytes  # (the stacked bf16 group alone would be `source`)


# ---------------------------------------------------------------- where a build puts the source weights


def test_on_host_is_what_a_gpu_packs_in_a_quantized_format():
    lin, emb = nn.Linear(4, 4, device="meta"), nn.Embedding(4, 4, device="meta")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for fmt in ("fp8", "int8", "int4"):
        assert on_host(lin, "model.layers.3.self_attn.q_a_proj", fmt, cuda) and on_host(lin, "lm_head", fmt, "cuda")
        assert not on_host(lin, "model.layers.3.mlp.gate", fmt, cuda)  # routers stay in the dtype, on the GPU
        assert not on_host(lin, "model.layers.3.self_attn.kv_b_proj", fmt, cuda)
        assert not on_host(emb, "model.embed_tokens", fmt, cuda)
        assert not on_host(lin, "lm_head", fmt, cpu)
    assert not on_host(lin, "lm_head", "bf16", cuda)  # bf16 on a GPU packs nothing


def test_loader_reads_what_a_gpu_packs_into_host_memory(tmp_path):
    """With a plan on a GPU in int4, the loader's fill puts a dense MLP's linears (all packed) in host memory, in
    the plan's dtype, with the checkpoint's values (the MLP alone: nothing of it is meant for the GPU as it is)."""
    from hetmoe.load.checkpoint import Checkpoint
    from hetmoe.load.materialize import Materializer

    path = synthetic.write_checkpoint(tmp_path / "ckpt", "deepseek_v3", max_shard_size="10MB")
    ckpt = Checkpoint(path)
    model = build_meta(ckpt.config)
    plan = type("Plan", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16, "dense_format": "int4"})()
    Materializer(ckpt, plan).fill(model, "model.layers.0.mlp")
    mlp = model.model.layers[0].mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(mlp, name).weight
        assert w.device.type == "cpu" and w.dtype == torch.bfloat16, name
        assert torch.equal(w, ckpt.get_float(f"model.layers.0.mlp.{name}.weight").bfloat16()), name


def test_pack_dense_of_a_model_whose_layers_are_not_loaded(monkeypatch):
    """The loader packs lm_head as soon as the globals are filled: pack_dense of the model leaves the layers, still
    on the meta device, as they are (nothing fused), and packs them when they are filled."""
    _gpu_linear_on_cpu(monkeypatch)
    model = build_meta(synthetic.shape_config(_tiny_config("deepseek_v3")))
    for name, p in list(model.named_parameters()):
        if not name.startswith("model.layers."):
            owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            owner._parameters[leaf] = nn.Parameter(torch.randn(p.shape) * 0.02, requires_grad=False)
    made = pack_dense(model, "int8", torch.device("cpu"), None, torch.float32)
    assert isinstance(model.lm_head, GPULinear) and made == model.lm_head.nbytes
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj, nn.Linear) and attn.q_a_proj.weight.is_meta and attn.q_kv_a is None
    synthetic._fill_random(model.model.layers[0], torch.device("cpu"), torch.float32, 0, 0.02)
    pack_dense(model.model.layers[0], "int8", torch.device("cpu"), None, torch.float32)
    assert isinstance(attn.q_kv_a, GPULinear) and isinstance(model.model.layers[0].mlp.gate_up, GPULinear)


# ---------------------------------------------------------------- on the GPU: the build against its plan

BUILD_SLACK = 256 * MiB  # one slab's temporaries (about 5 x 16 MiB, above) or the generator's 32 MiB chunk


def _planned(cfg, options) -> "object":
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    inter = (cfg.get("moe_intermediate_size") or cfg.intermediate_size) if blocks else 0
    return plan_model(model, cfg, blocks, options, inter, device=torch.device("cuda"))  # (no GPU needed)


def _check_build(build, plan) -> None:
    """Run ``build`` (-> LoadedModel) from a reset peak: its peak allocation stays within the plan's allocations (its
    VRAM less the CUDA context torch does not see) and at most BUILD_SLACK above what the model keeps."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = build()
    torch.cuda.synchronize()
    peak, kept = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    allowed = plan.vram_bytes - plan.vram.get("CUDA context", 0)
    msg = f"peak {peak / MiB:.0f} MiB, kept {kept / MiB:.0f} MiB, planned allocations {allowed / MiB:.0f} MiB"
    assert loaded.plan.dense_format == plan.dense_format
    assert peak <= allowed, msg
    assert peak - kept <= BUILD_SLACK, msg
    del loaded


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_random_deepseek_v3_build_stays_in_its_plan(fmt):
    """The deepseek-v3 shape, 2 layers (a dense MLP layer, a MoE layer of 16 experts: the real vocabulary, attention
    and MLP sizes), under a budget 256 MiB above its plan."""
    shape = {**synthetic.SHAPES["deepseek-v3"], "first_k_dense_replace": 1, "n_routed_experts": 16}
    cfg = synthetic.shape_config(shape, 2)
    opts = EngineOptions(device="cuda", dense_format=fmt, experts_format="int4", max_context=4096, gpu_prefill="off",
                         gpu_memory=1 << 40)
    plan = _planned(cfg, opts)
    opts = dataclasses.replace(opts, gpu_memory=plan.vram_bytes + 256 * MiB)
    plan = _planned(cfg, opts)
    _check_build(lambda: synthetic.build_random_model(shape, 2, opts, log=lambda m: None), plan)


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory):
    """A bf16 safetensors deepseek_v3 of 4096 hidden: a 400 MB dense MLP layer, a 260 MB lm_head, a MoE layer."""
    return synthetic.write_checkpoint(
        tmp_path_factory.mktemp("medium") / "ckpt", "deepseek_v3",
        dict(hidden_size=4096, intermediate_size=16384, moe_intermediate_size=256, num_hidden_layers=2,
             first_k_dense_replace=1, num_attention_heads=32, num_key_value_heads=32, q_lora_rank=1024,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=32000),
        max_shard_size="2GB", vocab_size=32000)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_checkpoint_load_stays_in_its_plan(medium_checkpoint, fmt):
    """load_model into fp8 / int4 dense weights: the loader reads the linears into host memory and packs each layer,
    lm_head first, a slab at a time."""
    from hetmoe.load.checkpoint import read_config
    from hetmoe.load.loader import load_model

    opts = EngineOptions(device="cuda", dense_format=fmt, experts_format="int4", max_context=4096,
                         gpu_prefill="off", gpu_memory=1 << 40)
    cfg = read_config(medium_checkpoint)
    plan = _planned(cfg, opts)
    opts = dataclasses.replace(opts, gpu_memory=plan.vram_bytes + 256 * MiB)
    plan = _planned(cfg, opts)
    _check_build(lambda: load_model(medium_checkpoint, opts, expert_cache=None, progress=False, log=lambda m: None),
                 plan)
