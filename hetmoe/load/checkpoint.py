"""Reading a Hugging Face checkpoint directory: ``config.json`` and (sharded) ``*.safetensors``.

Shards are memory-mapped and tensors are zero-copy views of the mapping; ``release()`` drops the mapped pages
from this process's resident set (they stay in the page cache), so a loader that converts one layer at a time
and releases after each never holds more than one layer of the source in memory.

Every shard header is checked when the checkpoint is opened: a truncated shard, an unknown dtype or a tensor
whose byte range disagrees with its shape is reported with the file and tensor name before anything loads.
DeepSeek's FP8 weights (e4m3 with a ``weight_scale_inv`` per 128x128 block) are dequantized by ``get_float``, or
handed over as stored by ``get_fp8`` (the fp8 dense format on a GPU keeps them: hetmoe/load/dense.py ``FP8Source``).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Optional

import torch

from hetmoe.models.config import ModelConfig

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FP8_BLOCK = 128  # DeepSeek-V3/R1: one weight_scale_inv per 128 x 128 block


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is (the message names the file and tensor)."""


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def read_config(path: Path) -> ModelConfig:
    """config.json of the model directory ``path`` (FileNotFoundError / CheckpointError naming the file); a
    missing directory spelled like a Hugging Face hub id gets the download command, as hetmoe downloads nothing."""
    path = Path(path)
    if not path.is_dir():
        hint = ""
        if _HUB_ID.fullmatch(str(path)) and not path.exists():
            hint = (f". It looks like a Hugging Face hub id: hetmoe does not download models; run "
                    f"`huggingface-cli download {path} --local-dir DIR`, then pass --model DIR")
        raise FileNotFoundError(f"model directory {path} does not exist{hint}")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} is missing: not a Hugging Face model directory")
    try:
        return ModelConfig.from_file(config_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    except (TypeError, ValueError):  # valid JSON, but not an object
        raise CheckpointError(f"{config_path} does not hold a JSON object") from None


class _Entry:
    __slots__ = ("shard", "dtype", "shape", "begin", "end")

    def __init__(self, shard, dtype, shape, begin, end):
        self.shard, self.dtype, self.shape, self.begin, self.end = shard, dtype, shape, begin, end


class Checkpoint:
    """The tensors of a checkpoint directory by name, memory-mapped."""

    def __init__(self, path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.shards = self._shard_files()
        self._entries: dict = {}
        self._maps: dict = {}
        for shard in self.shards:
            self._read_header(shard)

    def _shard_files(self) -> list:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index} is not a safetensors index ({err})") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing[:5])}")
            return [self.path / f for f in files]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.path}")
        return files

    def _read_header(self, shard: Path) -> None:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{shard} is truncated ({size} bytes): no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise CheckpointError(f"{shard} is truncated or not a safetensors file (header of {n} bytes, "
                                      f"file of {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{shard}: corrupt safetensors header ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{shard}: corrupt safetensors header (not a JSON object)")
        base = 8 + n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype_name, (begin, end) = str(meta["dtype"]), (int(o) for o in meta["data_offsets"])
                shape = tuple(int(d) for d in meta["shape"])
                if min(shape, default=0) < 0 or not 0 <= begin <= end:
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{shard}: tensor {name} has a malformed header entry {meta!r}") from None
            dtype = DTYPES.get(dtype_name)
            if dtype is None:
                raise CheckpointError(f"{shard}: tensor {name} has dtype {dtype_name!r}, which hetmoe cannot "
                                      f"read (supported: {', '.join(DTYPES)})")
            begin, end = base + begin, base + end
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize:
                raise CheckpointError(f"{shard}: tensor {name} has shape {list(shape)} ({meta['dtype']}) but "
                                      f"{end - begin} bytes")
            if end > size:
                raise CheckpointError(f"{shard} is truncated: tensor {name} ends at byte {end}, the file has {size}")
            if name in self._entries:
                raise CheckpointError(
                    f"tensor {name} appears in both {self._entries[name].shard.name} and {shard.name}")
            self._entries[name] = _Entry(shard, dtype, shape, begin, end)

    # ------------------------------------------------------------------ access

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list:
        return list(self._entries)

    def shape(self, name: str) -> tuple:
        return self._entry(name).shape

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.path}") from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (a view of the mapped file: do not write to it)."""
        e = self._entry(name)
        mm = self._maps.get(e.shard)
        if mm is None:
            with open(e.shard, "rb") as f:
                mm = self._maps[e.shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=e.dtype)
        with warnings.catch_warnings():  # read-only mapping: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.begin, offset=e.begin)
        return raw.view(e.dtype).view(e.shape)

    def get_float(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A floating-point weight in ``dtype`` (None: as stored). FP8 weights are multiplied by their block
        scales (``<name>_scale_inv``, one per 128x128 block) into ``dtype`` (None: fp32). A weight already in
        ``dtype`` is returned as the mapped view."""
        t = self.get(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + "_scale_inv"
            if scale_name not in self._entries:
                raise CheckpointError(f"FP8 tensor {name} has no {scale_name} in {self.path}")
            return dequantize_fp8(t, self.get(scale_name), dtype or torch.float32, name)
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name} has dtype {t.dtype}; a floating-point weight was expected")
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def get_fp8(self, name: str) -> Optional[tuple]:
        """(e4m3 weight [N, K], its scale_inv [ceil(N/128), ceil(K/128)]) as stored (views of the mapped file) when
        ``name`` is a DeepSeek FP8 weight (w = weight * scale_inv per 128x128 block); None for a weight stored
        otherwise (bf16, fp32, e5m2: ``get_float`` reads those)."""
        e = self._entry(name)
        if e.dtype != torch.float8_e4m3fn or len(e.shape) != 2:
            return None
        scale_name = name + "_scale_inv"
        if scale_name not in self._entries:
            raise CheckpointError(f"FP8 tensor {name} has no {scale_name} in {self.path}")
        scale = self.get(scale_name)
        check_fp8_scale(e.shape, scale, name)
        return self.get(name), scale

    def release(self) -> None:
        """Drop the mapped pages of every shard from this process's resident memory."""
        for mm in self._maps.values():
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):
                pass

    def close(self) -> None:
        self.release()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the mapping goes when that tensor does
                pass
        self._maps.clear()

    def fingerprint(self) -> list:
        """(file name, size, mtime) of config and shards: what the converted-expert cache is keyed by."""
        files = [self.path / "config.json", *self.shards]
        return [(f.name, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                   name: Optional[str] = None) -> torch.Tensor:
    """FP8 ``w [N, K]`` times its block scales ``scale_inv [ceil(N/128), ceil(K/128)]`` -> ``dtype``."""
    if w.dim() != 2:
        raise CheckpointError(f"FP8 tensor {name or ''} must be 2-D, got shape {tuple(w.shape)}")
    N, K = w.shape
    check_fp8_scale(w.shape, scale_inv, name)
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
    return (w.float() * s).to(dtype)


def check_fp8_scale(shape, scale_inv: torch.Tensor, name: Optional[str] = None) -> None:
    """CheckpointError unless ``scale_inv`` is floating point and has one entry per 128x128 block of ``shape``."""
    N, K = shape
    want = (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"{name or 'FP8 tensor'}_scale_inv has shape {tuple(scale_inv.shape)}; a [{N}, {K}] "
                              f"weight in 128x128 blocks needs {list(want)}")
    if not scale_inv.is_floating_point():
        raise CheckpointError(f"{name or 'FP8 tensor'}_scale_inv has dtype {scale_inv.dtype}; floating point "
                              "scales were expected")


def block_fp8(cfg) -> bool:
    """Whether ``cfg`` (config.json) says the checkpoint holds DeepSeek's FP8 weights: a quantization_config with
    quant_method fp8, e4m3 and 128x128 weight blocks."""
    qc = cfg.get("quantization_config")
    return (isinstance(qc, dict) and qc.get("quant_method") == "fp8" and qc.get("fmt", "e4m3") == "e4m3"
            and list(qc.get("weight_block_size") or ()) == [FP8_BLOCK, FP8_BLOCK])
