"""TensorStream (kvcompile/io/gguf/tensor_stream.py): chunks of tensors read through rotating
staging buffers with a read-ahead carry the file's bytes, whether the read-ahead covers the
next request (tensors back to back or past a few bytes of padding) or not (a jump)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_oracle import fresh_seed
from kvcompile.errors import ModelFileError
from kvcompile.io.gguf.tensor_stream import TensorStream


def test_chunks_carry_the_files_bytes_across_readahead_hits_and_misses(tmp_path):
    rng = np.random.default_rng(fresh_seed())
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    # (offset, rows, row bytes): back to back, padded by 32 bytes, a jump back, rows wider
    # than a chunk, the file's last byte
    tensors = [(0, 100, 96), (9600, 50, 100), (14632, 7, 1000), (1000, 10, 10),
               (20000, 3, 5000), (299_000, 10, 100)]
    with TensorStream(path, "cpu", chunk_bytes=2048) as stream:
        for offset, rows, row_bytes in tensors:
            got = torch.cat([c.clone() for _, c in stream.row_chunks(offset, rows, row_bytes)])
            want = torch.from_numpy(data[offset:offset + rows * row_bytes].copy())
            assert torch.equal(got.reshape(-1), want), (offset, rows, row_bytes)


def test_a_truncated_file_is_a_model_file_error(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(1000))
    with pytest.raises(ModelFileError, match="truncated"):
        with TensorStream(path, "cpu", chunk_bytes=256) as stream:
            for _ in stream.row_chunks(900, 4, 100):
                pass
