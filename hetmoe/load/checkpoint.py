"""Reading a Hugging Face checkpoint directory: ``config.json`` and (sharded) ``*.safetensors``.

Shards are memory-mapped and tensors are zero-copy views of the mapping; ``release()`` drops the mapped pages
from this process's resident set (they stay in the page cache), so a loader that converts one layer at a time
and releases after each never holds more than one layer of the source in memory.

Every shard header is checked when the checkpoint is opened: a truncated shard, an unknown dtype or a tensor
whose byte range disagrees with its shape is reported with the file and tensor name before anything loads.
DeepSeek's FP8 weights (e4m3 with a ``weight_scale_inv`` per 128x128 block) are dequantized by ``get_float``, or
handed over as stored by ``get_fp8`` (the fp8 dense format on a GPU keeps them: hetmoe/load/dense.py ``FP8Source``;
routed experts of the CPU engine's fp8 format are packed from them byte for byte, ``load_exact_experts``). MXFP8 (an
E8M0 scale per 32) and per-channel FP8 are read the same way, each scale checked against its weight from the headers
when the checkpoint is opened (hetmoe/load/fp8_formats.py); ``get_fp8`` hands over block FP8 only. DeepSeek-V4's FP4
experts (expert_dtype "fp4": int8 [N, K/2] codes and an E8M0 ``scale`` per 32) appear with their real shape [N, K],
dequantized by ``get_float`` and packed from their codes into lut4 e2m1 (``_deepseek_v4_fp4``, hetmoe/load/mxfp4.py).

Linears stored as int4 codes with their scales (and zero points) — by compressed-tensors as ``pack-quantized``
(``<m>.weight_packed``, ``weight_scale``, ``weight_shape``, ``weight_zero_point``: hetmoe/load/compressed.py), by
GPTQ or by AWQ's gemm packing (``<m>.qweight``, ``qzeros``, ``scales``, ``g_idx``: hetmoe/load/gptq.py) — appear under
their plain name ``<m>.weight`` with their real shape [out, in]; ``get_float`` dequantizes them (the dense linears),
and routed experts stored so are packed from their codes into the CPU engine's int4 (or int8) format, nothing
re-quantized: symmetric ones with their scales in the file's dtype, those with zero points as int4 affine with the
file's scales and one int8 zero point per group (scale dtype fp16_zp / bf16_zp / fp32_zp: min = scale * z, widened by
the kernels; ``experts_options`` / ``experts_layout`` / ``load_exact_experts``, the interface the loader uses for GGUF
files too).

NVFP4 linears — compressed-tensors ``nvfp4-pack-quantized`` and NVIDIA ModelOpt's (hetmoe/load/nvfp4.py; ModelOpt's
hf_quant_config.json read where config.json has no quantization_config) — appear as ``<m>.weight`` [out, in] too,
dequantized by ``get_float``; routed experts stored so are packed from their codes into lut4 e2m1 group 16.

gpt-oss's routed experts are stored stacked, ``<block>.experts.gate_up_proj`` [E, H, 2I] (gate and up interleaved:
columns 0::2 and 1::2) and ``down_proj`` [E, I, H] with their ``_bias`` [E, 2I] / [E, H], or, with quantization_config
quant_method "mxfp4", as MXFP4 ``*_blocks`` / ``*_scales`` (hetmoe/load/mxfp4.py); both appear under the per-expert
names the loader reads (``<block>.experts.<e>.gate_proj.weight`` [I, H], ``.bias`` [I], ...), read from the stored
tensors when asked for (``_gpt_oss_experts``), and MXFP4 experts are packed from their own codes and scale bytes
into the engine's lut4 e2m1 format (``experts_layout`` / ``load_exact_experts``), nothing dequantized.

A multimodal checkpoint whose language model hetmoe runs (hetmoe.models.MULTIMODAL, e.g. Kimi-K2.5's kimi_k25) is
read text only: config.json's text_config is the config, the language model's tensors are named without their
prefix (``language_model.``), and the vision tower's are left out unread (``skipped``).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from hetmoe.cpu.codes import layout_of, load_codes, load_fp8, lut4_values, plan_format
from hetmoe.cpu.layout import CODEBOOKS
from hetmoe.load import compressed, fp8_formats, gptq, mxfp4, nvfp4
from hetmoe.models.config import MULTIMODAL, ConfigError, ModelConfig, text_model_config
from hetmoe.plan.memory import HeldLayouts

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
FP8_BLOCK = 128  # DeepSeek-V3/R1: one weight_scale_inv per 128 x 128 block
CHUNK = 8  # routed experts unpacked and packed into the engine at once (load_exact_experts)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is (the message names the file and tensor)."""


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def read_config(path: Path) -> ModelConfig:
    """config.json of the model directory ``path`` (FileNotFoundError / CheckpointError naming the file); a
    missing directory spelled like a Hugging Face hub id gets the download command, as hetmoe downloads nothing. A
    multimodal checkpoint's is its language model's (hetmoe.models.text_model_config)."""
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
        cfg = ModelConfig.from_file(config_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path} is not valid JSON: {err}") from None
    except (TypeError, ValueError):  # valid JSON, but not an object
        raise CheckpointError(f"{config_path} does not hold a JSON object") from None
    gptq_file = path / "quantize_config.json"  # AutoGPTQ's / GPTQModel's, alone in checkpoints older than
    if "quantization_config" not in cfg and gptq_file.is_file():  # transformers' GPTQ integration
        try:
            qc = json.loads(gptq_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{gptq_file} is not valid JSON: {err}") from None
        if not isinstance(qc, dict):
            raise CheckpointError(f"{gptq_file} does not hold a JSON object")
        cfg["quantization_config"] = {"quant_method": "gptq", **qc}
    modelopt_file = path / "hf_quant_config.json"  # ModelOpt's, alone in its older exports
    if "quantization_config" not in cfg and modelopt_file.is_file():
        try:
            cfg["quantization_config"] = nvfp4.read_modelopt_file(modelopt_file)
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
    try:
        return text_model_config(cfg, str(config_path))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


def check_quantization(cfg: ModelConfig, source) -> None:
    """Refuse, before any weight is read, a quantization_config the native loader cannot read (CheckpointError
    naming the setting): FP8 in 128x128 blocks (DeepSeek), MXFP8 and per channel (hetmoe/load/fp8_formats.py),
    DeepSeek-V4's FP4 experts, compressed-tensors pack-quantized int4 and float-quantized FP8, GPTQ int4 and AWQ's
    gemm int4 are read (hetmoe/load/gptq.py names what of those it refuses)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in ("fp8", "mxfp8"):
        try:
            fp8_formats.check(qc, source)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        experts = fp4_experts_dtype(cfg)
        if experts not in (None, "fp8") and cfg.get("model_type") != "deepseek_v4":  # (V4's: models/config_checks.py)
            raise CheckpointError(f"{source}: expert_dtype {experts!r} on a {cfg.get('model_type')} model: hetmoe "
                                  "reads FP4 experts (expert_dtype 'fp4') as DeepSeek-V4 stores them (deepseek_v4)")
        return
    if method == "mxfp4":
        if cfg.get("model_type") != "gpt_oss":
            raise CheckpointError(f"{source}: quantization_config mxfp4 on a {cfg.get('model_type')} model: hetmoe "
                                  "reads MXFP4 experts as gpt-oss stores them (gpt_oss)")
        return
    if method in ("gptq", "awq"):
        try:
            gptq.Int4Scheme.parse(qc, str(source))
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        return
    if nvfp4.describes(qc):  # compressed-tensors nvfp4-pack-quantized, ModelOpt (hetmoe/load/nvfp4.py)
        try:
            nvfp4.Scheme.parse(qc, str(source))
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        return
    if method == "compressed-tensors":
        try:
            if qc.get("format") == "float-quantized":
                compressed.FloatQuantized.parse(qc, str(source))
                return
            compressed.PackQuantized.parse(qc, str(source))
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        return
    raise CheckpointError(f"{source}: quantization_config.quant_method is {method!r}, which hetmoe does not read "
                          "(it reads fp8 in 128x128 blocks, per channel or as MXFP8, mxfp8, compressed-tensors "
                          "pack-quantized int4, float-quantized FP8 and nvfp4-pack-quantized, modelopt NVFP4, gptq "
                          "and awq int4, and gpt-oss's mxfp4)")


def fp4_experts_dtype(cfg) -> Optional[str]:
    """DeepSeek-V4's expert_dtype (quantization_config's, else the top level's, as Transformers reads it)."""
    qc = cfg.get("quantization_config")
    dtype = qc.get("expert_dtype") if isinstance(qc, dict) else None
    return cfg.get("expert_dtype") if dtype is None else dtype


class _Entry:
    __slots__ = ("shard", "dtype", "shape", "begin", "end", "raw")

    def __init__(self, shard, dtype, shape, begin, end, raw):
        self.shard, self.dtype, self.shape, self.begin, self.end = shard, dtype, shape, begin, end
        self.raw = raw  # the name in the file


class Checkpoint:
    """The tensors of a checkpoint directory by name, memory-mapped."""

    def __init__(self, path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self.wrapper = MULTIMODAL.get(self.config.get("model_type"))
        self.shards = self._shard_files()
        self._entries: dict = {}
        self._maps: dict = {}
        self.skipped: list = []  # tensors of a multimodal wrapper that a text-only model never reads
        for shard in self.shards:
            self._read_header(shard)
        self._strip_prefix()
        self._rename()
        self._views: dict = {}  # name -> (shape, dtype, read()): tensors read out of stored ones (gpt-oss experts)
        self._mxfp4: set = set()  # "<block>.experts" prefixes whose experts are MXFP4 blocks
        self._fp4: dict = {}  # DeepSeek-V4 FP4 expert matrix name -> (its codes' entry, its scale's entry)
        self._fp4_blocks: set = set()  # "<block>.experts" prefixes whose experts are those
        self._fp8_kind = fp8_formats.scheme(self.config.get("quantization_config"))  # FP8 weights' scales
        self._split_fused_experts()
        self._gpt_oss_experts()
        self._deepseek_v4_fp4()
        self._check_fp8_scales()
        self._packed: dict = {}  # "<m>.weight" -> compressed.PackedWeight of an int4 linear (any of the three)
        self._parts: set = set()  # the stored tensors of those (hidden from names())
        self._scratch: dict = {}  # (matrix, shape) -> codes and scales of CHUNK experts (load_exact_experts)
        self._nvfp4 = self._find_nvfp4()  # (before _find_packed: compressed-tensors' NVFP4 is weight_packed too)
        self._find_packed()
        self._find_gptq()

    @property
    def notes(self) -> list:
        """What the loader says about this checkpoint beyond the plan (the tensors it leaves out)."""
        if not self.skipped:
            return []
        heads = sorted({n.split(".")[0] for n in self.skipped})
        return [f"{len(self.skipped)} tensors of {', '.join(heads)} (not the language model) left out: text only"]

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
        skip = self.wrapper.skipped if self.wrapper is not None else ()
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if name.startswith(skip):  # a vision tower's: never read, whatever its dtype
                self.skipped.append(name)
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
            self._entries[name] = _Entry(shard, dtype, shape, begin, end, name)

    def _strip_prefix(self) -> None:
        """A multimodal wrapper's language-model tensors under the names the text model has (its prefix off, or
        replaced by the wrapper's ``renamed``)."""
        prefix = self.wrapper.prefix if self.wrapper is not None else ""
        if not prefix or not any(n.startswith(prefix) for n in self._entries):
            return
        entries = {}
        for name, e in self._entries.items():
            short = self.wrapper.renamed + name[len(prefix):] if name.startswith(prefix) else name
            if short in entries:
                raise CheckpointError(f"{self.path}: tensors {entries[short].raw} and {name} are both {short} of the "
                                      "language model")
            entries[short] = e
        self._entries = entries

    def _rename(self) -> None:
        """Tensors under the names the model file has, for a model type whose checkpoints name them otherwise
        (hetmoe.models.checkpoint_names: DeepSeek-V4's own naming); a block FP8 weight's ``<m>.scale`` (V4's) is its
        ``<m>.weight_scale_inv``."""
        from hetmoe.models import checkpoint_names

        rename = checkpoint_names(self.config.get("model_type"))
        if rename is None:
            return
        entries = {}
        for name, e in self._entries.items():
            new = rename(name)
            if new in entries:
                raise CheckpointError(f"{self.path}: tensors {entries[new].raw} and {name} are both {new}")
            entries[new] = e
        for name in [n for n in entries if n.endswith(".scale") and n[:-len("scale")] + "weight" in entries]:
            entries[name[:-len("scale")] + "weight_scale_inv"] = entries.pop(name)
        self._entries = entries

    def _split_fused_experts(self) -> None:
        """Routed experts stored stacked, as transformers' fused experts hold them (Qwen3.5-MoE's checkpoints):
        ``<block>.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
        ``<block>.experts.down_proj`` [E, H, I] appear, for a model type of hetmoe's own model files, also under the
        per-expert names the loader reads (``<block>.experts.<e>.gate_proj.weight`` [I, H], ``up_proj``,
        ``down_proj`` [H, I]): byte ranges of the stored tensors, read in place. Other layouts (transposed, with
        biases, quantized) are left as they are."""
        from hetmoe.models import MODEL_TYPES

        if self.config.get("model_type") not in MODEL_TYPES:
            return
        for name in [n for n in self._entries if n.endswith(".experts.gate_up_proj")]:
            block = name[:-len(".gate_up_proj")]
            gu, down = self._entries[name], self._entries.get(block + ".down_proj")
            if down is None or len(gu.shape) != 3 or gu.dtype != down.dtype or not gu.dtype.is_floating_point \
                    or gu.dtype.itemsize < 2 or gu.shape[1] % 2 or f"{block}.0.gate_proj.weight" in self._entries:
                continue
            E, I, H = gu.shape[0], gu.shape[1] // 2, gu.shape[2]
            if down.shape != (E, H, I):
                continue
            size = I * H * gu.dtype.itemsize  # bytes of one expert's gate (or up, or down) matrix
            for e in range(E):
                at = gu.begin + 2 * e * size
                self._entries[f"{block}.{e}.gate_proj.weight"] = _Entry(gu.shard, gu.dtype, (I, H), at, at + size, name)
                self._entries[f"{block}.{e}.up_proj.weight"] = _Entry(gu.shard, gu.dtype, (I, H), at + size,
                                                                       at + 2 * size, name)
                at = down.begin + e * size
                self._entries[f"{block}.{e}.down_proj.weight"] = _Entry(down.shard, down.dtype, (H, I), at, at + size,
                                                                        block + ".down_proj")

    def _gpt_oss_experts(self) -> None:
        """gpt-oss's stacked experts (module docstring) under per-expert names: views of the stored tensors (bf16 /
        fp32), or their MXFP4 values dequantized when read as floats. CheckpointError naming the tensors when the
        stored shapes do not go together."""
        if self.config.get("model_type") != "gpt_oss":
            return
        for name in [n for n in self._entries if n.endswith(".experts.gate_up_proj")]:
            block = name[:-len(".gate_up_proj")]
            gu, down = self._entries[name], self._entry(block + ".down_proj")
            if len(gu.shape) != 3 or gu.shape[2] % 2 or down.shape != (gu.shape[0], gu.shape[2] // 2, gu.shape[1]):
                raise CheckpointError(f"{self.path}: {name} {list(gu.shape)} and {block}.down_proj "
                                      f"{list(down.shape)} are not gpt-oss experts [E, H, 2I] and [E, I, H]")
            E, H, I = gu.shape[0], gu.shape[1], gu.shape[2] // 2
            for e in range(E):
                for which, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    self._views[f"{block}.{e}.{which}.weight"] = (
                        (I, H), gu.dtype, lambda e=e, cols=cols, n=name: self.get(n)[e, :, cols].t())
                self._views[f"{block}.{e}.down_proj.weight"] = (
                    (H, I), down.dtype, lambda e=e, n=block + ".down_proj": self.get(n)[e].t())
            self._bias_views(block, E, I, H)
        for name in [n for n in self._entries if n.endswith(".experts.gate_up_proj_blocks")]:
            block = name[:-len(".gate_up_proj_blocks")]
            parts = {f"{w}_{p}": self._entry(f"{block}.{w}_{p}") for w in ("gate_up_proj", "down_proj")
                     for p in ("blocks", "scales")}
            try:
                for w in ("gate_up_proj", "down_proj"):
                    mxfp4.check_pair(f"{block}.{w}", parts[f"{w}_blocks"].shape, parts[f"{w}_scales"].shape)
                    if parts[f"{w}_blocks"].dtype != torch.uint8 or parts[f"{w}_scales"].dtype != torch.uint8:
                        raise ValueError(f"{block}.{w}_blocks / _scales must be uint8 (U8)")
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {err}") from None
            gub, dnb = parts["gate_up_proj_blocks"].shape, parts["down_proj_blocks"].shape
            E, I, H = gub[0], gub[1] // 2, gub[2] * mxfp4.BLOCK
            if gub[1] % 2 or dnb[:3] != (E, H, I // mxfp4.BLOCK) or I % mxfp4.BLOCK:
                raise CheckpointError(f"{self.path}: {block}.gate_up_proj_blocks {list(gub)} and down_proj_blocks "
                                      f"{list(dnb)} are not gpt-oss experts [E, 2I, H/32, 16] and [E, H, I/32, 16]")
            self._mxfp4.add(block)
            for e in range(E):
                for which, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    self._views[f"{block}.{e}.{which}.weight"] = (
                        (I, H), torch.float32, lambda e=e, rows=rows, b=block: self._mxfp4_matrix(b, "gate_up_proj",
                                                                                                  e, rows))
                self._views[f"{block}.{e}.down_proj.weight"] = (
                    (H, I), torch.float32, lambda e=e, b=block: self._mxfp4_matrix(b, "down_proj", e, slice(None)))
            self._bias_views(block, E, I, H)

    def _deepseek_v4_fp4(self) -> None:
        """DeepSeek-V4's FP4 routed experts (expert_dtype "fp4": hetmoe/load/mxfp4.py) under their own names with their
        real shape [N, K]: their values dequantized when read as floats, packed from their codes and scale bytes
        into lut4 e2m1 (``load_exact_experts``). CheckpointError naming a matrix whose scale is missing or whose
        shapes do not go together, before any weight is read."""
        if self.config.get("model_type") != "deepseek_v4" or fp4_experts_dtype(self.config) != "fp4":
            return
        pattern = re.compile(r"(model\.layers\.\d+\..*\.experts)\.\d+\.\w+\.weight")
        for name in [n for n, e in self._entries.items() if e.dtype in (torch.int8, torch.uint8)]:
            m = pattern.fullmatch(name)
            if m is None:
                continue
            scale = name + "_scale_inv"
            if scale not in self._entries:
                raise CheckpointError(f"{self.path}: FP4 expert weight {self._entries[name].raw} has no scale beside "
                                      "it")
            e, se = self._entries.pop(name), self._entries.pop(scale)
            try:
                mxfp4.check_packed(e.raw, e.shape, se.shape)
                if se.dtype not in fp8_formats.E8M0_DTYPES:
                    raise ValueError(f"{se.raw} has dtype {se.dtype}; FP4 scales are E8M0 (F8_E8M0 or U8)")
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {err}") from None
            self._fp4[name] = (e, se)
            self._fp4_blocks.add(m[1])
            self._views[name] = ((e.shape[0], 2 * e.shape[1]), torch.float32, lambda n=name: self._fp4_matrix(n))

    def _check_fp8_scales(self) -> None:
        """Every E4M3 weight's scale against its shape, by the kind quantization_config names (hetmoe/load/
        fp8_formats.py), from the headers: CheckpointError naming the tensor, before any weight is read."""
        if self._fp8_kind is None:
            return
        check_quantization(self.config, self.path / "config.json")  # a setting refused is named first
        for name, e in self._entries.items():
            if e.dtype != torch.float8_e4m3fn or len(e.shape) != 2 or name.startswith("mtp."):
                continue
            suffix = next((x for x in fp8_formats.scale_suffixes(self._fp8_kind) if name + x in self._entries), None)
            if suffix is None:
                want = name + fp8_formats.scale_suffixes(self._fp8_kind)[0]
                raise CheckpointError(f"FP8 tensor {name} has no {want} in {self.path}")
            se = self._entries[name + suffix]
            try:
                fp8_formats.check_scale(self._fp8_kind, e.shape, se.shape, se.dtype, name, name + suffix)
            except ValueError as err:
                raise CheckpointError(f"{e.shard}: {err}") from None

    def _fp4_matrix(self, name: str) -> torch.Tensor:
        e, se = self._fp4[name]
        codes = mxfp4.packed_codes(self._read(e))
        book = torch.tensor(CODEBOOKS["e2m1"], dtype=torch.float32)
        try:
            s = mxfp4.engine_scales(self._read(se), name).repeat_interleave(mxfp4.BLOCK, dim=-1)
        except ValueError as err:
            raise CheckpointError(f"{self.path}: {err}") from None
        return book[codes.long()] * s

    def _bias_views(self, block: str, E: int, I: int, H: int) -> None:
        """gpt-oss's expert biases ``<block>.gate_up_proj_bias`` [E, 2I] (interleaved) and ``down_proj_bias`` [E, H]
        as ``<block>.<e>.{gate,up,down}_proj.bias``."""
        gu, down = block + ".gate_up_proj_bias", block + ".down_proj_bias"
        if gu not in self._entries and down not in self._entries:
            return
        for name, shape in ((gu, (E, 2 * I)), (down, (E, H))):
            if self._entry(name).shape != shape:
                raise CheckpointError(f"{self.path}: {name} has shape {list(self._entry(name).shape)}; the experts "
                                      f"need {list(shape)}")
        for e in range(E):
            for which, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                self._views[f"{block}.{e}.{which}.bias"] = ((I,), self._entries[gu].dtype,
                                                            lambda e=e, cols=cols: self.get(gu)[e, cols])
            self._views[f"{block}.{e}.down_proj.bias"] = ((H,), self._entries[down].dtype,
                                                          lambda e=e: self.get(down)[e])

    def _mxfp4_matrix(self, block: str, which: str, e: int, rows: slice) -> torch.Tensor:
        """Expert e's ``which`` matrix rows (gate: 0::2, up: 1::2 of gate_up) dequantized to fp32 [N, K]."""
        name = f"{block}.{which}"
        try:
            return mxfp4.dequantize(self.get(name + "_blocks")[e, rows], self.get(name + "_scales")[e, rows],
                                    name=f"{name} of expert {e}")
        except ValueError as err:
            raise CheckpointError(f"{self.path}: {err}") from None

    def _find_nvfp4(self) -> Optional[nvfp4.FP4Linears]:
        """The NVFP4 linears (hetmoe/load/nvfp4.py) under their plain names ``<m>.weight`` [N, K], read dequantized
        (fp32); CheckpointError naming the setting or tensor, before any weight is read."""
        try:
            found = nvfp4.FP4Linears.find(self._entries, self._read, self.config.get("quantization_config"),
                                          str(self.path / "config.json"))
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        for name, w in (found.weights.items() if found is not None else ()):
            self._views[name] = (w.shape, torch.float32, lambda n=name: self._nvfp4_call(found.matrix, n))
        return found

    def _nvfp4_call(self, fn: Callable, *args):
        try:
            return fn(*args)
        except ValueError as err:
            raise CheckpointError(f"{self.path}: {err}") from None

    def _find_packed(self) -> None:
        """The pack-quantized linears: each checked against quantization_config (which group quantizes it) and its
        stored tensors' headers; CheckpointError naming the setting or tensor, before any weight is read."""
        tail = ".weight_packed"
        modules = [n[:-len(tail)] for n in self._entries if n.endswith(tail)]
        if not modules:
            return
        where = str(self.path / "config.json")
        check_quantization(self.config, where)  # another method named as such
        try:
            scheme = compressed.PackQuantized.parse(self.config.get("quantization_config"), where)
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        for m in modules:
            stored = self._entries[m + tail]
            group = scheme.group_of(m, stored.raw[:-len(tail)])
            if group is None:
                raise CheckpointError(f"{stored.shard}: {stored.raw} is pack-quantized, but {where}'s "
                                      f"quantization_config does not quantize {m} (no config group targets it, or "
                                      "ignore lists it)")
            if m + ".weight" in self._entries:
                raise CheckpointError(f"{stored.shard}: {m} has both a weight and a weight_packed")
            parts = {p: (self._entries[f"{m}.{p}"].dtype, self._entries[f"{m}.{p}"].shape)
                     for p in (*compressed.PARTS, compressed.ZERO_POINT) if f"{m}.{p}" in self._entries}
            try:
                self._packed[m + ".weight"] = compressed.check_parts(m, parts, group)
            except compressed.QuantizationConfigError as err:
                raise CheckpointError(f"{stored.shard}: {err}") from None
            self._parts.update(f"{m}.{p}" for p in (*compressed.PARTS, compressed.ZERO_POINT))

    def _find_gptq(self) -> None:
        """The GPTQ / AWQ int4 linears (``<m>.qweight`` beside qzeros, scales and GPTQ's g_idx): quantization_config
        checked (hetmoe/load/gptq.py) and each linear's tensors against it, from the headers; CheckpointError naming
        the setting or tensor, before any weight is read."""
        tail = ".qweight"
        modules = [n[:-len(tail)] for n in self._entries if n.endswith(tail)]
        if not modules:
            return
        where = str(self.path / "config.json")
        qc = self.config.get("quantization_config")
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method not in ("gptq", "awq"):
            stored = self._entries[modules[0] + tail]
            raise CheckpointError(f"{stored.shard}: {stored.raw} is a GPTQ / AWQ weight, but {where}'s "
                                  f"quantization_config.quant_method is {method!r} (gptq or awq describes it)")
        try:
            scheme = gptq.Int4Scheme.parse(qc, where)
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(str(err)) from None
        for m in modules:
            stored = self._entries[m + tail]
            if scheme.leaves_out(m):
                raise CheckpointError(f"{stored.shard}: {stored.raw} is quantized, but {where}'s quantization_config "
                                      f"leaves {m} out")
            if m + ".weight" in self._entries:
                raise CheckpointError(f"{stored.shard}: {m} has both a weight and a qweight")
            parts = {p: (self._entries[f"{m}.{p}"].dtype, self._entries[f"{m}.{p}"].shape)
                     for p in gptq.GPTQ_PARTS if f"{m}.{p}" in self._entries}
            try:
                self._packed[m + ".weight"] = gptq.check_parts(m, parts, scheme)
            except compressed.QuantizationConfigError as err:
                raise CheckpointError(f"{stored.shard}: {err}") from None
            self._parts.update(f"{m}.{p}" for p in gptq.GPTQ_PARTS)

    # ------------------------------------------------------------------ access

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._packed or name in self._views

    def names(self) -> list:
        """Every tensor by the model's names: a pack-quantized linear as ``<m>.weight`` (its parts not listed);
        gpt-oss's per-expert views besides the stacked tensors they read."""
        return [n for n in self._entries if n not in self._parts] + list(self._packed) + list(self._views)

    def shape(self, name: str) -> tuple:
        pw = self._packed.get(name)
        if pw is not None:
            return pw.shape
        view = self._views.get(name)
        return view[0] if view is not None else self._entry(name).shape

    def packed(self, name: str) -> Optional[compressed.PackedWeight]:
        """The PackedWeight of ``name`` (``<m>.weight``) when it is stored pack-quantized, else None."""
        return self._packed.get(name)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint in {self.path}") from None

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored (a view of the mapped file: do not write to it)."""
        pw = self._packed.get(name)
        if pw is not None:
            how = ("pack-quantized", f"{name}_packed") if pw.method == "compressed-tensors" else (
                f"as {pw.method.upper()} int4", f"{pw.module}.qweight")
            raise CheckpointError(f"tensor {name} is stored {how[0]} ({how[1]}): read it with get_float")
        if name in self._views:  # (a strided view of a stored tensor, or an MXFP4 matrix's values)
            return self._views[name][2]()
        return self._read(self._entry(name))

    def _read(self, e: _Entry) -> torch.Tensor:
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
        pw = self._packed.get(name)
        if pw is not None:
            codes, scales, mins = self._codes(pw)
            w = compressed.dequantize(codes, scales, pw.group_size, mins)
            return w if dtype is None or dtype == w.dtype else w.to(dtype)
        t = self.get(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            kind, scale = self._fp8_scale(name)
            try:
                return fp8_formats.dequantize(kind, t, scale, dtype or torch.float32, name)
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {err}") from None
        if not t.is_floating_point():
            raise CheckpointError(f"tensor {name} has dtype {t.dtype}; a floating-point weight was expected")
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def _fp8_scale(self, name: str) -> tuple:
        """(kind, the scale tensor as stored) of the FP8 weight ``name``: the kind config.json's quantization_config
        says (a checkpoint that says none: block FP8, DeepSeek's); CheckpointError when the scale is missing."""
        kind = self._fp8_kind or "block"
        suffixes = fp8_formats.scale_suffixes(kind)
        for suffix in suffixes:
            if name + suffix in self._entries:
                return kind, self.get(name + suffix)
        raise CheckpointError(f"FP8 tensor {name} has no {name + suffixes[0]} in {self.path}")

    def get_fp8(self, name: str) -> Optional[tuple]:
        """(e4m3 weight [N, K], its scale_inv [ceil(N/128), ceil(K/128)]) as stored (views of the mapped file) when
        ``name`` is a DeepSeek block FP8 weight (w = weight * scale_inv per 128x128 block); None for a weight stored
        otherwise (bf16, fp32, e5m2, pack-quantized, MXFP8 or per-channel FP8: ``get_float`` reads those)."""
        if name in self._packed or name in self._views or self._fp8_kind not in (None, "block"):
            return None
        e = self._entry(name)
        if e.dtype != torch.float8_e4m3fn or len(e.shape) != 2:
            return None
        _, scale = self._fp8_scale(name)
        check_fp8_scale(e.shape, scale, name)
        return self.get(name), scale

    # ------------------------------------------------------------------ pack-quantized routed experts

    def _codes(self, pw: compressed.PackedWeight, codes: Optional[torch.Tensor] = None,
               scales: Optional[torch.Tensor] = None, mins: Optional[torch.Tensor] = None) -> tuple:
        """(int8 codes [out, in], the engine's scales [out, in / group], its mins or None) of an int4 linear, written
        into ``codes`` / ``scales`` / ``mins`` when given: a symmetric one's codes q in [-8, 7] (value = scale * q),
        one with zero points as u in 0..15 with min = scale * z (value = scale * u - min), fp32. Its weight_shape
        (compressed-tensors), g_idx (GPTQ) and symmetric zero points (GPTQ / AWQ) checked: CheckpointError naming
        the tensor."""
        m = pw.module
        try:
            if pw.method == "compressed-tensors":
                compressed.check_shape(pw, self.get(m + ".weight_shape"))
                q = compressed.unpack_int4(self.get(m + ".weight_packed"), codes)
                if pw.symmetric:
                    return q, compressed.engine_scales(self.get(m + ".weight_scale"), scales), None
                q.add_(8)  # u = q + 8
                z = compressed.unpack_zero_points(self.get(f"{m}.{compressed.ZERO_POINT}"), pw.shape[0])
                s = self.get(m + ".weight_scale").float()  # [N, G]
            else:
                if pw.method == "gptq":
                    gptq.check_g_idx(pw, self.get(m + ".g_idx") if m + ".g_idx" in self._entries else None)
                z = gptq.zeros_of(pw, self.get(m + ".qzeros")).t()  # [N, G]
                if pw.symmetric:
                    gptq.check_symmetric_zeros(pw, z.t())
                q = torch.empty(pw.shape, dtype=torch.int8) if codes is None else codes
                gptq.codes_of(pw, self.get(m + ".qweight"), q)  # u [N, K]
                if pw.symmetric:
                    q.sub_(gptq.SYMMETRIC_ZERO)
                s = self.get(m + ".scales").float().t()  # [N, G]
        except compressed.QuantizationConfigError as err:
            raise CheckpointError(f"{self.path}: {err}") from None
        repeat = pw.stored_group // pw.group_size  # a file group held as several engine groups of its scale
        s = s.repeat_interleave(repeat, dim=1) if repeat > 1 else s
        s = s if scales is None else scales.copy_(s)
        if pw.symmetric:
            return q, s, None
        z = z.float().repeat_interleave(repeat, dim=1) if repeat > 1 else z.float()
        return q, s, torch.mul(s, z, out=mins)  # min = scale * z, exact in fp32 (at most 15 significant bits)

    def expert_layouts(self, prefixes: list, names: list) -> tuple:
        """Per-layer held layouts for the memory plan (FP8 experts' are the plan's own: hetmoe/load/loader.py
        plan_model): for int4 experts (compressed-tensors, GPTQ, AWQ) the int4 / int8 layouts ``experts_layout`` gives,
        so that their scale dtypes and an affine layout's mins are counted as the loader builds them."""
        if not self._packed and not (self._nvfp4 is not None and self._nvfp4.blocks):
            return ()
        out = []
        for prefix in prefixes:
            layouts = {}
            for fmt in ("int8", "int4"):
                x = self.experts_layout(prefix, names, fmt)
                if x is not None:
                    layouts[fmt] = x
            out.append(HeldLayouts(layouts))
        return tuple(out)

    def fp8_experts(self, prefix: str, names: list) -> Optional[str]:
        """The kind of FP8 (hetmoe/load/fp8_formats.py: "block", "mx", "channel") block ``prefix``'s expert 0 is
        stored in (e4m3 and its scale beside it), or None."""
        kind = self._fp8_kind
        keys = [f"{prefix}.experts.0.{w}.weight" for w in names]
        if kind is None or not all(k in self._entries and self._entries[k].dtype == torch.float8_e4m3fn
                                   and any(k + x in self._entries for x in fp8_formats.scale_suffixes(kind))
                                   for k in keys):
            return None
        return kind

    def experts_layout(self, prefix: str, names: list, plan: Optional[str] = None) -> Optional[dict]:
        """The CPUExperts layout holding block ``prefix``'s routed experts (``names``: gate, up, down as the model
        calls them) exactly when expert 0's are pack-quantized (int4 codes; in int8 when the plan gives the layer
        int8), in a layer planned as fp8, block FP8 (fp8 group 128, shared fp32 scales), or None (gate and up of
        different groups, or experts stored otherwise)."""
        if plan == "fp8":
            kind = self.fp8_experts(prefix, names)
            return None if kind is None else fp8_formats.layout(kind)
        if f"{prefix}.experts" in self._mxfp4 | self._fp4_blocks:  # gpt-oss, DeepSeek-V4: lut4 e2m1 codes, e8m0
            # scales (int8 codes in an int8 plan)
            fmt, book = ("int8", None) if plan == "int8" else ("lut4", "e2m1")
            return {"weight_format": fmt, "group_size": mxfp4.BLOCK, "down_group_size": mxfp4.BLOCK,
                    "scaling": ("symmetric", "symmetric"), "scale_dtype": ("e8m0", "e8m0"), "codebook": (book, book)}
        if self._nvfp4 is not None and f"{prefix}.experts" in self._nvfp4.blocks:  # lut4 e2m1 group 16
            return self._nvfp4_call(self._nvfp4.layout, prefix, names, plan)
        pws = [self._packed.get(f"{prefix}.experts.0.{w}.weight") for w in names]
        if None in pws or (pws[0].group_size, pws[0].symmetric, pws[0].held_scale_dtype) != (
                pws[1].group_size, pws[1].symmetric, pws[1].held_scale_dtype):
            return None
        layout = {"weight_format": "int8" if plan == "int8" else "int4", "group_size": pws[0].group_size,
                  "down_group_size": pws[2].group_size,
                  "scaling": tuple("symmetric" if pw.symmetric else "affine" for pw in (pws[0], pws[2]))}
        scales = (pws[0].held_scale_dtype, pws[2].held_scale_dtype)
        if scales != ("fp32", "fp32"):  # the engine's default
            layout["scale_dtype"] = scales
        return layout

    def load_exact_experts(self, prefix: str, names: list, experts) -> bool:
        """Pack block ``prefix``'s routed experts from their own codes and scales when ``experts`` has the layout that
        holds them exactly: True when done, False when not (the loader dequantizes and packs floats then).
        CheckpointError naming the expert and matrix that the engine refuses or that is stored otherwise."""
        held = layout_of(experts)
        mine = self.experts_layout(prefix, names, plan_format(held)[0])
        if mine is None or any(k in held and held[k] != v for k, v in mine.items()):  # (no scale_dtype: fp32)
            return False
        if mine["weight_format"] == "fp8":
            self._load_fp8_experts(prefix, names, experts, self.fp8_experts(prefix, names))
            return True
        if f"{prefix}.experts" in self._mxfp4:
            self._load_mxfp4(prefix + ".experts", experts, held["weight_format"] == "int8")
            return True
        if f"{prefix}.experts" in self._fp4_blocks:
            self._load_fp4(prefix, names, experts, held["weight_format"] == "int8")
            return True
        if self._nvfp4 is not None and f"{prefix}.experts" in self._nvfp4.blocks:
            self._nvfp4_call(self._nvfp4.load, prefix, names, experts)
            return True
        I, H = experts.intermediate_size, experts.hidden_size
        shapes = ((I, H), (I, H), (H, I))
        groups = (held["group_size"],) * 2 + (held["down_group_size"],)
        first = [self._packed[f"{prefix}.experts.0.{w}.weight"] for w in names]  # what every expert must be stored as
        for e0 in range(0, experts.num_experts, CHUNK):
            n = min(CHUNK, experts.num_experts - e0)
            codes, scales, mins = [], [], []
            for slot, (which, (rows, cols), g, like) in enumerate(zip(names, shapes, groups, first)):
                key = (slot, rows, cols, g, like.symmetric)
                if key not in self._scratch:
                    self._scratch[key] = (torch.empty(CHUNK, rows, cols, dtype=torch.int8),
                                          torch.empty(CHUNK, rows, cols // g, dtype=compressed.ENGINE_SCALE_DTYPE),
                                          None if like.symmetric else torch.empty(CHUNK, rows, cols // g))
                q, s, m = (None if t is None else t[:n] for t in self._scratch[key])
                for j in range(n):
                    name = f"{prefix}.experts.{e0 + j}.{which}.weight"
                    pw = self._packed.get(name)
                    if pw is None or (pw.shape, pw.group_size, pw.symmetric, pw.method) != (
                            (rows, cols), g, like.symmetric, like.method):
                        got = "stored otherwise" if pw is None else pw.describe() + f" {list(pw.shape)}"
                        raise CheckpointError(f"{self.path}: {name} is {got}; the layer's experts are "
                                              f"{like.describe()} [{rows}, {cols}]")
                    self._codes(pw, q[j], s[j], None if m is None else m[j])
                codes.append(q)
                scales.append(s)
                mins.append(m)
            try:
                load_codes(experts, codes, scales, first_expert=e0, mins=mins, scan_first=False)
            except ValueError as err:
                raise self._refused(experts, codes, scales, prefix, e0, err, mins) from None
        return True

    def _load_fp8_experts(self, prefix: str, names: list, experts, kind: str) -> None:
        """Block ``prefix``'s FP8 experts of ``kind`` (hetmoe/load/fp8_formats.py) into fp8 ``experts`` byte for byte,
        CHUNK at a time (their codes and per-row scales staged; no expert is ever dequantized). CheckpointError naming
        the expert and matrix stored otherwise or refused (a NaN code or scale, scales missing or of the wrong
        shape)."""
        I, H = experts.intermediate_size, experts.hidden_size
        group = fp8_formats.GROUPS[kind]
        for e0 in range(0, experts.num_experts, CHUNK):
            n = min(CHUNK, experts.num_experts - e0)
            codes, scales = [], []
            for slot, (which, (rows, cols)) in enumerate(zip(names, ((I, H), (I, H), (H, I)))):
                key = ("fp8", kind, slot, rows, cols)
                if key not in self._scratch:
                    self._scratch[key] = (torch.empty(CHUNK, rows, cols, dtype=torch.uint8),
                                          torch.empty(CHUNK, rows, -(-cols // group)))
                q, sc = (t[:n] for t in self._scratch[key])
                for j in range(n):
                    name = f"{prefix}.experts.{e0 + j}.{which}.weight"
                    e = self._entries.get(name)
                    if e is None or e.dtype != torch.float8_e4m3fn or e.shape != (rows, cols):
                        got = "missing" if name not in self else f"stored as {e.dtype} {list(e.shape)}"
                        raise CheckpointError(f"{self.path}: {name} is {got}; the layer's experts are "
                                              f"{fp8_formats.NAMES[kind]} [{rows}, {cols}]")
                    _, scale = self._fp8_scale(name)
                    try:
                        fp8_formats.check_scale(kind, e.shape, tuple(scale.shape), scale.dtype, name)
                        sc[j].copy_(fp8_formats.row_scales(kind, scale, rows, cols, name))
                    except ValueError as err:
                        raise CheckpointError(f"{self.path}: {err}") from None
                    q[j].copy_(self.get(name).view(torch.uint8))
                codes.append(q)
                scales.append(sc)
            try:
                load_fp8(experts, codes, scales, first_expert=e0)
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {prefix}.experts: {err}") from None

    def _load_mxfp4(self, block: str, experts, as_int8: bool) -> None:
        """gpt-oss's MXFP4 experts of ``block`` ("<mlp>.experts") packed from their nibbles and scale bytes, CHUNK
        experts at a time: gate = rows 0::2 of gate_up, up = rows 1::2, down as stored (hetmoe/load/mxfp4.py).
        ``as_int8``: codebook values as int8 codes (a layer planned int8), still exact."""
        gub, gus, dnb, dns = (self.get(f"{block}.{w}") for w in ("gate_up_proj_blocks", "gate_up_proj_scales",
                                                                    "down_proj_blocks", "down_proj_scales"))
        for e0 in range(0, experts.num_experts, CHUNK):
            e1 = min(e0 + CHUNK, experts.num_experts)
            try:
                gu_q, dn_q = mxfp4.codes(gub[e0:e1]), mxfp4.codes(dnb[e0:e1])
                gu_s = mxfp4.engine_scales(gus[e0:e1], f"{block}.gate_up_proj of experts {e0}..{e1 - 1}")
                dn_s = mxfp4.engine_scales(dns[e0:e1], f"{block}.down_proj of experts {e0}..{e1 - 1}")
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {err}") from None
            codes = [gu_q[:, 0::2], gu_q[:, 1::2], dn_q]
            if as_int8:
                codes = [lut4_values(q, "e2m1") for q in codes]
            scales = [gu_s[:, 0::2], gu_s[:, 1::2], dn_s]
            try:
                load_codes(experts, codes, scales, first_expert=e0, scan_first=False)
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {block} experts {e0}..{e1 - 1}: {err}") from None

    def _load_fp4(self, prefix: str, names: list, experts, as_int8: bool) -> None:
        """DeepSeek-V4's FP4 experts of block ``prefix`` packed from their nibbles and scale bytes, CHUNK experts at a
        time, into lut4 e2m1 (``as_int8``: their codebook values as int8 codes, a layer planned int8), nothing
        dequantized."""
        I, H = experts.intermediate_size, experts.hidden_size
        for e0 in range(0, experts.num_experts, CHUNK):
            e1 = min(e0 + CHUNK, experts.num_experts)
            codes, scales = [], []
            for which, shape in zip(names, ((I, H), (I, H), (H, I))):
                qs, ss = [], []
                for e in range(e0, e1):
                    name = f"{prefix}.experts.{e}.{which}.weight"
                    if name not in self._fp4 or self.shape(name) != shape:
                        got = "missing" if name not in self else f"stored as {list(self.shape(name))}"
                        raise CheckpointError(f"{self.path}: {name} is {got}; the layer's experts are FP4 "
                                              f"{list(shape)}")
                    w, s = self._fp4[name]
                    qs.append(mxfp4.packed_codes(self._read(w)))
                    try:
                        ss.append(mxfp4.engine_scales(self._read(s), f"{name} (expert {e})"))
                    except ValueError as err:
                        raise CheckpointError(f"{self.path}: {err}") from None
                q = torch.stack(qs)
                codes.append(lut4_values(q, "e2m1") if as_int8 else q)
                scales.append(torch.stack(ss))
            try:
                load_codes(experts, codes, scales, first_expert=e0, scan_first=False)
            except ValueError as err:
                raise CheckpointError(f"{self.path}: {prefix}.experts {e0}..{e1 - 1}: {err}") from None

    def _refused(self, experts, codes: list, scales: list, prefix: str, e0: int, err: ValueError,
                 mins: Optional[list] = None) -> CheckpointError:
        """The error of a chunk of experts the engine refused, naming its first bad expert (each loaded alone, its
        values scanned first)."""
        mins = mins or [None] * 3
        for j in range(codes[0].shape[0]):
            try:
                load_codes(experts, [q[j:j + 1] for q in codes], [s[j:j + 1] for s in scales], first_expert=e0 + j,
                           mins=[None if m is None else m[j:j + 1] for m in mins])
            except ValueError as bad:
                return CheckpointError(f"{self.path}: {prefix}.experts.{e0 + j}: {bad}")
        return CheckpointError(f"{self.path}: {prefix}.experts.{e0}-{e0 + codes[0].shape[0] - 1}: {err}")

    def _layer_names(self, names: list) -> list:
        """``names`` (one MoE layer's expert 0 gate, up, down) for every layer of the checkpoint that has them."""
        out = []
        for i in range(self.config.get("num_hidden_layers") or 0):
            mine = [re.sub(r"\.layers\.\d+\.", f".layers.{i}.", n, count=1) for n in names]
            if all(n in self for n in mine):
                out.append(mine)
        return out or [names]

    def experts_options(self, names: list, options, log: Callable[[str], None]):
        """``options`` with the experts format int4 routed experts (compressed-tensors, GPTQ, AWQ; ``names``: one
        layer's expert 0 gate, up, down) load at by default: int4 in their own group (or one dividing it), exactly.
        An explicit --experts-format is kept (exact where it holds them: int4 of their group, or their codes in
        int8); other experts: ``options`` as given. A GPTQ layer's first expert's g_idx is read here, so that
        act-order groups are refused before the plan (CheckpointError naming the tensor)."""
        if self._mxfp4 or self._fp4_blocks:
            return self._mxfp4_options(options, log)
        if self._nvfp4 is not None and self._nvfp4.blocks:
            prefixes = sorted({layer[0].rsplit(".experts.", 1)[0] for layer in self._layer_names(names)})
            return self._nvfp4_call(self._nvfp4.options, options, log, self.path.name, prefixes,
                                    [n.split(".")[-2] for n in names])
        layers = self._layer_names(names)
        layouts = [self.experts_layout(layer[0].rsplit(".experts.", 1)[0], [n.split(".")[-2] for n in layer])
                   for layer in layers]
        exact = [plan_format(x) for x in layouts if x is not None]
        prefix, short = names[0].rsplit(".experts.", 1)[0], [n.split(".")[-2] for n in names]
        kind = None if exact else self.fp8_experts(prefix, short)
        if kind is not None:
            what = f"{self.path.name}'s routed experts are {fp8_formats.NAMES[kind]}, e4m3"
            fmt, group = options.experts_format, options.group_size
            if fmt == "fp8" and group in (None, fp8_formats.GROUPS[kind]):
                log(f"hetmoe: {what}: held as fp8 at their own bytes, as asked")
                return dataclasses.replace(options, group_size=fp8_formats.GROUPS[kind])
            if fmt != "auto":
                log(f"hetmoe: {what}: dequantized and re-quantized into {fmt} as asked")
            return options  # auto: the plan prefers fp8 where it fits (hetmoe/load/loader.py plan_model)
        if not exact:
            return options
        groups = [g for _, g in exact]
        group = max(set(groups), key=groups.count)
        pw = next(self._packed[layer[0]] for layer, x in zip(layers, layouts) if x is not None)
        if pw.method == "gptq":  # act-order refused before anything is planned (each g_idx is checked as read, too)
            for n in names:
                w = self._packed.get(n)
                if w is not None and w.module + ".g_idx" in self._entries:
                    try:
                        gptq.check_g_idx(w, self.get(w.module + ".g_idx"))
                    except compressed.QuantizationConfigError as err:
                        raise CheckpointError(f"{self.path}: {err}") from None
        what = f"{self.path.name}'s routed experts are {pw.describe()}"
        held = "" if pw.symmetric else f" (zero points as int8 beside {pw.held_scale_dtype.split('_')[0]} scales)"
        fmt = options.experts_format
        if fmt == "auto":
            off = len(layouts) - groups.count(group)
            log(f"hetmoe: {what}: packed as int4 group {group}{held} from their codes"
                + (f", exactly except {off} layer(s) stored otherwise (re-quantized)" if off else ", exactly"))
            return dataclasses.replace(options, experts_format="int4", group_size=group)
        asked = options.group_size if options.group_size is not None else group
        if fmt in ("int4", "int8") and asked == group:
            log(f"hetmoe: {what}: packed as {fmt} group {group}{held} as asked, exactly")
        else:
            log(f"hetmoe: note: {what}: dequantized and re-quantized into {fmt} as asked")
        keep = options.group_size is not None or fmt == "bf16"  # bf16 has no groups
        return options if keep else dataclasses.replace(options, group_size=group)

    def _mxfp4_options(self, options, log: Callable[[str], None]):
        """``options`` with the experts format MXFP4 experts load at by default: the engine's lut4 (a plan's int4 of
        group 32), exactly; an explicit int4 / int8 of group 32 is exact too, anything else re-quantized as asked."""
        what = f"{self.path.name}'s routed experts are MXFP4 (E2M1 in blocks of 32, E8M0 scales)"
        fmt = options.experts_format
        if fmt == "auto":
            log(f"hetmoe: {what}: packed from their own codes and scales as lut4 (e2m1), exactly")
            return dataclasses.replace(options, experts_format="int4", group_size=mxfp4.BLOCK)
        if fmt in ("int4", "int8") and options.group_size in (None, mxfp4.BLOCK):
            log(f"hetmoe: {what}: packed as {'lut4 (e2m1)' if fmt == 'int4' else 'int8'} from their codes, exactly")
            return dataclasses.replace(options, group_size=mxfp4.BLOCK)
        log(f"hetmoe: note: {what}: dequantized and re-quantized into {fmt} as asked")
        return options

    def release(self) -> None:
        """Drop the mapped pages of every shard from this process's resident memory."""
        for mm in self._maps.values():
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (AttributeError, OSError, ValueError):
                pass

    def close(self) -> None:
        self._scratch.clear()
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
