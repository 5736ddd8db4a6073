"""Open a GGUF file: plain-Python metadata, tensor infos, memory-mapped tensor bytes.

Parsing is done by the `gguf` package's reader. It reports damaged files through assorted
ValueErrors, KeyErrors and numpy errors; here every failure becomes a ModelFileError (or
UnsupportedModelError for a tensor type id this gguf version does not know) whose message
says what is wrong with which file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.gguf.dequant import dequantize_tensor

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str            # ggml type name, e.g. "Q4_1"
    shape: tuple[int, ...]    # PyTorch order: [rows = out features, cols = in features]
    n_bytes: int
    data_offset: int          # absolute offset in the file

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that validates each tensor's type id and byte extent before mapping it,
    so that the error names the tensor (the base class fails with a bare reshape error)."""

    def _build_tensors(self, start_offs, fields):
        file_size = len(self.data)
        where = getattr(self.data, "filename", None) or "GGUF file"
        known = {int(t) for t in gguf.GGMLQuantizationType}
        for field in fields:
            # parts: name_len, name, n_dims, dims, type id, offset (gguf's tensor-info layout)
            name = bytes(field.parts[1]).decode("utf-8", errors="replace")
            dims, type_id, rel = field.parts[3], int(field.parts[4][0]), int(field.parts[5][0])
            if type_id not in known:
                raise UnsupportedModelError(
                    f"{where}: tensor {name!r} has ggml type id {type_id}, which this version of the "
                    f"gguf package does not know; convert the model to a supported type "
                    f"(e.g. Q8_0, Q4_K, F16)")
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elems = math.prod(int(d) for d in dims)  # Python ints: corrupt dims cannot wrap
            if len(dims) and int(dims[0]) % block:
                raise ModelFileError(
                    f"{where}: tensor {name!r}: row length {int(dims[0])} is not a multiple of the "
                    f"{qtype.name} block size {block}; the file is corrupt, re-convert it")
            end = start_offs + rel + n_elems // block * type_size
            if end > file_size:
                raise ModelFileError(
                    f"{where} is truncated: tensor {name!r} needs bytes up to {end} but "
                    f"the file has only {file_size} bytes; re-download or re-convert it")
        super()._build_tensors(start_offs, fields)


class GgufFile:
    """A parsed GGUF file. Tensor data stays memory-mapped until `tensor()` reads it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict = {}
        self.value_types: dict[str, list[gguf.GGUFValueType]] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue  # header counts, not metadata
            self.metadata[key] = _plain(field.contents())
            self.value_types[key] = list(field.types)
        self._raw = {t.name: t for t in self._reader.tensors}
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(
                name=t.name, ggml_type=t.tensor_type.name,
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                n_bytes=int(t.n_bytes), data_offset=int(t.data_offset))
            for t in self._reader.tensors}

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
        return self._lookup(name).data

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized, shape `self.tensors[name].shape`, in `dtype`."""
        t = self._lookup(name)
        values = dequantize_tensor(name, t.data, t.tensor_type)
        shape = self.tensors[name].shape
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape).to(dtype)

    def _lookup(self, name: str):
        try:
            return self._raw[name]
        except KeyError:
            raise ModelFileError(
                f"{self.path} has no tensor {name!r}; the file is incomplete or for a "
                f"different architecture") from None

    def __repr__(self) -> str:
        return f"GgufFile({str(self.path)!r}, arch={self.metadata.get('general.architecture')!r}, tensors={len(self.tensors)})"


def open_gguf(path: str | os.PathLike) -> GgufFile:
    return GgufFile(path)


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise ModelFileError(f"model file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise ModelFileError(f"{str(path)!r} is a folder; pass a .gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != GGUF_MAGIC:
        raise ModelFileError(
            f"{str(path)!r} is not a GGUF file (its first bytes are {head!r}, a GGUF starts "
            f"with b'GGUF'); pass a .gguf model file or a Hugging Face checkpoint folder")
    try:
        return _CheckedReader(path, "r")
    except (UnsupportedModelError, ModelFileError):
        raise
    except Exception as exc:  # gguf raises ValueError/KeyError/IndexError/... on damage
        size = path.stat().st_size
        raise ModelFileError(
            f"{str(path)!r} ({size} bytes) is a truncated or corrupt GGUF file "
            f"({type(exc).__name__}: {exc}); re-download or re-convert it") from exc


def _plain(value):
    """numpy scalars/arrays from the reader -> plain Python values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    return value
