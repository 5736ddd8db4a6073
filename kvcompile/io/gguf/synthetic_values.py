"""Random values of synthetic tensors, generated in parallel and streamed in file order.

A tensor is cut into fixed row chunks of about CHUNK_ELEMENTS values; chunk c of tensor
`name` draws from its own generator seeded by (seed, crc32(name), c). So the bytes depend
only on (seed, name, shape, type), never on how many threads made them, and chunks can be
produced concurrently (numpy's generators and torch's casts release the GIL) while a
bounded window of finished chunks is written in order: memory stays ~window x chunk.
"""
from __future__ import annotations

import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import torch

from kvcompile.io.gguf.quantize import quantize

CHUNK_ELEMENTS = 1 << 22   # ~16 MiB of float32 per chunk
_T = gguf.GGMLQuantizationType
_TORCH_FLOATS = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}
# types the gguf package cannot quantize go through our torch quantizer, on the GPU when
# there is one (its bytes do not depend on the device); the legacy types keep gguf's
# quantizer, llama.cpp's reference one
_OURS = {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.IQ4_NL, _T.IQ4_XS}


def chunk_rows(t) -> list[tuple[int, int]]:
    """(first row, n rows) of each chunk; vectors are one row."""
    rows, cols = (t.shape[0], t.shape[1]) if len(t.shape) == 2 else (1, t.shape[0])
    step = max(1, CHUNK_ELEMENTS // cols)
    return [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]


def make_chunk(t, seed: int, index: int, n_rows: int) -> np.ndarray:
    """The chunk's bytes in the tensor's ggml type (a uint8/float array ready for tofile)."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode()), index])
    shape = (n_rows, t.shape[1]) if len(t.shape) == 2 else (t.shape[0],)
    x = _values(t, rng, shape)
    if t.ggml_type in _TORCH_FLOATS:
        # torch rounds to nearest even like gguf.quants, and is several times faster
        y = torch.from_numpy(x).to(_TORCH_FLOATS[t.ggml_type])
        return (y.view(torch.int16) if y.dtype == torch.bfloat16 else y).numpy()
    if t.ggml_type in _OURS:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return quantize(torch.from_numpy(x).to(device), t.ggml_type.name).cpu().numpy()
    return gguf.quants.quantize(x, t.ggml_type)


def _values(t, rng: np.random.Generator, shape) -> np.ndarray:
    if t.init == "normal":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
    if t.init == "norm":
        return 1.0 + rng.standard_normal(shape, dtype=np.float32) * np.float32(t.scale)
    if t.init == "uniform":
        return rng.uniform(t.low, t.low + t.scale, shape).astype(np.float32)
    if t.init == "values":
        return np.asarray(t.values, dtype=np.float32).reshape(shape)
    if t.init == "neg_log_uniform":
        return -np.exp(rng.uniform(t.low, t.low + t.scale, shape)).astype(np.float32)
    raise ValueError(f"unknown init {t.init!r} for {t.name}")


def _jobs(plan):
    for t in plan:
        rows = chunk_rows(t)
        for i, (_, n) in enumerate(rows):
            yield t, i, n, i == len(rows) - 1


def stream_chunks(plan, seed: int, workers: int | None = None):
    """Yield (tensor, chunk bytes, is_last_chunk) in file order, computed by `workers`
    threads with a bounded look-ahead."""
    workers = workers or min(16, os.cpu_count() or 1)
    jobs = _jobs(plan)
    if workers == 1:
        for t, i, n, last in jobs:
            yield t, make_chunk(t, seed, i, n), last
        return
    with ThreadPoolExecutor(workers) as pool:
        window: deque = deque()
        for t, i, n, last in jobs:
            window.append((t, pool.submit(make_chunk, t, seed, i, n), last))
            if len(window) >= 2 * workers:
                t0, fut, last0 = window.popleft()
                yield t0, fut.result(), last0
        while window:
            t0, fut, last0 = window.popleft()
            yield t0, fut.result(), last0
