"""Open a GGUF file: plain-Python metadata, tensor infos, memory-mapped tensor bytes.

The header is parsed once by our own checked parser (`header.py`: no count or length in
the file is trusted); tensor bytes are memory-mapped on first use. Every failure is a
ModelFileError (or UnsupportedModelError for an architecture outside `archs` or a tensor
type id this gguf version does not know) whose message says what is wrong with which file.
"""
from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
import torch

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.dequant import dequantize_tensor
from kvcompile.io.gguf.header import TensorInfo, read_header

# Handed out typed, as the gguf package's reader does; every other type as its bytes.
_TYPED = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
          "I64": "<i8"}


class GgufFile:
    """A parsed GGUF file. Tensor data stays memory-mapped until `tensor()` reads it.

    archs: the architectures the caller can use; another one is refused before the rest of
    the header (the vocabulary) is decoded."""

    def __init__(self, path: str | os.PathLike, archs: Collection[str] | None = None):
        self.path = Path(path)
        check = None if archs is None else (lambda arch: _check_arch(self.path, arch, archs))
        header = read_header(self.path, check_arch=check)
        self.version, self.alignment = header.version, header.alignment
        self.metadata: dict = header.metadata
        self.value_types: dict[str, list[gguf.GGUFValueType]] = header.value_types
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in header.tensors}
        self._map: np.memmap | None = None

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFileError(
                f"{self.path} has no 'general.architecture' metadata key; it is not a model "
                f"GGUF, or it was written incompletely: re-convert it")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (or typed values for float/int types) as stored, memory-mapped."""
        info = self._lookup(name)
        if self._map is None:
            self._map = np.memmap(self.path, mode="r")
        data = self._map[info.data_offset:info.data_offset + info.n_bytes]
        if info.ggml_type in _TYPED:
            return data.view(_TYPED[info.ggml_type]).reshape(info.shape)
        qtype = gguf.GGMLQuantizationType[info.ggml_type]
        return data.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, qtype))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized, shape `self.tensors[name].shape`, in `dtype`."""
        info = self._lookup(name)
        qtype = gguf.GGMLQuantizationType[info.ggml_type]
        values = dequantize_tensor(name, self.raw(name), qtype)
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(info.shape).to(dtype)

    def _lookup(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path} has no tensor {name!r}; the file is incomplete or for a "
                f"different architecture") from None

    def __repr__(self) -> str:
        return f"GgufFile({str(self.path)!r}, arch={self.metadata.get('general.architecture')!r}, tensors={len(self.tensors)})"


def open_gguf(path: str | os.PathLike, archs: Collection[str] | None = None) -> GgufFile:
    return GgufFile(path, archs=archs)


def _check_arch(path: Path, arch: str, archs: Collection[str]) -> None:
    if arch not in archs:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(sorted(archs))}. Use a model of one of those families")
