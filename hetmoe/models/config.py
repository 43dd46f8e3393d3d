"""A model's ``config.json`` as an object with attribute access (no transformers needed at run time): the entries
Transformers' config classes fill in (``HF_DEFAULTS``), each family's derived settings (layer types, RoPE, the
multimodal wrappers) and the context a model can attend over. The checks that the entries describe a model these
files can build are hetmoe/models/config_checks.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json entry the models cannot run with; the message names the field, its value and the file."""


class ModelConfig(dict):
    """The parsed config.json; ``cfg.hidden_size`` reads ``cfg["hidden_size"]``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config.json has no {name!r}") from None

    @classmethod
    def from_file(cls, path) -> "ModelConfig":
        return cls(json.loads(Path(path).read_text()))

    def first(self, *names, default=None):
        """The first of several spellings present (configs written by different transformers versions vary,
        e.g. num_experts / num_local_experts)."""
        for n in names:
            if self.get(n) is not None:
                return self[n]
        if default is None:
            raise AttributeError(f"config.json has none of {', '.join(names)}")
        return default

    @property
    def rope_theta(self) -> float:
        params = self.get("rope_parameters") or {}
        return float(params.get("rope_theta", self.get("rope_theta", 10000.0)))

    @property
    def head_dim_or_default(self) -> int:
        return self.get("head_dim") or self["hidden_size"] // self["num_attention_heads"]

    @property
    def rope_dim(self) -> int:
        """The leading dims of each head that RoPE turns, as transformers computes them: int(head size x
        partial_rotary_factor), the factor from rope_parameters (or rope_scaling), else config.json's top level,
        else MiniMax's rotary_dim / head_dim, else the whole head (GLM-4.5's default 0.5: ``with_defaults``)."""
        name, value = rotary_entry(self)
        head_dim = self.head_dim_or_default
        factor = 1.0 if name is None else value / head_dim if name == "rotary_dim" else value
        return int(head_dim * factor)

    def with_defaults(self) -> "ModelConfig":
        """This config with the entries it leaves out that transformers' config class of its model_type fills with
        a default of its own (``HF_DEFAULTS``); the same object when there are none."""
        defaults = HF_DEFAULTS.get(self.get("model_type"), {})
        missing = {k: v for k, v in defaults.items() if k not in self}
        return ModelConfig({**missing, **self}) if missing else self

    @property
    def rope_scaling_params(self) -> dict:
        """rope_parameters (transformers >= 4.56) or rope_scaling, {} when neither scales (rope_type "default")."""
        params = self.get("rope_parameters") or self.get("rope_scaling") or {}
        if not isinstance(params, dict):
            return {}
        kind = params.get("rope_type", params.get("type", "default"))
        return {} if kind == "default" else {**params, "rope_type": kind}


# Entries that transformers' config class of a model_type fills when config.json leaves them out, where its default
# is not the one the model files assume otherwise (ModelConfig.with_defaults).
HF_DEFAULTS = {
    "glm4_moe": dict(first_k_dense_replace=1, n_shared_experts=1, partial_rotary_factor=0.5),
    "minimax_m2": dict(head_dim=128, rope_theta=5000000.0),
    **{t: dict(head_dim=256, partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
               moe_intermediate_size=512, shared_expert_intermediate_size=512)
       for t in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")},
    # DeepSeek-V3.2 and GLM-5: DeepseekV32Config / GlmMoeDsaConfig's MLA, routing and indexer sizes
    "deepseek_v32": dict(first_k_dense_replace=3, n_group=8, topk_group=4, n_shared_experts=1,
                         routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6, index_topk=2048,
                         index_head_dim=128, index_n_heads=64),
    # gpt-oss: GptOssConfig's (its default rope_parameters, YaRN x32 from 4096, is gpt_oss_rope's)
    "gpt_oss": dict(head_dim=64, num_key_value_heads=8, sliding_window=128, swiglu_alpha=1.702, swiglu_limit=7.0,
                    attention_bias=True, rope_theta=150000.0, rms_norm_eps=1e-5, num_experts_per_tok=4,
                    max_position_embeddings=131072),
    "glm_moe_dsa": dict(first_k_dense_replace=3, n_group=1, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5, index_topk=2048,
                        index_head_dim=128, index_n_heads=32),
    # DeepSeek-V4: DeepseekV4Config's defaults (V4-Flash's sizes); layer_types, mlp_layer_types, compress_rates and
    # the RoPE tables are derived from the config (deepseek_v4_* below)
    "deepseek_v4": dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                        num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024,
                        num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
                        norm_topk_prob=True, routed_scaling_factor=1.5, max_position_embeddings=1048576,
                        rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20,
                        hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024,
                        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=1,
                        rms_norm_eps=1e-6, hidden_act="silu", mlp_bias=False, attention_bias=False),
    # MiniMax-M3: MiniMaxM3VLTextConfig's defaults (its text_config); layer_types, mlp_layer_types and the indexer's
    # entries are also read from the legacy sparse_attention_config / moe_layer_freq (minimax_m3_config below)
    "minimax_m3_vl": dict(vocab_size=200064, hidden_size=6144, intermediate_size=3072, num_hidden_layers=60,
                          num_attention_heads=64, num_key_value_heads=4, head_dim=128, max_position_embeddings=524288,
                          rms_norm_eps=1e-6, num_experts_per_tok=4, num_local_experts=128, rope_theta=5000000.0,
                          dense_intermediate_size=12288, shared_intermediate_size=3072, routed_scaling_factor=2.0,
                          swiglu_alpha=1.702, swiglu_limit=7.0, index_n_heads=4, index_head_dim=128,
                          index_block_size=128, index_topk_blocks=16, index_local_blocks=1),
}


@dataclass(frozen=True)
class Multimodal:
    """A multimodal checkpoint whose language model one of the native model files runs, text only."""

    text_types: tuple  # the model_types its text_config may name (the first when it names none)
    prefix: str  # its language model's tensors are <prefix>model.layers.*, <prefix>lm_head.weight
    skipped: tuple  # name prefixes of the tensors a text-only model never reads (vision tower, projector)
    renamed: str = ""  # what the prefix becomes in the text model's names ("": dropped)


# model_type -> what it wraps. Kimi-K2.5 / K2.6 ("kimi_k25"): the DeepSeek-V3 language model of Kimi-K2 (text_config,
# model_type "kimi_k2") beside the MoonViT vision tower and its projector.
MULTIMODAL = {
    "kimi_k25": Multimodal(("kimi_k2", "deepseek_v3"), "language_model.", ("vision_tower.", "mm_projector.")),
    # Qwen3.5-MoE: model.language_model.* is the text model's model.*, lm_head stays, model.visual.* is the vision
    "qwen3_5_moe": Multimodal(("qwen3_5_moe_text",), "model.language_model.", ("model.visual.",), "model."),
    # MiniMax-M3: language_model.model.* / language_model.lm_head are the text model's model.* / lm_head
    "minimax_m3_vl": Multimodal(("minimax_m3_vl_text",), "language_model.",
                                ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")),
}
_WRAPPER_ONLY = ("text_config", "vision_config", "architectures", "auto_map")  # entries of the wrapper alone


def text_model_config(cfg: ModelConfig, source: str = "config.json") -> ModelConfig:
    """The config of the language model of a multimodal checkpoint (``MULTIMODAL``): its text_config's entries over
    the wrapper's other top-level ones (tie_word_embeddings, token ids, a quantization_config written beside
    text_config), model_type the wrapper's; any other config (one without text_config too) as it is. ConfigError
    naming ``source`` for a text_config that is not an object or names another model type."""
    wrapper = MULTIMODAL.get(cfg.get("model_type"))
    if wrapper is None or "text_config" not in cfg:
        return cfg
    text = cfg["text_config"]
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: text_config is {text!r}; a {cfg['model_type']} config.json holds its language "
                          "model's config there as an object")
    kind = text.get("model_type", wrapper.text_types[0])
    if kind not in wrapper.text_types:
        raise ConfigError(f"{source}: text_config.model_type is {kind!r}; hetmoe runs the language model of "
                          f"{cfg['model_type']} as {' / '.join(wrapper.text_types)} only")
    outer = {k: v for k, v in cfg.items() if k not in _WRAPPER_ONLY}
    return ModelConfig({**outer, **text, "model_type": cfg["model_type"]})


def rotary_entry(cfg: ModelConfig) -> tuple:
    """(the entry that sets how much of each head RoPE turns, its value), read as transformers reads them:
    rope_parameters' partial_rotary_factor wins over the top level's, which wins over MiniMax's rotary_dim; (None,
    None) without any (whole heads). Checked by check_config, not here."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(field)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return f"{field}.partial_rotary_factor", params["partial_rotary_factor"]
    for name in ("partial_rotary_factor", "rotary_dim"):
        if cfg.get(name) is not None:
            return name, cfg[name]
    return None, None


# ------------------------------------------------------------------------------------------------ checks

# model_type -> the entry or entries naming the routed-expert count
EXPERT_COUNT_FIELDS = {
    "qwen3_moe": ("num_experts", "num_local_experts"), "qwen2_moe": ("num_experts", "num_local_experts"),
    "mixtral": ("num_local_experts", "num_experts"),
    "deepseek_v2": ("n_routed_experts", "num_local_experts", "num_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts", "num_experts"),
    "kimi_k2": ("n_routed_experts", "num_local_experts", "num_experts"),
    "kimi_k25": ("n_routed_experts", "num_local_experts", "num_experts"),
    "glm4_moe": ("n_routed_experts", "num_local_experts"),
    "minimax_m2": ("num_local_experts", "num_experts"),
    "qwen3_next": ("num_experts", "num_local_experts"), "qwen3_5_moe": ("num_experts",),
    "qwen3_5_moe_text": ("num_experts",),
    "deepseek_v32": ("n_routed_experts", "num_local_experts", "num_experts"),
    "glm_moe_dsa": ("n_routed_experts", "num_local_experts", "num_experts"),
    "deepseek_v4": ("n_routed_experts", "num_local_experts"),
    "minimax_m3_vl": ("num_local_experts", "num_experts"),
    "gpt_oss": ("num_local_experts", "num_experts"),
}
PARTIAL_ROPE = ("glm4_moe", "minimax_m2")  # GQA models whose RoPE may turn part of each head (ModelConfig.rope_dim)
LINEAR_ATTENTION = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # Gated DeltaNet hybrids (models/qwen3_next.py)
SPARSE_ATTENTION = ("deepseek_v32", "glm_moe_dsa")  # MLA + DeepSeek Sparse Attention (models/deepseek_v32.py)
# how each sparse-attention model turns its indexer's rope dims (Transformers': V3.2 half-split, GLM-5 interleaved)
INDEXER_ROPE_INTERLEAVE = {"deepseek_v32": False, "glm_moe_dsa": True}


GPT_OSS_LAYERS = ("sliding_attention", "full_attention")
# GptOssConfig's RoPE when config.json sets none
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def gpt_oss_layer_types(cfg: ModelConfig) -> list:
    """gpt-oss: each layer's attention, config.json's layer_types or, as GptOssConfig fills it, sliding in even
    layers and full in odd ones. Checked by check_config, not here."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        return [GPT_OSS_LAYERS[i % 2] for i in range(cfg["num_hidden_layers"])]
    return list(kinds)


def gpt_oss_rope(cfg: ModelConfig) -> dict:
    """gpt-oss's RoPE parameters as transformers reads them: rope_parameters (or the older rope_scaling) with its
    rope_type and rope_theta filled in (theta from the top level, default 150000), or GptOssConfig's YaRN when
    config.json has neither."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or GPT_OSS_YARN
    params = dict(params) if isinstance(params, dict) else {}
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", HF_DEFAULTS["gpt_oss"]["rope_theta"]))
    return params


def dsa_indexer_types(cfg: ModelConfig) -> list:
    """Per layer, "full" (it runs its own indexer) or "shared" (it attends over the previous indexer's choice), as
    Transformers' config classes fill it: DeepSeek-V3.2 every layer full; GLM-5 config.json's indexer_types, else
    index_topk_pattern ("F"/"S" per layer, or the names), else every index_topk_freq-th layer from
    index_skip_topk_offset on (defaults 1 and 2: every layer). Checked by check_config, not here."""
    n = cfg["num_hidden_layers"]
    if cfg.get("model_type") != "glm_moe_dsa":
        return ["full"] * n
    kinds = cfg.get("indexer_types")
    if kinds is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq = max(cfg.get("index_topk_freq") or 1, 1)
            offset = cfg.get("index_skip_topk_offset")
            offset = 2 if offset is None else offset
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return list(kinds)[:n]


# DeepSeek-V4: each layer's attention and MoE kind, the compression rates and the two RoPE tables, as
# DeepseekV4Config.__post_init__ derives them from config.json (legacy entries folded in)
V4_ATTENTION = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
V4_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
V4_MLP = ("hash_moe", "moe")
V4_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def deepseek_v4_layer_types(cfg: ModelConfig) -> list:
    """Each layer's attention: config.json's layer_types, else its compress_ratios (0 / 4 / 128 per layer), else two
    HCA layers then CSA and HCA alternating (V4-Pro's schedule); cut to num_hidden_layers."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None and isinstance(cfg.get("compress_ratios"), list):
        kinds = [V4_RATIO_TYPES.get(r, r) if isinstance(r, int) else r for r in cfg["compress_ratios"]]
    if kinds is None:
        kinds = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    return list(kinds)[:n] if isinstance(kinds, list) else kinds


def deepseek_v4_mlp_layer_types(cfg: ModelConfig) -> list:
    """Each layer's MoE routing: mlp_layer_types, else num_hash_layers (default 3) hash-routed layers, then "moe"."""
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        n_hash = cfg.get("num_hash_layers")
        n_hash = 3 if n_hash is None else n_hash
        kinds = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    return list(kinds)[:n] if isinstance(kinds, list) else kinds


def deepseek_v4_compress_rates(cfg: ModelConfig) -> dict:
    """{attention kind: tokens per compressed entry}: compress_rates over the defaults (CSA 4, HCA 128), then the
    legacy compress_rate_csa / compress_rate_hca."""
    given = cfg.get("compress_rates")
    rates = {**V4_RATES, **(given if isinstance(given, dict) else {})}
    for name, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                       ("compress_rate_hca", "heavily_compressed_attention")):
        if cfg.get(name) is not None:
            rates[kind] = cfg[name]
    return rates


def deepseek_v4_rotary_factor(cfg: ModelConfig):
    """partial_rotary_factor, else qk_rope_head_dim / head_dim, else 64 / 512 (V4's rope dims of a 512 head)."""
    if cfg.get("partial_rotary_factor") is not None:
        return cfg["partial_rotary_factor"]
    if isinstance(cfg.get("qk_rope_head_dim"), int) and isinstance(cfg.get("head_dim"), int) and cfg["head_dim"]:
        return cfg["qk_rope_head_dim"] / cfg["head_dim"]
    return 64 / 512


def deepseek_v4_rope(cfg: ModelConfig) -> dict:
    """{"main": params, "compress": params}: rope_parameters as given when nested so; else main is default RoPE of
    rope_theta, and compress takes the flat rope_parameters (or rope_scaling: YaRN) with compress_rope_theta, a YaRN
    attention_factor of 1 unless given (the V4 reference does not scale cos/sin)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        return {"main": rp, "compress": rp}
    factor = deepseek_v4_rotary_factor(cfg)
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        tables = {k: dict(rp[k]) for k in ("main", "compress")}
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        tables = {"main": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0),
                           "partial_rotary_factor": factor},
                  "compress": {**flat, "rope_theta": cfg.get("compress_rope_theta", 160000.0),
                               "partial_rotary_factor": factor}}
        kind = flat.get("rope_type", flat.get("type", "default"))
        tables["compress"]["rope_type"] = kind
        if kind == "yarn":
            tables["compress"].setdefault("attention_factor", 1.0)
    for t in tables.values():
        t.setdefault("rope_type", t.get("type", "default"))
    return tables


# MiniMax-M3: the legacy entries MiniMaxM3VLTextConfig.__post_init__ reads, and the layer kinds
M3_LEGACY_INDEX = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                   "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                   "index_local_blocks": "sparse_local_block"}
M3_ATTENTION = ("full_attention", "minimax_m3_sparse")
M3_MLP = ("dense", "sparse")


def minimax_m3_config(cfg: ModelConfig) -> ModelConfig:
    """A MiniMax-M3 config as MiniMaxM3VLTextConfig fills it: its defaults (``HF_DEFAULTS``), the indexer's entries
    from sparse_attention_config's legacy names where it has them, layer_types from its sparse_attention_freq (else
    every layer full attention), mlp_layer_types from moe_layer_freq (else every layer MoE). Checked by
    check_config, not here."""
    if cfg.get("num_local_experts") is None and cfg.get("num_experts") is not None:  # (Transformers' alias)
        cfg = ModelConfig({**cfg, "num_local_experts": cfg["num_experts"]})
    cfg = cfg.with_defaults()
    sparse = cfg.get("sparse_attention_config") or {}
    sparse = sparse if isinstance(sparse, dict) else {}
    out = dict(cfg)
    out.update({flat: sparse[legacy] for flat, legacy in M3_LEGACY_INDEX.items() if legacy in sparse})
    n = cfg.get("num_hidden_layers")
    if out.get("layer_types") is None:
        freq = sparse.get("sparse_attention_freq")
        out["layer_types"] = ([M3_ATTENTION[1] if f else M3_ATTENTION[0] for f in freq] if isinstance(freq, list)
                              else [M3_ATTENTION[0]] * (n if isinstance(n, int) else 0))
    if out.get("mlp_layer_types") is None:
        freq = cfg.get("moe_layer_freq")
        out["mlp_layer_types"] = ([M3_MLP[1] if f else M3_MLP[0] for f in freq] if isinstance(freq, list)
                                  else [M3_MLP[1]] * (n if isinstance(n, int) else 0))
    return ModelConfig(out)


def minimax_m3_rotary(cfg: ModelConfig) -> tuple:
    """(the entry that sets MiniMax-M3's RoPE share of each head, its factor): rope_parameters' (or rope_scaling's)
    partial_rotary_factor, else the top level's (Transformers moves it there), else the whole head. Transformers'
    MiniMax-M3 never reads rotary_dim (check_config refuses one that disagrees)."""
    for field in ("rope_parameters", "rope_scaling"):
        params = cfg.get(field)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            return f"{field}.partial_rotary_factor", params["partial_rotary_factor"]
    if cfg.get("partial_rotary_factor") is not None:
        return "partial_rotary_factor", cfg["partial_rotary_factor"]
    return None, 1.0


def minimax_m3_rope_dim(cfg: ModelConfig) -> int:
    return int(cfg["head_dim"] * minimax_m3_rotary(cfg)[1])


def context_limit(cfg: ModelConfig, applies_rope_scaling: bool = True) -> tuple:
    """(positions the model can attend over, how that number was found) — None when config.json has no
    max_position_embeddings. With RoPE scaling that the model applies (a factor, e.g. YaRN), the larger of
    max_position_embeddings and original_max_position_embeddings x factor."""
    limit = cfg.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None, ""
    why = f"max_position_embeddings {limit}"
    scaling = cfg.rope_scaling_params
    factor = scaling.get("factor")
    if applies_rope_scaling and isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings") or limit
        scaled = int(original * factor)
        if scaled > limit:
            limit = scaled
            why = (f"{scaling['rope_type']} RoPE scaling: original_max_position_embeddings {original} x factor "
                   f"{factor:g}")
    return limit, why


# ------------------------------------------------------------------------------------------------ GLM-5.3-Flash

# GLM-5.3-Flash ("glm5_next"; its language model alone "glm5_next_text"): Glm5NextTextConfig's defaults, the
# checkpoint's multimodal wrapper (Glm5NextForConditionalGeneration: model.language_model.* is the text model's
# model.*, lm_head stays, model.visual.* is the vision tower) and its routed-expert count
GLM5_NEXT = ("glm5_next", "glm5_next_text")
GLM5_NEXT_ATTENTION = ("linear_attention", "indexed_attention")
for _t in GLM5_NEXT:
    HF_DEFAULTS[_t] = dict(
        vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=45,
        num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=288,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=0, v_head_dim=256,
        qk_nope_head_dim=256, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=1048576, rms_norm_eps=1e-5, attention_bias=False, index_topk=2048,
        index_head_dim=128, index_n_heads=32, swiglu_limit=10.0, linear_head_dim=128, linear_num_heads=64,
        linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20,
        index_kpool=16, index_kpool_always_select_tail=True)
    EXPERT_COUNT_FIELDS[_t] = ("n_routed_experts", "num_local_experts")
MULTIMODAL["glm5_next"] = Multimodal(("glm5_next_text",), "model.language_model.", ("model.visual.",), "model.")


def glm5_next_config(cfg: ModelConfig) -> ModelConfig:
    """A GLM-5.3-Flash config as Glm5NextTextConfig fills it: its defaults, linear_attn_config's entries (head_dim,
    num_heads, short_conv_kernel_size, gate_lower_bound; safe_gate) over the flat ones, layer_types (every 4th layer
    from the 4th indexed attention, the others KDA; "full_attention" read as "indexed_attention"), mlp_layer_types
    (3 dense layers, then MoE) and indexer_types (dsa_indexer_types' rules). Checked by check_config, not here."""
    cfg = cfg.with_defaults()
    out = dict(cfg)
    linear = cfg.get("linear_attn_config")
    if isinstance(linear, dict):
        for flat, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                          ("linear_conv_kernel_dim", "short_conv_kernel_size"), ("linear_lower_bound",
                                                                                 "gate_lower_bound")):
            out[flat] = linear.get(key, out.get(flat))
        if linear.get("safe_gate", True) and out.get("linear_lower_bound") is None:
            out["linear_lower_bound"] = -5.0
    n = cfg.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
    kinds = out.get("layer_types")
    if kinds is None:
        kinds = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    if isinstance(kinds, list):
        kinds = ["indexed_attention" if k == "full_attention" else k for k in kinds]
    out["layer_types"] = kinds
    if out.get("mlp_layer_types") is None:
        out["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
    if out.get("indexer_types") is None and n:
        pattern = cfg.get("index_topk_pattern")
        if pattern is None or (isinstance(pattern, str) and set(pattern) <= {"F", "S"}) or isinstance(pattern, list):
            out["indexer_types"] = dsa_indexer_types(ModelConfig({**out, "model_type": "glm_moe_dsa"}))
    return ModelConfig(out)
