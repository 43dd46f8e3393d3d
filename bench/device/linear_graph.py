"""Decode of a linear-attention model (a Qwen3-Next-80B-shaped slice, random weights) on the GPU with the CUDA graph
and with eager steps, in one run: batch 1 and 4, ms per step and tok/s. Experts int4 on the CPU engine, the dense
part in bf16 on the GPU (with ``cpu`` as the third argument: all on the CPU, eager steps only). From the repo root:

    python3 bench/device/linear_graph.py [layers, default 8] [steps, default 48] [cuda|cpu, default cuda]
"""

import sys
import time

import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.random_weights import build_random_model

L, F = "linear_attention", "full_attention"
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 48
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
# Qwen3-Next-80B-A3B's layer shapes (config.json), fewer layers and 512 experts kept
SHAPE = dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=layers,
             num_attention_heads=16, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-6,
             max_position_embeddings=262144, partial_rotary_factor=0.25, moe_intermediate_size=512, num_experts=512,
             num_experts_per_tok=10, shared_expert_intermediate_size=512, linear_num_value_heads=32,
             linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             layer_types=[(F if i % 4 == 3 else L) for i in range(layers)])

opts = EngineOptions(device=device, dtype="bf16", experts_format="int4", max_context=4096, max_batch=4)
for graph in ((True, False) if device == "cuda" else (False,)):
    runner = Runner(build_random_model(SHAPE, None, opts, log=lambda m: None), cuda_graph=graph)
    if runner.decoder is not None:
        d = runner.decoder
        print(f"{'graph' if graph else 'eager'}: decoder graph={d.cuda_graph} fused={d.fused}")
    for batch in (1, 4):
        rows = list(range(batch))
        sync()
        t0 = time.perf_counter()
        for slot in rows:
            runner.prefill(list(range(100 + slot, 612 + slot)), slot=slot)
        sync()
        pre_ms = 1e3 * (time.perf_counter() - t0) / batch
        tokens = [1] * batch
        for _ in range(4):  # capture, warm
            tokens = runner.decode_batch(tokens, rows).argmax(-1).tolist()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            tokens = runner.decode_batch(tokens, rows).argmax(-1).tolist()
        ms = 1e3 * (time.perf_counter() - t0) / steps
        print(f"  {'graph' if graph else 'eager'} batch {batch}: {ms:.2f} ms/step, {1e3 * batch / ms:.1f} tok/s "
              f"(prefill of 512 tokens: {pre_ms:.0f} ms a sequence)")
        for slot in rows:
            runner.release(slot)
    if runner.decoder is not None:
        runner.decoder.close()
    del runner
    if device == "cuda":
        torch.cuda.empty_cache()
