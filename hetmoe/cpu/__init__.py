"""The CPU side of hetmoe: the routed experts' engine (``CPUExperts``, experts.py; a job's ``Slots`` and ``HostRoute``
say which of each token's slots it computes and whether it routes itself; ``load_codes``, codes.py: experts packed
from codes quantized already, e.g. GGUF's Q8_0 / Q4_0), dense linears on the same engine (``CPULinear``,
linear.py), its pinned worker pools (``WorkerPool``, pool.py), NUMA subpools (numa.py) and the stream-ordered host
functions through which a CUDA stream submits and waits for CPU jobs (``HostFuncs``, host_funcs.py). The C++ behind
them is ``hetmoe._C`` (csrc/)."""

from hetmoe import _C  # noqa: F401
from hetmoe.config.options import AMX_EMULATED, ISAS, NumaOption
from hetmoe.cpu.attention import attention_kernel, decode_attention
from hetmoe.cpu.codes import load_codes
from hetmoe.cpu.experts import SWIGLU, WEIGHT_FORMATS, CPUExperts, Glu, HostRoute, Slots
from hetmoe.cpu.host_funcs import MECHANISMS, HostFuncs, cuda_hooks_available, default_mechanism, leaked_jobs
from hetmoe.cpu.linear import CPULinear
from hetmoe.cpu.numa import resolve_subpools
from hetmoe.cpu.pool import HYBRID_RESERVED_CORES, EngineJob, WorkerPool, cpu_info, default_threads, shared_pool

__all__ = [
    "AMX_EMULATED", "ISAS", "WEIGHT_FORMATS", "CPUExperts", "Glu", "SWIGLU", "HostRoute", "Slots", "load_codes",
    "CPULinear",
    "MECHANISMS", "HostFuncs",
    "leaked_jobs", "cuda_hooks_available", "default_mechanism", "NumaOption", "resolve_subpools",
    "HYBRID_RESERVED_CORES", "WorkerPool", "EngineJob", "cpu_info", "default_threads", "shared_pool",
    "attention_kernel", "decode_attention",
]
