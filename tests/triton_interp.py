"""Triton kernels in tests: without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton)."""

import contextlib
import importlib
import os
import subprocess
import sys

import pytest
import torch

from hetmoe import envs

RUN_ALL = os.environ.get("HETMOE_TEST_ALL", "") not in ("", "0")  # as tests/conftest.py


def triton_module(name: str, on_cpu: bool = False):
    """The hetmoe module ``name`` (one that imports triton), or a skip without the triton package. Without CUDA the
    interpreter is patched once: numpy >= 2.4 refuses int() of the 1-element arrays it keeps scalars in (loop
    bounds). ``on_cpu``: the caller launches the kernels on CPU tensors, which only the interpreter runs; tests/
    conftest.py turns it on only where there is no CUDA, so on a GPU machine such a test is skipped (the GPU tests
    beside it run the same kernels on the device)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not RUN_ALL:
        pytest.skip("Triton kernels on CPU run in Triton's interpreter: slow tier (HETMOE_TEST_ALL=1); checked with "
                    "Triton 3.6's interpreter (3.9's refuses scalar masks in several kernels)")
    if on_cpu and torch.cuda.is_available() and not envs.TRITON_INTERPRET:
        pytest.skip("runs Triton kernels on CPU tensors in the interpreter, which is off on a CUDA machine")
    if not torch.cuda.is_available():
        import triton.runtime.interpreter as interp

        if not getattr(interp, "_hetmoe_index_patch", False):
            original = interp._patch_lang_tensor

            def patched(tensor, *rest):
                original(tensor, *rest)
                tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

            interp._patch_lang_tensor = patched
            interp._hetmoe_index_patch = True
    return importlib.import_module(name)


@contextlib.contextmanager
def checked_accesses():
    """Under the interpreter: every masked-in load and store of a kernel launched inside must fall within the extent
    of one of that launch's tensor arguments (the view, not its whole storage), or the launch raises (Triton wraps
    the AssertionError in an InterpreterError). What the GPU would report as an illegal memory access, or silently
    read from a neighbouring buffer, fails here with the kernel's name and the argument extents."""
    import numpy as np
    import triton.runtime.interpreter as interp

    extents: list = []
    init, load, store = (interp.GridExecutor._init_args_hst, interp.InterpreterBuilder.create_masked_load,
                         interp.InterpreterBuilder.create_masked_store)

    def init_checked(self, args, kwargs):
        hst, kw = init(self, args, kwargs)
        extents[:] = [(self.fn.__name__, a.data_ptr(),
                       a.data_ptr() + (1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))) * a.element_size())
                      for a in list(hst) + list(kw.values()) if isinstance(a, torch.Tensor) and a.numel()]
        return hst, kw

    def check(ptrs, mask, what):
        addr = ptrs.data[mask.data.astype(bool)]
        size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addr.shape, dtype=bool)
        for _, lo, hi in extents:
            inside |= (addr >= lo) & (addr + size <= hi)
        name, spans = extents[0][0] if extents else "?", [(hex(lo), hi - lo) for _, lo, hi in extents]
        assert inside.all(), (f"{what} outside the arguments of {name}: {int((~inside).sum())} addresses, first "
                              f"{hex(int(addr[~inside][0]))}; arguments (address, bytes) {spans}")

    def load_checked(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interp.GridExecutor._init_args_hst = init_checked
    interp.InterpreterBuilder.create_masked_load = load_checked
    interp.InterpreterBuilder.create_masked_store = store_checked
    try:
        yield
    finally:
        interp.GridExecutor._init_args_hst = init
        interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store = load, store


def checked_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a [M, K], b [G, K, N], offs)`` for CPU tests, with its contract asserted (int32
    cumulative offsets, one per group of b, non-decreasing, the last <= M); rows past offs[-1] NaN, as unwritten GPU
    memory may be."""
    assert offs.dtype == torch.int32 and offs.dim() == 1 and a.dim() == 2 and b.dim() == 3, (offs, a.shape, b.shape)
    ends = offs.tolist()
    assert len(ends) == b.shape[0] and a.shape[1] == b.shape[1], (ends, a.shape, b.shape)
    assert all(x <= y for x, y in zip([0] + ends, ends)) and ends[-1] <= a.shape[0], (ends, a.shape)
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=a.dtype)
    start = 0
    for g, end in enumerate(ends):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def gpu_branch_on_cpu(monkeypatch, driver) -> None:
    """A ``LayerwisePrefill`` on a CPU device takes its GPU branch: the Triton unpack, the sync-free grouped GEMMs
    (``checked_grouped_mm``) and the combine kernel, all under the interpreter (``driver`` None: only the grouped
    GEMMs' branch, hetmoe/moe/grouped.py)."""
    from hetmoe.moe import grouped

    triton_module("hetmoe.ops.triton.packed", on_cpu=True)  # CPU tensors: the interpreter only (a skip on CUDA)
    triton_module("hetmoe.ops.triton.grouped", on_cpu=True)
    monkeypatch.setattr(grouped, "_grouped_mm_ok", lambda _w: True)
    monkeypatch.setattr(torch, "_grouped_mm", checked_grouped_mm, raising=False)
    if driver is not None:
        driver.triton_unpack = True


UNPACK_CHECK = """
import sys, torch
from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.ops.triton import packed as packed_triton
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
cuda = torch.cuda.is_available()
dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
E, H, I = %r
for kwargs in %r:
    experts = CPUExperts(E, H, I, pool=WorkerPool(1), **kwargs)
    experts.fill_random(seed=9)
    lay = ExpertLayout.of(experts)
    ranges = expert_ranges(experts)
    ref_gu, ref_d = unpack_experts(lay, ranges, E, torch.float32)
    w_gu = torch.full((E, 2 * I, H), float("nan"), dtype=dtype, device=dev)
    w_d = torch.full((E, H, I), float("nan"), dtype=dtype, device=dev)
    packed_triton.unpack_into(lay, [r.to(dev) for r in ranges], w_gu, w_d)
    if not (torch.equal(w_gu.cpu(), ref_gu.to(dtype)) and torch.equal(w_d.cpu(), ref_d.to(dtype))):
        sys.exit(f"{kwargs}: the kernel's weights differ from the engine's")
print("ok")
"""


def assert_unpack_equals_engine(shape: tuple, layouts: list) -> None:
    """The layerwise prefill's one-pass kernel (hetmoe/ops/triton/packed.py) against the engine's own unpack, for
    ``CPUExperts(*shape, **kwargs)`` (seeded random weights) per dict in ``layouts``: on a GPU bitwise the engine's
    values rounded to bf16; without one under Triton's interpreter, in a fresh process (the interpreter is chosen when
    the kernel is defined), bitwise in fp32 (the interpreter truncates where the GPU rounds)."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", UNPACK_CHECK % (tuple(shape), list(layouts))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
