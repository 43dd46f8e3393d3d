"""What the memory plan needs of a model built on the meta device (``loader.build_meta``): its ``ModelShapes``."""

from __future__ import annotations

from hetmoe.load.dense import dense_linears
from hetmoe.models import context_limit
from hetmoe.moe import moe_layers
from hetmoe.plan.memory import ModelShapes


def model_shapes(model, cfg, expert_inter: int) -> ModelShapes:
    """What the plan needs of a model built on the meta device (``loader.build_meta``) and its config."""
    n_routed = sum(b.num_experts for _, b in moe_layers(model))
    cache = model.make_cache(1, 1, device="meta")
    limit, why = context_limit(cfg)
    states = cache.states
    return ModelShapes(
        hidden=cfg.hidden_size, vocab_size=cfg.vocab_size, n_routed=n_routed, expert_inter=expert_inter,
        dense_params=sum(p.numel() for p in model.parameters()),
        kv_elems_per_token=cache.elems_per_token, act_width=8 * cfg.hidden_size,
        max_position_embeddings=cfg.get("max_position_embeddings"), n_moe_layers=len(moe_layers(model)),
        top_k=cfg.get("num_experts_per_tok") or 1,
        q_per_kv=max(1, cfg.num_attention_heads // (cfg.get("num_key_value_heads") or cfg.num_attention_heads)),
        context_limit=limit, context_why=why, moe_names=tuple(n for n, _ in moe_layers(model)),
        dense_linears=tuple((n, k) for _, n, k in dense_linears(model)),
        conv_state_elems=states.conv[:, 0].numel() if states is not None else 0,
        recurrent_state_bytes=states.recurrent[:, 0].numel() * 4 if states is not None else 0,
    )
