"""Fence waits on the CPU: device_wait defaults to a host wait; AllOf forwards the stream."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ArenaError
from kvcompile.kv.store import KvStore
from kvcompile.kv.fences import DONE, AllOf, EventFence, Fence, device_wait_all


def test_device_wait_of_a_host_fence_blocks_until_it_is_set():
    f = EventFence("copy")
    t0 = time.perf_counter()
    threading.Timer(0.05, f.set).start()
    f.device_wait()
    assert f.query() and time.perf_counter() - t0 >= 0.04
    DONE.device_wait("any stream")                       # already complete: returns


class _Seen(Fence):
    def __init__(self):
        self.streams = []

    def query(self):
        return True

    def wait(self):
        raise AssertionError("a device wait must not become a host wait here")

    def device_wait(self, stream=None):
        self.streams.append(stream)


def test_all_of_and_device_wait_all_pass_the_stream_to_every_fence():
    a, b, c = _Seen(), _Seen(), _Seen()
    AllOf([a, AllOf([b])]).device_wait("s1")
    device_wait_all([c, DONE], "s2")
    assert a.streams == ["s1"] and b.streams == ["s1"] and c.streams == ["s2"]


def test_host_history_larger_than_memory_fails_before_allocating():
    huge = ModelConfig(arch="llama", n_layers=4096, hidden=64, ffn=64, n_heads=8,
                       n_kv_heads=8, head_dim=128, vocab_size=256, context_length=131072)
    with pytest.raises(ArenaError, match="GiB of host memory.*--ctx-size"):
        KvStore(huge, 131072, 1100)             # 4 TiB of f32 history


def test_devices_without_a_streaming_backend_fail_clearly():
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, ffn=64, n_heads=2, n_kv_heads=1,
                      head_dim=32, vocab_size=64, context_length=256)
    with pytest.raises(ArenaError, match="CPU and CUDA backends.*--device cpu"):
        KvStore(cfg, 256, 4, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ArenaError, match="needs CUDA"):
            KvStore(cfg, 256, 4, device="cuda")
