"""``hetmoe doctor``: what this machine offers the CPU expert engine and what the engine chooses on it (CPU
features and ISAs, memory, the pinned pool, NUMA topology, AMX, the kernel per weight format), and the GPU side
(each CUDA device, its memory, the CUDA version torch was built with, Triton). Sizes in GiB, as the plan writes
them (hetmoe/config/units.py ``gib``)."""

from __future__ import annotations

import argparse

from hetmoe.config.flags import ISAS, numa, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="CPU features, chosen ISA and kernel per format, pinned CPUs, GPU and CUDA")
    p.add_argument("--threads", type=positive_int, default=None, help="pool size (default: physical cores)")
    p.add_argument("--isa", choices=ISAS, default="auto", help="default: auto, the best this CPU runs")
    p.add_argument("--numa", type=numa, default="auto", metavar="auto|off|N", help="NUMA subpools (default: auto)")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    return doctor(threads=args.threads, isa=args.isa, numa=args.numa)


def gpu_lines() -> list:
    """The GPU side: one line per CUDA device (name, memory total and free, compute capability), then CUDA and
    Triton; or why there is no CUDA device."""
    import torch

    from hetmoe.config.units import gib
    from hetmoe.plan.sysmem import free_vram

    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees none: no GPU, no driver, or "
               "CUDA_VISIBLE_DEVICES hides them")
        return [f"gpu:        no CUDA device ({why}); everything runs on the CPU"]
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free = free_vram(torch.device("cuda", i))
        lines.append(f"gpu:        cuda:{i} {props.name}, {gib(props.total_memory)} ({gib(free)} free), compute "
                     f"capability {props.major}.{props.minor}")
    try:
        import triton

        kernels = f"triton {triton.__version__}"
    except ImportError:
        kernels = "no triton: attention and decode kernels fall back to PyTorch"
    lines.append(f"cuda:       {torch.version.cuda} (torch {torch.__version__}), {kernels}")
    return lines


def doctor(threads=None, isa: str = "auto", numa="auto") -> int:
    import torch

    from hetmoe import cpu
    from hetmoe.bench.kernel import DEFAULT_GROUP
    from hetmoe.bench.machine import check_isa, cpu_model, llc_bytes, mem_total_bytes
    from hetmoe.config.units import gib
    from hetmoe.cpu.numa import describe as describe_numa
    from hetmoe.plan.sysmem import free_ram

    check_isa(isa)
    pool = cpu.shared_pool(threads, numa)
    info = cpu.cpu_info()
    print(f"cpu:        {cpu_model()}")
    print(f"features:   {info['flags']}")
    cap = f"; capped by {info['isa_cap']}" if info["isa_cap"] else ""
    print(f"isas:       {', '.join(info['supported_isas'])} (best: {info['best_isa']}{cap})")
    print(f"memory:     {gib(mem_total_bytes())} ({gib(free_ram())} available), last-level cache {gib(llc_bytes())}")
    print(f"pool:       {pool.threads} threads pinned to CPUs {pool.pinned_cpus}")
    print("\n".join(describe_numa(pool)))
    amx = info["amx_unavailable"]
    print(f"amx:        {'AMX unavailable: ' + amx if amx else 'available'}")
    print("choice per expert and call (kernel by tokens routed to the expert):")
    for fmt in cpu.WEIGHT_FORMATS:
        ex = cpu.CPUExperts(1, 256, 256, fmt, DEFAULT_GROUP[fmt], pool=pool, isa=isa)
        d = ex.info()
        line = f"{fmt + ':':11s} kernel {d['kernel']} (isa {d['isa']}, activations {d['activation']})"
        if d["amx"] != "off":
            line = (f"{fmt + ':':11s} < {d['amx_min_tokens']} tokens: {d['kernel']} (activations {d['activation']}); "
                    f">= {d['amx_min_tokens']} tokens: {d['amx_kernel']} (activations {d['amx_activation']})")
        print(line)
    print(f"torch:      {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(gpu_lines()))
    return 0
