"""Read a GGUF tensor's bytes in row chunks through a few reusable staging buffers.

Plain file reads (not a memory map): a mapped file's pages count toward the process's
resident memory as they are touched, so mapping a 15 GB model would grow it to 15 GB; here
the bytes go from the page cache straight into a staging buffer (pinned host memory when
the destination is a GPU, so the copy to the device is asynchronous) and host memory stays
at a few chunks whatever the model's size. Buffers rotate; each is reused only once the
device copy that read it has finished (an event a buffer). While the caller copies one
chunk out, the bytes after it are already being read into the next buffer (tensors lie in
file order, so the next request is almost always there).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvcompile.errors import ModelFileError

CHUNK_BYTES = 64 << 20
READERS = max(4, min(16, os.cpu_count() or 4))
READ_PIECE = 4 << 20
SLACK = 4096          # a read-ahead covers the next tensor's first chunk past its padding


class TensorStream:
    def __init__(self, path: str | os.PathLike, device: torch.device,
                 chunk_bytes: int = CHUNK_BYTES, buffers: int = 3):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.buffers = [torch.empty(chunk_bytes + SLACK, dtype=torch.uint8, device="cpu",
                                    pin_memory=self.cuda) for _ in range(buffers)]
        self.events = [None] * buffers
        self.turn = 0
        self.bytes_read = 0
        self.read_seconds = 0.0       # waiting for file bytes (not hidden behind other work)
        self.wait_seconds = 0.0       # waiting for a buffer's device copy to finish
        self.pool = ThreadPoolExecutor(READERS)
        self.ahead_pool = ThreadPoolExecutor(1)
        self.ahead = None             # (turn, offset, length, future) of the read-ahead

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead[3].exception()
            self.ahead = None
        self.ahead_pool.shutdown()
        self.pool.shutdown()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.close()

    def row_chunks(self, offset: int, rows: int, row_bytes: int):
        """Yield (first row, host uint8 [n, row_bytes]) covering the tensor's rows in
        order. A chunk is valid until the caller has queued its use (a device copy or a
        host read) and asked for the next one: the caller copies out of it before then."""
        per = max(1, self.chunk_bytes // max(row_bytes, 1))
        if row_bytes > self.chunk_bytes:
            self._grow(row_bytes)
            per = 1
        for r0 in range(0, rows, per):
            n = min(per, rows - r0)
            view = self._fetch(offset + r0 * row_bytes, n * row_bytes)
            yield r0, view.view(n, row_bytes)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self.events[self.turn] = ev

    def _fetch(self, offset: int, length: int) -> torch.Tensor:
        """The file's bytes [offset, offset + length) in a staging buffer (the read-ahead's,
        when it holds them), and the read-ahead of the bytes after them started."""
        hit = None
        if self.ahead is not None:
            turn, at, n, fut = self.ahead
            t = time.perf_counter()
            fut.result()
            self.read_seconds += time.perf_counter() - t
            self.ahead = None
            if at <= offset and offset + length <= at + n:
                hit = turn, offset - at
        if hit is None:
            buf = self._next_buffer()          # its wait counts in wait_seconds
            t = time.perf_counter()
            self._read_into(buf[:length].numpy(), offset)
            self.read_seconds += time.perf_counter() - t
            hit = self.turn, 0
        else:
            self.turn = hit[0]
        end = offset + length
        if end < self.size:
            nxt = self._next_buffer(advance=False)
            n = min(self.chunk_bytes + SLACK, self.size - end)
            self.ahead = (nxt[0], end, n, self.ahead_pool.submit(
                self._read_into, nxt[1][:n].numpy(), end))
        return self.buffers[hit[0]][hit[1]:hit[1] + length]

    def _grow(self, row_bytes: int) -> None:
        if self.ahead is not None:
            self.ahead[3].result()
            self.ahead = None
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.chunk_bytes = row_bytes
        self.buffers = [torch.empty(row_bytes + SLACK, dtype=torch.uint8, device="cpu",
                                    pin_memory=self.cuda) for _ in self.buffers]
        self.events = [None] * len(self.buffers)

    def _next_buffer(self, advance: bool = True):
        """The buffer after the current one, once free (advance: it becomes current; else
        (its turn, the buffer), for the read-ahead)."""
        turn = (self.turn + 1) % len(self.buffers)
        ev = self.events[turn]
        if ev is not None:
            t = time.perf_counter()
            ev.synchronize()          # the device copy that last read this buffer is done
            self.wait_seconds += time.perf_counter() - t
            self.events[turn] = None
        if not advance:
            return turn, self.buffers[turn]
        self.turn = turn
        return self.buffers[turn]

    def _read_into(self, out: np.ndarray, offset: int) -> None:
        """Fill `out` from the file at `offset`: large reads in READERS threads at once (a
        single reader copied from the page cache at a fifth of `cat`'s rate on the H200's
        host; preadv releases the GIL)."""
        mv = memoryview(out).cast("B")
        step = -(-len(mv) // READERS)
        if len(mv) < 2 * READ_PIECE:
            self._read_range(mv, offset)
        else:
            parts = [(mv[i:i + step], offset + i) for i in range(0, len(mv), step)]
            for f in [self.pool.submit(self._read_range, *p) for p in parts]:
                f.result()
        self.bytes_read += len(mv)

    def _read_range(self, mv: memoryview, offset: int) -> None:
        done = 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:]], offset + done)
            if n <= 0:
                raise ModelFileError(f"{self.path} ended at byte {offset + done} while a "
                                     f"tensor was read (the header says more); the file is "
                                     f"truncated: re-download or re-convert it")
            done += n
