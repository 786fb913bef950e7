"""Open a GGUF file: metadata as plain Python values, tensors as torch (gguf's dequantization).

GGUF stores shapes innermost-first ([in, out] for a linear layer); `tensor()` returns the
PyTorch order ([out, in]) dequantized to float32.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pellucid.errors import ModelLoadError
from pellucid.weights.gguf_header import GGUFFormatError, TensorEntry, read_header

SUPPORTED_TYPES = {
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}


class GGUFFile:
    """A GGUF file opened for reading: `metadata` (dict) and `tensor(name)` (float32 torch)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata, tensors = _read(self.path)
        self._tensors: dict[str, TensorEntry] = {t.name: t for t in tensors}
        if len(self._tensors) != len(tensors):
            raise ModelLoadError(f"{self.path}: a tensor name appears twice; the file is corrupt")
        self._check_tensor_types()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._tensors[name].tensor_type

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (rows of quantized blocks), without copying."""
        return self._tensors[name].data

    def tensor(self, name: str) -> torch.Tensor:
        """Dequantize one tensor to float32 in PyTorch's order (outermost dimension first)."""
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        t = self._tensors[name]
        shape = tuple(reversed(t.dims))
        try:
            data = dequantize(t.data, t.tensor_type)
        except Exception as e:  # the gguf package raises plain errors on short data
            raise ModelLoadError(f"{self.path}: tensor {name!r} could not be decoded ({e})") from e
        data = np.ascontiguousarray(data, dtype=np.float32)
        if not data.flags.writeable:  # F32 tensors come straight from the read-only memory map
            data = data.copy()
        return torch.from_numpy(data).reshape(shape)

    def _check_tensor_types(self) -> None:
        for t in self._tensors.values():
            if t.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                    f"which pellucid does not read (supported: {supported})"
                )


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Metadata of a GGUF file as plain Python values (str, int, float, bool, lists of them)."""
    return GGUFFile(path).metadata


def _read(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF')"
        )
    try:
        return read_header(path)
    except (GGUFFormatError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"{path}: the GGUF file is truncated or corrupt ({type(e).__name__}: {e}); "
            "download or assemble it again"
        ) from e
