"""Decode attention over the contiguous KV cache on the CPU engine's threads (csrc/dense/attention.h).

One query token per sequence, each at its own position: ``q [B, Hq, D1]`` over one layer's cache ``k [rows, cap, Hkv,
D1]`` / ``v [rows, cap, Hkv, Dv]`` (hetmoe/layers/kv_cache.py, contiguous layout, fp32 or bf16), sequence b reading
cache row ``rows[b]`` at positions ``< lens[b]``. Query head h reads kv head ``h // (Hq // Hkv)``. MLA's absorbed
form: a second key part (``q2 [B, Hq, D2]`` against ``k2 [rows, cap, Hkv, D2]``) and the latent as the value
(``v_is_k1``). With ``sinks [Hq]``, each head's sink logit joins its softmax's denominator and adds no value
(gpt-oss); with ``window``, sequence b attends only to its last ``window`` positions (``lens[b] - window <= t``).
Softmax in fp32, output in q's dtype; bitwise the same for any thread count (a fixed split of the keys
and a fixed merge order), different rounding on the portable and the AVX2 build of the loops
(``attention_kernel()``).
"""

from __future__ import annotations

from typing import Optional

import torch

from hetmoe import _C
from hetmoe.cpu import pool as _pool
from hetmoe.cpu.pool import default_pool

DTYPES = (torch.float32, torch.bfloat16)


def attention_kernel() -> str:
    """Which build of the loops runs on this CPU: ``"avx2"`` or ``"portable"`` (HETMOE_MAX_ISA caps it)."""
    return _C.attention_kernel()


def _check(name: str, t: torch.Tensor, dims: int, dtypes=DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"decode_attention: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"decode_attention: {name} must be on the CPU, got {t.device}")
    if t.dim() != dims:
        raise ValueError(f"decode_attention: {name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"decode_attention: {name} must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"decode_attention: {name}'s last dim must be contiguous (stride 1), got {t.stride()}")


def _index(name: str, t, B: int) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.device.type != "cpu" or t.dim() != 1 or t.shape[0] != B or t.dtype.is_floating_point:
        raise ValueError(f"decode_attention: {name} must be a CPU integer tensor of shape [{B}], got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return t.to(torch.int64).contiguous()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], rows, lens, scale: float,
                     q2: Optional[torch.Tensor] = None, k2: Optional[torch.Tensor] = None, v_is_k1: bool = False,
                     out: Optional[torch.Tensor] = None, pool: Optional[_pool.WorkerPool] = None,
                     sinks: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Attention of B decode queries over their cache rows -> ``out [B, Hq, Dv]`` (q's dtype, or the ``out`` given:
    fp32 or q's dtype).

    ``q [B, Hq, D1]`` (fp32 or bf16; ``q2 [B, Hq, D2]`` the same dtype), ``k [rows, cap, Hkv, D1]`` (``k2 [rows, cap,
    Hkv, D2]``, ``v [rows, cap, Hkv, Dv]``: one dtype, fp32 or bf16, any strides with a contiguous last dim),
    ``rows [B]`` the cache row of each sequence, ``lens [B]`` its keys (position + 1, 1..cap). ``v_is_k1``: no ``v``;
    the values are k's first Dv = D1 dims. ``sinks [Hq]`` (any float dtype, used in fp32): a logit per head in the
    softmax's denominator, unscaled, with no value. ``window`` (an int >= 1): only positions ``lens[b] - window ..
    lens[b] - 1`` are attended (the query's own included). ``pool``: an ``WorkerPool`` (default:
    ``default_pool()``); the call runs after the jobs queued on it and returns when done.
    """
    _check("q", q, 3)
    _check("k", k, 4)
    B, Hq, D1 = q.shape
    n_rows, cap, Hkv, Dk = k.shape
    if Dk != D1:
        raise ValueError(f"decode_attention: q's head dim {D1} differs from k's {Dk}")
    if Hq % Hkv:
        raise ValueError(f"decode_attention: q's {Hq} heads are not a multiple of the cache's {Hkv} kv heads")
    if v_is_k1 != (v is None):
        raise ValueError("decode_attention: give v, or v=None with v_is_k1=True (the values are k's first dims)")
    if (q2 is None) != (k2 is None):
        raise ValueError("decode_attention: q2 and k2 come together (MLA's second key part)")
    D2 = 0
    if q2 is not None:
        _check("q2", q2, 3, (q.dtype,))
        _check("k2", k2, 4, (k.dtype,))
        D2 = q2.shape[2]
        if q2.shape[:2] != q.shape[:2] or k2.shape[:3] != k.shape[:3] or k2.shape[3] != D2:
            raise ValueError(f"decode_attention: q2 {tuple(q2.shape)} / k2 {tuple(k2.shape)} do not match q "
                             f"{tuple(q.shape)} / k {tuple(k.shape)} with a second part of one size")
    if v is not None:
        _check("v", v, 4, (k.dtype,))
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"decode_attention: v {tuple(v.shape)} must share [rows, cap, kv_heads] with k "
                             f"{tuple(k.shape)}")
        Dv = v.shape[3]
    else:
        Dv = D1
    rows, lens = _index("rows", rows, B), _index("lens", lens, B)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"decode_attention: window must be an int >= 1 (or None), got {window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.device.type != "cpu" or not sinks.dtype.is_floating_point \
                or tuple(sinks.shape) != (Hq,):
            raise ValueError(f"decode_attention: sinks must be a CPU float tensor of shape [{Hq}], got "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}")
        sinks = sinks.detach().to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(B, Hq, Dv, dtype=q.dtype)
    else:
        _check("out", out, 3, (torch.float32, q.dtype))
        if tuple(out.shape) != (B, Hq, Dv):
            raise ValueError(f"decode_attention: out must have shape {(B, Hq, Dv)}, got {tuple(out.shape)}")
    bf16 = torch.bfloat16
    spec = _C.AttentionSpec(
        q=q.data_ptr(), q_strides=list(q.stride()[:2]), q_bf16=q.dtype == bf16,
        k1=k.data_ptr(), k1_strides=list(k.stride()[:3]), kv_bf16=k.dtype == bf16,
        rows=rows.data_ptr(), lens=lens.data_ptr(), n_rows=n_rows, cap=cap,
        B=B, n_head=Hq, n_kv_head=Hkv, d1=D1, d2=D2, dv=Dv, scale=float(scale),
        out=out.data_ptr(), out_strides=list(out.stride()[:2]), out_bf16=out.dtype == bf16)
    if q2 is not None:
        spec.q2, spec.q2_strides = q2.data_ptr(), list(q2.stride()[:2])
        spec.k2, spec.k2_strides = k2.data_ptr(), list(k2.stride()[:3])
    if v is not None:
        spec.v, spec.v_strides = v.data_ptr(), list(v.stride()[:3])
    if sinks is not None:
        spec.sinks = sinks.data_ptr()
    if window is not None:
        spec.window = window
    _C.decode_attention((pool or default_pool())._pool, spec)
    return out


def _block_check(name: str, t, dims: int, dtypes=DTYPES) -> None:
    try:
        _check(name, t, dims, dtypes)
    except ValueError as e:
        raise ValueError(str(e).replace("decode_attention:", "decode_block:", 1)) from None


class DecodeBlock:
    """A ``decode_block`` call bound to its buffers (``prepare_decode_block``): ``run()`` as often as needed, their
    contents may change between runs (a decode loop's fixed buffers: no argument checks or binding per call)."""

    def __init__(self, spec, keep: tuple, out: torch.Tensor, pool: _pool.WorkerPool):
        self._spec, self._keep, self.out, self.pool = spec, keep, out, pool

    def run(self) -> torch.Tensor:
        """Runs after the jobs queued on the pool; returns ``out`` when done."""
        _C.decode_block(self.pool._pool, self._spec)
        return self.out

    def job(self) -> _pool.EngineJob:
        """The same call as a job for ``pool.submit`` or a ``job_list`` (its errors raised by the pool's sync)."""
        return _pool.EngineJob(_C.decode_block_job(self._spec), self._keep, None, self.out)


def decode_block(qkv: torch.Tensor, n_head: int, n_kv_head: int, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, rows, positions, scale: float,
                 q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None, norm_eps: float = 1e-6,
                 out: Optional[torch.Tensor] = None, pool: Optional[_pool.WorkerPool] = None) -> torch.Tensor:
    """The attention block of one GQA decode step in one job (csrc/dense/decode_block.h) -> ``out [B, n_head * D]``.

    ``qkv [B, (n_head + 2 n_kv_head) D]`` (fp32 or bf16, q heads then k heads then v heads: the fused projections'
    output): per-head RMSNorm of q and k with ``q_norm`` / ``k_norm [D]`` (both or neither, eps ``norm_eps``), RoPE
    with ``cos`` / the signed ``sin`` rows ``[B, D]`` (hetmoe/layers/rope.py cos_sin, fp32 or bf16), k and v written
    into ``k_cache`` / ``v_cache [rows, cap, n_kv_head, D]`` (one layer, one dtype) at ``(rows[b], positions[b])``,
    then decode attention over positions ``<= positions[b]``. The roped q and k overwrite their part of ``qkv``.
    Rounding as the eager torch ops (bf16: after each op); ``out`` fp32 or qkv's dtype (default qkv's).
    """
    return prepare_decode_block(qkv, n_head, n_kv_head, cos, sin, k_cache, v_cache, rows, positions, scale, q_norm,
                                k_norm, norm_eps, out, pool).run()


def prepare_decode_block(qkv: torch.Tensor, n_head: int, n_kv_head: int, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, rows, positions, scale: float,
                         q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                         norm_eps: float = 1e-6, out: Optional[torch.Tensor] = None,
                         pool: Optional[_pool.WorkerPool] = None) -> DecodeBlock:
    """``decode_block``'s arguments checked and bound once -> a ``DecodeBlock`` to ``run()``."""
    _block_check("qkv", qkv, 2)
    _block_check("cos", cos, 2)
    _block_check("sin", sin, 2, (cos.dtype,))
    _block_check("k_cache", k_cache, 4)
    _block_check("v_cache", v_cache, 4, (k_cache.dtype,))
    B, width = qkv.shape
    n_rows, cap, Hkv, D = k_cache.shape
    if n_kv_head != Hkv or n_head < 1 or n_head % Hkv or width != (n_head + 2 * Hkv) * D:
        raise ValueError(f"decode_block: qkv [B, {width}] must hold {n_head} q heads (a multiple of the cache's {Hkv} "
                         f"kv heads) and 2 x {n_kv_head} k/v heads of the cache's head dim {D}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"decode_block: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    if tuple(cos.shape) != (B, D) or tuple(sin.shape) != (B, D) or cos.stride() != sin.stride():
        raise ValueError(f"decode_block: cos and sin must be [{B}, {D}] with one layout, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_block: q_norm and k_norm come together (or neither)")
    rows, positions = _index("rows", rows, B), _index("positions", positions, B)
    if out is None:
        out = torch.empty(B, n_head * D, dtype=qkv.dtype)
    else:
        _block_check("out", out, 2, (torch.float32, qkv.dtype))
        if tuple(out.shape) != (B, n_head * D):
            raise ValueError(f"decode_block: out must have shape {(B, n_head * D)}, got {tuple(out.shape)}")
    bf16 = torch.bfloat16
    keep = [qkv, cos, sin, k_cache, v_cache, rows, positions, out]
    spec = _C.DecodeBlockSpec(
        qkv=qkv.data_ptr(), qkv_stride_b=qkv.stride(0), qkv_bf16=qkv.dtype == bf16, B=B, n_head=n_head,
        n_kv_head=Hkv, d=D, cos=cos.data_ptr(), sin=sin.data_ptr(), cs_stride_b=cos.stride(0),
        cs_bf16=cos.dtype == bf16, k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        k_strides=list(k_cache.stride()[:3]), v_strides=list(v_cache.stride()[:3]), kv_bf16=k_cache.dtype == bf16,
        n_rows=n_rows, cap=cap, rows=rows.data_ptr(), positions=positions.data_ptr(), scale=float(scale),
        out=out.data_ptr(), out_strides=[out.stride(0), D], out_bf16=out.dtype == bf16)
    if q_norm is not None:
        norms = [w.detach().to(torch.float32).contiguous() for w in (q_norm, k_norm)]
        if any(w.shape != (D,) for w in norms):
            raise ValueError(f"decode_block: q_norm and k_norm must be [{D}], got {[tuple(w.shape) for w in norms]}")
        spec.q_norm, spec.k_norm, spec.norm_eps = norms[0].data_ptr(), norms[1].data_ptr(), float(norm_eps)
        keep += norms
    return DecodeBlock(spec, tuple(keep), out, pool or default_pool())
