"""GLM-5.3-Flash (glm5_next): KDA linear attention, NoPE MLA with the pooled DSA indexer, hyper-connections
(hetmoe/models/glm5_next.py, hetmoe/layers/linear_attention.py).

* KDA's torch forms (recurrent, chunked at several chunk sizes, S not a multiple) against a naive fp32 per-token
  loop written here, from a non-zero state; padding (b = 0, log g = 0) leaves the state as it is;
* parity: a checkpoint written by Transformers' own Glm5NextForConditionalGeneration (the class its checkpoints
  use: the multimodal wrapper, a one-block vision tower) against transformers' logits over a prefill and cached
  greedy steps, batch 1 and 2, prompts within the indexer's dense range (5), past it (20 > index_topk + kpool) and
  past KDA's chunk (70 > 64), with fp32 TorchExperts or bf16 experts in the CPU engine (its best row-block path;
  run with HETMOE_MAX_ISA=avx2 too);
* end to end: the loader on that checkpoint (the vision tower never read), the runner's chunked prefill of two
  prompts of different lengths into two slots, a right-padded batched prefill, and batched decode over both
  against transformers' logits for each alone;
* config.json entries the model cannot run, refused naming the entry before any weight is read.

Tolerances (max |ours - hf| / max |hf|), MEASURED on the dev machine: TorchExperts fp32 <= 1e-6, engine bf16
<= 2e-6, runner <= 2e-6 (bound 1e-4, as the other families' FP32_TOL); the KDA forms vs the naive loop <= 2e-6
(bound 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.load.checkpoint import Checkpoint
from parity import assert_refused_before_weights, max_rel, trace_ours
from parity import load_ours as parity_load
from paths import BEST_ROW_PATH

transformers = pytest.importorskip("transformers")

from hetmoe.layers.linear_attention import chunk_kda, recurrent_kda  # noqa: E402
from hetmoe.models.glm5_next import Glm5NextForCausalLM, Glm5NextMoE  # noqa: E402

L, I = "linear_attention", "indexed_attention"
# 5 layers: KDA, two MLA layers in a row (the second reusing the first's choice), KDA, MLA; a dense first layer;
# an indexer keeping 2 pools of 4 (topk 8): a query sees every position up to 10, 2 streams
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, num_experts_per_tok=2,
            n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0,
            qk_nope_head_dim=16, v_head_dim=8, index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4,
            linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=3, hc_mult=2, swiglu_limit=0.5,
            layer_types=[L, I, I, L, I], indexer_types=["full", "full", "shared", "full", "full"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], max_position_embeddings=256,
            pad_token_id=None)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
              projection_intermediate_size=32)
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)
FP32_TOL = 1e-4
STEPS = 6


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> Path:
    """A random GLM-5.3-Flash checkpoint written by transformers' Glm5NextForConditionalGeneration (weights N(0,
    0.08) rounded to bf16, norms 1 + that, correction biases random; the KDA gates' A_log, dt_bias as drawn)."""
    from transformers.models import glm5_next as hf

    path = tmp_path_factory.mktemp("glm5")
    torch.manual_seed(7)
    model = hf.Glm5NextForConditionalGeneration(hf.Glm5NextConfig(text_config=TEXT, vision_config=VISION))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = (torch.randn_like(p) * 0.08).to(torch.bfloat16).float()
            p.copy_(1 + noise if "norm" in name and p.dim() == 1 else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path, max_shard_size="100KB")
    return path


_TRACES = {}


def hf_trace(path: Path, batch: int, prompt_len: int) -> tuple:
    """transformers' logits over a random prompt and STEPS greedy steps: (ids, the tokens fed, logits per call)."""
    from transformers.models.glm5_next import Glm5NextForConditionalGeneration

    key = (str(path), batch, prompt_len)
    if key not in _TRACES:
        hf = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.randint(0, TEXT["vocab_size"], (batch, prompt_len), generator=torch.Generator().manual_seed(
            prompt_len))
        with torch.no_grad():
            out = hf(ids, use_cache=True)
            logits, fed = [out.logits], []
            for _ in range(STEPS):
                fed.append(out.logits[:, -1:].argmax(-1))
                out = hf(fed[-1], cache=out.past_key_values, use_cache=True)
                logits.append(out.logits)
        _TRACES[key] = ids, fed, logits
    return _TRACES[key]


def load_ours(path: Path, backend) -> Glm5NextForCausalLM:
    """Our model through hetmoe's Checkpoint (parity.load_ours): routed experts into ``backend`` (None: fp32)."""
    return parity_load(path, Glm5NextForCausalLM, backend)


# ---------------------------------------------------------------- KDA against a naive loop


def naive_kda(q, k, v, g, beta, state):
    """KDA one batch row, head and token at a time, fp32: q, k [B, S, H, Dk], v [B, S, H, Dv], g [B, S, H, Dk],
    beta [B, S, H], state [B, H, Dk, Dv]."""
    B, S, H, Dk = k.shape
    out = torch.zeros(B, S, H, v.shape[-1])
    final = state.clone().double()
    for b in range(B):
        for h in range(H):
            M = final[b, h]
            for t in range(S):
                qt, kt = q[b, t, h].double(), k[b, t, h].double()
                qt, kt = qt / (qt @ qt + 1e-6).sqrt() * Dk**-0.5, kt / (kt @ kt + 1e-6).sqrt()
                M = torch.diag(g[b, t, h].double().exp()) @ M
                M = M + beta[b, t, h].double() * torch.outer(kt, v[b, t, h].double() - M.T @ kt)
                out[b, t, h] = (M.T @ qt).float()
            final[b, h] = M
    return out, final.float()


@pytest.mark.parametrize("S", [1, 7, 70])
def test_kda_forms_match_a_naive_loop(S):
    gen = torch.Generator().manual_seed(S)
    B, H, Dk, Dv = 2, 3, 8, 6
    q, k = torch.randn(B, S, H, Dk, generator=gen), torch.randn(B, S, H, Dk, generator=gen)
    v = torch.randn(B, S, H, Dv, generator=gen)
    g = -5 * torch.rand(B, S, H, Dk, generator=gen)  # GLM-5.3-Flash's bounded gate: log decays in (-5, 0)
    beta = torch.rand(B, S, H, generator=gen)
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    ref, ref_state = naive_kda(q, k, v, g, beta, state)
    forms = {"recurrent": recurrent_kda(q, k, v, g, beta, state)}
    for chunk in (16, 64):
        forms[f"chunk{chunk}"] = chunk_kda(q, k, v, g, beta, state, chunk=chunk)
    for name, (out, final) in forms.items():
        errs = max_rel(out, ref), max_rel(final, ref_state)
        print(f"S={S} {name}: out {errs[0]:.1e}, state {errs[1]:.1e}")
        assert out.dtype == final.dtype == torch.float32 and max(errs) < 1e-5, (name, errs)
    # padding (b = 0, log g = 0) after the real tokens: the same outputs for them, the same final state
    pad = lambda x: torch.cat((x, torch.zeros(B, 5, *x.shape[2:])), dim=1)  # noqa: E731
    out, final = chunk_kda(pad(q), pad(k), pad(v), pad(g), pad(beta), state, chunk=16)
    assert max_rel(out[:, :S], ref) < 1e-5 and max_rel(final, ref_state) < 1e-5


# ---------------------------------------------------------------- parity with transformers

def engine_clamped(gate, up, down, glu):
    """bf16 experts in the CPU engine on its best row-block path, computing the layer's clamped SwiGLU."""
    from hetmoe.cpu import CPUExperts

    ex = CPUExperts(gate.shape[0], gate.shape[2], gate.shape[1], "bf16", glu=glu, **BEST_ROW_PATH.options)
    ex.load(gate, up, down)
    return ex


BACKENDS = [pytest.param(None, id="torch-fp32"), pytest.param(engine_clamped, id="engine-bf16")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,prompt_len", [(1, 5), (2, 20), (1, 70)])
def test_logits_and_greedy_tokens_match_transformers(glm5, backend, batch, prompt_len):
    """A prompt within the indexer's dense range (5), past it (20: 2 pools of 4 chosen of 5, then sparse decode) and
    past KDA's chunk (70), then STEPS cached greedy steps: transformers' logits and greedy tokens."""
    ids, fed, hf_logits = hf_trace(glm5, batch, prompt_len)
    ours = trace_ours(load_ours(glm5, backend), ids, fed)
    errors = [max_rel(a, b) for a, b in zip(ours, hf_logits)]
    print(f"batch {batch} prompt {prompt_len}: " + " ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == STEPS + 1 and max(errors) < FP32_TOL, errors
    for a, b in zip(ours, hf_logits):
        assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))


def test_cache_layout(glm5):
    """The cache: latents only for the 3 MLA layers (no RoPE keys), the indexer's key and gate for the 2 that run
    one, conv windows and states for the 2 KDA layers."""
    model = load_ours(glm5, None)
    cache = model.make_cache(3, 64)
    assert cache.n_layers == 3 and cache.k.shape == (3, 3, 64, 1, 16) and cache.v.shape[-1] == 0
    assert cache.ik.shape == (2, 3, 64, 32) and cache.index_layers == 2
    assert model.model.layers[2].self_attn.indexer is None
    assert cache.states.conv.shape == (2, 3, 3 * 32, 2) and cache.states.recurrent.shape == (2, 3, 4, 8, 8)
    assert cache.elems_per_token == 3 * 16 + 2 * 32


# ---------------------------------------------------------------- end to end


def test_loader_and_runner_batched_decode(glm5, monkeypatch):
    """The loader on the multimodal checkpoint (text_config; the vision tower's tensors never read); two prompts
    of different lengths (9 and 23 tokens) prefilled in chunks of 4 into slots 1 and 0, then batched decode of both
    (the KDA states and MLA caches of two lengths in one call), against transformers' logits for each alone; then
    the same two prompts as one right-padded batched prefill (the padding changes no state), decoded again."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    read = []
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: read.append(name) or get(self, name))
    said = []
    loaded = load_model(glm5, EngineOptions(max_context=64, max_batch=2, prefill_chunk=4, **CPU), expert_cache=None,
                        progress=False, log=said.append)
    assert loaded.config["model_type"] == "glm5_next" and isinstance(loaded.model, Glm5NextForCausalLM)
    assert read and not any("visual" in n for n in read) and any("left out" in m for m in said)
    runner = Runner(loaded)
    assert runner.recurrent and runner.sparse
    traces = [hf_trace(glm5, 1, n) for n in (9, 23)]
    for how in ("chunked", "batched"):
        errors = []
        if how == "chunked":
            for slot, (ids, _, logits) in zip((1, 0), traces):
                errors.append(max_rel(runner.prefill(ids[0].tolist(), slot=slot), logits[0][0, -1]))
        else:
            for slot in (0, 1):
                runner.release(slot)
            short, long = traces[0][0][0].tolist(), traces[1][0][0].tolist()
            for a in range(0, 23, 4):  # both prompts 4 tokens a call; at 8 the short one's last token, padded
                chunks, slots = [long[a:a + 4]] + ([short[a:a + 4]] if a < 9 else []), [0] + ([1] if a < 9 else [])
                out = runner.prefill_batch(chunks, slots, [a] * len(slots))
                if a < 9 <= a + 4:
                    errors.append(max_rel(out[1], traces[0][2][0][0, -1]))
            errors.append(max_rel(out[0], traces[1][2][0][0, -1]))
        for i in range(STEPS):
            fed = [int(traces[0][1][i]), int(traces[1][1][i])]
            out = runner.decode_batch(fed, [1, 0])
            errors += [max_rel(out[0], traces[0][2][i + 1][0, -1]), max_rel(out[1], traces[1][2][i + 1][0, -1])]
        print(f"{how}: " + " ".join(f"{e:.1e}" for e in errors))
        assert max(errors) < FP32_TOL, (how, errors)


# ---------------------------------------------------------------- refused configs

BAD = {  # case -> (text_config changes, the message after the file name)
    "rope": ({"qk_rope_head_dim": 8}, "qk_rope_head_dim is 8; GLM-5.3-Flash's MLA layers use no positional"),
    "kv-heads": ({"num_key_value_heads": 2}, "num_key_value_heads is 2; GLM-5.3-Flash's MLA has as many"),
    "pool": ({"index_kpool": 3}, "index_topk is 8; the indexer chooses whole pools of index_kpool"),
    "tail": ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail is False"),
    "layer-types": ({"layer_types": [L, I, "sliding_attention", L, I]}, "layer_types is"),
    "shared-after-kda": ({"indexer_types": ["full", "full", "full", "full", "shared"]},
                         "indexer_types makes layer 4 'shared', but layer 3 is not"),
    "indexer-types": ({"indexer_types": ["full", "partial", "full", "full", "full"]}, "indexer_types is"),
    "mlp": ({"mlp_layer_types": ["dense"]}, r"mlp_layer_types is \['dense'\]"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    "conv": ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim is 0; it must be an integer >= 1"),
    "bound": ({"linear_lower_bound": "low"}, "linear_lower_bound is 'low'; it must be a number"),
    "groups": ({"n_group": 4}, "n_group is 4; it must divide the 6 routed experts"),
    "top-k": ({"num_experts_per_tok": 7}, "num_experts_per_tok is 7"),
    "limit": ({"swiglu_limit": 0}, "swiglu_limit is 0; it must be a number > 0"),
    "streams": ({"hc_mult": 0}, "hc_mult is 0; it must be an integer >= 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_refused_before_any_weight(glm5, tmp_path, monkeypatch, case):
    changes, message = BAD[case]
    text = {k: v for k, v in {**TEXT, **changes}.items()}
    assert_refused_before_weights(glm5, tmp_path / "glm5", monkeypatch, {"text_config": text}, message, CPU)


def test_flat_config_is_the_text_model():
    """A config.json with the text fields at its top level (no text_config) and one with them under text_config
    build the same model; layer_types' defaults are Transformers' (every 4th layer indexed attention)."""
    from hetmoe.models.config import ModelConfig, glm5_next_config, text_model_config

    nested = text_model_config(ModelConfig({"model_type": "glm5_next", "text_config": TEXT}))
    flat = ModelConfig({**TEXT, "model_type": "glm5_next"})
    assert glm5_next_config(nested) == glm5_next_config(flat)
    hf = transformers.models.glm5_next.Glm5NextTextConfig(num_hidden_layers=8)
    ours = glm5_next_config(ModelConfig({"model_type": "glm5_next", "num_hidden_layers": 8}))
    assert ours["layer_types"] == hf.layer_types and ours["mlp_layer_types"] == hf.mlp_layer_types
    assert ours["indexer_types"] == hf.indexer_types


def test_full_size_shape():
    """``hetmoe plan --shape glm-5.3-flash``: 45 layers, 34 KDA and 11 MLA (every 4th), each MLA layer caching a 512
    latent and the indexer's key and gate (2 x 128) per position; a KDA layer's state per sequence is a 3-wide
    window of 3 x 8192 channels (bf16) and 64 heads of a 128 x 128 fp32 state."""
    from hetmoe.load.loader import build_meta
    from hetmoe.load.random_weights import shape_config

    model = build_meta(shape_config("glm-5.3-flash"))
    cache = model.make_cache(1, 1, torch.bfloat16, device="meta")
    assert cache.n_layers == 11 and cache.index_layers == 11 and cache.elems_per_token == 11 * (512 + 256)
    assert cache.states.n_layers == 34
    assert cache.states.bytes_per_row == 34 * (3 * 3 * 8192 * 2 + 64 * 128 * 128 * 4)  # 140.8 MiB
    assert sum(isinstance(layer.mlp, Glm5NextMoE) for layer in model.model.layers) == 42
