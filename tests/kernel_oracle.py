"""Helpers for the Triton kernel tests: fresh inputs, placements, the fp64 oracle, and a
runner that executes kernels under TRITON_INTERPRET=1 in a subprocess.

The interpreter flag must be set before a kernel is decorated, so interpreted runs happen
in a child process (`tests/interp_worker.py`); the parent builds the inputs, computes the
references and compares. This keeps the rest of the suite (and the GPU tests) unaffected
by the flag, whatever order the tests run in.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvcompile.ops import kv_format as F
from kvcompile.ops.kv_write.naive import kv_write_naive
from kvcompile.kv.span_plan import Ring, Span, SpanPlan

TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]
PAIRS = [(k, v) for k in TYPES for v in TYPES]
WORKER = Path(__file__).with_name("interp_worker.py")


def fresh_seed() -> int:
    seed = int(os.environ.get("KVC_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed {seed} (set KVC_SEED to replay)")
    return seed


def garbage_pool(n_pages: int, kv_name: str, page_size: int, n_kv: int, head_dim: int,
                 gen: torch.Generator, device="cpu") -> torch.Tensor:
    """Random bytes (NaN/inf patterns included): unwritten positions must never be read."""
    nbytes = F.page_bytes(F.kv_type(kv_name), page_size, n_kv, head_dim)
    pool = torch.randint(0, 256, (n_pages, nbytes), dtype=torch.uint8, generator=gen)
    return pool.to(device)


def paired_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, gen: torch.Generator):
    """The same pages as the streaming cache lays them out (kv/kv_pages.PagePair):
    (buffer [N, stride], K view, V view), each physical page a K page then a V page, any
    padding random bytes; a kernel that steps pages by page_bytes reads the wrong ones."""
    from kvcompile.kv.kv_pages import PagePair
    pair = PagePair(k_pool.shape[1], v_pool.shape[1])
    kv = torch.randint(0, 256, (k_pool.shape[0], pair.stride), dtype=torch.uint8,
                       generator=gen).to(k_pool.device)
    k, v = pair.views(kv)
    k.copy_(k_pool)
    v.copy_(v_pool)
    return kv, k, v


def spaced_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, gen: torch.Generator,
                 gaps=(16, 48)):
    """The same pages with K and V pages further apart than their size by different gaps
    (random bytes between): a kernel that steps V's pages by K's stride, or either by its
    page size, reads the wrong bytes."""
    def spaced(pool, gap):
        buf = torch.randint(0, 256, (pool.shape[0], pool.shape[1] + gap), dtype=torch.uint8,
                            generator=gen).to(pool.device)
        view = buf[:, :pool.shape[1]]
        view.copy_(pool)
        return view
    return spaced(k_pool, gaps[0]), spaced(v_pool, gaps[1])


def placements(n_pages: int, page_size: int) -> dict[str, SpanPlan]:
    """Three plans for logical pages 0..n-1 in one pool of 3n + 3 pages: all resident,
    resident then ring, all in the ring with a wrap (when n > 1)."""
    n = n_pages
    ring = Ring(first_physical_page=2 * n + 2, n_slots=n + 1)
    plans = {"resident": SpanPlan([Span(0, n + 1, n)], 3 * n + 3, ring)}
    half = max(1, n // 2)
    mixed = [Span(0, 1, half)]
    if n > half:
        mixed += ring.spans(half, n - half, start_slot=1)
    plans["mixed"] = SpanPlan(mixed, 3 * n + 3, ring)
    plans["ring_wrap"] = SpanPlan(ring.spans(0, n, start_slot=ring.n_slots - max(1, n // 2)),
                                  3 * n + 3, ring)
    return plans


def fill_pools(k_rows, v_rows, table, k_name, v_name, page_size, n_phys, gen, device="cpu"):
    """Pools of garbage with logical rows [0, S) written (by the reference kv_write) into
    the pages that `table` names."""
    _, n_kv, head_dim = k_rows.shape
    kp = garbage_pool(n_phys, k_name, page_size, n_kv, head_dim, gen).to(device)
    vp = garbage_pool(n_phys, v_name, page_size, n_kv, head_dim, gen).to(device)
    pos = torch.arange(k_rows.shape[0], device=device)
    slots = table.to(device)[pos // page_size].long() * page_size + pos % page_size
    kv_write_naive(kp, vp, k_rows.to(device), v_rows.to(device), slots,
                   F.kv_type(k_name).ggml_id, F.kv_type(v_name).ggml_id, page_size)
    return kp, vp


def dense_reference(q, k_pool, v_pool, table, q_pos, k_name, v_name, page_size, scale,
                    window=0):
    """fp64 causal attention over the dequantized KV that `table` points at (window > 0:
    each row over its last `window` positions)."""
    n_rows, n_q, head_dim = q.shape
    kt, vt = F.kv_type(k_name), F.kv_type(v_name)
    n_kv = F.n_kv_heads_of(k_pool, kt, page_size, head_dim)
    n_ctx = int(q_pos.max()) + 1
    phys = table[: -(-n_ctx // page_size)].long().to(k_pool.device)
    k = F.decode_pages(k_pool[phys], kt, n_kv, page_size, head_dim, role="k").double()
    v = F.decode_pages(v_pool[phys], vt, n_kv, page_size, head_dim, role="v").double()
    k = k.permute(1, 0, 2, 3).reshape(n_kv, -1, head_dim)[:, :n_ctx]
    v = v.permute(1, 0, 2, 3).reshape(n_kv, -1, head_dim)[:, :n_ctx]
    g = n_q // n_kv
    qd = q.double().to(k.device).reshape(n_rows, n_kv, g, head_dim).permute(1, 2, 0, 3)
    s = torch.einsum("hgtd,hsd->hgts", qd, k) * scale
    key, rows = torch.arange(n_ctx, device=k.device)[None, :], q_pos.long().to(k.device)[:, None]
    vis = key <= rows
    if window:
        vis &= key > rows - window
    s = s.masked_fill(~vis, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(s, -1), v)
    return out.permute(2, 0, 1, 3).reshape(n_rows, n_q, head_dim)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (fp64)."""
    ref = ref.to(out.device)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def run_interpreted(jobs: list[dict], timeout: int = 600) -> list[dict]:
    """Run kernel jobs (see interp_worker.py) under TRITON_INTERPRET=1 in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = Path(tmp) / "jobs.pt", Path(tmp) / "results.pt"
        torch.save(jobs, inp)
        env = dict(os.environ, TRITON_INTERPRET="1")
        t0 = time.time()
        proc = subprocess.run([sys.executable, str(WORKER), str(inp), str(outp)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        print(f"interpreter worker: {len(jobs)} jobs in {time.time() - t0:.1f}s")
        if proc.returncode != 0:
            raise RuntimeError(f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}")
        return torch.load(outp)


def build(k_name, v_name, n_ctx, n_rows, head_dim, n_kv, group, page_size, q_dtype, gen,
          plan_names=("resident",), device="cpu", scattered_rows=False, table_pad=0,
          q_outliers=0):
    """Fresh logical KV + queries for the last n_rows positions (or, scattered_rows, for
    random distinct positions in random order, the last one included), written under each
    plan; table_pad extra page-table entries past the plan; q_outliers channels of the
    queries x 40 (the outlier dims of real models' queries)."""
    n_pages = math.ceil(n_ctx / page_size)
    k = torch.randn(n_ctx, n_kv, head_dim, generator=gen)
    v = torch.randn(n_ctx, n_kv, head_dim, generator=gen)
    q = torch.randn(n_rows, n_kv * group, head_dim, generator=gen) * 1.5
    if q_outliers:
        q[..., torch.randperm(head_dim, generator=gen)[:q_outliers]] *= 40
    q = q.to(q_dtype)
    q_pos = torch.arange(n_ctx - n_rows, n_ctx, dtype=torch.int32)
    if scattered_rows:
        pick = torch.randperm(n_ctx - 1, generator=gen)[:n_rows - 1]
        q_pos = torch.cat([pick, torch.tensor([n_ctx - 1])]).int()
        q_pos = q_pos[torch.randperm(n_rows, generator=gen)]
    plans = placements(n_pages, page_size)
    placed = {}
    for name in plan_names:
        plan = plans[name]
        table = plan.page_table(length=plan.n_logical_pages + table_pad)
        kp, vp = fill_pools(k, v, table, k_name, v_name, page_size, plan.num_physical_pages,
                            gen, device)
        placed[name] = (table.to(device), kp, vp)
    return q.to(device), q_pos.to(device), placed


def stale_before_window(table: torch.Tensor, q_pos: torch.Tensor, window: int,
                        page_size: int) -> torch.Tensor:
    """`table` with every logical page wholly before all rows' windows pointed at physical
    page 0 (garbage in every placement): a kernel that reads such a page gives another
    result."""
    first = max(int(q_pos.min()) - window + 1, 0) // page_size
    stale = table.clone()
    stale[:first] = 0
    return stale


def args_of(k_name, v_name, q, q_pos, table, kp, vp, page_size):
    return dict(q=q, k_pool=kp, v_pool=vp, page_table=table, q_pos=q_pos,
                k_type=F.kv_type(k_name).ggml_id, v_type=F.kv_type(v_name).ggml_id,
                page_size=page_size, scale=q.shape[-1] ** -0.5)
