"""The fast paths of GGUF reading (loading at >= 1 GB/s) give what gguf's own code gives:

* metadata arrays read whole (hetmoe/load/gguf/reader.py Reader._get_field_parts) == gguf.GGUFReader's values, for
  arrays of strings, integers, floats and booleans, empty ones and arrays of arrays; a file cut inside an array is
  named as truncated;
* dense tensors dequantized by the C++ block decoders in row chunks (reader.py _dequantize) == gguf.quants
  .dequantize bitwise, in fp32 and rounded once to bf16;
* K-quant blocks decoded on several threads into given buffers (kquants.py kquant_codes) == one thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import random_blocks  # noqa: E402

import hetmoe.load.gguf.reader as reader  # noqa: E402
from hetmoe.load.gguf import GGUFError, open_gguf  # noqa: E402
from hetmoe.load.gguf.kquants import kquant_codes  # noqa: E402


def _file(path, tokens: int = 300):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_token_list([f"tok{i}" + "é" * (i % 3) for i in range(tokens)])  # multi-byte UTF-8 too
    w.add_token_types([i % 4 for i in range(tokens)])
    w.add_array("test.floats", [0.1 * i for i in range(7)])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_token_merges([f"tok{i} tok{i + 1}" for i in range(tokens // 2)])
    w.add_tensor("a.weight", np.ones((4, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


def test_arrays_read_whole_equal_gguf_reader(tmp_path):
    path = _file(tmp_path / "m.gguf")
    plain = gguf.GGUFReader(path)
    with open_gguf(path) as f:
        assert f.metadata == reader._metadata(plain, path)
        assert f.metadata["tokenizer.ggml.tokens"][2] == "tok2éé"
        assert f.metadata["tokenizer.ggml.token_type"][:5] == [0, 1, 2, 3, 0]
        assert f.metadata["test.bools"] == [True, False, True] and "test.nested" in f.metadata
        assert len(f.metadata["tokenizer.ggml.merges"]) == 150


def test_a_file_cut_inside_a_string_array_is_truncated(tmp_path):
    data = _file(tmp_path / "m.gguf").read_bytes()
    at = data.index(b"tok150")  # inside the token list
    (tmp_path / "cut.gguf").write_bytes(data[:at + 3])
    with pytest.raises(GGUFError, match=r"cut\.gguf is truncated"):
        open_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"])
def test_dense_dequantization_is_gguf_bitwise(kind, monkeypatch):
    monkeypatch.setattr(reader, "_ROWS", 7)  # several chunks and a partial one
    raw = random_blocks(kind, 30, 512, np.random.default_rng(5))
    ref = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32))
    out = reader._dequantize(raw, kind, (3, 10, 512), torch.float32)
    assert out.shape == (3, 10, 512) and torch.equal(out.reshape(30, 512), ref)
    assert torch.equal(reader._dequantize(raw, kind, (30, 512), torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_threaded_decoding_into_buffers_equals_one_thread(kind):
    raw = random_blocks(kind, 37, 768, np.random.default_rng(6))
    one = kquant_codes(raw, kind, (37, 768))
    bufs = tuple(None if t is None else torch.full_like(t, 99) for t in one)
    got = kquant_codes(raw, kind, (37, 768), out=bufs, threads=3)
    assert all(g is b for g, b in zip(got, bufs))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(one, got))
    with pytest.raises(ValueError, match="output tensors"):
        kquant_codes(raw, kind, (37, 768), out=(bufs[0][:5], *bufs[1:]))
