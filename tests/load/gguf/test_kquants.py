"""GGUF's K-quant experts (Q2_K .. Q6_K), the blocks of 32 with mins or fifth bits (Q4_1, Q5_0, Q5_1) and the ternary
TQ2_0 / TQ1_0 at their own precision (hetmoe/load/gguf/kquants.py, checkpoint.py block_codes, ternary.py ->
hetmoe/cpu/codes.py -> the affine, group-16, int2 group-128 and k8 / fp16 scale layouts of csrc/formats/layout.h).

Fixtures: the ``gguf`` package cannot quantize K-quants, so the blocks are written here from random bytes — every
byte pattern is a valid block (codes, 6-bit and int8 scales) once the fp16 d / dmin fields hold finite values — and
``gguf.quants.dequantize`` of those bytes is the reference; TQ2_0 / TQ1_0 are quantized by the gguf package (random
ternary bytes: tests/load/gguf/test_ternary.py). No binary fixture is committed.

Paths covered: the row-block kernels at each ISA the tests may use (scalar, AVX2, AVX-512: HETMOE_MAX_ISA / the
CPU caps the list), the AMX GEMM through its emulation (``isa="amx-emulated"``) and, on a CPU with AMX, natively; one
pool and two NUMA subpools; the GPU prefill's PyTorch unpack (hetmoe/moe/streamed/packed.py) and its Triton kernel
(interpreted here, on the GPU there). Tolerances are written next to each comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from triton_interp import assert_unpack_equals_engine

from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import exact_layout, load_codes
from hetmoe.load.gguf.kquants import kquant_codes
from hetmoe.load.gguf.ternary import TERNARY, ternary_codes
from reference import ACTIVATION_QMAX, _moe, fake_quantize, rel_err

gguf = pytest.importorskip("gguf")
from gguf_files import BLOCKS_32, assert_torch_unpack_equals_engine, random_blocks  # noqa: E402

E, H, I = 3, 256, 512
HAS_AMX = "amx" in cpu_info()["supported_isas"]
ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
PATHS = ROW_ISAS + ["amx-emulated"] + (["amx"] if HAS_AMX else [])
AMX_PATHS = ("amx-emulated", "amx")
ROWS_ONLY = 10**6  # amx_min_tokens that keeps every expert on the row-block kernels
# (gate/up type, down type): one type per layer, unsloth's Q4_K_M mix (Q4_K gate/up, Q6_K down), Q2_K / Q3_K_M-like
# mixes (group 16 beside 32), the blocks of 32 with mins (Q4_1, Q5_1) or a fifth bit (Q5_0), and the ternary types
# (int2 group 128; TQ1_0 gate/up beside a Q2_K down, as a "UD-TQ1_0" file may have)
LAYERS = [("Q4_K", "Q4_K"), ("Q5_K", "Q5_K"), ("Q6_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q6_K", "Q8_0"),
          ("Q3_K", "Q3_K"), ("Q2_K", "Q2_K"), ("Q2_K", "Q3_K"), ("Q3_K", "Q4_K"), ("Q4_1", "Q4_1"), ("Q5_0", "Q5_1"),
          ("TQ2_0", "TQ2_0"), ("TQ1_0", "TQ1_0"), ("TQ1_0", "Q2_K")]
# RAM held / file bytes of one type's matrices (whole super-blocks, rows a multiple of 16): codes + scale sets
RAM_FACTOR = {"Q4_K": (4 + 16 / 32 + 32 / 256) / 4.5, "Q5_K": (5 + 16 / 32 + 32 / 256) / 5.5,
              "Q6_K": (6 + 8 / 16 + 16 / 256) / 6.5625, "Q3_K": (3 + 8 / 16 + 16 / 256) / 3.4375,
              "Q2_K": (2 + 8 / 16 + 32 / 256) / 2.625, "Q4_1": 1.0, "Q5_0": 1.0, "Q5_1": 1.0, "Q8_0": 1.0,
              # the ternary types as int2 with an fp16 scale per 128 (the file's d per 256, twice)
              "TQ2_0": (2 + 16 / 128) / 2.0625, "TQ1_0": (2 + 16 / 128) / 1.6875}


def matrix_codes(kind: str, raw: np.ndarray, shape: tuple) -> tuple:
    if kind in TERNARY:
        return (*ternary_codes(raw, kind, shape), None)
    if kind in BLOCKS_32:
        from hetmoe.load.gguf.checkpoint import block_codes

        return block_codes(raw, kind, shape)
    return kquant_codes(raw, kind, shape)


def layout_of(kinds: tuple) -> dict:
    """CPUExperts arguments holding (gate/up type, down type) exactly."""
    return exact_layout(*kinds)


def kquant_experts(kinds: tuple, seed: int, pool: WorkerPool, isa: str = "auto", centered: bool = False, **kw):
    """(experts loaded from random blocks, gguf's dequantization of gate, up, down [E, rows, cols] each)."""
    rng = np.random.default_rng(seed)
    experts = CPUExperts(E, H, I, threads=None, pool=pool, isa=isa, **layout_of(kinds), **kw)
    codes, scales, mins, refs = [], [], [], []
    for kind, (rows, cols) in zip((kinds[0], kinds[0], kinds[1]), ((I, H), (I, H), (H, I))):
        qt = getattr(gguf.GGMLQuantizationType, kind)
        raws = [gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qt)
                if kind in TERNARY else random_blocks(kind, rows, cols, rng, centered) for _ in range(E)]
        refs.append(torch.stack([torch.from_numpy(gguf.quants.dequantize(r, qt).astype(np.float32)) for r in raws]))
        q, s, m = matrix_codes(kind, np.stack(raws), (E, rows, cols))
        codes.append(q), scales.append(s), mins.append(m)
    load_codes(experts, codes, scales, mins=mins)
    return experts, refs


@pytest.fixture(scope="module")
def two_subpools():
    return WorkerPool(2, numa=2)


@pytest.mark.parametrize("split", [False, True], ids=["one-pool", "numa2"])
@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_packed_experts_dequantize_bitwise_as_gguf(kinds, split, two_subpools):
    experts, refs = kquant_experts(kinds, 1, two_subpools if split else WorkerPool(1))
    for e in range(E):
        for got, want in zip(experts.dequantized(e), refs):
            assert torch.equal(got.view(torch.int32), want[e].view(torch.int32))  # bit for bit, -0.0 included


def reference(experts, x, ids, w, refs, amx: bool) -> torch.Tensor:
    """The float64 MoE on gguf's values with the engine's activation rounding: x per gate/up group in gate/up's
    activation format, h per down group in down's (row blocks: int16 for int8 weights, int8 for int4; AMX: int8)."""
    info = experts.info()
    qmax_x, qmax_h = (ACTIVATION_QMAX["int8" if amx else info[a]] for a in ("activation", "down_activation"))
    qx = lambda v: fake_quantize(v, info["group_size"], qmax_x).double()  # noqa: E731
    qh = lambda v: fake_quantize(v, info["down_group_size"], qmax_h).double()  # noqa: E731
    weights_of = lambda e: tuple(r[e].double() for r in refs)  # noqa: E731
    return _moe(x.double(), weights_of, refs[0].shape[0], ids, w, None, qx, qh)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
@pytest.mark.parametrize("T", [1, 37])
def test_a_moe_call_matches_the_reference_on_gguf_values(kinds, T, path):
    """Each path against the reference on the same values and activation rounding (tight: fp32 summation order
    only; measured max 3.4e-6) and against the plain fp64 MoE on gguf's values (the activation rounding: measured
    max 1.3e-2 with int8 activations, 1.7e-2 for TQ2_0 / TQ1_0's int8 per group of 128, 4.9e-5 with int16). T = 1 is
    decode, T = 37 a prefill chunk."""
    amx = path in AMX_PATHS
    kw = dict(isa=path, amx_min_tokens=1) if amx else dict(isa=path)  # every expert on one path
    experts, refs = kquant_experts(kinds, 2, WorkerPool(1), centered=True, **kw)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, 2), generator=gen)
    ids[0, 1] = -1  # a skipped slot
    w = torch.rand(T, 2, generator=gen)
    got = experts.forward(x, ids, w)
    # Q2_K: codes 0..3 beside a min of ~1.5 scales, so each group's two epilogue terms nearly cancel and fp32's
    # rounding of them weighs ~10x more (measured max 4.4e-5, the same on every path, scalar included)
    tight = 1e-4 if "Q2_K" in kinds else 1e-5
    assert rel_err(got, reference(experts, x, ids, w, refs, amx)) < tight
    plain = _moe(x.double(), lambda e: tuple(r[e].double() for r in refs), E, ids, w, None, lambda v: v.double(),
                 lambda v: v.double())
    int8_act = amx or experts.info()["activation"] == "int8" or experts.info()["down_activation"] == "int8"
    assert rel_err(got, plain) < (3e-2 if int8_act else 2e-4)


ODD_LAYOUTS = [dict(weight_format="int4", group_size=32, scaling="affine"),
               dict(weight_format="int8", group_size=16),
               dict(weight_format=("int4", "int8"), group_size=32, down_group_size=16, scaling=("affine", "symmetric"))]


@pytest.mark.parametrize("path", ["rows", "amx-emulated"] + (["amx"] if HAS_AMX else []))
@pytest.mark.parametrize("layout", ODD_LAYOUTS, ids=["int4-affine", "int8-g16", "int4+int8"])
@pytest.mark.parametrize("H, I, E_odd, T, k", [(96, 40, 5, 1, 1), (130, 24, 7, 7, 6), (64, 144, 3, 64, 2)])
def test_odd_shapes_match_the_dequantized_reference(layout, path, H, I, E_odd, T, k):
    """The new layouts packed from fp32 (csrc/formats/pack.cpp: an affine group takes its range with 0), K and N
    padded: the engine against the fp64 MoE on its own dequantized weights with its activation rounding (tight:
    measured max 6.3e-6), experts with no tokens and -1 ids included."""
    amx = path != "rows"
    kw = dict(isa=path, amx_min_tokens=1) if amx else dict(amx_min_tokens=ROWS_ONLY)
    experts = CPUExperts(E_odd, H, I, pool=WorkerPool(1), **layout, **kw)
    gen = torch.Generator().manual_seed(H + T)
    experts.load(*(torch.randn(E_odd, r, c, generator=gen) * 0.05 for r, c in ((I, H), (I, H), (H, I))))
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E_odd - 1, (T, k), generator=gen)  # the last expert gets no token
    ids[-1, k - 1] = -1 if T > 1 else ids[-1, k - 1]  # a skipped slot (not the only one)
    w = torch.rand(T, k, generator=gen)
    dq = [experts.dequantized(e) for e in range(E_odd)]
    refs = [torch.stack([d[m] for d in dq]) for m in range(3)]
    assert rel_err(experts.forward(x, ids, w), reference(experts, x, ids, w, refs, amx)) < 2e-5


@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_amx_emulated_and_row_blocks_agree_on_one_token_per_expert(kinds):
    """Below amx_min_tokens the AMX engine runs the row-block kernels: the same bits as a row-block engine."""
    a, _ = kquant_experts(kinds, 3, WorkerPool(1), isa="amx-emulated", amx_min_tokens=ROWS_ONLY)
    b, _ = kquant_experts(kinds, 3, WorkerPool(1), amx_min_tokens=ROWS_ONLY)
    gen = torch.Generator().manual_seed(5)
    x, ids, w = torch.randn(4, H, generator=gen), torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]]), torch.rand(4, 2)
    assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))


@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_held_bytes_are_the_files_own(kinds):
    """The engine holds each type within its RAM factor of the file's bytes (the k8 scale sets: an int8 sub-scale per
    group, an fp16 per 256 values; Q2_K's k4: a byte of 4-bit sub-scale and sub-min per group, an fp16 d and dmin per
    256 values; fp16 scales and mins): Q4_K and Q4_1 at <= 1.05x, exactly as
    hetmoe/cpu/layout.py counts it (the memory plan's and ``hetmoe plan``'s number)."""
    from hetmoe.cpu.layout import layout_bytes

    experts, _ = kquant_experts(kinds, 7, WorkerPool(1))
    per_expert = experts.info()["bytes_per_expert"]
    assert per_expert == layout_bytes(exact_layout(*kinds), H, I) == experts.nbytes // E
    qt = [getattr(gguf.GGMLQuantizationType, k) for k in kinds]
    file = [gguf.GGML_QUANT_SIZES[t][1] * rows * cols // gguf.GGML_QUANT_SIZES[t][0]
            for t, (rows, cols) in zip((qt[0], qt[0], qt[1]), ((I, H), (I, H), (H, I)))]
    want = (2 * file[0] * RAM_FACTOR[kinds[0]] + file[2] * RAM_FACTOR[kinds[1]])
    assert per_expert == pytest.approx(want, rel=1e-12)
    for kind in set(kinds) & {"Q4_K", "Q4_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "TQ2_0"}:  # (Q6_K, Q2_K: the file's)
        assert RAM_FACTOR[kind] <= 1.05
    # Q2_K's 4-bit sub-scale and sub-min pairs, fp16 d and dmin (k4) and 2-bit codes: the file's 84 bytes per 256
    if kinds == ("Q2_K", "Q2_K"):
        assert per_expert == sum(file)


@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_the_gpu_prefill_unpack_equals_the_engine(kinds):
    """hetmoe/moe/streamed/packed.py's torch twin reads the affine, group-16, k8 / k4 / fp16 scale, bit-plane (Q6_K,
    Q5_K, Q3_K, Q2_K) and mixed-format layouts bitwise (fp32) like the engine, on the files' own blocks (H = 256: one
    super-block of gate/up; I = 512: two of down)."""
    experts, _ = kquant_experts(kinds, 4, WorkerPool(1))
    info = experts.info()
    for kind, key in zip(kinds, ("gate_up_scale_dtype", "down_scale_dtype")):  # Q2_K's own two levels: k4
        assert (info[key] == "k4") == (kind == "Q2_K"), (kinds, info[key])
    assert_torch_unpack_equals_engine(experts, E)
    if "Q2_K" in kinds:  # k4's reader in the one-pass kernel too, on the same blocks
        env = dict(os.environ)
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
        here = Path(__file__).resolve().parent
        done = subprocess.run([sys.executable, "-c", KQUANT_TRITON_CHECK % ([str(here), str(here.parents[1])], kinds)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# The layerwise prefill's one-pass kernel (hetmoe/ops/triton/packed.py) on a layer of GGUF blocks, against
# CPUExperts.dequantized: in a fresh process (the interpreter is chosen when the kernel is defined), bitwise fp32
# under the interpreter, bitwise the values rounded to bf16 on a GPU
KQUANT_TRITON_CHECK = """
import sys, torch
sys.path[:0] = %r
from test_kquants import E, kquant_experts
from hetmoe.cpu import WorkerPool
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges
from hetmoe.ops.triton import packed as packed_triton
dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
experts, _ = kquant_experts(%r, 4, WorkerPool(1))
H, I = experts.hidden_size, experts.intermediate_size
w_gu = torch.full((E, 2 * I, H), float("nan"), dtype=dtype, device=dev)
w_d = torch.full((E, H, I), float("nan"), dtype=dtype, device=dev)
packed_triton.unpack_into(ExpertLayout.of(experts), [r.to(dev) for r in expert_ranges(experts)], w_gu, w_d)
for e in range(E):
    g, u, d = experts.dequantized(e)
    if not (torch.equal(w_gu[e].cpu(), torch.cat([g, u]).to(dtype)) and torch.equal(w_d[e].cpu(), d.to(dtype))):
        sys.exit(f"expert {e}: the kernel's weights differ from the engine's")
print("ok")
"""


def test_bad_blocks_and_layouts_are_refused():
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match="not whole super-blocks of 256"):
        kquant_codes(np.zeros(144 * 2, np.uint8), "Q4_K", (2, 128))
    with pytest.raises(ValueError, match=r"Q6_K \[2, 256\] needs 420 bytes, got 419"):
        kquant_codes(np.zeros(419, np.uint8), "Q6_K", (2, 256))
    with pytest.raises(ValueError, match=r"Q2_K \[1, 256\] needs 84 bytes, got 110"):
        kquant_codes(np.zeros(110, np.uint8), "Q2_K", (1, 256))
    experts = CPUExperts(E, H, I, "int4", 32, pool=WorkerPool(1), scaling="affine", scale_dtype="k8")
    codes, scales, mins = [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q, s, m = kquant_codes(np.stack([random_blocks("Q4_K", rows, cols, rng) for _ in range(E)]), "Q4_K",
                               (E, rows, cols))
        codes.append(q), scales.append(s), mins.append(m)
    with pytest.raises(ValueError, match="gate is held affine: mins are needed"):
        load_codes(experts, codes, scales)
    bad = mins[2].clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="down has mins that are NaN or Inf"):
        load_codes(experts, codes, scales, mins=[mins[0], mins[1], bad])
    neg = codes[1].clone()
    neg[0, 0, 0] = -1
    with pytest.raises(ValueError, match=r"up has codes in \[-1, 15\]; int4 affine holds \[0, 15\]"):
        load_codes(experts, [codes[0], neg, codes[2]], scales, mins=mins)
    assert experts.info()["experts_loaded"] == 0
    with pytest.raises(ValueError, match=r"group_size must be 16, 32, 64 or 128 \(or 0 for per-row\), got 8"):
        CPUExperts(E, H, I, "int4", 8, pool=WorkerPool(1))
    with pytest.raises(ValueError, match="affine scaling needs a group size"):
        CPUExperts(E, H, I, "int8", 0, pool=WorkerPool(1), scaling="affine")
    with pytest.raises(ValueError, match="unknown scaling 'asym'"):
        CPUExperts(E, H, I, "int8", 32, pool=WorkerPool(1), scaling="asym")


# The layouts of LAYERS with the scale dtypes of the files (Q4_K, Q5_K, Q6_K, Q4_K + Q6_K, Q3_K, Q2_K, Q4_1, Q5_0 +
# Q5_1), and the K-quants' layouts with fp32 scales (their bytes before k8)
TRITON_LAYOUTS = [("int4", 32, 32, "affine", "k8"), ("int8", 32, 32, "affine", "k8"),
                  ("int8", 16, 16, "symmetric", "k8"), (("int4", "int8"), 32, 16, ("affine", "symmetric"), "k8"),
                  ("int4", 16, 16, "symmetric", "k8"), ("int4", 16, 16, "affine", "k8"),
                  ("int4", 32, 32, "affine", "fp16"), ("int8", 32, 32, ("symmetric", "affine"), "fp16"),
                  ("int4", 32, 32, "affine", "fp32"), ("int8", 16, 16, "symmetric", "fp32")]


def test_the_triton_unpack_reads_the_kquant_layouts():
    """The layerwise prefill's one-pass kernel on the affine, group-16, k8 and fp16-min layouts (@gpu run: the same
    test), K padded to the group in down; H = 288: two k8 super-blocks, the second partial."""
    assert_unpack_equals_engine((2, 288, 40), [dict(weight_format=fmt, group_size=group, down_group_size=down_group,
                                                    scaling=scaling, scale_dtype=sdt)
                                               for fmt, group, down_group, scaling, sdt in TRITON_LAYOUTS])


def test_bench_kernel_takes_the_gguf_formats():
    """`hetmoe bench kernel --formats` lists the same names the benchmark builds (the CLI imports no torch)."""
    from hetmoe.bench.kernel import FORMATS, format_args
    from hetmoe.cli.bench import KERNEL_FORMATS

    assert FORMATS == KERNEL_FORMATS
    assert format_args("q4_k_m", None) == {"weight_format": ("int4", "int6"), "group_size": 32,
                                           "down_group_size": 16, "scaling": ("affine", "symmetric"),
                                           "scale_dtype": ("k8", "k8"), "codebook": (None, None)}
    assert format_args("int4", 32) == {"weight_format": "int4", "group_size": 32}
