"""Decode of a DeepSeek Sparse Attention model (a DeepSeek-V3.2-shaped slice, random weights) on the GPU with the
CUDA graph and with eager steps, in one run: batch 1 at a context below the indexer's top-k (dense attention) and
one past it (the indexer's selection), ms per step. Experts int4 on the CPU engine, the dense part in bf16 on the
GPU. From the repo root:

    python3 bench/device/dsa_graph.py [layers, default 4] [steps, default 32] [model_type, default deepseek_v32]
"""

import sys
import time

import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.random_weights import build_random_model

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
model_type = sys.argv[3] if len(sys.argv) > 3 else "deepseek_v32"
# DeepSeek-V3.2's layer shapes (its config.json; the MLA, routing and indexer sizes are the model type's defaults),
# fewer layers, the first dense
SHAPE = dict(model_type=model_type, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
             moe_intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128,
             n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=1, max_position_embeddings=163840,
             rope_theta=10000.0, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
CONTEXTS = (1024, 6144)  # below index_topk (2048), past it
sync = torch.cuda.synchronize
opts = EngineOptions(device="cuda", dtype="bf16", experts_format="int4", max_context=8192, max_batch=1)
loaded = build_random_model(SHAPE, None, opts, log=lambda m: None)
for graph in (True, False):
    runner = Runner(loaded, cuda_graph=graph)
    d = runner.decoder
    print(f"{'graph' if graph else 'eager'}: decoder graph={d.cuda_graph} fused={d.fused} "
          f"sparse_topk={runner.sparse_topk}")
    for ctx in CONTEXTS:
        sync()
        t0 = time.perf_counter()
        runner.prefill([(7 * j) % 1000 + 5 for j in range(ctx)], slot=0)
        sync()
        pre_s = time.perf_counter() - t0
        token = [1]
        for _ in range(3):  # capture, warm
            token = runner.decode_batch(token, [0]).argmax(-1).tolist()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            token = runner.decode_batch(token, [0]).argmax(-1).tolist()
        ms = 1e3 * (time.perf_counter() - t0) / steps
        print(f"  {'graph' if graph else 'eager'} context {ctx}: {ms:.2f} ms/step, {1e3 / ms:.1f} tok/s "
              f"(prefill {pre_s:.2f} s)")
        runner.release(0)
    d.close()
    del runner
    torch.cuda.empty_cache()
