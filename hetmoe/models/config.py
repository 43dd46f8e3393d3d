"""A model's ``config.json`` as an object with attribute access (no transformers needed at run time), and the
checks that its entries describe a model these files can build (``check_config``), made before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


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
        name, value = _rotary_entry(self)
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


def _rotary_entry(cfg: ModelConfig) -> tuple:
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
_EXPERTS = {
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


class _Checker:
    def __init__(self, cfg: ModelConfig, source: str):
        self.cfg, self.source, self.model_type = cfg, source, cfg.get("model_type")

    def fail(self, what: str):
        raise ConfigError(f"{self.source}: {what}")

    def int(self, name: str, minimum: int = 1, default=None, required: bool = True) -> Optional[int]:
        v = self.cfg.get(name, default)
        if v is None:
            if required:
                raise ConfigError(f"{self.source} does not describe a {self.model_type} model: it has no {name}")
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(f"{name} is {v!r}; it must be an integer >= {minimum}")
        return v

    def number(self, name: str, value, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
            self.fail(f"{name} is {value!r}; it must be a number > 0")
        return float(value)


def check_config(cfg: ModelConfig, source: str = "config.json") -> None:
    """Refuse (ConfigError naming the field, its value and ``source``) a config.json whose entries the model
    files cannot run: sizes that are missing or not positive, a top-k outside 1..experts, DeepSeek expert groups
    that do not divide the experts, head sizes that do not divide, RoPE settings the model cannot build. Only
    supported model types are checked (model_class refuses the others)."""
    cfg = cfg.with_defaults()
    c = _Checker(cfg, source)
    if c.model_type not in _EXPERTS:
        return
    if c.model_type == "deepseek_v4":
        _check_deepseek_v4(c)
        return
    if c.model_type == "minimax_m3_vl":
        _check_minimax_m3(c)
        return
    if c.model_type in GLM5_NEXT:
        _check_glm5_next(c)
        return
    deepseek = c.model_type.startswith("deepseek") or c.model_type in ("kimi_k2", "kimi_k25", "glm_moe_dsa")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        c.int(name)
    layers, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    if cfg.get("rms_norm_eps") is None:
        c.int("rms_norm_eps")  # the "has no" message
    c.number("rms_norm_eps", cfg["rms_norm_eps"])
    c.int("max_position_embeddings", required=deepseek)
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        c.fail(f"rope_parameters is {params!r}; it must be an object")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        c.number("rope_theta", theta)
    _check_rope_scaling(c, deepseek)
    if c.model_type in LINEAR_ATTENTION:
        _check_linear_attention(c)
    if c.model_type in SPARSE_ATTENTION:
        _check_sparse_attention(c)

    n_experts = _n_experts(c)
    first_dense = 0
    if deepseek:
        first_dense = c.int("first_k_dense_replace", minimum=0, default=0)
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            c.int(name)
        c.int("qk_nope_head_dim", minimum=0)
        c.int("q_lora_rank", required=False)
        if cfg["qk_rope_head_dim"] % 2:
            c.fail(f"qk_rope_head_dim is {cfg['qk_rope_head_dim']}; RoPE needs an even size")
    else:
        kv = c.int("num_key_value_heads")
        if heads % kv:
            c.fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
        head_dim = c.int("head_dim", required=False)
        if head_dim is None:
            if hidden % heads:
                c.fail(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and there is no "
                       "head_dim)")
            head_dim = hidden // heads
        if head_dim % 2:
            c.fail(f"the head size is {head_dim} ({'head_dim' if cfg.get('head_dim') else 'hidden_size / heads'}); "
                   "RoPE needs an even size")
        if c.model_type in PARTIAL_ROPE:
            _check_rotary(c, head_dim)
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                c.fail(f"hidden_act is {act!r}; {c.model_type} runs SwiGLU experts and MLPs (silu)")
    if c.model_type == "glm4_moe":
        first_dense = c.int("first_k_dense_replace", minimum=0)
    dense_layers = n_experts == 0 or first_dense > 0
    if c.model_type in SPARSE_ATTENTION and cfg.get("mlp_layer_types") is not None:
        kinds = cfg["mlp_layer_types"]
        dense_layers = "dense" in kinds
        if "sparse" in kinds and not n_experts:
            c.fail(f"mlp_layer_types lists MoE ('sparse') layers, but {_expert_field(cfg)} is {n_experts}")
    if c.model_type in ("qwen3_moe", "qwen2_moe"):
        step = c.int("decoder_sparse_step", default=1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            c.fail(f"mlp_only_layers is {only!r}; it must be a list of layer indices")
        bad = [i for i in only if not 0 <= i < layers]
        if bad:
            c.fail(f"mlp_only_layers lists layer(s) {bad}; the model has {layers} (num_hidden_layers)")
        dense_layers = dense_layers or bool(only) or step > 1
    experts_in_intermediate = c.model_type in ("mixtral", "minimax_m2", "gpt_oss")  # the experts' size
    if experts_in_intermediate or dense_layers:
        c.int("intermediate_size")
    if not n_experts:
        return
    if not experts_in_intermediate:
        c.int("moe_intermediate_size")
    if c.model_type == "qwen2_moe":
        c.int("shared_expert_intermediate_size")
    if deepseek or c.model_type == "glm4_moe":
        c.int("n_shared_experts", minimum=0, default=0)
    if c.model_type == "minimax_m2":
        _check_minimax(c, n_experts)
    if c.model_type == "gpt_oss":
        _check_gpt_oss(c)
    k = cfg.get("num_experts_per_tok")
    if k is None:
        c.int("num_experts_per_tok")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        c.fail(f"num_experts_per_tok is {k!r}; with {n_experts} routed experts ({_expert_field(cfg)}) it must be "
               f"between 1 and {n_experts}")
    if deepseek or c.model_type == "glm4_moe":
        _check_groups(c, n_experts, k)
    if c.model_type in PARTIAL_ROPE and cfg.get("routed_scaling_factor") is not None:
        c.number("routed_scaling_factor", cfg["routed_scaling_factor"])


def _check_deepseek_v4(c: _Checker) -> None:
    """DeepSeek-V4: its sizes, one shared KV head, the grouped output projection, each layer's attention kind (and
    its compression rate) and MoE routing, the router's scoring, the clamped SwiGLU, the hyper-connections, the
    two RoPE tables, and entries Transformers' DeepseekV4 classes do not run otherwise (refused by name)."""
    cfg = c.cfg
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "o_groups", "o_lora_rank", "sliding_window", "moe_intermediate_size", "hc_mult",
                 "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings"):
        c.int(name)
    layers, heads, head_dim = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]
    c.number("rms_norm_eps", cfg.get("rms_norm_eps"))
    c.number("swiglu_limit", cfg.get("swiglu_limit"))
    c.number("routed_scaling_factor", cfg.get("routed_scaling_factor"))
    c.number("hc_eps", cfg.get("hc_eps"), positive=False)
    if cfg.get("num_key_value_heads", 1) != 1:
        c.fail(f"num_key_value_heads is {cfg['num_key_value_heads']!r}; DeepSeek-V4 has one key/value head shared by "
               "every query head")
    if heads * head_dim % cfg["o_groups"]:
        c.fail(f"o_groups is {cfg['o_groups']}; it must divide num_attention_heads x head_dim ({heads * head_dim})")
    kinds = deepseek_v4_layer_types(cfg)
    source = "layer_types" if cfg.get("layer_types") is not None else "compress_ratios"
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in V4_ATTENTION for k in kinds):
        c.fail(f"{source} is {cfg.get(source)!r}; it must give each of the {layers} layers (num_hidden_layers) one of "
               f"{', '.join(V4_ATTENTION)}" + (" (compress ratio 0, 4 or 128)" if source == "compress_ratios" else ""))
    rates = deepseek_v4_compress_rates(cfg)
    for kind in set(kinds) - {"sliding_attention"}:
        r = rates.get(kind)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            c.fail(f"compress_rates[{kind!r}] is {r!r}; it must be an integer >= 1")
    mlp = deepseek_v4_mlp_layer_types(cfg)
    if not isinstance(mlp, list) or len(mlp) != layers or any(k not in V4_MLP for k in mlp):
        name = "mlp_layer_types" if cfg.get("mlp_layer_types") is not None else "num_hash_layers"
        c.fail(f"{name} is {cfg.get(name)!r}; it must give each of the {layers} layers (num_hidden_layers) "
               "'hash_moe' or 'moe'")
    n_experts = _n_experts(c)
    k = cfg.get("num_experts_per_tok")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        c.fail(f"num_experts_per_tok is {k!r}; with {n_experts} routed experts ({_expert_field(cfg)}) it must be "
               f"between 1 and {n_experts}")
    for name, want, what in (
            ("hidden_act", "silu", "SwiGLU experts (silu)"),
            ("norm_topk_prob", True, "a router that always renormalises its top-k weights"),
            ("n_shared_experts", 1, "one shared expert of moe_intermediate_size in every layer"),
            ("attention_bias", False, "attention projections without biases")):
        if cfg.get(name, want) != want:
            c.fail(f"{name} is {cfg[name]!r}; DeepSeek-V4 runs {what}")
    if cfg.get("scoring_func") not in ("sqrtsoftplus", "sigmoid"):
        c.fail(f"scoring_func is {cfg.get('scoring_func')!r}; DeepSeek-V4's router scores with sqrtsoftplus or "
               "sigmoid")
    _check_v4_rope(c, head_dim)
    qc = cfg.get("quantization_config")
    experts_dtype = qc.get("expert_dtype") if isinstance(qc, dict) else None
    experts_dtype = cfg.get("expert_dtype") if experts_dtype is None else experts_dtype
    if experts_dtype not in (None, "fp8", "bf16", "fp4"):
        c.fail(f"quantization_config.expert_dtype is {experts_dtype!r}: hetmoe reads DeepSeek-V4's routed experts in "
               "FP8 blocks, FP4 (E2M1 with an E8M0 scale per 32) or floats")


def _check_v4_rope(c: _Checker, head_dim: int) -> None:
    tables = deepseek_v4_rope(c.cfg)
    for label in ("main", "compress"):
        p = tables[label]
        where = f"rope_parameters[{label!r}]"
        if not isinstance(p, dict):
            c.fail(f"{where} is {p!r}; it must be an object")
        if p["rope_type"] not in ("default", "yarn"):
            c.fail(f"{where} has rope_type {p['rope_type']!r}; DeepSeek-V4 runs default or yarn RoPE")
        c.number(f"{where}.rope_theta", p.get("rope_theta"))
        factor = p.get("partial_rotary_factor", 1.0)
        c.number(f"{where}.partial_rotary_factor", factor)
        dim = int(head_dim * factor)
        if not 2 <= dim <= head_dim or dim % 2:
            c.fail(f"{where}.partial_rotary_factor is {factor!r}: RoPE would turn {dim} of the {head_dim} dims of each "
                   f"head; it needs an even number between 2 and {head_dim}")
        if label == "compress" and dim > c.cfg["index_head_dim"]:
            c.fail(f"index_head_dim is {c.cfg['index_head_dim']}; the indexer turns the last {dim} dims of each of its "
                   "heads, so it needs at least that many")
        if p["rope_type"] == "yarn":
            c.number(f"{where}.factor", p.get("factor"))
            original = p.get("original_max_position_embeddings")
            if isinstance(original, bool) or not isinstance(original, int) or original < 1:
                c.fail(f"{where}.original_max_position_embeddings is {original!r}; yarn needs an integer >= 1")


def _check_minimax_m3(c: _Checker) -> None:
    """MiniMax-M3: its sizes, each layer's attention and MLP kind, the block indexer, default RoPE over an even
    share of each head, the clamped SwiGLU, and entries Transformers' MiniMaxM3VL classes do not run otherwise
    (refused by name): a quantization_config other than MXFP8 (MiniMax-M3's own: e4m3 with an E8M0 scale per 32
    weights; its settings are checked by the loader, hetmoe/load/fp8_formats.py)."""
    cfg = c.cfg = minimax_m3_config(c.cfg)
    qc = cfg.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        block = qc.get("weight_block_size") if isinstance(qc, dict) else None
        mxfp8 = method == "mxfp8" or (method == "fp8" and isinstance(block, (list, tuple)) and list(block) == [1, 32])
        if not mxfp8:
            c.fail(f"quantization_config (quant_method {method!r}, weight_block_size {block!r}): hetmoe reads "
                   "MiniMax-M3 checkpoints in bf16 / fp16 / fp32 or with MXFP8 weights (quant_method 'mxfp8', or "
                   "'fp8' with weight_block_size [1, 32])")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "num_local_experts", "shared_intermediate_size",
                 "max_position_embeddings"):
        c.int(name)
    layers, heads, kv, head_dim = (cfg[n] for n in ("num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim"))
    n_experts = cfg["num_local_experts"]
    c.number("rms_norm_eps", cfg.get("rms_norm_eps"))
    if heads % kv:
        c.fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if cfg.get("num_experts") is not None and cfg["num_experts"] != n_experts:
        c.fail(f"num_experts is {cfg['num_experts']!r} and num_local_experts {n_experts}; they name one count")
    k = cfg.get("num_experts_per_tok")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        c.fail(f"num_experts_per_tok is {k!r}; with {n_experts} routed experts (num_local_experts) it must be "
               f"between 1 and {n_experts}")
    for name in ("swiglu_alpha", "swiglu_limit", "routed_scaling_factor"):
        c.number(name, cfg.get(name))
    kinds = cfg["layer_types"]
    if not isinstance(kinds, list) or len(kinds) != layers or any(t not in M3_ATTENTION for t in kinds):
        c.fail(f"layer_types is {kinds!r}; it must give each of the {layers} layers (num_hidden_layers) one of "
               f"{' or '.join(map(repr, M3_ATTENTION))}")
    mlps = cfg["mlp_layer_types"]
    if not isinstance(mlps, list) or len(mlps) != layers or any(t not in M3_MLP for t in mlps):
        c.fail(f"mlp_layer_types is {mlps!r}; it must give each of the {layers} layers (num_hidden_layers) 'dense' "
               "or 'sparse'")
    if "dense" in mlps:
        c.int("dense_intermediate_size")
    if M3_ATTENTION[1] in kinds:
        for name in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks"):
            c.int(name)
        local = c.int("index_local_blocks", minimum=0)
        if local > cfg["index_topk_blocks"]:
            c.fail(f"index_local_blocks is {local}; the blocks always kept are among the index_topk_blocks "
                   f"({cfg['index_topk_blocks']}) a query attends to, so at most that many")
        if heads % cfg["index_n_heads"]:
            c.fail(f"index_n_heads is {cfg['index_n_heads']}; each indexer head chooses for a group of attention "
                   f"heads, so it must divide num_attention_heads ({heads})")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        c.fail(f"rope_parameters is {params!r}; it must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        c.fail(f"rope_parameters has rope_type {kind!r}; hetmoe's MiniMax-M3 runs default RoPE only")
    c.number("rope_theta", cfg.rope_theta)
    name, factor = minimax_m3_rotary(cfg)
    if name is not None:
        c.number(name, factor)
    dim = minimax_m3_rope_dim(cfg)
    if not 2 <= dim <= head_dim or dim % 2:
        c.fail(f"{name or 'head_dim'} is {factor if name else head_dim!r}: RoPE would turn {dim} of the {head_dim} "
               f"dims of each head; it needs an even number between 2 and {head_dim}")
    rotary = cfg.get("rotary_dim")
    if rotary is not None and rotary != dim:
        c.fail(f"rotary_dim is {rotary!r}, but Transformers' MiniMax-M3 turns {dim} of the {head_dim} dims of each "
               f"head ({name or 'no partial_rotary_factor: the whole head'}) and never reads rotary_dim; make them "
               "agree (rope_parameters.partial_rotary_factor = rotary_dim / head_dim)")
    if M3_ATTENTION[1] in kinds and dim > cfg["index_head_dim"]:
        c.fail(f"index_head_dim is {cfg['index_head_dim']}; the indexer's heads are turned by the model's RoPE "
               f"table ({dim} dims), so they need at least that many")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swigluoai"):
        c.fail(f"hidden_act is {act!r}; MiniMax-M3 runs its clamped SwiGLU (swigluoai)")
    if cfg.get("scoring_func") not in (None, "sigmoid"):
        c.fail(f"scoring_func is {cfg['scoring_func']!r}; MiniMax-M3's router scores with sigmoid")
    if cfg.get("use_routing_bias") not in (None, True):
        c.fail(f"use_routing_bias is {cfg['use_routing_bias']!r}; MiniMax-M3's router always adds its "
               "e_score_correction_bias")
    for name in ("sliding_window", "attn_window_size"):
        if cfg.get(name) is not None:
            c.fail(f"{name} is {cfg[name]!r}; MiniMax-M3 has no sliding-window attention")


def _check_linear_attention(c: _Checker) -> None:
    """Qwen3-Next / Qwen3.5-MoE: which layers are linear attention (layer_types, or full_attention_interval), the
    Gated DeltaNet sizes (value heads a multiple of key heads), SiLU, partial RoPE, and the shared expert and dense
    MLP sizes."""
    cfg = c.cfg
    layers = cfg["num_hidden_layers"]
    if isinstance(cfg.get("head_dim"), int) and cfg["head_dim"] > 0:
        _check_rotary(c, cfg["head_dim"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        c.int("full_attention_interval", default=4)
    elif (not isinstance(kinds, list) or len(kinds) != layers
          or any(k not in ("linear_attention", "full_attention") for k in kinds)):
        c.fail(f"layer_types is {kinds!r}; it must list one of 'linear_attention' or 'full_attention' for each of the "
               f"{layers} layers (num_hidden_layers)")
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "shared_expert_intermediate_size"):
        c.int(name)
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        c.fail(f"linear_num_value_heads {cfg['linear_num_value_heads']} is not a multiple of linear_num_key_heads "
               f"{cfg['linear_num_key_heads']}")
    if cfg.get("hidden_act", "silu") != "silu":
        c.fail(f"hidden_act is {cfg['hidden_act']!r}; {c.model_type} runs SiLU convolutions and SwiGLU experts")
    if c.model_type != "qwen3_next":  # Qwen3.5-MoE: every layer a MoE layer
        c.int("num_experts")
    else:
        step = c.int("decoder_sparse_step", default=1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers
                                             for i in only):
            c.fail(f"mlp_only_layers is {only!r}; it must be a list of layer indices below {layers}")
        if only or step > 1:
            c.int("intermediate_size")


def _check_sparse_attention(c: _Checker) -> None:
    """DeepSeek-V3.2 / GLM-5: the indexer's sizes (its heads turn their first qk_rope_head_dim dims), q LoRA (the
    indexer reads its output), MLA's interleaved RoPE, SiLU, every layer indexed attention, which layers are MoE
    (mlp_layer_types) and, for GLM-5, which layers run their own indexer (dsa_indexer_types)."""
    cfg, layers = c.cfg, c.cfg["num_hidden_layers"]
    for name in ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank"):
        c.int(name)
    rope = cfg.get("qk_rope_head_dim")
    if isinstance(rope, int) and cfg["index_head_dim"] < rope:
        c.fail(f"index_head_dim is {cfg['index_head_dim']}; the indexer turns the first {rope} dims of each of its "
               "heads (qk_rope_head_dim), so it needs at least that many")
    if cfg.get("rope_interleave") not in (None, True):
        c.fail(f"rope_interleave is {cfg['rope_interleave']!r}; {c.model_type}'s MLA rotates interleaved pairs only")
    want = INDEXER_ROPE_INTERLEAVE[c.model_type]
    if cfg.get("indexer_rope_interleave") not in (None, want):
        c.fail(f"indexer_rope_interleave is {cfg['indexer_rope_interleave']!r}; {c.model_type}'s indexer turns its "
               f"rope dims {'as interleaved pairs' if want else 'half-split'} only")
    if cfg.get("hidden_act", "silu") != "silu":
        c.fail(f"hidden_act is {cfg['hidden_act']!r}; {c.model_type} runs SwiGLU experts and MLPs (silu)")
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
                              or any(k != "indexed_attention" for k in kinds)):
        c.fail(f"layer_types is {kinds!r}; {c.model_type} runs 'indexed_attention' (MLA with a sparse-attention "
               f"indexer) in each of its {layers} layers")
    kinds = cfg.get("mlp_layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
                              or any(k not in ("dense", "sparse") for k in kinds)):
        c.fail(f"mlp_layer_types is {kinds!r}; it must list 'dense' or 'sparse' for each of the {layers} layers "
               "(num_hidden_layers)")
    if c.model_type == "deepseek_v32":
        kinds = cfg.get("indexer_types")
        if kinds is not None and (not isinstance(kinds, list) or any(k != "full" for k in kinds)):
            c.fail(f"indexer_types is {kinds!r}; deepseek_v32 runs its indexer in every layer ('full')")
        for name, every in (("index_topk_pattern", None), ("index_topk_freq", 1)):
            if cfg.get(name) not in (None, every):
                c.fail(f"{name} is {cfg[name]!r}; deepseek_v32 runs its indexer in every layer (layers that reuse "
                       "another's choice are GLM-5's: model_type glm_moe_dsa)")
        return
    _check_indexer_types(c, layers)


def _check_indexer_types(c: _Checker, layers: int) -> None:
    """GLM-5: the entries dsa_indexer_types reads, and a first layer that runs its own indexer."""
    cfg = c.cfg
    if cfg.get("indexer_types") is not None:
        name, kinds = "indexer_types", cfg["indexer_types"]
        ok = isinstance(kinds, list) and all(k in ("full", "shared") for k in kinds)
    elif cfg.get("index_topk_pattern") is not None:
        name, kinds = "index_topk_pattern", cfg["index_topk_pattern"]
        ok = (isinstance(kinds, str) and set(kinds) <= {"F", "S"}) or (
            isinstance(kinds, list) and all(k in ("full", "shared") for k in kinds))
    else:
        for entry in ("index_topk_freq", "index_skip_topk_offset"):
            v = cfg.get(entry)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                c.fail(f"{entry} is {v!r}; it must be an integer")
        name, kinds, ok = None, None, True
    if not ok or (kinds is not None and len(kinds) < layers):
        c.fail(f"{name} is {kinds!r}; it must give each of the {layers} layers (num_hidden_layers) 'full' or "
               f"'shared'{' (F or S)' if name == 'index_topk_pattern' else ''}")
    if dsa_indexer_types(cfg)[0] != "full":
        c.fail(f"{name or 'index_topk_freq / index_skip_topk_offset'} makes layer 0 'shared'; a shared layer reuses "
               "the previous layer's indexer, so the first layer must run its own ('full')")


def _check_rotary(c: _Checker, head_dim: int) -> None:
    """Partial RoPE (ModelConfig.rope_dim): an even number of dims between 2 and the head size."""
    name, value = _rotary_entry(c.cfg)
    if name is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        c.fail(f"{name} is {value!r}; it must be a number > 0")
    dim = c.cfg.rope_dim
    if not 2 <= dim <= head_dim or dim % 2:
        c.fail(f"{name} is {value!r}: RoPE would turn {dim} of the {head_dim} dims of each head; it needs an even "
               f"number between 2 and {head_dim}")


def _check_minimax(c: _Checker, n_experts: int) -> None:
    """What hetmoe's minimax_m2 (transformers' MiniMaxM2) runs: every layer full attention over the whole context
    with q/k norm over all heads, sigmoid routing without expert groups or scaling, no shared expert. Entries
    transformers ignores are refused where they would ask for something else, rather than run as if absent."""
    cfg = c.cfg
    if n_experts < 2:
        c.fail(f"{_expert_field(cfg)} is {n_experts}; MiniMax-M2's router needs at least 2 routed experts")
    for name, want in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"), ("use_qk_norm", True),
                       ("routed_scaling_factor", 1.0)):
        if cfg.get(name) is not None and cfg[name] != want:
            c.fail(f"{name} is {cfg[name]!r}; hetmoe's minimax_m2 runs MiniMax-M2's {name} {want!r} only")
    groups = cfg.get("num_expert_group")
    if cfg.get("use_grouped_topk") and groups not in (None, 1):
        c.fail(f"num_expert_group is {groups!r} (use_grouped_topk); hetmoe's minimax_m2 routes without expert groups")
    shared = cfg.get("shared_intermediate_size") or 0
    if shared:
        c.fail(f"shared_intermediate_size is {shared!r}; hetmoe's minimax_m2 has no shared expert")
    types = cfg.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(t != 1 for t in types)):
        c.fail("attn_type_list lists layers other than full attention (1): hetmoe's minimax_m2 has no linear "
               "(lightning) attention layers")
    for name in ("sliding_window", "attn_window_size"):
        window = cfg.get(name)
        windows = window if isinstance(window, list) else [window]
        if any(w is not None and not (isinstance(w, (int, float)) and w <= 0) for w in windows):
            c.fail(f"{name} is {window!r}; hetmoe's minimax_m2 attends over the whole context (no sliding window)")


def _check_gpt_oss(c: _Checker) -> None:
    """gpt-oss: which layers slide (layer_types) and over how many positions, the clamped SwiGLU's alpha and limit,
    biases on or off, and RoPE default or YaRN."""
    cfg, layers = c.cfg, c.cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
                              or any(k not in GPT_OSS_LAYERS for k in kinds)):
        c.fail(f"layer_types is {kinds!r}; it must list 'sliding_attention' or 'full_attention' for each of the "
               f"{layers} layers (num_hidden_layers)")
    if "sliding_attention" in gpt_oss_layer_types(cfg):
        c.int("sliding_window")
    for name in ("swiglu_alpha", "swiglu_limit"):
        c.number(name, cfg[name])
    if not isinstance(cfg["attention_bias"], bool):
        c.fail(f"attention_bias is {cfg['attention_bias']!r}; it must be true or false")
    rope = gpt_oss_rope(cfg)
    if rope["rope_type"] not in ("default", "yarn"):
        c.fail(f"the RoPE's rope_type is {rope['rope_type']!r}; hetmoe's gpt_oss runs default or yarn RoPE")
    if rope["rope_type"] == "yarn" and rope.get("original_max_position_embeddings") is None:
        c.fail("the RoPE is yarn without original_max_position_embeddings")


def _expert_field(cfg: ModelConfig) -> str:
    return next(n for n in _EXPERTS[cfg["model_type"]] if cfg.get(n) is not None)


def _n_experts(c: _Checker) -> int:
    names = _EXPERTS[c.model_type]
    present = [n for n in names if c.cfg.get(n) is not None]
    if not present:
        raise ConfigError(f"{c.source} does not describe a {c.model_type} model: it has none of {', '.join(names)}")
    return c.int(present[0], minimum=1 if c.model_type in ("mixtral", *PARTIAL_ROPE) else 0)


def _check_groups(c: _Checker, n_experts: int, k: int) -> None:
    """DeepSeek's group-limited routing: V3 always (n_group default 1, a group's score is its best two experts),
    V2 with topk_method group_limited_greedy."""
    cfg = c.cfg
    v3 = c.model_type != "deepseek_v2"
    method = cfg.get("topk_method", "greedy")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        c.fail(f"topk_method is {method!r}; DeepSeek-V2 routes with greedy or group_limited_greedy")
    if not v3 and method == "greedy":
        return
    n_group = c.int("n_group", default=1) if not v3 else (cfg.get("n_group") or 1)
    topk_group = c.int("topk_group", default=1) if not v3 else (cfg.get("topk_group") or 1)
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            c.fail(f"{name} is {v!r}; it must be an integer >= 1")
    if n_experts % n_group:
        c.fail(f"n_group is {n_group}; it must divide the {n_experts} routed experts ({_expert_field(cfg)})")
    per_group = n_experts // n_group
    if v3 and per_group < 2:
        c.fail(f"n_group is {n_group}: groups of {per_group} expert(s); a group is scored by its best two, so "
               f"n_group can be at most {n_experts // 2}")
    if topk_group > n_group:
        c.fail(f"topk_group is {topk_group}; it must be between 1 and n_group ({n_group})")
    if k > topk_group * per_group:
        c.fail(f"num_experts_per_tok is {k}, but topk_group {topk_group} groups of {per_group} experts offer only "
               f"{topk_group * per_group}")


def _check_rope_scaling(c: _Checker, deepseek: bool) -> None:
    raw = c.cfg.get("rope_parameters") or c.cfg.get("rope_scaling")
    if raw is None:
        return
    field_name = "rope_parameters" if c.cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(raw, dict):
        c.fail(f"{field_name} is {raw!r}; it must be an object")
    scaling = c.cfg.rope_scaling_params
    if not scaling:
        return
    factor = scaling.get("factor")
    if factor is not None:
        c.number(f"{field_name}.factor", factor)
    original = scaling.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        c.fail(f"{field_name}.original_max_position_embeddings is {original!r}; it must be an integer >= 1")
    if deepseek:
        if scaling["rope_type"] != "yarn":
            c.fail(f"{field_name} has rope_type {scaling['rope_type']!r}; DeepSeek models run default or yarn RoPE")
        if original is None:
            c.fail(f"{field_name} (yarn) has no original_max_position_embeddings")


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
    _EXPERTS[_t] = ("n_routed_experts", "num_local_experts")
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


def _check_glm5_next(c: _Checker) -> None:
    """GLM-5.3-Flash: its sizes; KDA layers (heads, head size, convolution, the forget gate's lower bound) and NoPE
    MLA layers (q LoRA, no RoPE dims, as many KV heads as query heads) per layer_types; the pooled DSA indexer (pool
    size dividing index_topk, the incomplete tail always attended) and which MLA layers reuse the previous one's
    choice; dense or MoE per layer, sigmoid group-limited routing, the clamped SwiGLU, the hyper-connections. Entries
    Transformers' Glm5Next classes run otherwise, or not at all, are refused by name."""
    cfg = c.cfg = glm5_next_config(c.cfg)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                 "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads",
                 "index_kpool", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult",
                 "hc_sinkhorn_iters", "max_position_embeddings"):
        c.int(name)
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    for name in ("rms_norm_eps", "swiglu_limit", "routed_scaling_factor"):
        c.number(name, cfg.get(name))
    c.number("hc_eps", cfg.get("hc_eps"), positive=False)
    if cfg.get("num_key_value_heads", heads) != heads:
        c.fail(f"num_key_value_heads is {cfg['num_key_value_heads']!r}; GLM-5.3-Flash's MLA has as many key/value "
               f"heads as query heads ({heads}, num_attention_heads)")
    if cfg.get("qk_rope_head_dim") != 0:
        c.fail(f"qk_rope_head_dim is {cfg.get('qk_rope_head_dim')!r}; GLM-5.3-Flash's MLA layers use no positional "
               "encoding (NoPE: 0 RoPE dims)")
    if cfg["index_topk"] % cfg["index_kpool"]:
        c.fail(f"index_topk is {cfg['index_topk']}; the indexer chooses whole pools of index_kpool "
               f"({cfg['index_kpool']}) positions, so it must be a multiple of that")
    if cfg.get("index_kpool_always_select_tail") is not True:
        c.fail(f"index_kpool_always_select_tail is {cfg.get('index_kpool_always_select_tail')!r}; hetmoe runs "
               "GLM-5.3-Flash with the incomplete last pool always attended (true): without it the first tokens "
               "attend to nothing")
    bound = cfg.get("linear_lower_bound")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
        c.fail(f"linear_lower_bound is {bound!r}; it must be a number (or null: the unbounded softplus gate)")
    if cfg.get("hidden_act") != "silu":
        c.fail(f"hidden_act is {cfg.get('hidden_act')!r}; GLM-5.3-Flash runs SiLU convolutions and SwiGLU MLPs")
    for name in ("norm_topk_prob", "attention_bias"):
        if not isinstance(cfg.get(name), bool):
            c.fail(f"{name} is {cfg.get(name)!r}; it must be true or false")
    kinds = cfg["layer_types"]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in GLM5_NEXT_ATTENTION for k in kinds):
        c.fail(f"layer_types is {cfg.get('layer_types')!r}; it must give each of the {layers} layers "
               f"(num_hidden_layers) 'linear_attention' (KDA) or 'indexed_attention' (MLA with the DSA indexer)")
    mlp = cfg["mlp_layer_types"]
    if not isinstance(mlp, list) or len(mlp) != layers or any(k not in ("dense", "sparse") for k in mlp):
        c.fail(f"mlp_layer_types is {mlp!r}; it must list 'dense' or 'sparse' for each of the {layers} layers "
               "(num_hidden_layers)")
    if "dense" in mlp:
        c.int("intermediate_size")
    index = cfg.get("indexer_types")
    if not isinstance(index, list) or len(index) < layers or any(k not in ("full", "shared") for k in index):
        source = next((n for n in ("indexer_types", "index_topk_pattern") if c.cfg.get(n) is not None),
                      "index_topk_freq / index_skip_topk_offset")
        c.fail(f"{source} is {cfg.get(source)!r}; it must give each of the {layers} layers (num_hidden_layers) "
               "'full' or 'shared' (F or S)")
    for i, kind in enumerate(kinds):
        if kind == "indexed_attention" and index[i] == "shared" and not (
                i > 0 and kinds[i - 1] == "indexed_attention" and index[i - 1] == "full"):
            c.fail(f"indexer_types makes layer {i} 'shared', but layer {i - 1} is not an indexed-attention layer that "
                   "runs its own indexer ('full'): a shared layer reuses the top-k of the layer just before it")
    n_experts = _n_experts(c)
    if "sparse" in mlp:
        if n_experts < 1:
            c.fail(f"mlp_layer_types lists MoE ('sparse') layers, but {_expert_field(cfg)} is {n_experts}")
        c.int("moe_intermediate_size")
        c.int("n_shared_experts", minimum=0, default=0)
        k = cfg.get("num_experts_per_tok")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
            c.fail(f"num_experts_per_tok is {k!r}; with {n_experts} routed experts ({_expert_field(cfg)}) it must be "
                   f"between 1 and {n_experts}")
        _check_groups(c, n_experts, k)
