"""Write an all-F32 GGUF from any readable GGUF: same metadata, dequantized weights.

llama.cpp quantizes activations inside quantized matmuls, so on a quantized file it is
not an exact oracle for a float implementation. On this F32 copy it is: llama.cpp and
kvcompile then multiply the very same float32 weights.
"""
from __future__ import annotations

import os
from pathlib import Path

import gguf

from kvcompile.io.gguf.reader import open_gguf

LLAMA_FTYPE_ALL_F32 = 0
# Keys the writer produces itself (or that describe the old tensor encoding).
_SKIP_KEYS = {"general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment"}


def export_f32(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Dequantize every tensor of `src` to F32 and write it, with `src`'s metadata, to `dst`."""
    src_file = open_gguf(src)
    dst = Path(dst)
    writer = gguf.GGUFWriter(str(dst), src_file.arch)
    for key, value in src_file.metadata.items():
        if key in _SKIP_KEYS:
            continue
        types = src_file.value_types[key]
        sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub_type)
    writer.add_file_type(LLAMA_FTYPE_ALL_F32)
    for name in src_file.tensors:
        writer.add_tensor(name, src_file.tensor(name).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
