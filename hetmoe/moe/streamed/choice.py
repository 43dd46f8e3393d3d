"""What the layerwise GPU prefill chooses from the rates it measures at load (``LayerwisePrefill.measure``: one
layer's H2D copy, the GPU path's and the CPU engine's compute at two token counts, in seconds per layer): the token
count from which the GPU path wins (``choose_min_tokens``) and, per chunk, how many of each layer's experts the CPU
engine computes meanwhile (``choose_cpu_share``; hetmoe/moe/streamed/cpu_share.py) and whether it copies only the routed
experts (``wants_routed_only``; hetmoe/moe/streamed/copy.py), pure functions of the rates; and the model's layerwise
prefill set up at load with those choices (``setup``), which the load log prints.

Shape letters: T tokens, k experts per token, E experts.
"""

from __future__ import annotations

from typing import Optional


def _line(rates: dict) -> tuple:
    """(fixed seconds, seconds per token) through the two measured points of ``rates`` {tokens: seconds}."""
    (t0, s0), (t1, s1) = sorted(rates.items())[:2]
    per = max((s1 - s0) / (t1 - t0), 0.0)
    return max(s0 - per * t0, 0.0), per


def choose_min_tokens(rates: dict, limit: int = 1 << 20) -> Optional[int]:
    """The smallest token count from which one layer is faster on the layerwise GPU path than on the CPU engine:
    per layer, the GPU path takes max(its copy, its compute) (the copy of the next layer overlaps this one's
    compute), the CPU its compute. None when the GPU path never wins below ``limit`` tokens."""
    g0, g1 = _line(rates["gpu_s"])
    c0, c1 = _line(rates["cpu_s"])
    copy = rates["copy_s"]
    T = 16
    while T <= limit:
        if max(copy, g0 + g1 * T) <= c0 + c1 * T:
            lo = T // 2
            while lo + 1 < T:  # the exact crossover between T/2 and T
                mid = (lo + T) // 2
                if max(copy, g0 + g1 * mid) <= c0 + c1 * mid:
                    T = mid
                else:
                    lo = mid
            return T
        T *= 2
    return None


# A share must promise at least this fraction of a layer's time: the model below is rough, and a share the GPU then
# waits on costs more than it saves (the GPU machine at 2,048 tokens: modelled +10%, measured -17% with 18 experts)
MIN_GAIN = 0.15
# The CPU's share ran 1.16-1.18x longer than its part of the whole-layer time measured at load (GPU machine,
# qwen3-30b-a3b int4, 46 and 18 of 128 experts at 512 and 2,048 tokens): the DMA reads the same DRAM meanwhile
CPU_CONTENTION = 1.17


def layer_seconds(rates: dict, n_tokens: int, num_experts: int, cpu_experts: int) -> float:
    """The modelled time of one MoE layer of ``n_tokens`` tokens with ``cpu_experts`` of its ``num_experts`` on the
    CPU (routing spread evenly over the experts). The GPU side: its share of max(copy, GPU compute), the copy made a
    layer ahead. The CPU side cannot start before the layer's input exists, so the GPU's work of the layer comes
    before it (its compute time stands in for attention and the rest) and its part of the whole-layer CPU time
    is stretched by ``CPU_CONTENTION``."""
    g0, g1 = _line(rates["gpu_s"])
    c0, c1 = _line(rates["cpu_s"])
    gpu = g0 + g1 * n_tokens
    f = cpu_experts / num_experts
    if not cpu_experts:
        return max(rates["copy_s"], gpu)
    return max((1 - f) * max(rates["copy_s"], gpu), gpu + CPU_CONTENTION * f * (c0 + c1 * n_tokens))


def choose_cpu_share(rates: dict, n_tokens: int, num_experts: int, min_gain: float = MIN_GAIN) -> int:
    """How many of a layer's experts (the last ones) the CPU computes for a chunk of ``n_tokens`` tokens, from the
    rates the layerwise path measured (``LayerwisePrefill.measure``): the count in [0, E - 1] that minimises
    ``layer_seconds``, or 0 where it saves less than ``min_gain`` of the all-GPU time."""
    if num_experts < 2 or n_tokens < 1:
        return 0
    alone = layer_seconds(rates, n_tokens, num_experts, 0)
    best = min(range(num_experts), key=lambda c: (layer_seconds(rates, n_tokens, num_experts, c), c))
    return best if layer_seconds(rates, n_tokens, num_experts, best) <= (1 - min_gain) * alone else 0


def share_capacity(rates: dict, num_experts: int, chunk: int) -> int:
    """The largest chunk (<= ``chunk`` tokens) the CPU takes a share of: the size of its staging buffers."""
    if choose_cpu_share(rates, chunk, num_experts):
        return chunk
    lo, hi = 0, chunk  # the share shrinks as chunks grow: the last count with one, by bisection
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if choose_cpu_share(rates, mid, num_experts) else (lo, mid)
    return lo


ROUTED_ONLY_PAIRS = 4  # chunks with T·k >= 4 E route to ~98% of the experts: whole layers, copied a layer ahead


def routed_fraction(n_tokens: int, top_k: int, num_experts: int) -> float:
    """The expected fraction of E experts that T tokens routing k each reach, routing spread evenly (a skewed
    router reaches fewer)."""
    return 1.0 - (1.0 - 1.0 / num_experts) ** (n_tokens * top_k)


def wants_routed_only(n_tokens: int, top_k: int, num_experts: int, rates: Optional[dict] = None) -> bool:
    """Whether a chunk copies only each layer's routed experts (hetmoe/moe/streamed/copy.py), after the layer's
    router, instead of whole layers a layer ahead: per layer that is (routed fraction x copy) + GPU compute, in
    series, against max(copy, GPU compute). Without measured rates: when at most half the experts are reached."""
    if n_tokens * top_k >= ROUTED_ONLY_PAIRS * num_experts:
        return False
    f = routed_fraction(n_tokens, top_k, num_experts)
    if rates is None:
        return f <= 0.5
    g0, g1 = _line(rates["gpu_s"])
    gpu, copy = g0 + g1 * n_tokens, rates["copy_s"]
    return f * copy + gpu <= (1 - MIN_GAIN) * max(copy, gpu)


def describe_share(rates: dict, num_experts: int, lo: int, hi: int) -> str:
    """The share at powers of two from ``lo`` to ``hi`` tokens, for the load log: "41/128 experts at 512 tokens,
    ..., none from 4096"."""
    parts, T = [], 1 << max(int(lo) - 1, 1).bit_length()
    while T <= hi:
        c = choose_cpu_share(rates, T, num_experts)
        if not c:
            parts.append(f"none from {T}")
            break
        parts.append(f"{c}/{num_experts} experts at {T} tokens")
        T *= 2
    return ", ".join(parts) if parts else "none"


def cpu_tokens_per_second(rates: dict) -> float:
    """The CPU engine's measured rate on a whole MoE layer (every expert): the larger token count of ``rates["cpu_s"]``
    over its seconds."""
    T = max(rates["cpu_s"])
    return T / rates["cpu_s"][T]


def describe_rates(rates: dict, layer_bytes: int) -> str:
    """The measured rates for the load log: "H2D 52.1 GB/s (324 MiB per layer in 6.5 ms), CPU experts 44107 tok/s
    per layer"."""
    return (f"H2D {rates['copy_gbps']:.1f} GB/s ({layer_bytes / 2**20:.0f} MiB per layer in "
            f"{1e3 * rates['copy_s']:.1f} ms), CPU experts {cpu_tokens_per_second(rates):.0f} tok/s per layer")


def eligible(layer) -> bool:
    """Whether a MoE layer can take this path: the CPU engine, not split over NUMA subpools."""
    engine = layer.engine
    return engine is not None and engine.info().get("numa_subpools", 1) == 1


def unreadable(layers: list) -> Optional[str]:
    """Why the GPU prefill's readers of the packed layout cannot read some layer's experts (the PyTorch unpack,
    hetmoe/moe/streamed/packed.py, and where Triton is installed its one-pass kernel, hetmoe/ops/triton/packed.py:
    each refuses what it does not read by name), or None. Layers holding grid blocks (GGUF's i-quants) take the
    PyTorch reader whether Triton is there or not (``ExpertLayout.torch_only``); E4M3 scale bytes and zero points are
    read by both."""
    from hetmoe.moe.streamed.packed import ExpertLayout
    from hetmoe.ops.triton import packed as packed_triton

    for layer in layers:
        try:
            layout = ExpertLayout.of(layer.engine)
            if packed_triton.available() and not layout.torch_only:
                packed_triton.check_layout(layout)
        except ValueError as err:
            return f"{err} (prefill stays on the CPU)"
    return None


def setup(layers: list, plan, options, log) -> tuple:
    """The model's layerwise GPU prefill for a plan that holds its buffers (``plan.gpu_prefill``), with the token
    threshold of ``options.gpu_prefill`` (a count, or "auto": measured here) -> (LayerwisePrefill or None, the
    report kept in ``LoadedModel.info``). Where the driver refuses to register the experts' memory, or the GPU path
    never wins, prefill stays on the CPU and ``log`` says why."""
    from hetmoe.moe.streamed.layerwise import LayerwisePrefill
    from hetmoe.moe.streamed.vram import GPU_PREFILL_SLOTS, UNPACK_EXPERTS  # the buffers the plan counted

    if not plan.gpu_prefill:
        return None, {"enabled": False, "why": "off" if options.gpu_prefill == "off" else "no room on the GPU"}
    if not layers:
        why = "no MoE layer to stream (every routed expert is on the GPU, or the rules mix bf16 and int layers in a " \
              "deferral chain)"
        return None, {"enabled": False, "why": why}
    odd = [layer for layer in layers if not layer.plain_swiglu]
    if odd:  # the grouped GPU kernels compute plain SwiGLU without biases
        why = (f"the routed experts are {odd[0].glu.kind}{' with biases' if odd[0].bias else ''}, which only the CPU "
               "engine computes")
        log(f"hetmoe: GPU prefill off: {why}")
        return None, {"enabled": False, "why": why}
    if not all(eligible(layer) for layer in layers):  # all or none: a layer left out could split a deferral chain
        return None, {"enabled": False, "why": "MoE layers split over NUMA subpools (their storage is per slice)"}
    if any(layer.engine.info()["weight_format"] == "fp8" for layer in layers):  # (all or none, as above)
        why = "fp8 experts: the GPU unpacking of the packed layout reads no fp8 yet (prefill stays on the CPU)"
        log(f"hetmoe: GPU prefill off: {why}")
        return None, {"enabled": False, "why": why}
    why = unreadable(layers)  # (all or none, as above)
    if why:
        log(f"hetmoe: GPU prefill off: {why}")
        return None, {"enabled": False, "why": why}
    threshold = options.gpu_prefill if isinstance(options.gpu_prefill, int) else 1
    group = getattr(plan, "prefill_group", 0) or None  # slots of a group of experts (None: whole layers)
    slots = getattr(plan, "prefill_slots", 0) or GPU_PREFILL_SLOTS
    try:  # groups unpack one expert at a time where PyTorch ops unpack (the plan counts that)
        driver = LayerwisePrefill(layers, plan.device, plan.dtype, threshold, slots, 1 if group else UNPACK_EXPERTS,
                                  group, getattr(plan, "prefill_rows", 0) or None)
    except RuntimeError as err:
        log(f"hetmoe: GPU prefill off: {err}")
        return None, {"enabled": False, "why": str(err)}
    report = {"enabled": True, "chunk": plan.prefill_chunk, "layers": len(layers), "min_tokens": threshold,
              "chosen_by": "--gpu-prefill", "experts_per_slot": driver.group, "slots": driver.n_slots,
              "slot_bytes": driver.slot_bytes}
    share = options.gpu_prefill_cpu_share
    rate_text = ""
    if options.gpu_prefill == "auto" or share == "auto":  # the CPU's share is chosen from the same rates
        rates = driver.measure()
        report["rates"] = rates
        rate_text = f" ({describe_rates(rates, driver.layer_bytes(0))})"
    ring = (f", {driver.n_slots} slots of {driver.group} experts ({driver.slot_bytes / driver.n_slots / 2**20:.0f} "
            f"MiB each)" if group else "")
    if options.gpu_prefill == "auto":
        chosen = choose_min_tokens(report["rates"])
        report["chosen_by"] = "measured"
        if chosen is None:
            driver.close()
            log(f"hetmoe: GPU prefill off: the CPU is faster at every prompt length here{rate_text}")
            return None, {**report, "enabled": False, "why": "the CPU is faster"}
        driver.min_tokens = report["min_tokens"] = chosen
        text = f"hetmoe: GPU prefill from {chosen} tokens per chunk, chunks of {plan.prefill_chunk}{ring}"
    else:
        text = (f"hetmoe: GPU prefill from {threshold} tokens per chunk (--gpu-prefill), chunks of "
                f"{plan.prefill_chunk}{ring}")
    on = driver.enable_share(share, plan.prefill_chunk)
    E = driver.layouts[0].num_experts
    if on is None:
        share_text = "off" if share == "off" else "none"
    elif share == "auto":
        share_text = describe_share(driver.rates, E, driver.min_tokens, plan.prefill_chunk)
    else:
        share_text = f"{min(share, E - 1)}/{E} experts (--gpu-prefill-cpu-share)"
    report["cpu_share"] = {"mode": share, "capacity": on.capacity if on is not None else 0, "text": share_text}
    log(f"{text}{rate_text}; CPU share of each layer's experts: {share_text}")
    return driver, report

