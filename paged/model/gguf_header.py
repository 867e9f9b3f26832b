"""A GGUF file's scalar metadata and tensor shapes, read from its header with `struct`.

gguf's GGUFReader makes a numpy view of every element of every array field, and SmolLM2's
vocabulary and merges are ~100k strings: reading its architecture that way takes seconds, paid by
every config check and simulator that needs the shape of a GGUF model. The architecture needs only
the scalar fields and the tensor shapes, so this steps over the arrays by their lengths instead of
materializing them: GGUFReader's values, in milliseconds.
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from paged.model.arch import LlamaArch

# struct formats of the scalar value types (GGUFReader.gguf_scalar_to_np)
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFHeader:
    """The non-array key/values, as GGUFReader's `contents()` gives them (its `GGUF.version`,
    `GGUF.tensor_count` and `GGUF.kv_count` included), and each tensor's shape in PyTorch order."""

    metadata: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]


class _Cursor:
    """Reads values one after another from `buf` in byte order `order` ("<" or ">")."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self) -> bytes:
        length = self.scalar("Q")
        if self.pos + length > len(self.buf):
            raise ValueError(f"GGUF string of {length} bytes at offset {self.pos} runs past the end of the file")
        self.pos += length
        return self.buf[self.pos - length : self.pos]

    def string(self) -> str:
        return str(self.raw_string(), encoding="utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind])
        raise ValueError(f"Unknown/unhandled field type {kind}")

    def skip_array(self) -> None:
        """Past an array's elements (arrays of arrays too) without decoding them."""
        kind, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if kind == GGUFValueType.ARRAY:
            for _ in range(count):
                self.skip_array()
        elif kind == GGUFValueType.STRING:
            length = struct.Struct(self.order + "Q")
            for _ in range(count):
                (n,) = length.unpack_from(self.buf, self.pos)
                self.pos += 8 + n
        elif kind in _SCALAR_FORMATS:
            self.pos += count * struct.calcsize(_SCALAR_FORMATS[kind])
        else:
            raise ValueError(f"Unknown/unhandled field type {kind}")
        if self.pos > len(self.buf):
            raise ValueError("a GGUF array runs past the end of the file")


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor shapes of the GGUF file at `path`; raises where GGUFReader would refuse
    the header: ValueError (magic, version, truncation, a repeated tensor, tensors past the end of
    the file), KeyError for a repeated key, as GGUFReader does."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(buf)
        except struct.error as e:
            raise ValueError(f"{path}: the GGUF header is truncated ({e})") from e


def _parse(buf: mmap.mmap) -> GGUFHeader:
    cur = _Cursor(buf, "<")
    if cur.scalar("I") != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version = cur.scalar("I")
    if version & 0xFFFF == 0:  # written on a host of the other byte order (GGUFReader's test)
        cur.order = ">" if sys.byteorder == "little" else "<"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in READER_SUPPORTED_VERSIONS:
        raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
    tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    kinds = {"GGUF.version": GGUFValueType.UINT32, "GGUF.tensor_count": GGUFValueType.UINT64,
             "GGUF.kv_count": GGUFValueType.UINT64}
    for _ in range(kv_count):
        key = cur.string()
        if key in kinds:
            raise KeyError(f"Duplicate {key} already in list")
        kinds[key] = GGUFValueType(cur.scalar("I"))
        if kinds[key] == GGUFValueType.ARRAY:
            cur.skip_array()
        else:
            metadata[key] = cur.value(kinds[key])
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        infos.append((name, dims, GGMLQuantizationType(cur.scalar("I")), cur.scalar("Q")))
    if kinds.get("general.alignment", GGUFValueType.UINT32) != GGUFValueType.UINT32:
        raise ValueError("Bad type for general.alignment field")
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError("Invalid alignment: must be a non-zero power of two")
    data_start = -(-cur.pos // alignment) * alignment
    shapes: dict[str, tuple[int, ...]] = {}
    for name, dims, kind, offset in infos:
        if name in shapes:
            raise ValueError(f"Found duplicated tensor with name {name}")
        block_size, type_size = GGML_QUANT_SIZES[kind]
        elements = 1
        for d in dims:
            elements *= d
        if data_start + offset + elements * type_size // block_size > len(buf):
            raise ValueError(f"GGUF tensor {name} runs past the end of the file")
        shapes[name] = tuple(reversed(dims))
    return GGUFHeader(metadata, shapes)


def read_arch(path: str | Path) -> LlamaArch:
    """The architecture alone, from the metadata and tensor shapes (the weights stay on disk)."""
    header = read_header(path)
    return LlamaArch.from_gguf_metadata(header.metadata, header.shapes)
