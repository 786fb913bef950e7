"""Read a GGUF file's header (metadata and tensor table) in one pass over a memory map.

The gguf package's GGUFReader makes a numpy view of every element of every array it meets: on a
vocabulary of 128k tokens and 280k merges that is ~10 s before the first tensor is touched, and
Gemma 3's 262k tokens take twice that. Here strings are cut from the bytes with `struct` and
numeric arrays read whole with numpy, so the same header takes a fraction of a second. Tensor data
stay in the map, shaped as GGUFReader shapes them, for gguf's own `dequantize`.

Layout (little-endian): magic, version (u32), tensor count, metadata count (u64 each); metadata
entries (key, value type, value); tensor entries (name, n_dims, dims innermost first, type,
offset); padding to `general.alignment`; then the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, numpy dtype) of fixed-size values
SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
# tensor types GGUFReader hands out as typed arrays; the others are rows of quantized blocks (bytes)
PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF header pellucid can read (gguf_file.py says so to the user)."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]  # innermost first, as GGUF stores them
    data: np.ndarray  # a view of the memory map: typed for PLAIN types, else uint8 blocks


class _Cursor:
    """Reads values one after another from the file's bytes."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file")
        text = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array(GGUFValueType(self.scalar("<I")), self.scalar("<Q"))
        return self.scalar(SCALARS[kind][0])

    def array(self, kind: GGUFValueType, count: int) -> list[Any]:
        if kind in SCALARS:  # numbers in one read
            dtype = np.dtype(SCALARS[kind][1]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(kind) for _ in range(count)]  # strings (or nested arrays)


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """(metadata, tensors) of the GGUF file at `path`. Raises GGUFFormatError (or struct.error
    on a file cut short) when the bytes are not a whole GGUF header."""
    mm = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(mm))
    if cur.scalar("<4s") != b"GGUF":
        raise GGUFFormatError("the file does not start with b'GGUF'")
    version = cur.scalar("<I")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (big-endian, or unknown) is not read here")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        table.append((name, GGMLQuantizationType(cur.scalar("<I")), dims, cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
    start = -(-cur.pos // alignment) * alignment
    return metadata, [_entry(mm, start, *row) for row in table]


def _entry(
    mm: np.ndarray, start: int, name: str, kind: GGMLQuantizationType, dims: tuple, offset: int
) -> TensorEntry:
    n = int(np.prod(dims))
    shape = tuple(reversed(dims))  # outermost first, as numpy (and GGUFReader) shape them
    block, block_bytes = GGML_QUANT_SIZES[kind]
    n_bytes = n * block_bytes // block
    begin = start + offset
    if begin + n_bytes > len(mm):
        raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
    raw = mm[begin : begin + n_bytes]
    if kind in PLAIN:
        data = raw.view(PLAIN[kind]).reshape(shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
    return TensorEntry(name, kind, dims, data)
