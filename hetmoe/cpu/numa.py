"""NUMA options of the CPU expert engine: ``numa = "auto" | "off" | N``.

With N > 1 subpools (one per NUMA node by default), each MoE layer's experts are split along their intermediate
dimension across the subpools, each slice in its node's memory, and every call runs the slices at once and adds
their partial outputs (csrc/moe/split_experts.h). ``auto`` = one subpool per NUMA node that has CPUs this process
may use (so 1, the plain single pool, on a one-node machine); ``off`` = 1; N forces N (e.g. 2 on a one-node machine,
for tests). Machine topology is read from /sys/devices/system (csrc/runtime/topology.h).
"""

from __future__ import annotations

from typing import Optional

from hetmoe.config.options import NumaOption, parse_numa


def topology(root: Optional[str] = None, allowed: Optional[list] = None) -> dict:
    """``{"nodes": [{"id", "cpus", "cores", "has_memory", "distance"}], "source", "cpu_nodes", "memory_nodes"}``
    of this machine (default) or of a sysfs tree at ``root`` with ``allowed`` CPUs (tests)."""
    from hetmoe import _C

    return _C.numa_topology(root or "", allowed)


def resolve_subpools(numa: Optional[NumaOption], threads: Optional[int] = None) -> int:
    """The number of subpools ``numa`` asks for with ``threads`` threads in all (None: one per core)."""
    numa = parse_numa(numa)
    if numa == "off":
        return 1
    if numa == "auto":
        n = topology()["cpu_nodes"]
        return max(1, min(n, threads)) if threads else n
    return numa


def describe(pool) -> list:
    """Lines for ``hetmoe doctor``: the topology and what ``pool`` (an WorkerPool) does with it."""
    topo = topology()
    lines = [f"numa:       {len(topo['nodes'])} node(s) ({topo['source']})"]
    for node in topo["nodes"]:
        mem = "memory" if node["has_memory"] else "no memory"
        dist = f", distances {node['distance']}" if node["distance"] else ""
        lines.append(f"  node {node['id']}: {len(node['cores'])} cores (CPUs {_ranges(node['cpus'])}), {mem}{dist}")
    if pool.subpools == 1:
        lines.append(f"  engine: one pool of {pool.threads} threads (numa off, or one node: no split)")
    else:
        lines.append(f"  engine: {pool.subpools} subpools, experts split along I; memory: {pool.numa_binding}")
        for i, plan in enumerate(pool.numa_plans):
            lines.append(f"  subpool {i}: node(s) {plan['nodes']}, {plan['threads']} threads on CPUs "
                         f"{_ranges(plan['cpus'])}, memory node {plan['memory_node']}")
    return lines


def _ranges(cpus: list) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out) or "-"
