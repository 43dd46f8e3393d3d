"""NUMA tensor parallelism: csrc/runtime/topology.h (topology, subpools, mbind) and
csrc/moe/split_experts.h (every expert's intermediate dimension I split across subpools, partial outputs reduced).

On a one-node machine ``numa=2`` cuts the cores into two subpools: the code path of a two-socket machine, except
where the memory lands. Every case compares the split engine with the unsplit one on the same weights.

What is bitwise and what is not:
  * packing: slice boundaries are multiples of the group size (bf16: 32; per-row int8/int4: amx_row_group(I), the
    AMX activation group of h, at least 128), so the slices hold
    exactly the unsplit engine's bytes, and the activations (x, and h = silu(gate x) * up x, quantized in
    groups along I) round identically: ``dequantized()`` is asserted bitwise equal for every format;
  * outputs: the down projection's dot product over I becomes per-slice partial sums added afterwards, and the
    weighted combine runs per slice; only fp32 summation order differs. ||split - unsplit|| / ||unsplit||
    MEASURED over this file's cases (dev machine, AVX2 kernels): 0.9e-7..2.3e-7 for fp32 out (bf16 weights the
    most), asserted SPLIT_TOL = 1e-6; with bf16 out, the few elements whose fp32 values straddle a bf16
    rounding boundary round the other way (measured up to 8.3e-5 relative over a whole output), asserted
    elementwise: at most one bf16 ulp apart. Plus the tolerances of tests/cpu/test_kernels.py against the exact
    fp32 reference and the dequantized (emulated) reference;
  * with I at most one group there is one slice and the output is bitwise the unsplit engine's (asserted).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from cases import FORMATS, make_routing, make_weights, make_x
from hetmoe import _C, cpu
from hetmoe.config.options import parse_numa
from hetmoe.cpu import CPUExperts, HostFuncs, WorkerPool, cpu_info, shared_pool
from hetmoe.cpu.numa import resolve_subpools, topology
from reference import amx_row_group, moe_reference, moe_reference_emulated, rel_err

# The row-block kernels (AVX-512 on the GPU machine, AVX2 here); the AMX path has its own test below, with the
# tolerances of tests/cpu/test_amx.py (its activations are rounded to bf16 / int8).
ROW_ISA = next(i for i in ("avx512", "avx2", "scalar") if i in cpu_info()["supported_isas"])
AMX_PATHS = [getattr(cpu, "AMX_EMULATED", None)] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
AMX_FP32_TOL = {"bf16": 5.5e-3, "int8-g128": 2.3e-2, "int8-row": 2.5e-2, "int4-g64": 0.22, "int4-row": 0.24}
# the tolerances of tests/cpu/test_kernels.py ("all cases" column)
FP32_TOL = {"bf16": 5.0e-3, "int8-g32": 1.5e-2, "int8-g64": 1.3e-2, "int8-g128": 1.4e-2, "int8-row": 1.75e-2,
            "int4-g32": 0.27, "int4-g64": 0.23, "int4-g128": 0.25, "int4-row": 0.235}
EMULATED_TOL = 1e-3
SPLIT_TOL = 1e-6

SPLIT = (12, 160, 300)  # E, H, I: two slices for every group size (I = 300 is not a multiple of any)
ODD = (10, 200, 232)  # H, I not multiples of 16
TINY = (5, 40, 24)  # I below one group: a single slice
CASES = ((1, 1), (3, 2), (7, 8), (64, 6), (300, 4))  # (T, k)


@pytest.fixture(scope="module")
def one(pool):
    return pool


@pytest.fixture(scope="module")
def two():
    return WorkerPool(2, numa=2)


@functools.lru_cache(maxsize=None)
def weights(shape):
    return make_weights(*shape, "numa")


def build(fmt, shape, pool, isa=ROW_ISA, **kw):
    E, H, I = shape
    weight_format, group = FORMATS[fmt]
    ex = CPUExperts(E, H, I, weight_format, group, isa=isa, pool=pool, **kw)
    ex.load(*weights(shape))
    return ex


def inputs(shape, T, k, seed=0):
    E, H, _ = shape
    x = make_x(T, H, "numa", shape, k, seed)
    ids, w = make_routing(T, k, E, "numa", shape, seed)
    return x, ids, w


def within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 tensors whose every element pair differs by at most one unit in the last place (2^-7 relative: 8
    significant bits), what rounding values that differ in fp32 summation order does, plus that fp32 noise
    itself (1e-6 of the largest element) where a sum cancels to near zero (seen: 1.90e-7 vs 1.92e-7 in an
    output whose largest element is 0.09)."""
    a, b = a.float(), b.float()
    slack = 1e-6 * b.abs().max()
    return bool(((a - b).abs() <= a.abs().maximum(b.abs()) * 2.0**-7 + slack).all())


def emulated(ex, x, ids, w, skip_mask=None):
    info = ex.info()
    g, u, d = zip(*(ex.dequantized(e) for e in range(ex.num_experts)))
    return moe_reference_emulated(x, g, u, d, ids, w, info["activation"], info["group_size"], skip_mask)


# ---------------------------------------------------------------- split == unsplit


@pytest.mark.parametrize("shape", [SPLIT, ODD], ids=["split", "odd"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_matches_unsplit(fmt, shape, one, two):
    a, b = build(fmt, shape, one), build(fmt, shape, two)
    slices = b.info()["numa_slices"]
    unit = 32 if fmt == "bf16" else (FORMATS[fmt][1] or amx_row_group(shape[2]))
    assert len(slices) == 2 and slices[0][0] == 0 and slices[-1][1] == shape[2]
    assert slices[0][1] == slices[1][0] and slices[0][1] % unit == 0
    for e in range(shape[0]):
        for m_a, m_b in zip(a.dequantized(e), b.dequantized(e)):
            assert torch.equal(m_a, m_b), f"expert {e}: the split packing differs from the unsplit one"
    worst, worst_bf16 = 0.0, 0.0
    for T, k in CASES:
        x, ids, w = inputs(shape, T, k)
        ours, base = b(x, ids, w), a(x, ids, w)
        err = rel_err(ours, base)
        worst = max(worst, err)
        assert err <= SPLIT_TOL, f"T={T} k={k}: {err:.2e} from the unsplit engine"
        ours16, base16 = (ex(x, ids, w, torch.empty(T, shape[1], dtype=torch.bfloat16)) for ex in (b, a))
        assert within_one_bf16_ulp(ours16, base16), f"T={T} k={k}: bf16 out differs by more than rounding"
        worst_bf16 = max(worst_bf16, rel_err(ours16.float(), base16.float()))
        # The float64 references are slow in Python: T <= 64 (the unsplit engine is checked at T = 300 too).
        if T <= 64:
            assert rel_err(ours, moe_reference(x, *weights(shape), ids, w)) <= FP32_TOL[fmt]
        if T <= 7:
            assert rel_err(ours, emulated(b, x, ids, w)) <= EMULATED_TOL
    print(f"{fmt} {shape}: max {worst:.1e} from the unsplit engine ({worst_bf16:.1e} with bf16 out)")


def test_single_slice_is_bitwise(one, two):
    a, b = build("int8-g64", TINY, one), build("int8-g64", TINY, two)
    assert b.info()["numa_slices"] == [(0, TINY[2])] and b.info()["numa_subpools"] == 2
    for T, k in CASES:
        x, ids, w = inputs(TINY, T, min(k, 3))  # E = 5 with 2 experts left cold
        assert torch.equal(a(x, ids, w), b(x, ids, w))


def test_two_threads_per_subpool():
    """Parallel loops inside each subpool (2 threads each), and the reduction spread over both subpools."""
    wide = WorkerPool(4, numa=2)
    assert [p["threads"] for p in wide.numa_plans] == [2, 2]
    shape = (6, 48, 96)
    a, b = build("bf16", shape, WorkerPool(2)), build("bf16", shape, wide)
    x, ids, w = inputs(shape, 1100, 2)  # two chunks of tokens; 1100 x 48 x 2 partials: the parallel reduction
    assert rel_err(b(x, ids, w), a(x, ids, w)) <= SPLIT_TOL
    out = torch.randn(1100, 48).bfloat16()
    ref = out.clone()
    b(x, ids, w, out, accumulate=True)
    a(x, ids, w, ref, accumulate=True)
    assert within_one_bf16_ulp(out, ref)


@pytest.mark.skipif(AMX_PATHS[0] is None, reason="this build has no AMX path")
@pytest.mark.parametrize("path", AMX_PATHS)
@pytest.mark.parametrize("fmt,shape", [(f, SPLIT) for f in AMX_FP32_TOL] + [("int8-row", (12, 160, 1500))],
                         ids=list(AMX_FP32_TOL) + ["int8-row-h-groups-512"])
def test_amx_path_split(fmt, shape, path, one, two):
    """Experts with at least amx_min_tokens tokens take the AMX GEMM (emulated everywhere; native where the
    CPU has AMX); the others the row-block kernels, in each slice as in the unsplit engine (per-row int8 with
    I = 1500: h in AMX groups of 512, the slices cut at 512)."""
    a = build(fmt, shape, one, isa=path, amx_min_tokens=3)
    b = build(fmt, shape, two, isa=path, amx_min_tokens=3)
    if shape != SPLIT:
        assert [tuple(s) for s in b.info()["numa_slices"]] == [(0, 512), (512, 1500)]
    assert b.amx_min_tokens == 3 and b.info()["amx"] == a.info()["amx"] != "off"
    b.amx_min_tokens = 3  # set on every slice
    for T, k in ((7, 8), (64, 6)):
        x, ids, w = inputs(shape, T, k)
        ours = b(x, ids, w)
        err = rel_err(ours, a(x, ids, w))
        print(f"{fmt} {path} T={T}: {err:.1e} from the unsplit engine")
        assert err <= SPLIT_TOL
        assert rel_err(ours, moe_reference(x, *weights(shape), ids, w)) <= AMX_FP32_TOL[fmt]


# ---------------------------------------------------------------- the call contract


def test_call_variants(one, two):
    """bf16 x, int32 ids, bf16 out, accumulate, T read through a pointer, a skip mask read at run time."""
    shape = SPLIT
    a, b = build("int4-g32", shape, one), build("int4-g32", shape, two)
    cap, k = 16, 4
    x, ids, w = inputs(shape, cap, k, seed=3)
    x = x.bfloat16()
    ids = ids.int()
    n = torch.tensor([cap])
    mask = torch.zeros(shape[0], dtype=torch.bool)
    base = torch.randn(cap, shape[1]).bfloat16()
    outs = {}
    jobs = {}
    for name, ex in (("a", a), ("b", b)):
        outs[name] = base.clone()
        jobs[name] = ex.prepare(x, ids, w, outs[name], n_tokens=n, accumulate=True, skip_mask=mask)
    for t, masked in ((16, []), (5, [0, 3]), (0, []), (1, list(range(shape[0])))):
        n[0] = t
        mask.zero_()
        mask[masked] = True
        for name, ex in (("a", a), ("b", b)):
            outs[name].copy_(base)
            ex.submit(jobs[name])
            ex.sync()
        assert torch.equal(outs["b"][t:], base[t:]), "rows beyond T were written"
        if t:
            assert within_one_bf16_ulp(outs["b"][:t], outs["a"][:t])
            if masked == list(range(shape[0])):
                assert torch.equal(outs["b"][:t], base[:t]), "every expert masked: out must be unchanged"
    # fp32 out, overwrite, all -1 ids: zeros
    x1, ids1, w1 = inputs(shape, 4, 2, seed=4)
    ids1[:] = -1
    assert torch.equal(b(x1, ids1, w1), torch.zeros(4, shape[1]))


def test_errors_raised_at_sync(one, two):
    b = build("bf16", SPLIT, two)
    x, ids, w = inputs(SPLIT, 1300, 2, seed=5)
    bad = ids.clone()
    bad[1100, 1] = 99  # in the second chunk of tokens: the message names the token in the whole call
    b.submit(x, bad, w)
    with pytest.raises(ValueError, match=r"topk_ids\[1100, 1\] = 99 is not an expert id"):
        b.sync()
    b.sync()  # raised once
    assert rel_err(b(x[:8], ids[:8], w[:8]), build("bf16", SPLIT, one)(x[:8], ids[:8], w[:8])) <= SPLIT_TOL
    n = torch.tensor([9])
    job = b.prepare(x[:8], ids[:8], w[:8], n_tokens=n)
    b.submit(job)
    with pytest.raises(ValueError, match="number of tokens 9 is outside"):
        b.sync()
    empty = CPUExperts(*SPLIT, "bf16", pool=two)
    empty.load(*(m[:1] for m in weights(SPLIT)))  # expert 0 only
    routed = torch.tensor([[0, 1]])
    empty.submit(x[:1], routed, w[:1])
    with pytest.raises(RuntimeError, match="expert 1 is routed to but was never loaded"):
        empty.sync()
    g, u, d = (m[:2].clone() for m in weights(SPLIT))
    d[1, 3, 250] = float("nan")  # in the second slice's columns
    with pytest.raises(ValueError, match=r"down\[1\] contains NaN or Inf"):
        CPUExperts(*SPLIT, "int8", 0, pool=two).load(g, u, d)


def test_submit_sync_in_order(one, two):
    a, b = build("int8-g64", SPLIT, one), build("int8-g64", SPLIT, two)
    runs = [inputs(SPLIT, T, 3, seed=10 + T) for T in (1, 40, 7)]
    jobs = [b.prepare(*r) for r in runs]
    for j in jobs:
        b.submit(j)
    b.sync(allow_pending=1)
    assert b.pool.pending() <= 1
    b.sync()
    for j, r in zip(jobs, runs):
        assert rel_err(j.out, a(*r)) <= SPLIT_TOL


@pytest.mark.parametrize("mech", getattr(cpu, "MECHANISMS", (None,)))
def test_stream_submit_sync_replay(two, mech):
    """Stream-ordered submit/sync (host functions or stream signals, on a FakeStream here), captured once and
    replayed with new inputs and T: the split job goes through subpool 0 like any job."""
    b = build("int8-g32", SPLIT, two)
    cap, k, H = 8, 4, SPLIT[1]
    x_h, ids_h, w_h = torch.zeros(cap, H), torch.zeros(cap, k, dtype=torch.int64), torch.zeros(cap, k)
    out_h, n = torch.zeros(cap, H), torch.tensor([cap])
    job = b.prepare(x_h, ids_h, w_h, out_h, n_tokens=n)
    hf, stream = (HostFuncs() if mech is None else HostFuncs(mech)), _C.FakeStream()
    try:
        stream.begin_capture()
        b.pool.submit_on_stream(job, stream, host_funcs=hf)
        b.pool.sync_on_stream(0, stream, host_funcs=hf)
        stream.end_capture()
        for i, t in enumerate((3, 8, 1)):
            x, ids, w = inputs(SPLIT, cap, k, seed=20 + i)
            x_h.copy_(x)
            ids_h.copy_(ids)
            w_h.copy_(w)
            n[0] = t
            stream.replay()
            stream.synchronize()
            assert torch.equal(out_h[:t], b(x[:t], ids[:t], w[:t])), f"replay {i}"
    finally:
        stream.resume()
        stream.synchronize()
        b.pool.sync()
        hf.close()


@pytest.mark.gpu
@pytest.mark.gpu
def test_gpu_graph_replay(two):
    """A CUDA graph that copies x in, submits the split job, syncs on the stream and copies out, replayed."""
    b = build("int8-g128", SPLIT, two)
    cap, k, H = 6, 4, SPLIT[1]
    pin = lambda t: t.pin_memory()  # noqa: E731
    x_pin, w_pin = pin(torch.zeros(cap, H)), pin(torch.zeros(cap, k))
    ids_pin = pin(torch.zeros(cap, k, dtype=torch.int64))
    out_pin, n_pin = pin(torch.zeros(cap, H)), pin(torch.tensor([cap]))
    job = b.prepare(x_pin, ids_pin, w_pin, out_pin, n_tokens=n_pin)
    x_gpu, out_gpu = torch.zeros(cap, H, device="cuda"), torch.zeros(cap, H, device="cuda")
    hf = HostFuncs()
    b.pool.submit_on_stream(job, host_funcs=hf)  # once outside a capture (stream signals map memory then)
    b.pool.sync_on_stream(host_funcs=hf)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            x_pin.copy_(x_gpu, non_blocking=True)
            b.pool.submit_on_stream(job, host_funcs=hf)
            b.pool.sync_on_stream(host_funcs=hf)
            out_gpu.copy_(out_pin, non_blocking=True)
    for i, t in enumerate((6, 2, 1)):
        x, ids, w = inputs(SPLIT, cap, k, seed=30 + i)
        x_gpu.copy_(x)
        ids_pin.copy_(ids)
        w_pin.copy_(w)
        n_pin[0] = t
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_gpu[:t].cpu(), b(x[:t], ids[:t], w[:t])), f"replay {i}"
    b.pool.sync()
    del graph
    hf.close()


# ---------------------------------------------------------------- storage, checksum, the converted-expert cache


def test_storage_roundtrip_and_checksum(one, two):
    b = build("int4-g64", SPLIT, two)
    views = b.storage()
    assert len(views) == 8 and b.nbytes == sum(v.nbytes for v in views)  # 2 slices x (data, scales) x (gate+up, down)
    fresh = CPUExperts(*SPLIT, "int4", 64, pool=two)
    for src, dst in zip(views, fresh.storage()):
        dst[:] = src
    fresh.mark_loaded()
    assert fresh.checksum() == b.checksum()
    x, ids, w = inputs(SPLIT, 9, 4)
    assert torch.equal(fresh(x, ids, w), b(x, ids, w))
    v = fresh.storage()[6]  # second slice, down data
    v[0] = (v[0] + 1) % 256
    assert fresh.checksum() != b.checksum()
    # boundaries on group multiples: the slices pad exactly as the unsplit matrices do, no byte more
    for fmt in ("bf16", "int8-row", "int4-g128"):
        assert build(fmt, ODD, two).info()["bytes_per_expert"] == build(fmt, ODD, one).info()["bytes_per_expert"]


class _Ckpt:
    """What ExpertCache reads of a checkpoint."""

    def __init__(self, path):
        self.path = path

    def fingerprint(self):
        return [["config.json", 1, 2]]


def test_expert_cache_key_includes_split(tmp_path, one, two):
    from hetmoe.load.expert_cache import ExpertCache

    ck = _Ckpt(tmp_path / "model")
    c1 = ExpertCache(tmp_path / "cache", ck, "int8", 128, warn=lambda m: None)
    log = []
    c2 = ExpertCache(tmp_path / "cache", ck, "int8", 128, warn=log.append, numa=2)
    assert c1.dir != c2.dir and c2.dir.name.startswith("model-int8-g128-numa2-")
    a, b = build("int8-g128", SPLIT, one), build("int8-g128", SPLIT, two)
    assert c1.save(0, a) and c2.save(0, b)
    b2 = CPUExperts(*SPLIT, "int8", 128, pool=two)
    assert c2.load(0, b2) and b2.checksum() == b.checksum()
    x, ids, w = inputs(SPLIT, 5, 2)
    assert torch.equal(b2(x, ids, w), b(x, ids, w))
    # an unsplit file where a split one is expected is refused (header), never read as slices
    shutil.copy(c1._path(0), c2._path(0))
    assert not c2.load(0, CPUExperts(*SPLIT, "int8", 128, pool=two))
    assert any("made from other files or settings" in m for m in log), log


# ---------------------------------------------------------------- topology (fake sysfs trees), plans, options


def fake_sysfs(root: Path, nodes: dict, online=None, has_memory=None, siblings=None, distance=None) -> str:
    """nodes: {id: cpulist text}; siblings: {cpu: core_id} (default: every CPU its own core)."""
    (root / "node").mkdir(parents=True)
    (root / "node" / "online").write_text(",".join(str(n) for n in sorted(nodes)) + "\n")
    if has_memory is not None:
        (root / "node" / "has_memory").write_text(has_memory + "\n")
    for n, cpus in nodes.items():
        d = root / "node" / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        if distance:
            (d / "distance").write_text(" ".join(map(str, distance[n])) + "\n")
        for c in _C.parse_cpu_list(cpus):
            t = root / "cpu" / f"cpu{c}" / "topology"
            t.mkdir(parents=True)
            (t / "core_id").write_text(f"{(siblings or {}).get(c, c)}\n")
            (t / "physical_package_id").write_text(f"{n}\n")
    if online is not None:
        (root / "cpu" / "online").write_text(online + "\n")
    return str(root)


def test_parse_cpu_list():
    assert _C.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert _C.parse_cpu_list("") == []
    for bad in ("0-", "a", "3-1", "1,,2", "1 2"):
        with pytest.raises(ValueError, match="malformed"):
            _C.parse_cpu_list(bad)


def test_topology_two_nodes_with_siblings(tmp_path):
    # 2 nodes x 4 physical cores, hyperthread siblings 8-15 (core_id of cpu c+8 == core_id of cpu c)
    sib = {c + 8: c for c in range(8)}
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, has_memory="0-1", siblings=sib,
                      distance={0: [10, 21], 1: [21, 10]})
    topo = topology(root, list(range(16)))
    assert [n["cores"] for n in topo["nodes"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo["cpu_nodes"] == 2 and topo["memory_nodes"] == 2
    plans = _C.numa_plan(0, 0, root, list(range(16)))
    assert [(p["nodes"], p["cpus"], p["threads"], p["memory_node"]) for p in plans] == \
        [([0], [0, 1, 2, 3], 4, 0), ([1], [4, 5, 6, 7], 4, 1)]
    plans = _C.numa_plan(4, 6, root, list(range(16)))  # more subpools than nodes: each node cut in two
    assert [p["cpus"] for p in plans] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert sum(p["threads"] for p in plans) == 6 and min(p["threads"] for p in plans) == 1
    assert [p["memory_node"] for p in plans] == [0, 0, 1, 1]
    merged = _C.numa_plan(1, 0, root, list(range(16)))  # one subpool over both nodes: no single memory node
    assert merged[0]["nodes"] == [0, 1] and merged[0]["memory_node"] == -1 and merged[0]["threads"] == 8
    # affinity: only CPUs 1, 2 and 5 allowed
    assert [p["cpus"] for p in _C.numa_plan(0, 0, root, [1, 2, 5])] == [[1, 2], [5]]


def test_topology_offline_cpus_and_memoryless_node(tmp_path):
    # node 1 has CPUs but no memory (nearest memory: node 2, then 0); node 2 is memory only; CPU 3 is offline
    root = fake_sysfs(tmp_path, {0: "0-3", 1: "4-5", 2: ""}, online="0-2,4-5", has_memory="0,2",
                      distance={0: [10, 20, 30], 1: [20, 10, 15], 2: [30, 15, 10]})
    topo = topology(root, list(range(8)))
    assert [n["cores"] for n in topo["nodes"]] == [[0, 1, 2], [4, 5], []]
    assert [n["has_memory"] for n in topo["nodes"]] == [True, False, True]
    assert topo["cpu_nodes"] == 2
    plans = _C.numa_plan(0, 0, root, list(range(8)))
    assert [(p["nodes"], p["memory_node"]) for p in plans] == [([0], 0), ([1], 2)]
    assert [p["threads"] for p in plans] == [3, 2]


def test_topology_without_numa_or_unreadable(tmp_path):
    (tmp_path / "flat" / "cpu").mkdir(parents=True)
    topo = topology(str(tmp_path / "flat"), [0, 1, 2])
    assert len(topo["nodes"]) == 1 and topo["nodes"][0]["cpus"] == [0, 1, 2] and "one node" in topo["source"]
    root = fake_sysfs(tmp_path / "bad", {0: "0-1", 1: "2-3"})
    (Path(root) / "node" / "node1" / "cpulist").write_text("2-x\n")
    topo = topology(root, [0, 1, 2, 3])
    assert len(topo["nodes"]) == 1 and "unreadable NUMA topology" in topo["source"]


def test_plan_errors(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1"})
    with pytest.raises(ValueError, match="2 subpools need at least as many threads"):
        _C.numa_plan(2, 1, root, [0, 1])
    with pytest.raises(ValueError, match="cannot cut node 0"):
        _C.numa_plan(3, 3, root, [0, 1])
    with pytest.raises(ValueError, match="must be >= 1"):
        _C.numa_plan(-1, 0, root, [0, 1])


def test_mbind_probe():
    ok, msg = _C.numa_bind_probe(0)
    assert ok or "mbind" in msg  # a sandbox may refuse mbind: reported, never fatal
    ok, msg = _C.numa_bind_probe(4000)
    assert not ok and msg


def test_options_and_pool_api(two, capsys):
    from hetmoe.cli import main
    from hetmoe.config.options import EngineOptions

    assert parse_numa(None) == "auto" and parse_numa("OFF") == "off" and parse_numa("2") == 2 and parse_numa(3) == 3
    for bad in ("x", 0, "-1", True, 1.5):
        with pytest.raises(ValueError, match="numa must be auto, off or a number"):
            parse_numa(bad)
    assert EngineOptions(numa="2").numa == 2
    with pytest.raises(ValueError, match="numa must be"):
        EngineOptions(numa="two")
    assert resolve_subpools("off") == 1 and resolve_subpools(2) == 2
    assert resolve_subpools("auto") == topology()["cpu_nodes"]
    assert two.subpools == 2 and two.threads == 2
    assert two.pinned_cpus == [p["cpus"][0] for p in two.numa_plans]  # each subpool's thread on its own share
    assert len(two.numa_plans) == 2 and isinstance(two.numa_binding, str)
    with pytest.raises(ValueError, match="asks for 1 subpools; the pool given has 2"):
        CPUExperts(*TINY, pool=two, numa="off")
    assert shared_pool(2, numa=2) is shared_pool(2, numa="2") and shared_pool(2, numa=2).subpools == 2
    assert two.read_bandwidth(64 << 20, 1) > 0
    assert main(["doctor", "--numa", "2", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "engine: 2 subpools" in out and "subpool 1:" in out
    with pytest.raises(SystemExit):
        main(["doctor", "--numa", "zero"])
