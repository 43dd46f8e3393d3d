"""Benchmarks behind ``hetmoe bench ...``: each prints the physics (GB/s, % of measured STREAM, FLOP/s), not only ms.

``kernel``: the fused CPU MoE layer per (shape, format, T) against DRAM read bandwidth and a naive PyTorch loop.
``e2e``: prefill and decode tok/s of a whole model (CPU alone and hybrid) against the decode roofline.
``serve``: concurrent streaming clients against ``hetmoe serve``: output tok/s, time to first token, per-token latency.
"""
