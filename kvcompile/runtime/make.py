"""One entry point for the engine: the reference cache or the streaming one, and the request
slot (`make_sequence_cache`: the KV of the layers a model declares, its recurrent state).

`--kv-stream-arena-mib 0` keeps the whole KV on the device (PagedKvCache, the reference
path); N > 0 streams it through an arena of N MiB (StreamingKvCache), with the CPU backend or,
for a cuda device, the CUDA backend (side-stream copies, event fences).
"""
from __future__ import annotations

import torch

from kvcompile.errors import ArenaError
from kvcompile.kv_cache import PagedKvCache
from kvcompile.runtime.streaming_cache import StreamingKvCache


def check_arena_mib(arena_mib) -> None:
    """0 / None (everything on the device), "auto" (what the memory budget leaves:
    kvcompile/memory_budget.py) or a positive size in MiB; ArenaError otherwise."""
    if arena_mib == "auto":
        return
    if arena_mib is not None and (not isinstance(arena_mib, (int, float))
                                  or isinstance(arena_mib, bool) or not arena_mib >= 0):
        raise ArenaError(f"kv_stream_arena_mib (--kv-stream-arena-mib) must be 0 (everything "
                         f"on the device), auto (what --gpu-memory-gib leaves) or a positive "
                         f"size in MiB, got {arena_mib!r}")


def make_kv_cache(config, max_tokens: int, arena_mib: float = 0, k_type="f32", v_type="f32",
                  page_size: int = 256, device="cpu", layers=None, backend=None, **kw):
    if arena_mib is None or arena_mib == 0:
        return PagedKvCache(config, max_tokens, k_type=k_type, v_type=v_type,
                            page_size=page_size, device=device, layers=layers)
    check_arena_mib(arena_mib)
    if backend is None:
        kind = torch.device(device).type
        if kind == "cuda":
            from kvcompile.runtime.cuda_backend import CudaBackend
            backend = CudaBackend(device)
        elif kind != "cpu":
            raise ArenaError(f"the streaming runtime has CPU and CUDA backends, not {kind}; "
                             f"use --kv-stream-arena-mib 0 on {device}")
    return StreamingKvCache(config, max_tokens, arena_mib, k_type=k_type, v_type=v_type,
                            page_size=page_size, layers=layers, backend=backend, **kw)


def make_sequence_cache(model, config, ctx: int, k_type: str, v_type: str, arena_mib: float,
                        device, page_size: int = 256):
    """The request slot's state: KV pages of the layers the model declares
    (`model.layer_plan`), all on the device (arena_mib 0) or history on the host streamed
    through an arena of that size, and a hybrid model's recurrent state beside them."""
    plan = model.layer_plan
    layers = None if plan.plain else plan.kv_layers
    cache = make_kv_cache(plan.kv_config(config), ctx, arena_mib, k_type=k_type,
                          v_type=v_type, page_size=page_size, device=device, layers=layers)
    if plan.recurrent:
        model.recurrent_state(cache)          # allocated now, not by the first forward
    return cache
