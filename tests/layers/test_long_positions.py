"""RoPE at positions past 32K against transformers' own implementation, for every RoPE scaling hetmoe applies:
default RoPE in every model family, and YaRN in the DeepSeek family (``APPLIES_ROPE_SCALING``: deepseek_v3,
deepseek_v2 and kimi_k2, which runs the DeepSeek-V3 class), with the RoPE settings of the published configs (head
size 128 / rope 64, rope_theta, YaRN factor 40 over 4096 positions, mscale / mscale_all_dim) and the variants that
change the YaRN arithmetic (an attention factor != 1, no mscale at all, the half-split rotation). Qwen2/3-MoE and
Mixtral run default RoPE whatever config.json asks for (the loader says so at load): a YaRN config there has no
hetmoe table to compare. Two comparisons per case, neither running 32K tokens:

* ``test_rope_table_matches_transformers``: the cos/sin table the model hands its layers (caught by a pre-hook on
  the first layer, which stops the forward there) against transformers' ``model.model.rotary_emb(x,
  position_ids)`` at positions from 32,767 up to the model's context limit (163,839 for the YaRN cases). One ulp
  off an inverse frequency moves the fp32 angle position x frequency by one of its ulps here (3.9e-3 at 40,959,
  1.6e-2 at 163,839; measured in the table: 3.8e-3 qwen3, 1.5e-2 deepseek_v3 yarn). Measured max abs.
  difference: 0; 6.0e-8 for DeepSeek-V2 (transformers takes torch.polar, hetmoe cos and sin). Bound 1e-6.
* ``test_logits_match_transformers``: the whole model, two rows of 8 random tokens at scattered positions, short
  and past 32K (distances up to 39,994: RoPE scores depend on the distance only, so a table error shows in the
  logits only over a long distance), prefill (MLA's expanded form) then 2 greedy decode steps (MLA's absorbed
  form). Transformers gets those ``position_ids`` and attends the tokens it was given; hetmoe writes them at those
  positions of a contiguous cache of 40,064. A hetmoe query attends every cached position <= its own, the
  never-written zeros between them too (score 0, not masked), so its step here is a ``Written``: the model's own
  mask plus -inf at the positions never written. Everything else (the table, the rotation, the softmax scale,
  the cache write and read past 32K, both MLA forms) is the model's own code. Routed experts: fp32 TorchExperts.
  Measured max rel. logit error over the prefill and the decode steps: 1.9e-7 to 6.0e-7 (1 or 2 threads, other
  tokens: at most 6.0e-7). Bound 2e-6, under what these faults measured: one ulp off the first inverse frequency
  2.8e-4 (qwen3) / 4.7e-6 (deepseek_v3 yarn); hetmoe's plain mask (never-written zeros attended) 0.34 to 1.45.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.layers.rope import inv_frequencies  # noqa: E402
from hetmoe.models import APPLIES_ROPE_SCALING, MODEL_TYPES, context_limit, model_class  # noqa: E402
from hetmoe.models.config import ModelConfig  # noqa: E402
from parity import load_ours, max_rel, torch_fp32  # noqa: E402

# DeepSeek-V3 / R1's config.json (V2 and V2-Lite: mscale = mscale_all_dim = 0.707).
YARN_V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK = {"qk_rope_head_dim": 64, "max_position_embeddings": 163840}
GQA = {"head_dim": 128, "num_key_value_heads": 1}  # 4 query heads per kv head


def _default(theta: float, max_positions: int) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}, "max_position_embeddings": max_positions}


def _yarn(**changes) -> dict:
    return {**DEEPSEEK, "rope_parameters": {k: v for k, v in {**YARN_V3, **changes}.items() if v is not None}}


# case -> (model_type, config overrides)
CASES = {
    "qwen3_moe-default": ("qwen3_moe", {**GQA, **_default(1e6, 40960)}),  # Qwen3-30B-A3B
    "qwen2_moe-default": ("qwen2_moe", {**GQA, **_default(1e6, 65536)}),
    "mixtral-default": ("mixtral", {**GQA, **_default(1e6, 65536)}),  # Mixtral-8x22B
    "deepseek_v3-default": ("deepseek_v3", {**DEEPSEEK, **_default(10000.0, 65536)}),
    "deepseek_v2-default": ("deepseek_v2", {**DEEPSEEK, **_default(10000.0, 65536)}),
    "deepseek_v3-yarn": ("deepseek_v3", _yarn()),  # cos/sin unscaled, softmax scale x mscale**2
    "deepseek_v3-yarn-attention-factor": ("deepseek_v3", _yarn(mscale_all_dim=0.707)),  # cos/sin x 1.09 too
    "deepseek_v3-yarn-no-mscale": ("deepseek_v3", _yarn(mscale=None, mscale_all_dim=None)),  # cos/sin x 1.37
    "deepseek_v3-yarn-half-split": ("deepseek_v3", {**_yarn(), "rope_interleave": False}),
    "deepseek_v2-yarn": ("deepseek_v2", _yarn(mscale=0.707, mscale_all_dim=0.707)),  # DeepSeek-V2
}
TABLE_POSITIONS = (32_767, 32_768, 33_000, 39_999, 40_000, 65_535, 100_000, 131_071)
# Two rows of 8 tokens each: short and long positions, distances up to 39,994 (decode: 2 steps after the last).
ROWS = ([0, 1, 2, 3, 32_768, 33_000, 33_001, 33_002], [7, 16_384, 32_767, 39_990, 39_991, 39_992, 39_993, 39_994])
DECODE = 2


def test_every_scaling_model_type_is_covered():
    # A model type that starts applying RoPE scaling needs a case here; kimi_k2 runs the DeepSeek-V3 class. The
    # sparse-attention models run DeepSeek-V3's table: their YaRN cases are in tests/models/test_deepseek_v32.py;
    # gpt-oss's (its published YaRN, table to 131,071) in tests/models/test_gpt_oss.py.
    covered = {arch for arch, overrides in CASES.values() if overrides["rope_parameters"]["rope_type"] != "default"}
    elsewhere = {"deepseek_v32", "glm_moe_dsa", "gpt_oss"}
    assert {MODEL_TYPES[t] for t in APPLIES_ROPE_SCALING - elsewhere} == {MODEL_TYPES[t] for t in covered}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, checkpoints):
    arch, overrides = CASES[request.param]
    path = checkpoints(arch, {"num_hidden_layers": 2, **overrides}, seed=5, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, hf, load_ours(path, model_class(ModelConfig.from_file(path / "config.json")), torch_fp32)


class _Stop(Exception):
    pass


def _our_table(model, positions: torch.Tensor) -> tuple:
    """The (cos, sin) table the model gives its layers at ``positions`` [1, S], as full-width [1, S, D] (each half
    the same frequencies, as transformers lays it out)."""
    seen = []

    def grab(module, args):
        seen.append(args[1])
        raise _Stop

    hook = model.model.layers[0].register_forward_pre_hook(grab)
    try:
        with torch.no_grad(), pytest.raises(_Stop):
            model(torch.zeros_like(positions), Step(positions=positions, slots=torch.tensor([0])), None)
    finally:
        hook.remove()
    cos, sin = seen[0]
    if cos.dim() == 4:  # default-RoPE models: [B, S, 1, D], sin signed [-sin, sin] (exact negation)
        cos, sin = cos[:, :, 0], sin[:, :, 0]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # DeepSeek: [B, S, rope / 2]


def _hf_table(hf, positions: torch.Tensor) -> tuple:
    with torch.no_grad():
        out = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    if torch.is_tensor(out) and out.is_complex():  # DeepSeek-V2: freqs_cis [B, S, rope / 2]
        return torch.cat((out.real, out.real), dim=-1), torch.cat((out.imag, out.imag), dim=-1)
    return out


# Measured (max abs. difference of cos and sin over the positions): 0; deepseek_v2 6.0e-8.
def test_rope_table_matches_transformers(case):
    name, hf, ours = case
    limit, _ = context_limit(ours.config)
    positions = torch.tensor([[p for p in TABLE_POSITIONS if p < limit] + [limit - 1]])
    cos, sin = _our_table(ours, positions)
    hf_cos, hf_sin = _hf_table(hf, positions)
    assert cos.shape == hf_cos.shape and sin.shape == hf_sin.shape
    err = max((cos - hf_cos).abs().max().item(), (sin - hf_sin).abs().max().item())
    print(f"{name}: positions {positions[0, 0].item()}..{limit - 1}, max abs. cos/sin difference {err:.1e}")
    assert err <= 1e-6, err
    if ours.config.rope_scaling_params:  # the scaling is in effect: far from the unscaled table at these positions
        dim = cos.shape[-1]
        freqs = positions.float().unsqueeze(-1) * inv_frequencies(dim, ours.config.rope_theta)
        assert (cos - torch.cat((freqs.cos(), freqs.cos()), dim=-1)).abs().max() > 0.1


class Written(Step):
    """The model's own attention mask, plus -inf at the cache positions the test never wrote (``written`` [B,
    capacity] bool): transformers attends only the tokens it was given."""

    written: torch.Tensor

    def attn_mask(self, ctx: int, dtype: torch.dtype, group: int = 1) -> torch.Tensor:
        unwritten = ~self.written[:, :ctx].view(-1, 1, 1, ctx)  # [B, 1, 1, ctx] over [B, 1, S * group, ctx]
        return super().attn_mask(ctx, dtype, group).masked_fill(unwritten, float("-inf"))


# Measured (TorchExperts fp32, max rel. logit error over the prefill and the decode steps): 1.9e-7 to 6.0e-7.
def test_logits_match_transformers(case, monkeypatch):
    name, hf, ours = case
    # Written's mask is read on the torch path; the CPU engine's decode op (hetmoe/cpu/attention.py) takes no mask
    monkeypatch.setattr("hetmoe.layers.attention.cpu_decode", lambda q, cache: None)
    positions = torch.tensor(ROWS)  # [B, S]
    B, S = positions.shape
    ids = torch.randint(0, hf.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    cache = ours.make_cache(B, int(positions.max()) + DECODE + 64)
    written = torch.zeros(B, cache.capacity, dtype=torch.bool)

    def step(pos: torch.Tensor) -> Step:
        written[torch.arange(B).unsqueeze(1), pos] = True
        s = Written(positions=pos, slots=torch.arange(B), kv_len=int(pos.max()) + 1, first_slot=0)
        s.written = written
        return s

    errors = []
    with torch.no_grad():
        # an explicit attention mask: transformers would otherwise read the jumps in position_ids as packed sequences
        out = hf(ids, attention_mask=torch.ones(B, S, dtype=torch.long), position_ids=positions, use_cache=True)
        errors.append(max_rel(ours.logits(ours(ids, step(positions), cache)), out.logits))
        for i in range(DECODE):
            nxt, pos = out.logits[:, -1:].argmax(-1), positions[:, -1:] + 1 + i
            out = hf(nxt, attention_mask=torch.ones(B, S + i + 1, dtype=torch.long), position_ids=pos,
                     past_key_values=out.past_key_values, use_cache=True)
            errors.append(max_rel(ours.logits(ours(nxt, step(pos), cache)), out.logits))
    print(f"{name}: rows at positions {ROWS}, max rel. logit error prefill + {DECODE} decode steps: {max(errors):.2e}")
    assert max(errors) <= 2e-6, errors
