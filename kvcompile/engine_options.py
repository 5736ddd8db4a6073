"""Engine options that need no model, checked before the (possibly long) model load: the
device, the context size, the prefill ubatch, the KV cache types and the arena size."""
from __future__ import annotations

import torch

from kvcompile.errors import ContextLengthError, DeviceError, KvcompileError
from kvcompile.ops.kv_format import kv_type
from kvcompile.runtime.make import check_arena_mib


def parse_device(device: str | torch.device | None) -> torch.device:
    """The torch device of `device` (None: the CPU); DeviceError if it is not usable here."""
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device {device!r} is not a device name; use cpu or cuda "
                          f"(cuda:N for a GPU other than the first)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("CUDA is not available to this torch build (or no GPU is "
                              "visible): use device cpu (--device cpu), or install a CUDA "
                              "build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: this machine has "
                              f"{torch.cuda.device_count()} GPU(s), cuda:0.."
                              f"cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise DeviceError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def check_engine_options(ctx_size, ubatch, cache_type_k="f32", cache_type_v="f32",
                         kv_stream_arena_mib=0, gpu_memory_gib=None) -> None:
    """The engine options a typo can break that need no model (checked before loading)."""
    kv_type(cache_type_k), kv_type(cache_type_v)          # KvLayoutError names the types
    check_arena_mib(kv_stream_arena_mib)
    if gpu_memory_gib is not None and (not isinstance(gpu_memory_gib, (int, float))
                                       or isinstance(gpu_memory_gib, bool)
                                       or not gpu_memory_gib > 0):
        raise KvcompileError(f"gpu_memory_gib (--gpu-memory-gib) must be a positive number of "
                             f"GiB (or None: the device's free memory), got {gpu_memory_gib!r}")
    if ctx_size is not None and (not isinstance(ctx_size, int) or isinstance(ctx_size, bool)
                                 or ctx_size <= 0):
        raise ContextLengthError(f"ctx_size (--ctx-size) must be a positive integer (or None "
                                 f"for the default), got {ctx_size!r}")
    if not isinstance(ubatch, int) or isinstance(ubatch, bool) or ubatch <= 0:
        raise KvcompileError(f"ubatch (-ub / --ubatch-size) must be a positive integer, got "
                             f"{ubatch!r}")
