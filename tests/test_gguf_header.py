"""paged.model.gguf_header reads what gguf's GGUFReader reads (scalar metadata, tensor shapes, the
architecture) from files gguf's own writer makes: every value type, arrays of strings and of arrays,
a custom alignment, both byte orders; and refuses the headers GGUFReader refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from paged.model import gguf_header, gguf_loader


def write_llama(path: Path, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    """A two-layer llama GGUF with every scalar type and the array kinds a tokenizer uses."""
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_eos_token_id(2)
    for add, key, value in ((w.add_uint8, "t.u8", 200), (w.add_int8, "t.i8", -3), (w.add_uint16, "t.u16", 60000),
                            (w.add_int16, "t.i16", -300), (w.add_int32, "t.i32", -70000),
                            (w.add_uint64, "t.u64", 2**40), (w.add_int64, "t.i64", -(2**40)),
                            (w.add_float64, "t.f64", 0.1), (w.add_bool, "t.bool", True), (w.add_string, "t.str", "é")):
        add(key, value)
    w.add_token_list(["<unk>", "a", "bc", "ü"] * 5)
    w.add_array("t.floats", [0.5, 1.5])
    w.add_key_value("t.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    for name, shape in (("token_embd.weight", (20, 8)), ("blk.0.attn_q.weight", (8, 8)),
                        ("blk.0.attn_q.bias", (8,)), ("blk.1.ffn_down.weight", (8, 16))):
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))  # the writer swaps the bytes for a big-endian file
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_matches_gguf_reader(tmp_path: Path, endianess: GGUFEndian, alignment: int | None) -> None:
    path = write_llama(tmp_path / "m.gguf", endianess, alignment)
    reader = GGUFReader(str(path))
    header = gguf_header.read_header(path)
    assert header.metadata == gguf_loader.read_metadata(reader)
    assert [type(v) for v in header.metadata.values()] == [type(v) for v in gguf_loader.read_metadata(reader).values()]
    assert header.shapes == {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert header.metadata["t.str"] == "é" and "tokenizer.ggml.tokens" not in header.metadata
    assert gguf_header.read_arch(path) == gguf_loader.read_arch(path)


def test_a_bad_header_is_refused_like_gguf_reader_refuses_it(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "m.gguf")
    data = path.read_bytes()
    cases = {"magic": b"GGUX" + data[4:], "truncated": data[:200], "no tensor data": data[:-64]}
    for name, content in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises((ValueError, IndexError)):  # GGUFReader's error for a truncated header: IndexError
            GGUFReader(str(bad))
        with pytest.raises(ValueError):
            gguf_header.read_header(bad)
