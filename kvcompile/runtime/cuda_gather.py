"""SM-driven host->device copies: a Triton kernel that reads pinned host memory directly.

Pinned memory is mapped into the device's address space (unified addressing), so a kernel
can load from it over PCIe / C2C like from device memory. Compared with the copy engine
(cudaMemcpyAsync on a side stream) it costs SMs but no DMA setup; which wins end to end is
measured by `python -m kvcompile.runtime.cuda_gather` (numbers in docs/streaming.md).
`CudaBackend(copy="gather")` (or KVCOMPILE_STREAM_COPY=gather) uses it for fills; publishes
(device->host) stay on the copy engine.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

BLOCK = 8192        # int32 words per program: 32 KiB, 16-byte loads per thread


@triton.jit
def _copy_words(dst, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 run as int32 words (page runs are whole pages: 16-byte multiples)."""
    if not t.is_contiguous() or t.nbytes % 4 or t.data_ptr() % 16:
        raise ValueError("gather copies need contiguous, 16-byte aligned runs of whole words")
    return t.reshape(-1).view(torch.int32)


def gather_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (device) <- src (pinned host), by SMs, on the current stream."""
    if src.device.type != "cpu" or not src.is_pinned():
        raise ValueError("the gather copy reads pinned host memory only")
    d, s = _words(dst), _words(src)
    n = d.numel()
    if n:
        _copy_words[(triton.cdiv(n, BLOCK),)](d, s, n, BLOCK=BLOCK, num_warps=8)


# ---- micro-benchmark ---------------------------------------------------------------------------
def _time(fn, stream, reps) -> float:
    with torch.cuda.stream(stream):
        fn()                                   # warm up (and compile the kernel)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(reps):
            fn()
        b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / 1000 / reps


def bandwidth(mib: int = 256, reps: int = 10) -> dict:
    """GB/s pinned host -> device: copy engine on a side stream vs the SM gather kernel."""
    n = mib * 2 ** 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    out = {}
    for name, fn in (("copy_engine", lambda: dst.copy_(src, non_blocking=True)),
                     ("sm_gather", lambda: gather_copy(dst, src))):
        dst.zero_()
        s = _time(fn, side, reps)
        torch.cuda.synchronize()
        assert torch.equal(dst[:4096].cpu(), src[:4096]) and torch.equal(dst[-4096:].cpu(),
                                                                        src[-4096:])
        out[name] = n / s / 1e9
    return out


def end_to_end(ctx: int = 16384, n_decode: int = 48, kv: str = "q8_0") -> dict:
    """Decode tokens/s of a SmolLM2-geometry model (random weights) whose whole KV streams
    through a tiny arena, per copy mode."""
    from kvcompile.config import ModelConfig
    from kvcompile.kv_cache import PagedKvCache
    from kvcompile.models.llama import LlamaModel
    from kvcompile.runtime.arena import MIB
    from kvcompile.runtime.cuda_backend import CudaBackend
    from kvcompile.runtime import StreamingKvCache, forward, min_arena_bytes
    cfg = ModelConfig(arch="llama", n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3,
                      head_dim=64, vocab_size=49152, context_length=ctx, rope_theta=1e5,
                      tie_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaModel(cfg).eval().requires_grad_(False)
    prompt = torch.randint(0, cfg.vocab_size, (ctx - n_decode - 8,), device="cuda")
    out = {}
    runs = [("all resident (PagedKvCache)", None, None)]
    runs += [(f"{mode}, {depth}", mode, slack) for mode in ("copy_engine", "sm_gather")
             for depth, slack in (("1 layer ring", 1.05), ("3 layer ring", 3.1))]
    for name, mode, slack in runs:
        if mode is None:
            cache = PagedKvCache(cfg, ctx, k_type=kv, v_type=kv, device="cuda")
        else:
            mib = min_arena_bytes(cfg, ctx, kv, kv) * slack / MIB
            cache = StreamingKvCache(cfg, ctx, mib, k_type=kv, v_type=kv,
                                     backend=CudaBackend(copy="gather" if mode == "sm_gather"
                                                         else "engine"))
        with torch.inference_mode():
            for s in range(0, len(prompt), 4096):
                t = prompt[s:s + 4096]
                forward(model, cache, t, torch.arange(s, s + len(t), device="cuda"),
                        last_only=True)
            tok, pos = int(prompt[-1]), len(prompt)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(n_decode):
                logits = forward(model, cache, torch.tensor([tok], device="cuda"),
                                 torch.tensor([pos + i], device="cuda"), last_only=True)
                tok = int(logits[-1].argmax())
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        if mode is None:
            out[name] = dict(tok_s=n_decode / dt)
            continue
        st = cache.stats()
        cache.close()
        out[name] = dict(
            tok_s=n_decode / dt, streamed_fraction=st["streamed_fraction"],
            gib_per_step=st["h2d_bytes"] / st["steps"] / 2 ** 30,
            copy_busy_pct=st["copy_busy_pct"], misses=st["readiness_misses"])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the numbers here too")
    ap.add_argument("--ctx", type=int, default=16384)
    a = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), "h2d_GBps": bandwidth()}
    print(json.dumps(res["h2d_GBps"]), flush=True)
    res["decode_end_to_end"] = end_to_end(a.ctx)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
