"""Writes the small MoE checkpoint built into hetmoe (hetmoe/data/default_model), the model that
``hetmoe generate`` / ``hetmoe chat`` run when no --model is given.

Until the trained demo model exists, this is a DeepSeek-V3-architecture model with *random* weights: it
exercises every part of the engine (MLA, dense first layer, shared expert, sigmoid group-limited router, 16
routed experts, top-4) but its output is meaningless text. Needs transformers (a development dependency).

    python tools/make_default_model.py [OUT_DIR]
"""

import shutil
import sys
from pathlib import Path

from hetmoe.engine.synthetic import write_checkpoint

CONFIG = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
)

README = """\
# The built-in default model

A DeepSeek-V3-architecture MoE (4 layers, hidden 128, 16 routed experts + 1 shared, top-4, MLA) with
**random weights**, written by `tools/make_default_model.py`. It lets `hetmoe generate` and `hetmoe chat` run on
a fresh machine with no download; its output is meaningless text. A trained demo model will replace it.
"""


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    write_checkpoint(out, "deepseek_v3", CONFIG, seed=2026, dtype="bfloat16", max_shard_size="1MB", vocab_size=1024)
    (out / "README.md").write_text(README)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "hetmoe" / "data" / "default_model")
