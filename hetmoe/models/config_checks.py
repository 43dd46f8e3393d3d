"""The checks that a model's ``config.json`` describes a model the files of hetmoe/models/ can build
(``check_config``), made before any weight is read: sizes that are missing or not positive, a top-k outside
1..experts, DeepSeek expert groups that do not divide the experts, head sizes that do not divide, RoPE and attention
settings the model cannot build. Each refusal is a ConfigError naming the field, its value and the file.
"""

from __future__ import annotations

from typing import Optional

from hetmoe.models.config import (
    EXPERT_COUNT_FIELDS,
    GLM5_NEXT,
    GLM5_NEXT_ATTENTION,
    GPT_OSS_LAYERS,
    INDEXER_ROPE_INTERLEAVE,
    LINEAR_ATTENTION,
    M3_ATTENTION,
    M3_MLP,
    PARTIAL_ROPE,
    SPARSE_ATTENTION,
    V4_ATTENTION,
    V4_MLP,
    ConfigError,
    ModelConfig,
    deepseek_v4_compress_rates,
    deepseek_v4_layer_types,
    deepseek_v4_mlp_layer_types,
    deepseek_v4_rope,
    dsa_indexer_types,
    glm5_next_config,
    gpt_oss_layer_types,
    gpt_oss_rope,
    minimax_m3_config,
    minimax_m3_rope_dim,
    minimax_m3_rotary,
    rotary_entry,
)


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
    if c.model_type not in EXPERT_COUNT_FIELDS:
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
    name, value = rotary_entry(c.cfg)
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
    return next(n for n in EXPERT_COUNT_FIELDS[cfg["model_type"]] if cfg.get(n) is not None)


def _n_experts(c: _Checker) -> int:
    names = EXPERT_COUNT_FIELDS[c.model_type]
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
