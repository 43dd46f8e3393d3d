"""A GGUF file (llama.cpp's single-file format) read: metadata as Python values, tensors memory-mapped.

``open_gguf(path)`` reads one file or a split set (``name-00001-of-00003.gguf``: give any part; every part must be
there, each part's ``split.no`` / ``split.count`` must agree with its name, and the parts together must hold
``split.tensors.count`` tensors). The files stay memory-mapped (gguf's ``GGUFReader``); nothing is copied until a
tensor is converted. Metadata values come back as Python values; a float32 value as the shortest decimal that is
the same float32 (1e-06, not 9.999999974752427e-07), as a config.json writes it. A tensor's ``shape`` is in
Hugging Face / numpy order: the reverse of ggml's ``ne``. Truncated files, files that are not GGUF, and a split set
with a part missing raise ``GGUFError`` (a ValueError) naming the file.
"""

from __future__ import annotations

import functools
import gc
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

_U64 = struct.Struct("<Q")
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or that does not describe a model hetmoe runs; the message names the file."""


class _Truncated(Exception):
    """(bytes a read needs, bytes the file has[, the tensor whose data needs them])"""


class _BadTensor(Exception):
    """(tensor name, what is wrong with its header)"""


@functools.lru_cache(maxsize=None)
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        # GGUFReader slices its memory map unchecked: a truncated file would surface as a numpy reshape error.
        # Every read goes through _get, so the bounds are checked there. It reads a plain ndarray view of the map:
        # slicing the np.memmap itself costs ~20 us a value (its __array_finalize__), 25 s for the 300 k strings of
        # a Qwen3 vocabulary.
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dtype = np.dtype(dtype)
            offset, count = int(offset), int(count)
            end = offset + dtype.itemsize * count
            if end > len(plain):
                raise _Truncated(end, len(plain))
            arr = plain[offset:end].view(dtype)
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

        def _build_tensors(self, start_offs, fields):
            # Each tensor's header checked first, so that an error names the tensor: a type id gguf does not know,
            # rows that are not whole blocks of the type (the byte count would not match the shape), data past the
            # end of the file.
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _BadTensor(name, f"GGML type id {int(raw_dtype[0])} is not one gguf "
                                           f"{getattr(gguf, '__version__', '')} knows") from None
                per, nbytes = gguf.GGML_QUANT_SIZES[kind]
                ne = [int(d) for d in dims]
                if ne and ne[0] % per:
                    raise _BadTensor(name, f"{kind.name} rows of {ne[0]} values are not whole blocks of {per}: "
                                           "its byte count does not match its shape")
                end = int(start_offs + offset[0]) + int(np.prod(ne)) // per * nbytes
                if end > size:
                    raise _Truncated(end, size, name)
            return super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs, raw_type):
            # An array read whole: GGUFReader reads it one element at a time (two _get calls per string), seconds
            # for a tokenizer's 150 k tokens and merges. The same parts and indices as GGUFReader's.
            V = gguf.GGUFValueType
            if raw_type != V.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = V(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            if itype == V.ARRAY or n == 0 or (nptype is None and itype != V.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                return 12 + int(values.nbytes), [raw_itype, alen, *values[:, None]], list(range(2, n + 2)), \
                    [V.ARRAY, itype]
            if self.byte_order == "S":  # a byte-swapped file (big-endian): GGUFReader's own reading
                return super()._get_field_parts(orig_offs, raw_type)
            view, starts, unpack = memoryview(self._plain), [], _U64.unpack_from
            try:
                for _ in range(n):
                    starts.append(offs)
                    offs += 8 + unpack(view, offs)[0]
            except struct.error:
                raise _Truncated(offs + 8, len(self._plain)) from None
            if offs > len(self._plain):
                raise _Truncated(offs, len(self._plain))
            # the parts as bytes (GGUFReader's are arrays; slicing the map per string costs ~10 us)
            buf, base, parts = bytes(view[orig_offs + 12:offs]), orig_offs + 12, [raw_itype, alen]
            for a, b in zip(starts, starts[1:] + [offs]):
                parts += (buf[a - base:a - base + 8], buf[a - base + 8:b - base])
            return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [V.ARRAY, itype]

    return Reader


def _f32(v: float) -> float:
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


def _field_value(field) -> Any:
    """A ReaderField's value: a str, int, float (float32 as its shortest decimal), bool, or a list of them."""
    from gguf import GGUFValueType as V

    def scalar(part, kind):
        if kind == V.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return _f32(value) if kind == V.FLOAT32 else bool(value) if kind == V.BOOL else value

    if field.types[0] != V.ARRAY:
        return scalar(field.parts[field.data[0]], field.types[0])
    sub = field.types[1] if len(field.types) > 1 else None
    if sub is None or not field.data:
        return []
    if sub == V.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if sub == V.ARRAY:
        return None  # arrays of arrays: no key hetmoe reads has them
    values = np.concatenate([field.parts[i] for i in field.data]).tolist()
    return [bool(v) for v in values] if sub == V.BOOL else values


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in Hugging Face order (reversed ggml ne); ``data`` the raw memory-mapped array (the
    element shape for F32/F16/F64/integers; rows of bytes for BF16 and block-quantized types)."""

    name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    shape: tuple
    data: np.ndarray
    part: Path

    def dequantized(self, dtype, index: Optional[int] = None):
        """The values as a torch tensor of ``dtype`` (fp32 values rounded once), from the block decoders in row
        chunks for FAST_TYPES (no whole fp32 copy), else from ``float32``."""
        import torch

        if self.ggml_type.name not in FAST_TYPES:
            return torch.from_numpy(self.float32(index)).to(dtype)
        raw = self.data if index is None else self.data[index]
        try:
            return _dequantize(raw, self.ggml_type.name, self.shape if index is None else self.shape[1:], dtype)
        except ValueError as e:
            raise GGUFError(f"{self.part}: tensor {self.name}: {e}") from None

    def float32(self, index: Optional[int] = None) -> np.ndarray:
        """The values as a float32 array of ``shape`` (a copy, dequantized); with ``index`` only ``tensor[index]``
        (one expert of a stacked-experts tensor: block-quantized rows never straddle the first dimension)."""
        import gguf

        raw = self.data if index is None else self.data[index]
        kind = gguf.GGMLQuantizationType
        if self.ggml_type in (kind.F32, kind.F16, kind.F64):
            return np.array(raw, dtype=np.float32)
        if self.ggml_type.name.startswith("I") and self.ggml_type.name[1:].isdigit():
            raise GGUFError(f"{self.part}: tensor {self.name} holds integers ({self.ggml_type.name}), not weights")
        if self.ggml_type.name in FAST_TYPES:
            import torch

            return self.dequantized(torch.float32, index).numpy()
        try:
            out = gguf.quants.dequantize(raw, self.ggml_type)
        except NotImplementedError as e:
            raise GGUFError(f"{self.part}: tensor {self.name} is {self.ggml_type.name}, which gguf "
                            f"{getattr(gguf, '__version__', '')} cannot dequantize: {e}") from None
        return np.asarray(out, dtype=np.float32)


FAST_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ2_0",
              "TQ1_0")  # hetmoe's decoders
_ROWS = 4096  # rows dequantized at once (bounds the codes' temporaries)


def _dequantize(raw: np.ndarray, kind: str, shape: tuple, dtype):
    """``raw`` (rows of blocks of GGML type ``kind``) as a ``dtype`` tensor of ``shape``: scale * code (- min) in
    fp32 (bitwise what gguf.quants.dequantize gives), _ROWS rows at a time, from the C++ block decoders on torch's
    threads (gguf's numpy dequantization runs at ~0.05 GB/s of file)."""
    import torch

    from hetmoe.load.gguf.checkpoint import block_codes
    from hetmoe.load.gguf.kquants import KQUANTS, kquant_codes
    from hetmoe.load.gguf.ternary import TERNARY, ternary_codes

    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = np.asarray(raw).reshape(rows, -1)
    out = torch.empty(rows, cols, dtype=dtype)
    tmp = torch.empty(min(rows, _ROWS), cols) if dtype != torch.float32 else None
    threads = torch.get_num_threads()
    for r0 in range(0, rows, _ROWS):
        r1 = min(rows, r0 + _ROWS)
        if kind in KQUANTS:
            codes, scales, mins = kquant_codes(raw[r0:r1], kind, (r1 - r0, cols), threads=threads)
        elif kind in TERNARY:
            (codes, scales), mins = ternary_codes(raw[r0:r1], kind, (r1 - r0, cols), threads=threads), None
        else:
            codes, scales, mins = block_codes(raw[r0:r1], kind, (r1 - r0, cols))
        dst = out[r0:r1] if tmp is None else tmp[:r1 - r0]
        view = dst.view(r1 - r0, scales.shape[-1], -1)  # [rows, groups, group]
        view.copy_(codes.view(view.shape)).mul_(scales[..., None])
        if mins is not None:
            view.sub_(mins[..., None])
        if tmp is not None:
            out[r0:r1].copy_(dst)
    return out.reshape(shape)


class GGUFFile:
    """One GGUF model, from one file or a split set: ``metadata`` (key -> value, from the first part, which holds
    them all), ``tensors`` (name -> GGUFTensor, over all parts), ``arch`` (general.architecture)."""

    def __init__(self, path: Path, parts: tuple, metadata: dict, tensors: dict, readers: list):
        self.path, self.parts, self.metadata, self.tensors = path, parts, metadata, tensors
        self._readers = readers
        self.arch: str = metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {self.arch}, {len(self.parts)} part(s), {len(self.tensors)} tensors)"

    def close(self) -> None:
        """Drop the memory maps (tensors taken before keep theirs alive until they are dropped too)."""
        self._readers.clear()
        self.tensors = {}

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(path: Path):
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(4)
    if len(head) < 4:
        raise GGUFError(f"{path} is truncated: {size} bytes, too few for a GGUF header")
    if head != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF'")
    try:
        return _reader_class()(path)
    except _BadTensor as e:
        raise GGUFError(f"{path}: tensor {e.args[0]}: {e.args[1]}") from None
    except _Truncated as e:
        if len(e.args) > 2:
            raise GGUFError(f"{path} is truncated: tensor {e.args[2]}'s data ends at byte {e.args[0]}, the file has "
                            f"{e.args[1]} (or the tensor's shape and type do not match its data)") from None
        raise GGUFError(f"{path} is truncated: it has {e.args[1]} bytes, its header and tensors need at least "
                        f"{e.args[0]}") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e


def _metadata(reader, path: Path) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = _field_value(field)
        except UnicodeDecodeError as e:
            raise GGUFError(f"{path}: metadata {key} is not valid UTF-8: {e}") from None
    return out


def _split_parts(path: Path) -> tuple:
    """The files of the set ``path`` belongs to (just ``path`` when its name has no -NNNNN-of-NNNNN)."""
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return (path,), None
    no, count = int(m["no"]), int(m["count"])
    if not 1 <= no <= count:
        raise GGUFError(f"{path}: a split part numbered {no} of {count}")
    parts = tuple(path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{path} is part {no} of a split set of {count} files in {path.parent}, but "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    return parts, count


def open_gguf(path: Union[str, Path]) -> GGUFFile:
    """Open a GGUF file, or the whole split set of a ``-NNNNN-of-NNNNN.gguf`` part (see the module docstring)."""
    collect = gc.isenabled()
    gc.disable()  # reading makes ~1 M small objects (a tokenizer's strings): no collection walks them meanwhile
    try:
        return _open(Path(path))
    finally:
        if collect:
            gc.enable()


def _open(path: Path) -> GGUFFile:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file {path}")
    parts, count = _split_parts(path)
    readers = [_read(p) for p in parts]
    metadata = _metadata(readers[0], parts[0])
    declared = metadata.get("split.count")
    if count is None and declared not in (None, 1):
        raise GGUFError(f"{path}: split.count is {declared}, but the file is not named like a split part "
                        f"(name-00001-of-{declared:05d}.gguf): rename the parts as llama.cpp's gguf-split wrote them")
    tensors: dict = {}
    for i, (part, reader) in enumerate(zip(parts, readers)):
        meta = metadata if i == 0 else _metadata(reader, part)
        if count is not None:
            no, n = meta.get("split.no"), meta.get("split.count")
            if (no, n) != (i, count):
                raise GGUFError(f"{part}: its split.no / split.count are {no} / {n}; its name says {i} / {count}")
        for t in reader.tensors:
            if t.name in tensors:
                raise GGUFError(f"{part}: tensor {t.name} is also in {tensors[t.name].part}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, t.data, part)
        reader.fields.clear()  # read into ``metadata``: their ~600 k parts need not stay alive (nor be walked by gc)
    total = metadata.get("split.tensors.count")
    if count is not None and total is not None and total != len(tensors):
        raise GGUFError(f"{parts[0]}: split.tensors.count is {total}, but the {count} parts hold {len(tensors)}")
    if not isinstance(metadata.get("general.architecture"), str):
        raise GGUFError(f"{parts[0]} has no general.architecture")
    return GGUFFile(parts[0], parts, metadata, tensors, readers)
