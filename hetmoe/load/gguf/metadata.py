"""A GGUF file's metadata as a config.json (the file itself is read by hetmoe/load/gguf/reader.py ``open_gguf``).

``config_from_gguf(f)`` is the config.json hetmoe's models take (Hugging Face keys), checked with
``hetmoe.models.check_config``. The keys mean what llama.cpp's convert_hf_to_gguf.py writes and its loader
(src/llama-model.cpp, src/models/*.cpp) reads; ``A.`` is the architecture prefix (``qwen3moe.``):

    A.block_count, embedding_length, context_length -> num_hidden_layers, hidden_size, max_position_embeddings
    A.attention.head_count, head_count_kv (absent: = heads, as llama.cpp) -> num_attention_heads, num_key_value_heads
    A.attention.layer_norm_rms_epsilon -> rms_norm_eps; A.rope.freq_base (absent: llama.cpp's 10000) -> rope_theta
    A.vocab_size (absent: the token list's length, then token_embd's rows) -> vocab_size
    A.feed_forward_length -> intermediate_size (dense FFN); A.attention.key_length -> head_dim (GQA models)
    A.expert_count, expert_used_count -> the expert count, num_experts_per_tok
    A.expert_feed_forward_length (absent: the ffn_gate_exps shape) -> moe_intermediate_size
    A.rope.scaling.type/factor/original_context_length (+ yarn_beta_fast/slow...) -> rope_scaling
    tokenizer.ggml.bos_token_id / eos_token_id -> bos_token_id / eos_token_id; no output.weight -> tie_word_embeddings

* qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe: every layer MoE (llama.cpp builds no dense layer there);
  norm_topk_prob true for qwen3moe, false for qwen2moe (fixed in llama.cpp's graphs; no key); attention biases when
  attn_q.bias exists; qwen2moe's shared_expert_intermediate_size from A.expert_shared_feed_forward_length (absent:
  the ffn_up_shexp shape), its sigmoid gate is the ffn_gate_inp_shexp tensor.
* llama with A.expert_count > 0 -> mixtral (a dense llama is refused); A.rope.dimension_count must be the head size.
* deepseek2 -> deepseek_v3 when A.expert_gating_func is 2 (sigmoid: V3 routing with the exp_probs_b correction bias,
  topk_method noaux_tc, rope_interleave), deepseek_v2 when 1 (softmax) or absent (as llama.cpp reads GGUFs from
  before the key); V2 routes group_limited_greedy when A.expert_group_count > 1, else greedy.
  A.leading_dense_block_count -> first_k_dense_replace; expert_shared_count -> n_shared_experts;
  expert_group_count / expert_group_used_count (absent: 1) -> n_group / topk_group; expert_weights_scale (absent:
  1.0) -> routed_scaling_factor; expert_weights_norm (absent: false, the converter writes only true) ->
  norm_topk_prob; attention.q_lora_rank (absent: none, V2-Lite) / kv_lora_rank; rope.dimension_count ->
  qk_rope_head_dim. MLA-era files hold the per-head sizes in attention.key_length_mla / value_length_mla
  (key_length / value_length are then the compressed kv_lora_rank + rope / kv_lora_rank, head_count_kv 1); older
  files in key_length / value_length: qk_nope_head_dim = key length - rope, v_head_dim = value length.
  num_key_value_heads = heads, as in Hugging Face's DeepSeek configs. YaRN: the converter writes
  rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim, llama.cpp divides the 0.1 out
  ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]) and takes mscale = mscale_all_dim for deepseek2: both are multiplier / 0.1
  (so for deepseek32 and glm-dsa, whose converter classes derive from DeepSeek-V2's).
  (Elsewhere the multiplier is mscale_all_dim itself, with mscale 1, as llama-context.cpp reads it.)

* glm4moe -> glm4_moe: DeepSeek-V3's routing (sigmoid + exp_probs_b, groups) under GQA with partial RoPE:
  rope.dimension_count / key_length -> partial_rotary_factor; expert_shared_count, leading_dense_block_count
  (absent: 0), expert_weights_scale (1.0), expert_weights_norm (false), expert_group_count / used (1) as for
  deepseek2; expert_gating_func absent or 2 (llama.cpp's default for glm4moe is sigmoid); attention_bias when
  attn_q.bias exists, use_qk_norm when attn_q_norm does. nextn_predict_layers: the MTP blocks counted in block_count
  (their tensors are skipped, names.py).
* minimax-m2 -> minimax_m2: expert_feed_forward_length -> intermediate_size (the experts'), rope.dimension_count ->
  rotary_dim; sigmoid routing (expert_gating_func absent or 2) with the exp_probs_b bias when the file has it,
  top-k always renormalised (fixed in llama.cpp's graph).
* qwen3next -> qwen3_next, qwen35moe -> qwen3_5_moe_text: softmax top-k, renormalised (fixed in llama.cpp's graphs),
  shared expert of expert_shared_feed_forward_length (absent: the ffn_up_shexp shape); rope.dimension_count /
  key_length -> partial_rotary_factor (rope.dimension_sections, Qwen3.5's multimodal RoPE, turns text positions as
  the one-axis RoPE does); the Gated DeltaNet sizes from ssm.conv_kernel -> linear_conv_kernel_dim, ssm.state_size
  -> linear_key_head_dim, ssm.group_count -> linear_num_key_heads, ssm.time_step_rank -> linear_num_value_heads,
  ssm.inner_size / time_step_rank -> linear_value_head_dim; attention.recurrent_layers (per layer) -> layer_types,
  else full_attention_interval (llama.cpp's default 4).
* glm-dsa -> glm_moe_dsa, deepseek32 -> deepseek_v32: deepseek2's MLA and V3 routing (gating 2; glm-dsa's default
  when absent, deepseek32 requires the key) plus the indexer: attention.indexer.head_count / key_length / top_k ->
  index_n_heads / index_head_dim / index_topk; glm-dsa's attention.indexer.types (per layer, true = "full") ->
  indexer_types, absent: every layer full below a 1M context (GLM-5, 5.1), else GLM-5.2's layout (llama.cpp).
* gpt-oss -> gpt_oss (llama.cpp's LLM_ARCH_OPENAI_MOE): expert_feed_forward_length -> intermediate_size (the
  experts'), attention.sliding_window -> sliding_window (required, as llama.cpp reads it);
  attention.sliding_window_pattern -> layer_types as llama.cpp's load_swa_pattern reads it: a per-layer list (true:
  sliding), or n (absent: 2), layer i sliding when i % n < n - 1 (0: every layer); softmax over the top-k logits
  (llama.cpp's SOFTMAX_WEIGHT gating, fixed in its graph); attention_bias when attn_q.bias exists. The clamped
  SwiGLU's swiglu_alpha 1.702 and swiglu_limit 7.0 have no key: llama.cpp's graph hard-codes them (llama-graph.cpp
  LLM_FFN_SWIGLU_OAI_MOE), and so does this mapping. YaRN is read as Transformers reads gpt-oss's own config.json
  (GptOssConfig and every published gpt-oss checkpoint): ``truncate`` false, a key the converter does not write
  (llama.cpp itself rounds the correction range, which Transformers does not for gpt-oss).
* minimax-m3 -> minimax_m3_vl (its language model, text only), laid out as llama.cpp builds it: the first
  leading_dense_block_count layers dense (feed_forward_length -> dense_intermediate_size) with full attention, the
  others MoE with block-sparse attention (layer_types, mlp_layer_types); expert_feed_forward_length ->
  intermediate_size (the experts'), the shared expert's size from ffn_up_shexp (llama.cpp: the experts' size x
  expert_shared_count); rope.dimension_count -> rotary_dim and partial_rotary_factor; attention.indexer.head_count /
  key_length / top_k / block_size / local_blocks -> index_n_heads / index_head_dim / index_topk_blocks /
  index_block_size / index_local_blocks; expert_gating_func required and 2 (sigmoid), expert_weights_norm true,
  expert_weights_scale (absent: 1.0) -> routed_scaling_factor; swiglu_alpha 1.702 / swiglu_limit 7.0 as llama.cpp's
  graph hard-codes them. Every norm is stored as 1 + w (names.py NORM_OFFSET).
* deepseek4 -> deepseek_v4: attention.compress_ratios (per layer: 0 sliding window only, 4 CSA with the indexer,
  128 HCA; llama.cpp reads no other) -> layer_types, hash_layer_count -> mlp_layer_types (the first ones
  "hash_moe"), expert_gating_func required and 4 (sqrtsoftplus, the one llama.cpp's loader takes);
  attention.key_length -> head_dim, rope.dimension_count / key_length -> partial_rotary_factor, rope.freq_base and
  attention.compress_rope_freq_base -> rope_theta and compress_rope_theta (YaRN, for the compressed layers, from
  rope.scaling.*: factor, original context, beta_fast / slow; the attention factor 1 as llama.cpp and Transformers
  take it); attention.q_lora_rank, sliding_window, output_group_count / output_lora_rank -> q_lora_rank,
  sliding_window, o_groups / o_lora_rank; the indexer's head_count / key_length / top_k; hyper_connection.count /
  sinkhorn_iterations / epsilon -> hc_mult / hc_sinkhorn_iters / hc_eps; swiglu_clamp_exp and swiglu_clamp_shexp
  (one value or one per layer; absent shexp: = exp) -> swiglu_limit, which must be one number for every layer and
  both; expert_shared_count, expert_weights_scale, expert_weights_norm -> n_shared_experts, routed_scaling_factor,
  norm_topk_prob. nextn_predict_layers: the MTP blocks counted in block_count (and compress_ratios), skipped.

Anything hetmoe needs that the file lacks (and llama.cpp has no default for) raises GGUFError naming the file, the
architecture and the key.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Optional

from hetmoe.load.gguf.reader import GGUFError, GGUFFile

# ------------------------------------------------------------------------------------------------ config.json

ARCHITECTURES = ("qwen3moe", "qwen2moe", "deepseek2", "llama", "glm4moe", "minimax-m2", "qwen3next", "qwen35moe",
                 "glm-dsa", "deepseek32", "gpt-oss", "minimax-m3",
                 "deepseek4")  # the GGUF architectures config_from_gguf maps
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


class _Keys:
    """The architecture's keys of one file, each refused with the file, the architecture and the key named."""

    def __init__(self, f: GGUFFile):
        self.f, self.arch = f, f.arch

    def fail(self, what: str):
        raise GGUFError(f"{self.f.path}: the {self.arch} GGUF {what}")

    def get(self, name: str, hf: str, kind=int, default: Any = ..., prefix: bool = True) -> Any:
        key = f"{self.arch}.{name}" if prefix else name
        value = self.f.metadata.get(key)
        if value is None:
            if default is ...:
                self.fail(f"has no {key} (needed for config.json {hf})")
            return default
        if isinstance(value, list):
            self.fail(f"has a per-layer list for {key} ({hf}); hetmoe models take one value for every layer")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {bool: isinstance(value, bool), str: isinstance(value, str), float: number,
              int: number and isinstance(value, int)}[kind]
        if not ok:
            self.fail(f"has {key} = {value!r}, not {_KIND_NAMES[kind]} ({hf})")
        return float(value) if kind is float else value

    def layers(self, name: str, hf: str, n: int) -> Optional[list]:
        """A per-layer list (A.name) of ``n`` entries, or None when absent."""
        key = f"{self.arch}.{name}"
        value = self.f.metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or len(value) < n:
            self.fail(f"has {key} = {value!r}, not a list of one entry per layer ({n}) ({hf})")
        return value[:n]

    def sigmoid_gating(self, default: bool) -> None:
        """expert_gating_func must be 2 (sigmoid), or absent where llama.cpp defaults to sigmoid (``default``)."""
        gating = self.get("expert_gating_func", "scoring_func", default=2 if default else ...)
        if gating != 2:
            self.fail(f"has expert_gating_func {gating}; hetmoe's {self.arch} runs 2 (sigmoid) only")

    def shape(self, name: str) -> Optional[tuple]:
        t = self.f.tensors.get(name)
        return t.shape if t is not None else None


def _vocab_size(k: _Keys) -> int:
    size = k.get("vocab_size", "vocab_size", default=None)
    if size is None:
        tokens = k.f.metadata.get("tokenizer.ggml.tokens")
        size = len(tokens) if tokens else None
    if size is None and k.shape("token_embd.weight"):
        size = k.shape("token_embd.weight")[0]
    if size is None:
        k.fail(f"has no {k.arch}.vocab_size, no tokenizer.ggml.tokens and no token_embd.weight (vocab_size)")
    return size


def _rope_scaling(k: _Keys) -> Optional[dict]:
    kind = k.get("rope.scaling.type", "rope_scaling", kind=str, default=None)
    if kind in (None, "none"):
        return None
    factor = k.get("rope.scaling.factor", "rope_scaling.factor", kind=float)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        k.fail(f"has rope.scaling.type {kind!r}; hetmoe reads none, linear and yarn")
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings":
           k.get("rope.scaling.original_context_length", "rope_scaling.original_max_position_embeddings")}
    for name, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                     ("yarn_attn_factor", "attention_factor"), ("yarn_ext_factor", "extrapolation_factor")):
        value = k.get(f"rope.scaling.{name}", f"rope_scaling.{hf}", kind=float, default=None)
        if value is not None:
            out[hf] = value
    log_mul = k.get("rope.scaling.yarn_log_multiplier", "rope_scaling.mscale_all_dim", kind=float, default=None)
    if log_mul is not None and k.arch in ("deepseek2", "deepseek32", "glm-dsa"):  # DeepseekV2Model's subclasses
        out["mscale"] = out["mscale_all_dim"] = float(Decimal(repr(log_mul)) / Decimal("0.1"))
    elif log_mul is not None:
        out["mscale"], out["mscale_all_dim"] = 1.0, log_mul
    return out


def _experts(k: _Keys, cfg: dict, field: str, inter_tensor: str) -> None:
    n = k.get("expert_count", field, default=0)
    if not n:
        k.fail(f"has no experts ({k.arch}.expert_count is {n}); hetmoe runs Mixture-of-Experts models only")
    cfg[field] = n
    cfg["num_experts_per_tok"] = k.get("expert_used_count", "num_experts_per_tok")
    if k.arch != "llama":
        cfg["moe_intermediate_size"] = _size(k, "expert_feed_forward_length", "moe_intermediate_size", inter_tensor, 1)


def _size(k: _Keys, name: str, hf: str, tensor: str, dim: int) -> int:
    """A size from its key, else from a tensor's shape (files written before the key existed)."""
    value = k.get(name, hf, default=None)
    if value is None and k.shape(tensor):
        value = k.shape(tensor)[dim]
    if value is None:
        k.fail(f"has no {k.arch}.{name} and no {tensor} tensor ({hf})")
    return value


def _gqa(k: _Keys, cfg: dict) -> None:
    head_dim = k.get("attention.key_length", "head_dim", default=None)
    value_dim = k.get("attention.value_length", "head_dim", default=head_dim)
    if head_dim is not None and value_dim != head_dim:
        k.fail(f"has key_length {head_dim} but value_length {value_dim}; hetmoe's attention needs them equal")
    if head_dim is not None:
        cfg["head_dim"] = head_dim


def _qwen(k: _Keys, cfg: dict) -> None:
    qwen2 = k.arch == "qwen2moe"
    cfg.update(model_type="qwen2_moe" if qwen2 else "qwen3_moe",
               architectures=["Qwen2MoeForCausalLM" if qwen2 else "Qwen3MoeForCausalLM"],
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=not qwen2, use_sliding_window=False,
               sliding_window=None)
    _gqa(k, cfg)
    _experts(k, cfg, "num_experts", "blk.0.ffn_gate_exps.weight")
    bias = "blk.0.attn_q.bias" in k.f.tensors
    if qwen2:
        cfg["qkv_bias"] = bias
        cfg["shared_expert_intermediate_size"] = _size(
            k, "expert_shared_feed_forward_length", "shared_expert_intermediate_size", "blk.0.ffn_up_shexp.weight", 0)
    else:
        cfg["attention_bias"] = bias


def _mixtral(k: _Keys, cfg: dict) -> None:
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=None)
    _experts(k, cfg, "num_local_experts", "")
    _gqa(k, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rot = k.get("rope.dimension_count", "head_dim", default=head_dim)
    if rot != head_dim:
        k.fail(f"rotates {rot} of the {head_dim} dimensions of a head (llama.rope.dimension_count); hetmoe's Mixtral "
               "rotates all of them")
    if "rope_freqs.weight" in k.f.tensors:
        k.fail("has rope_freqs.weight (Llama-3 RoPE frequency factors), which hetmoe's Mixtral does not apply")
    if k.get("attention.sliding_window", "sliding_window", default=None):
        k.fail("uses sliding-window attention (llama.attention.sliding_window), which hetmoe's Mixtral does not run")


def _deepseek2(k: _Keys, cfg: dict, gating: Optional[int] = None) -> None:
    gating = gating or k.get("expert_gating_func", "scoring_func", default=1)
    if gating not in (1, 2):
        k.fail(f"has expert_gating_func {gating}; hetmoe runs 1 (softmax, DeepSeek-V2) and 2 (sigmoid, V3)")
    v3 = gating == 2
    if not v3 and any(name.endswith(".exp_probs_b.bias") for name in k.f.tensors):
        k.fail("has exp_probs_b (expert selection bias) tensors but softmax gating; hetmoe's DeepSeek-V2 has no bias")
    heads = cfg["num_attention_heads"]
    rope = k.get("rope.dimension_count", "qk_rope_head_dim")
    mla = f"{k.arch}.attention.key_length_mla" in k.f.metadata
    key_len = k.get("attention.key_length_mla" if mla else "attention.key_length", "qk_nope_head_dim")
    q_lora = k.get("attention.q_lora_rank", "q_lora_rank", default=None)
    if q_lora is None and "blk.0.attn_q_a.weight" in k.f.tensors:
        k.fail("has attn_q_a tensors but no deepseek2.attention.q_lora_rank (q_lora_rank)")
    n_group = k.get("expert_group_count", "n_group", default=1)
    cfg.update(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        num_key_value_heads=heads,
        first_k_dense_replace=k.get("leading_dense_block_count", "first_k_dense_replace"),
        q_lora_rank=q_lora, kv_lora_rank=k.get("attention.kv_lora_rank", "kv_lora_rank"),
        qk_rope_head_dim=rope, qk_nope_head_dim=key_len - rope, head_dim=rope,  # head_dim: as transformers sets it
        attention_bias="blk.0.attn_kv_a_mqa.bias" in k.f.tensors,
        v_head_dim=k.get("attention.value_length_mla" if mla else "attention.value_length", "v_head_dim"),
        n_shared_experts=k.get("expert_shared_count", "n_shared_experts"),
        n_group=n_group, topk_group=k.get("expert_group_used_count", "topk_group", default=1),
        routed_scaling_factor=k.get("expert_weights_scale", "routed_scaling_factor", kind=float, default=1.0),
        norm_topk_prob=k.get("expert_weights_norm", "norm_topk_prob", kind=bool, default=False),
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
    )
    if v3:
        cfg["rope_interleave"] = True  # llama.cpp rotates interleaved pairs (GGML_ROPE_TYPE_NORM) in deepseek2
    _nextn(k, cfg)
    _experts(k, cfg, "n_routed_experts", f"blk.{cfg['first_k_dense_replace']}.ffn_gate_exps.weight")


def _nextn(k: _Keys, cfg: dict) -> None:
    """The multi-token-prediction blocks counted in block_count: hetmoe runs the main layers only."""
    nextn = k.get("nextn_predict_layers", "num_nextn_predict_layers", default=0)
    if nextn:
        cfg["num_hidden_layers"] -= nextn
        cfg["num_nextn_predict_layers"] = nextn


def _partial_rope(k: _Keys, cfg: dict) -> None:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["partial_rotary_factor"] = k.get("rope.dimension_count", "partial_rotary_factor", default=head_dim) / head_dim


def _glm4moe(k: _Keys, cfg: dict) -> None:
    k.sigmoid_gating(default=True)
    cfg.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
               first_k_dense_replace=k.get("leading_dense_block_count", "first_k_dense_replace", default=0),
               n_shared_experts=k.get("expert_shared_count", "n_shared_experts"),
               n_group=k.get("expert_group_count", "n_group", default=1),
               topk_group=k.get("expert_group_used_count", "topk_group", default=1),
               routed_scaling_factor=k.get("expert_weights_scale", "routed_scaling_factor", kind=float, default=1.0),
               norm_topk_prob=k.get("expert_weights_norm", "norm_topk_prob", kind=bool, default=False),
               attention_bias="blk.0.attn_q.bias" in k.f.tensors,
               use_qk_norm="blk.0.attn_q_norm.weight" in k.f.tensors)
    _gqa(k, cfg)
    _partial_rope(k, cfg)
    _nextn(k, cfg)
    _experts(k, cfg, "n_routed_experts", f"blk.{cfg['first_k_dense_replace']}.ffn_gate_exps.weight")


def _minimax_m2(k: _Keys, cfg: dict) -> None:
    k.sigmoid_gating(default=True)
    cfg.update(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], scoring_func="sigmoid",
               use_routing_bias=any(n.endswith(".exp_probs_b.bias") for n in k.f.tensors))
    _gqa(k, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["head_dim"] = head_dim
    cfg["rotary_dim"] = k.get("rope.dimension_count", "rotary_dim", default=head_dim)
    _experts(k, cfg, "num_local_experts", "blk.0.ffn_gate_exps.weight")
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # MiniMax's intermediate_size is the experts'


def _gated_deltanet(k: _Keys, cfg: dict) -> None:
    qwen35 = k.arch == "qwen35moe"
    cfg.update(model_type="qwen3_5_moe_text" if qwen35 else "qwen3_next",
               architectures=["Qwen3_5MoeForCausalLM" if qwen35 else "Qwen3NextForCausalLM"],
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
    _gqa(k, cfg)
    _partial_rope(k, cfg)
    _nextn(k, cfg)
    _experts(k, cfg, "num_experts", "blk.0.ffn_gate_exps.weight")
    cfg["shared_expert_intermediate_size"] = _size(
        k, "expert_shared_feed_forward_length", "shared_expert_intermediate_size", "blk.0.ffn_up_shexp.weight", 0)
    value_heads = k.get("ssm.time_step_rank", "linear_num_value_heads")
    inner = k.get("ssm.inner_size", "linear_value_head_dim")
    if not value_heads or inner % value_heads:
        k.fail(f"has ssm.inner_size {inner}, not a multiple of ssm.time_step_rank {value_heads} "
               "(linear_value_head_dim)")
    cfg.update(linear_conv_kernel_dim=k.get("ssm.conv_kernel", "linear_conv_kernel_dim"),
               linear_key_head_dim=k.get("ssm.state_size", "linear_key_head_dim"),
               linear_num_key_heads=k.get("ssm.group_count", "linear_num_key_heads"),
               linear_num_value_heads=value_heads, linear_value_head_dim=inner // value_heads)
    n = cfg["num_hidden_layers"]
    recurrent = k.layers("attention.recurrent_layers", "layer_types", n)
    if recurrent is None:
        interval = k.get("full_attention_interval", "full_attention_interval", default=4)
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent]


def _dsa(k: _Keys, cfg: dict) -> None:
    """deepseek2's MLA and V3 routing, plus DeepSeek Sparse Attention's indexer."""
    glm = k.arch == "glm-dsa"
    k.sigmoid_gating(default=glm)
    _deepseek2(k, cfg, gating=2)
    n = cfg["num_hidden_layers"]
    cfg.update(model_type="glm_moe_dsa" if glm else "deepseek_v32",
               architectures=["GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM"],
               index_n_heads=k.get("attention.indexer.head_count", "index_n_heads"),
               index_head_dim=k.get("attention.indexer.key_length", "index_head_dim"),
               index_topk=k.get("attention.indexer.top_k", "index_topk"))
    cfg.pop("rope_interleave", None)  # MLA turns interleaved pairs in both (not a config entry of theirs)
    if glm:
        full = k.layers("attention.indexer.types", "indexer_types", n)
        if full is None:  # llama.cpp: GLM-5 / 5.1 (contexts below 1M) index every layer; GLM-5.2 every 4th from 2
            full = [True] * n if cfg["max_position_embeddings"] < 1048576 else [i < 2 or i % 4 == 2 for i in range(n)]
        cfg["indexer_types"] = ["full" if x else "shared" for x in full]


def _gpt_oss(k: _Keys, cfg: dict) -> None:
    cfg.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], swiglu_alpha=1.702, swiglu_limit=7.0,
               attention_bias="blk.0.attn_q.bias" in k.f.tensors,
               sliding_window=k.get("attention.sliding_window", "sliding_window"))
    _gqa(k, cfg)
    _experts(k, cfg, "num_local_experts", "blk.0.ffn_gate_exps.weight")
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # gpt-oss's intermediate_size is the experts'
    n = cfg["num_hidden_layers"]
    key = f"{k.arch}.attention.sliding_window_pattern"
    pattern = k.f.metadata.get(key)
    if isinstance(pattern, list):
        sliding = k.layers("attention.sliding_window_pattern", "layer_types", n)
    else:
        period = k.get("attention.sliding_window_pattern", "layer_types", default=2)
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
        cfg["rope_scaling"]["truncate"] = False


def _minimax_m3(k: _Keys, cfg: dict) -> None:
    """MiniMax-M3's language model, laid out as llama.cpp builds it: leading_dense_block_count dense layers of full
    attention, then MoE layers of block-sparse attention (llama-model's minimax-m3: is_sparse = il >= n_dense)."""
    k.sigmoid_gating(default=False)  # llama.cpp requires the key for minimax-m3
    if not k.get("expert_weights_norm", "norm_topk_prob", kind=bool, default=False):
        k.fail("does not renormalise the chosen experts' weights (minimax-m3.expert_weights_norm is false or "
               "absent); hetmoe's MiniMax-M3 always does")
    _gqa(k, cfg)
    head_dim = cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rot = k.get("rope.dimension_count", "rotary_dim", default=head_dim)
    cfg.update(model_type="minimax_m3_vl", architectures=["MiniMaxM3SparseForConditionalGeneration"],
               scoring_func="sigmoid", use_routing_bias=True, rotary_dim=rot,
               rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                "partial_rotary_factor": rot / head_dim},
               routed_scaling_factor=k.get("expert_weights_scale", "routed_scaling_factor", kind=float, default=1.0),
               swiglu_alpha=1.702, swiglu_limit=7.0)  # no keys: llama.cpp's LLM_FFN_SWIGLU_OAI_MOE hard-codes them
    n = cfg["num_hidden_layers"]
    dense = k.get("leading_dense_block_count", "mlp_layer_types", default=0)
    if not 0 <= dense <= n:
        k.fail(f"has leading_dense_block_count {dense}, more than its {n} layers (mlp_layer_types)")
    cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n - dense)
    cfg["layer_types"] = ["full_attention"] * dense + ["minimax_m3_sparse"] * (n - dense)
    if dense == n:
        k.fail("has no MoE layer (leading_dense_block_count = block_count); hetmoe runs Mixture-of-Experts models only")
    if dense:
        cfg["dense_intermediate_size"] = _size(k, "feed_forward_length", "dense_intermediate_size",
                                               "blk.0.ffn_up.weight", 0)
    _experts(k, cfg, "num_local_experts", f"blk.{dense}.ffn_gate_exps.weight")
    cfg["intermediate_size"] = cfg.pop("moe_intermediate_size")  # MiniMax's intermediate_size is the experts'
    shared = k.shape(f"blk.{dense}.ffn_up_shexp.weight")  # llama.cpp: experts' size x expert_shared_count
    cfg["shared_intermediate_size"] = shared[0] if shared else cfg["intermediate_size"] * k.get(
        "expert_shared_count", "shared_intermediate_size")
    cfg.update(index_n_heads=k.get("attention.indexer.head_count", "index_n_heads"),
               index_head_dim=k.get("attention.indexer.key_length", "index_head_dim"),
               index_topk_blocks=k.get("attention.indexer.top_k", "index_topk_blocks"),
               index_block_size=k.get("attention.indexer.block_size", "index_block_size"),
               index_local_blocks=k.get("attention.indexer.local_blocks", "index_local_blocks"))


def _one_per_layer(k: _Keys, name: str, hf: str, n: int, default: Any = ...) -> float:
    """A key llama.cpp reads as one value or a per-layer list (get_key_or_arr), as one number for every layer."""
    value = k.f.metadata.get(f"{k.arch}.{name}")
    if isinstance(value, list):
        values = set(k.layers(name, hf, n))
        if len(values) != 1 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            k.fail(f"has {k.arch}.{name} = {value!r}; hetmoe's model takes one {hf} for every layer")
        return float(values.pop())
    return k.get(name, hf, kind=float, default=default)


def _deepseek4(k: _Keys, cfg: dict) -> None:
    """DeepSeek-V4 as llama.cpp's deepseek4 loader reads it: per-layer compress_ratios 0 (sliding window only), 4
    (CSA, with the indexer) or 128 (HCA); the first hash_layer_count layers hash-routed; sqrtsoftplus scoring."""
    gating = k.get("expert_gating_func", "scoring_func")
    if gating != 4:  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the one llama.cpp's deepseek4 loader accepts
        k.fail(f"has expert_gating_func {gating}; DeepSeek-V4 GGUFs score experts with 4 (sqrtsoftplus)")
    _gqa(k, cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    _nextn(k, cfg)
    n = cfg["num_hidden_layers"]
    ratios = k.layers("attention.compress_ratios", "compress_ratios", n)
    if ratios is None:
        k.fail("has no deepseek4.attention.compress_ratios (needed for config.json layer_types)")
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    if any(r not in kinds for r in ratios):
        k.fail(f"has attention.compress_ratios {ratios}; llama.cpp and hetmoe read 0, 4 and 128 only (layer_types)")
    n_hash = k.get("hash_layer_count", "mlp_layer_types")
    limit = _one_per_layer(k, "swiglu_clamp_exp", "swiglu_limit", n)
    if _one_per_layer(k, "swiglu_clamp_shexp", "swiglu_limit", n, default=limit) != limit:
        k.fail("clamps the shared expert (swiglu_clamp_shexp) otherwise than the routed ones (swiglu_clamp_exp); "
               "hetmoe's DeepSeek-V4 takes one swiglu_limit for both")
    cfg.update(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], head_dim=head_dim,
        scoring_func="sqrtsoftplus", hidden_act="silu", attention_bias=False, mlp_bias=False,
        q_lora_rank=k.get("attention.q_lora_rank", "q_lora_rank"),
        sliding_window=k.get("attention.sliding_window", "sliding_window"),
        n_shared_experts=k.get("expert_shared_count", "n_shared_experts"),
        routed_scaling_factor=k.get("expert_weights_scale", "routed_scaling_factor", kind=float),
        norm_topk_prob=k.get("expert_weights_norm", "norm_topk_prob", kind=bool),
        swiglu_limit=limit,
        index_n_heads=k.get("attention.indexer.head_count", "index_n_heads"),
        index_head_dim=k.get("attention.indexer.key_length", "index_head_dim"),
        index_topk=k.get("attention.indexer.top_k", "index_topk"),
        o_groups=k.get("attention.output_group_count", "o_groups"),
        o_lora_rank=k.get("attention.output_lora_rank", "o_lora_rank"),
        compress_rope_theta=k.get("attention.compress_rope_freq_base", "compress_rope_theta", kind=float),
        hc_mult=k.get("hyper_connection.count", "hc_mult"),
        hc_sinkhorn_iters=k.get("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters"),
        hc_eps=k.get("hyper_connection.epsilon", "hc_eps", kind=float),
        layer_types=[kinds[r] for r in ratios], compress_rates={kinds[4]: 4, kinds[128]: 128},
        mlp_layer_types=["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash),
        partial_rotary_factor=k.get("rope.dimension_count", "partial_rotary_factor", default=head_dim) / head_dim)
    cfg.setdefault("num_nextn_predict_layers", 0)
    scaling = cfg.pop("rope_scaling", None)
    if scaling is not None:  # the compressed layers' YaRN (llama.cpp cancels YaRN's attention factor: none, as V4)
        keep = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        cfg["rope_scaling"] = {key: v for key, v in scaling.items() if key in keep}
    _experts(k, cfg, "n_routed_experts", "blk.0.ffn_gate_exps.weight")


def config_from_gguf(f: GGUFFile) -> dict:
    """The Hugging Face config.json dict of the model in ``f`` (a GGUFFile from ``open_gguf``), checked with
    hetmoe's own config checks (ConfigError, a ValueError, names the file). See the module docstring."""
    from hetmoe.models.config import ModelConfig
    from hetmoe.models.config_checks import check_config

    if f.arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: GGUF architecture {f.arch!r} is not one hetmoe runs "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    k = _Keys(f)
    heads = k.get("attention.head_count", "num_attention_heads")
    cfg = {
        "vocab_size": _vocab_size(k),
        "hidden_size": k.get("embedding_length", "hidden_size"),
        "num_hidden_layers": k.get("block_count", "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": k.get("attention.head_count_kv", "num_key_value_heads", default=heads),
        "rms_norm_eps": k.get("attention.layer_norm_rms_epsilon", "rms_norm_eps", kind=float),
        "max_position_embeddings": k.get("context_length", "max_position_embeddings"),
        "rope_theta": k.get("rope.freq_base", "rope_theta", kind=float, default=10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }
    optional = {"intermediate_size": k.get("feed_forward_length", "intermediate_size", default=None),
                "rope_scaling": _rope_scaling(k),
                "bos_token_id": k.get("tokenizer.ggml.bos_token_id", "bos_token_id", default=None, prefix=False),
                "eos_token_id": k.get("tokenizer.ggml.eos_token_id", "eos_token_id", default=None, prefix=False)}
    cfg.update({key: value for key, value in optional.items() if value is not None})
    {"qwen3moe": _qwen, "qwen2moe": _qwen, "llama": _mixtral, "deepseek2": _deepseek2, "glm4moe": _glm4moe,
     "minimax-m2": _minimax_m2, "qwen3next": _gated_deltanet, "qwen35moe": _gated_deltanet, "glm-dsa": _dsa,
     "deepseek32": _dsa, "gpt-oss": _gpt_oss, "minimax-m3": _minimax_m3,
     "deepseek4": _deepseek4}[f.arch](k, cfg)
    check_config(ModelConfig(cfg), str(f.path))
    return cfg
