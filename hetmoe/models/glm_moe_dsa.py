"""GLM-5 / 5.1 / 5.2 (model_type "glm_moe_dsa"): DeepSeek-V3.2's architecture (models/deepseek_v32.py: MLA with
DeepSeek Sparse Attention, sigmoid group-limited routing with shared experts) under GLM's sizes, with two
differences, as Transformers' GlmMoeDsa classes have them:

* the indexer turns its rope dims as interleaved pairs (DeepSeek-V3.2's indexer: half-split);
* ``indexer_types`` (or, in config.json files without it, ``index_topk_pattern``, else ``index_topk_freq`` /
  ``index_skip_topk_offset``; models/config.py ``dsa_indexer_types``) says per layer whether it runs its own indexer
  ("full") or attends over the positions the previous indexer chose ("shared": no indexer weights, no indexer keys
  in the cache). GLM-5.2 runs its indexer in every 4th layer.

The multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is not built, so never read.
"""

from __future__ import annotations

from hetmoe.models.deepseek_v32 import (
    ROPE_BY_FORM,
    DeepseekV32Attention,
    DeepseekV32DecoderLayer,
    DeepseekV32ForCausalLM,
    DeepseekV32Model,
)


class GlmMoeDsaAttention(DeepseekV32Attention):
    indexer_rope = staticmethod(ROPE_BY_FORM["interleave"])


class GlmMoeDsaDecoderLayer(DeepseekV32DecoderLayer):
    attn_cls = GlmMoeDsaAttention


class GlmMoeDsaModel(DeepseekV32Model):
    layer_cls = GlmMoeDsaDecoderLayer


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    model_cls = GlmMoeDsaModel
