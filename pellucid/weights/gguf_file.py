"""Open a GGUF file with the `gguf` package: metadata as plain Python values, tensors as torch.

GGUF stores shapes innermost-first ([in, out] for a linear layer); `tensor()` returns the
PyTorch order ([out, in]) dequantized to float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pellucid.errors import ModelLoadError

SUPPORTED_TYPES = {
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
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {
            key: _field_value(field)
            for key, field in self._reader.fields.items()
            if not key.startswith("GGUF.")
        }
        self._tensors = {t.name: t for t in self._reader.tensors}
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
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            data = dequantize(t.data, t.tensor_type)
        except Exception as e:  # the gguf package raises plain errors on short data
            raise ModelLoadError(f"{self.path}: tensor {name!r} could not be decoded ({e})") from e
        data = np.ascontiguousarray(data, dtype=np.float32)
        if not data.flags.writeable:  # F32 tensors come straight from the read-only memory map
            data = data.copy()
        return torch.from_numpy(data).reshape(shape)

    def _check_tensor_types(self) -> None:
        for t in self._reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                    f"which pellucid does not read (supported: {supported})"
                )


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Metadata of a GGUF file as plain Python values (str, int, float, bool, lists of them)."""
    return GGUFFile(path).metadata


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF')"
        )
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises ValueError/IndexError on short files
        raise ModelLoadError(
            f"{path}: the GGUF file is truncated or corrupt ({type(e).__name__}: {e}); "
            "download or assemble it again"
        ) from e


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
