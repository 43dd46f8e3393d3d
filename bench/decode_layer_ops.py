"""The ops of one MoE layer of a hybrid decode step, listed in order, counted on the CPU (issue 27): a tiny model of
each architecture with its routed experts on the CPU engine, driven by a ``StreamDecode`` on a ``FakeStream`` (the
CPU stand-in for the CUDA stream: the same host functions, staging buffers and copies as on a GPU), one decode step
of ``batch`` rows, fused decode path on (Triton kernels through the interpreter) or off. Every aten op that would
launch a GPU kernel or a copy is listed (views and no-op casts are not), each Triton kernel as one, and each stream
host function (SUBMIT / SYNC) as one node. Run from the repo root (seconds per architecture):

    TRITON_INTERPRET=1 python3 bench/decode_layer_ops.py [--arch=qwen3_moe,deepseek_v3] [--fused=off,on,on+mapped]
        [--batch=1] [--layer=N] [--step]

``--step`` lists the whole step's ops instead of one layer's. ``--layer``: the decoder layer listed (default: the
last MoE layer but one, a layer with a successor). ``on+mapped``: the fused path with the MoE layers' mapped staging
(``StreamDecode.step(mapped=True)``), as the GPU decoder runs it; ``on``: the fused path with the staging copies.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hetmoe import _C  # noqa: E402
from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.cpu import host_funcs  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.load.loader import moe_blocks  # noqa: E402
from hetmoe.load.random_weights import _config, build_random_model  # noqa: E402
from hetmoe.moe import StreamDecode  # noqa: E402
from hetmoe.ops.triton import attention as triton_attention  # noqa: E402
from hetmoe.ops.triton import fused as triton_fused

_patch = interp._patch_lang_tensor


def _index_patch(tensor, *rest):  # numpy >= 2.4 refuses int() of the interpreter's 1-element scalars (loop bounds)
    _patch(tensor, *rest)
    tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])


interp._patch_lang_tensor = _index_patch

FREE = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.slice", "aten.select", "aten.expand",
        "aten.unsqueeze", "aten.squeeze", "aten.t", "aten.transpose", "aten.permute", "aten.as_strided",
        "aten.split", "aten.split_with_sizes", "aten.detach", "aten.alias", "aten.empty", "aten.empty_like",
        "aten.empty_strided", "aten.unbind", "aten.lift_fresh", "aten._to_copy.noop", "aten.is_same_size",
        "aten._local_scalar_dense", "aten.numpy_T", "aten.clone.noop"}


class Ops(TorchDispatchMode):
    """Records the aten ops run outside a Triton kernel's Python (the interpreter's own tensor work is not a GPU
    op), with a marker per decoder layer."""

    def __init__(self):
        super().__init__()
        self.log, self.muted = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.muted:
            name = str(func.overloadpacket)
            if name not in FREE and not (not name.endswith("_") and _aliases(out, args)):
                self.log.append(_describe(name, args, kwargs or {}))
        return out


def _aliases(out, args) -> bool:
    """A view or a cast that copied nothing: the result shares an input's memory."""
    if not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


def _describe(name: str, args, kwargs) -> str:
    if name == "aten.copy_":
        dst, src = args[0], args[1]
        return f"copy_ {tuple(src.shape)} {str(src.dtype)[6:]}->{str(dst.dtype)[6:]}"
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    return f"{name[5:]} {shapes}"


OPS: Ops = None


def _muted(label: str, fn):
    def call(*a, **k):
        if OPS is not None:
            OPS.log.append(label)
            OPS.muted += 1
        try:
            return fn(*a, **k)
        finally:
            if OPS is not None:
                OPS.muted -= 1
    return call


for _mod in (triton_fused, triton_attention):
    for _name in ("add_rms_norm", "qkv_epilogue", "mla_epilogue", "silu_mul", "decode", "router_stage",
                  "add_rows"):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _muted(f"triton {_name}", getattr(_mod, _name)))
for _name in ("submit", "sync"):  # the stream host functions: one graph node each on a GPU
    _orig = getattr(host_funcs.HostFuncs, _name, None)
    if _orig is not None:
        setattr(host_funcs.HostFuncs, _name, (lambda f, n: lambda *a, **k: _muted(f"host {n}", f)(*a, **k))(
            _orig, _name.upper()))


def layer_ops(arch: str, fused: bool, batch: int, layer: int = -1, mapped: bool = None) -> tuple:
    """(index of the listed layer, its ops, the whole step's ops) of one decode step. ``mapped`` (default: fused):
    the StreamDecode's mapped staging."""
    global OPS
    mapped = fused if mapped is None else mapped
    cfg = _config(arch, {"num_hidden_layers": 4}, 300).to_dict()
    opts = EngineOptions(device="cpu", dtype="fp32", experts_format="bf16", max_context=96, max_batch=8)
    loaded = build_random_model(cfg, None, opts, log=lambda m: None)
    model = loaded.model
    layers = [m for _, m in moe_blocks(model)]
    fake = _C.FakeStream()
    hybrid = StreamDecode(8, "cpu", layers, fake_stream=fake)
    cache = model.make_cache(8, 96, torch.float32, "cpu", page_size=16, initial_tokens=96)
    decoder_layers = model.model.layers
    index = layer if layer >= 0 else max(i for i, m in enumerate(decoder_layers) if hasattr(m.mlp, "moe")) - 1
    marks = []
    for i, mod in enumerate(decoder_layers):
        for attr in ("forward", "forward_fused"):
            if hasattr(mod, attr):
                setattr(mod, attr, (lambda f, i: lambda *a, **k: marks.append((i, len(OPS.log) if OPS else 0))
                                    or f(*a, **k))(getattr(mod, attr), i))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for s in range(batch):
            n = 14 + 3 * s
            model(torch.randint(3, 300, (1, n), generator=gen), Step(torch.arange(n).view(1, n), torch.tensor([s]),
                                                                      kv_len=n), cache)
        pos = torch.tensor([14 + 3 * s for s in range(batch)]).view(batch, 1)
        ids = torch.randint(3, 300, (batch, 1), generator=gen)
        for record in (False, True):  # the first step makes the static buffers and jobs
            step = Step(pos, torch.arange(batch), kv_len=96, fused=fused)
            marks.clear()
            OPS = Ops() if record else None
            with hybrid.step(torch.tensor([batch]), mapped=mapped), (OPS if record else _null()):
                hidden = model(ids, step, cache)[:, -1]
                model.logits(hidden)
            fake.synchronize()
    ops = OPS.log
    OPS = None
    bounds = [n for i, n in marks] + [len(ops)]
    at = [j for j, (i, _) in enumerate(marks) if i == index][0]
    hybrid.close()
    return index, ops[bounds[at]:bounds[at + 1]], ops


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def opt(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


if __name__ == "__main__":
    for arch in opt("arch", "qwen3_moe,deepseek_v3").split(","):
        for fused in opt("fused", "off,on,on+mapped").split(","):
            index, ops, step_ops = layer_ops(arch, fused != "off", int(opt("batch", "1")), int(opt("layer", "-1")),
                                             fused == "on+mapped")
            print(f"{arch} fused={fused}: layer {index}: {len(ops)} ops (whole step: {len(step_ops)})")
            for op in step_ops if "--step" in sys.argv else ops:
                print(f"    {op}")
