"""AMX parts of ``hetmoe bench kernel``: skewed (Zipf) routing, the AMX-vs-AVX-512 paths on one set of weights,
and the crossover in tokens per expert that sets ``amx_min_tokens``.

Both paths run on the same packed weights of one engine: "amx" is the engine's per-expert choice (AMX GEMM for
experts with at least ``amx_min_tokens`` tokens, row-block kernels below), "avx512" sets the threshold above
any count so every expert runs the row-block kernels (on an AMX machine: the AVX-512 ones).
"""

from __future__ import annotations

import statistics

import torch

from hetmoe import cpu

ROUTINGS = ("uniform", "zipf")
ZIPF_S = 1.0  # expert popularity ~ 1 / rank^s
NEVER = 1 << 30  # an amx_min_tokens no expert reaches
CROSSOVER_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def zipf_routing(T: int, E: int, k: int, gen: torch.Generator, s: float = ZIPF_S) -> tuple:
    """k distinct experts per token drawn without replacement with P(expert of rank r) ~ 1 / r^s (Gumbel
    top-k), ranks a random permutation per call: ids [T, k] int64, weights [T, k] fp32 (positive, sum 1)."""
    rank = torch.randperm(E, generator=gen).double() + 1
    logp = (-s * rank.log()).float()
    gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen).clamp_min(1e-20)))
    ids = (logp + gumbel).topk(k, dim=1).indices
    weights = torch.rand(T, k, generator=gen).softmax(dim=1)
    return ids.contiguous(), weights.contiguous()


def uniform_routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple:
    vals, ids = torch.rand(T, E, generator=gen).topk(k, dim=1)
    return ids.contiguous(), vals.softmax(dim=1).contiguous()


def make_routing(kind: str, T: int, E: int, k: int, gen: torch.Generator) -> tuple:
    if kind == "zipf":
        return zipf_routing(T, E, k, gen)
    if kind == "uniform":
        return uniform_routing(T, E, k, gen)
    raise ValueError(f"unknown routing {kind!r}; expected one of {', '.join(ROUTINGS)}")


def paths_of(experts: cpu.CPUExperts, compare: bool) -> list:
    """[(path name, amx_min_tokens to set or None)] to time on this engine."""
    info = experts.info()
    if info["amx"] == "off":
        return [(info["isa"], None)]
    own = experts.amx_min_tokens
    name = "amx" if info["amx"] == "native" else "amx-emulated"
    row_block = info["kernel"].split("/")[-1].split("-")[0]  # the row-block kernels' ISA, e.g. avx512
    return [(name, own), (row_block, NEVER)] if compare else [(name, own)]


def balanced_routing(n_per_expert: int, E: int, k: int) -> tuple:
    """T = n * E / k tokens; token t takes experts (t*k + j) mod E: every expert gets exactly n tokens."""
    T = n_per_expert * E // k
    ids = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E
    return ids.contiguous(), torch.full((T, k), 1.0 / k)


def crossover(experts: cpu.CPUExperts, k: int, say, repeats: int, warmup: int, time_calls) -> dict:
    """ms of one layer call with every expert at n tokens, all on AMX vs all on the row-block kernels; the
    crossover is the smallest n from which AMX is at least as fast at every larger n measured."""
    E, H = experts.num_experts, experts.hidden_size
    own = experts.amx_min_tokens
    rows = []
    say(f"#   crossover (E {E}, k {k}, every expert at n tokens): n, ms amx, ms row-block, row-block/amx")
    for n in CROSSOVER_TOKENS:
        if (n * E) % k:
            continue
        ids, w = balanced_routing(n, E, k)
        x = torch.randn(ids.shape[0], H, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ms = {}
        for name, threshold in (("amx", 1), ("row", NEVER)):
            experts.amx_min_tokens = threshold
            ms[name] = statistics.median(time_calls(lambda i: experts.forward(x, ids, w, out), repeats, warmup)) * 1e3
        rows.append({"tokens_per_expert": n, "T": ids.shape[0], "ms_amx": ms["amx"], "ms_row_block": ms["row"],
                     "speedup": ms["row"] / ms["amx"]})
        say(f"#   {n:4d} {ms['amx']:9.2f} {ms['row']:9.2f} {ms['row'] / ms['amx']:6.2f}x")
    experts.amx_min_tokens = own
    faster = [r["speedup"] >= 1.0 for r in rows]
    cross = next((rows[i]["tokens_per_expert"] for i in range(len(rows)) if all(faster[i:])), None)
    say(f"#   crossover: AMX at least as fast from {cross} tokens per expert (engine default {own})")
    return {"rows": rows, "crossover_tokens": cross, "amx_min_tokens": own}
