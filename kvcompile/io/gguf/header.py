"""Our own GGUF header parser: no count or length in the file is trusted.

Model files come from the internet and servers load what users name. The gguf package's
reader believes the header: an array declared with 2^40 elements made it loop while memory
grew by gigabytes (issue 30). Here every count and length is checked against the bytes left
in the file and a sane limit before anything is allocated or iterated; a violation raises
ModelFileError naming the field and the file (UnsupportedModelError for a tensor type id
ggml does not know).

Layout (GGUF v2/v3, little-endian): b"GGUF", version u32, tensor count u64, key/value count
u64; the key/values (string key, u32 value type, value); the tensor infos (string name, u32
n_dims, n_dims u64 dims with the row length first, u32 ggml type, u64 offset into the data);
padding to `general.alignment` (u32, default 32); the tensor data. A string is a u64 byte
length then UTF-8 bytes; an array is a u32 element type, a u64 count, then the elements.

The file is memory-mapped, so reading the header touches only the header's pages. The
architecture can be checked (`check_arch`) before the vocabulary arrays are decoded.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from kvcompile.errors import ModelFileError, UnsupportedModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)             # v1 had 32-bit counts; nothing writes it any more
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                  # GGML_MAX_DIMS
# Sane limits, far above real files (hundreds of keys, a few thousand tensors, vocabularies
# of ~262K tokens, chat templates of tens of KB), so that a file's size alone cannot make
# a header cost gigabytes of Python objects.
MAX_ITEMS = 1 << 20           # key/values, tensors
MAX_ARRAY_LEN = 1 << 24       # elements of one array value
MAX_STRING = 1 << 24          # bytes of one string value
MAX_NAME = 1 << 16            # bytes of a key or a tensor name
INT64_MAX = (1 << 63) - 1     # ggml keeps element counts in int64
# Smallest encodings: a key/value is a length, a type and a 1-byte value; a tensor info is
# a name length, n_dims, a type and an offset (no dims).
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_BYTES = 8 + 4 + 4 + 8

VT = gguf.GGUFValueType
_SCALARS = {  # fixed-size value types: struct format, numpy dtype (little-endian)
    VT.UINT8: ("<B", "<u1"), VT.INT8: ("<b", "<i1"), VT.UINT16: ("<H", "<u2"),
    VT.INT16: ("<h", "<i2"), VT.UINT32: ("<I", "<u4"), VT.INT32: ("<i", "<i4"),
    VT.FLOAT32: ("<f", "<f4"), VT.BOOL: ("<?", "?"), VT.UINT64: ("<Q", "<u8"),
    VT.INT64: ("<q", "<i8"), VT.FLOAT64: ("<d", "<f8"),
}
_STRUCTS = {t: struct.Struct(fmt) for t, (fmt, _) in _SCALARS.items()}
_U64 = _STRUCTS[VT.UINT64]
_VALUE_TYPES = {int(t): t for t in VT}
_GGML_TYPES = {int(t): t for t in gguf.GGMLQuantizationType}


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


@dataclass
class GgufHeader:
    path: Path
    version: int
    metadata: dict            # key -> plain Python value (int, float, bool, str or list)
    value_types: dict         # key -> [type] or [ARRAY, element type] (gguf.GGUFValueType)
    tensors: list             # TensorInfo, in file order
    alignment: int
    data_offset: int          # absolute offset of the tensor data section
    file_size: int


def read_header(path: str | os.PathLike,
                check_arch: Callable[[str], None] | None = None) -> GgufHeader:
    """Parse and validate the header of the GGUF file at `path`.

    check_arch(arch) runs on the `general.architecture` value before any other value is
    decoded (it may raise to refuse the file); a file without that key is refused then.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise ModelFileError(f"{str(path)!r} is a folder; pass a .gguf file")
    with open(path, "rb") as f:
        head = f.read(4)
        if head != MAGIC:
            raise ModelFileError(
                f"{str(path)!r} is not a GGUF file (its first bytes are {head!r}, a GGUF "
                f"starts with b'GGUF'); pass a .gguf model file or a Hugging Face checkpoint "
                f"folder")
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _Parser(mm, size, path).header(check_arch)
    finally:
        mm.close()


class _Parser:
    """A bounds-checked cursor over the mapped file. Values are read by slicing or
    struct/numpy reads of exactly the checked extent, so no view outlives the parse."""

    def __init__(self, buf, size: int, path: Path):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, detail: str) -> ModelFileError:
        return ModelFileError(
            f"{str(self.path)!r} ({self.size} bytes) is a truncated or corrupt GGUF file: "
            f"{detail}; re-download or re-convert it")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but only {left} "
                            f"bytes are left")

    def scalar(self, vtype, what: str):
        st = _STRUCTS[vtype]
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n = self.scalar(VT.UINT64, f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} declares {n} bytes, more than the {limit} a GGUF string "
                            f"may have here")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})")

    def value_type(self, what: str):
        code = self.scalar(VT.UINT32, what)
        vtype = _VALUE_TYPES.get(code)
        if vtype is None:
            raise self.fail(f"{what} is {code}, not a GGUF value type (0-{max(_VALUE_TYPES)})")
        return vtype

    # -- the key/values

    def array_head(self, key: str):
        """An array's element type and count, both checked against the bytes left."""
        what = f"key {key!r}"
        etype = self.value_type(f"the element type of array {what}")
        if etype == VT.ARRAY:
            raise self.fail(f"{what} is an array of arrays, which GGUF does not allow")
        n = self.scalar(VT.UINT64, f"the length of array {what}")
        if n > MAX_ARRAY_LEN:
            raise self.fail(f"array {what} declares {n} elements, more than the "
                            f"{MAX_ARRAY_LEN} an array may have here")
        item = _STRUCTS[etype].size if etype in _STRUCTS else 8  # a string: its length, at least
        self.need(n * item, f"array {what} of {n} {etype.name} elements")
        return etype, n

    def value(self, vtype, key: str):
        """-> (the value as plain Python, [vtype] or [ARRAY, element type])."""
        if vtype in _STRUCTS:
            return self.scalar(vtype, f"the value of key {key!r}"), [vtype]
        if vtype == VT.STRING:
            return self.string(f"the value of key {key!r}"), [vtype]
        etype, n = self.array_head(key)
        if etype == VT.STRING:
            return self.string_array(n, key), [vtype, etype]
        dtype = np.dtype(_SCALARS[etype][1])
        values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()  # no view outlives this
        self.pos += n * dtype.itemsize
        return values, [vtype, etype]

    def string_array(self, n: int, key: str, decode: bool = True) -> list[str] | None:
        """n strings in one tight loop (262K tokens in ~0.1 s); decode=False only checks
        and skips them."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = [] if decode else None
        for i in range(n):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"the length of element {i} of array key {key!r}")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos or length > MAX_STRING:
                self.pos = pos
                raise self.fail(f"element {i} of array key {key!r} declares {length} bytes, "
                                f"but at most {min(size - pos, MAX_STRING)} can be read")
            if decode:
                out.append(buf[pos:pos + length])
            pos += length
        self.pos = pos
        if not decode:
            return None
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError:
            bad = next(i for i, b in enumerate(out) if not _is_utf8(b))
            raise self.fail(f"element {bad} of array key {key!r} is not valid UTF-8") from None

    def skip_value(self, vtype, key: str) -> None:
        if vtype in _STRUCTS:
            self.need(_STRUCTS[vtype].size, f"the value of key {key!r}")
            self.pos += _STRUCTS[vtype].size
        elif vtype == VT.STRING:
            n = self.scalar(VT.UINT64, f"the length of the value of key {key!r}")
            self.need(n, f"the value of key {key!r}")
            self.pos += n
        else:
            etype, n = self.array_head(key)
            if etype == VT.STRING:
                self.string_array(n, key, decode=False)
            else:
                self.pos += n * _STRUCTS[etype].size  # checked by array_head

    def key(self, i: int) -> str:
        return self.string(f"the name of key/value {i}", MAX_NAME)

    def find_arch(self, n_kv: int) -> str | None:
        """`general.architecture`, skipping the values before it undecoded (it is the
        first key in files written by llama.cpp and the gguf package)."""
        start = self.pos
        try:
            for i in range(n_kv):
                key = self.key(i)
                vtype = self.value_type(f"the value type of key {key!r}")
                if key == "general.architecture":
                    if vtype == VT.STRING:
                        return self.string(f"the value of key {key!r}")
                    self.skip_value(vtype, key)  # a bad length is the first thing to report
                    raise self.fail(f"key {key!r} is a {vtype.name}, not a STRING")
                self.skip_value(vtype, key)
            return None
        finally:
            self.pos = start

    # -- the whole header

    def header(self, check_arch) -> GgufHeader:
        self.pos = 4
        version = self.scalar(VT.UINT32, "the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            where = str(self.path)
            if swapped in VERSIONS:
                raise ModelFileError(f"{where!r} is a big-endian GGUF; kvcompile reads "
                                     f"little-endian files: convert the model again as "
                                     f"little-endian")
            raise ModelFileError(f"{where!r} is GGUF version {version}; kvcompile reads "
                                 f"versions {' and '.join(map(str, VERSIONS))}: convert the "
                                 f"model with a current llama.cpp")
        n_tensors = self.scalar(VT.UINT64, "the tensor count")
        n_kv = self.scalar(VT.UINT64, "the key/value count")
        for n, what in ((n_kv, "key/value count"), (n_tensors, "tensor count")):
            if n > MAX_ITEMS:
                raise self.fail(f"the {what} is {n}, more than the {MAX_ITEMS} kvcompile reads")
        least = n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_BYTES
        if least > self.size - self.pos:
            raise self.fail(
                f"the key/value count {n_kv} and tensor count {n_tensors} need at least "
                f"{least} bytes, but only {self.size - self.pos} bytes are left")
        if check_arch is not None:
            arch = self.find_arch(n_kv)
            if not arch:
                raise ModelFileError(
                    f"{str(self.path)!r} has no 'general.architecture' string key; it is not a "
                    f"model GGUF, or it was written incompletely: re-convert it")
            check_arch(arch)
        metadata, value_types = {}, {}
        for i in range(n_kv):
            key = self.key(i)
            if key in metadata:
                raise self.fail(f"key {key!r} appears twice")
            vtype = self.value_type(f"the value type of key {key!r}")
            metadata[key], value_types[key] = self.value(vtype, key)
        alignment = self.alignment(metadata, value_types)
        infos = [self.tensor_info(i) for i in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        return GgufHeader(self.path, version, metadata, value_types,
                          self.place_tensors(infos, data_offset, alignment),
                          alignment, data_offset, self.size)

    def alignment(self, metadata: dict, value_types: dict) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        a = metadata["general.alignment"]
        if value_types["general.alignment"] != [VT.UINT32]:
            raise self.fail(f"key 'general.alignment' is a "
                            f"{'/'.join(t.name for t in value_types['general.alignment'])}, "
                            f"not a UINT32")
        if a == 0 or a & (a - 1):
            raise self.fail(f"key 'general.alignment' is {a}, not a power of two")
        return a

    def tensor_info(self, i: int):
        name = self.string(f"the name of tensor {i}", MAX_NAME)
        what = f"tensor {name!r}"
        n_dims = self.scalar(VT.UINT32, f"the dimension count of {what}")
        if n_dims > MAX_DIMS:
            raise self.fail(f"{what} declares {n_dims} dimensions; ggml tensors have at most "
                            f"{MAX_DIMS}")
        dims = [self.scalar(VT.UINT64, f"dimension {d} of {what}") for d in range(n_dims)]
        type_id = self.scalar(VT.UINT32, f"the ggml type of {what}")
        offset = self.scalar(VT.UINT64, f"the data offset of {what}")
        if 0 in dims:
            raise self.fail(f"{what} has a dimension of 0 (dims {dims})")
        n_elements = 1
        for d in dims:  # Python ints: a product past int64 is reported, never wrapped
            n_elements *= d
        if n_elements > INT64_MAX:
            raise self.fail(f"the dimensions {dims} of {what} multiply to {n_elements} "
                            f"elements, past ggml's int64 element count")
        qtype = _GGML_TYPES.get(type_id)
        if qtype is None:
            raise UnsupportedModelError(
                f"{str(self.path)!r}: tensor {name!r} has ggml type id {type_id}, which this "
                f"version of the gguf package does not know; convert the model to a supported "
                f"type (e.g. Q8_0, Q4_K, F16)")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise ModelFileError(
                f"{str(self.path)!r}: tensor {name!r}: row length {dims[0]} is not a multiple "
                f"of the {qtype.name} block size {block}; the file is corrupt, re-convert it")
        return name, qtype, dims, offset, n_elements // block * type_size

    def place_tensors(self, infos, data_offset: int, alignment: int) -> list[TensorInfo]:
        tensors, seen = [], set()
        for name, qtype, dims, offset, n_bytes in infos:
            if name in seen:
                raise self.fail(f"tensor {name!r} appears twice")
            seen.add(name)
            if offset % alignment:
                raise self.fail(f"the data offset {offset} of tensor {name!r} is not a "
                                f"multiple of the alignment {alignment}")
            start = data_offset + offset
            if start + n_bytes > self.size:
                raise ModelFileError(
                    f"{str(self.path)!r} is truncated: tensor {name!r} needs bytes up to "
                    f"{start + n_bytes} but the file has only {self.size} bytes; re-download "
                    f"or re-convert it")
            tensors.append(TensorInfo(name=name, ggml_type=qtype.name,
                                      shape=tuple(reversed(dims)), n_bytes=n_bytes,
                                      data_offset=start))
        return tensors


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
