"""Probe (device): a timeline of the transposed decode's calls, stamped inside its kernels.

Copies of the split and reduce kernels (their source with `globaltimer` reads added, built
into a temporary module) record, per program: entry (just before the PDL wait), the wait's
release, the loop's start (its first page-table and scale loads issued), the end of its
first tile, its end, and its SM. The reads are in issue order, not ordered after the loads
and dots before them: "first tile" is when the first iteration's code was issued (its
softmax needs the K codes; the V dot may still run). They are launched as the op launches
the originals (untraced: codes by TMA, PDL between kernels; checked) and captured as
bench_attention captures the op (20 calls over 4 disjoint KV copies in one CUDA graph; 3
replays, then 1 timed). For the call in the middle of the replay the row gives, in us from
the first split program's passing its wait (earlier entries are negative): when the split's
programs enter and pass their wait, start their loop, finish their first tile (medians),
finish (first, median, last); when the reduce's programs enter, pass their wait and finish;
when the next call's split passes its wait.

The stamps cost registers: the stamped split keeps the shipped one's registers at D 128
(128) but takes 168 at D 256 (3 programs an SM instead of 4: a second wave the shipped
kernel does not have), so only 8 x 128 timelines stand for the shipped kernel; the rows
carry both counts. --l2-pages N: page tables cycling over N pages that stay in L2
(probe_compute_ceiling; one table, 5 calls a graph; kv_bytes is then the pool's, not what
a call reads), the same timeline without HBM traffic. --raw: every program's stamps (10 ns
units from the first split program's passing its wait, then the SM) in the JSON.

usage: python benchmarks/probe_timeline.py [--contexts 32768] [--geoms 8x128,4x256]
       [--pps 4,8,16] [--l2-pages 16] [--raw] [--json PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile

import torch
from torch._library.triton import set_wrap_triton_enabled

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import DecodeCase  # noqa: E402
from probe_compute_ceiling import l2_case  # noqa: E402

from kvcompile.ops.launching import interpreting, register_cap  # noqa: E402
from kvcompile.ops.pdl import launch as pdl_launch  # noqa: E402
from kvcompile.ops.span_attention import decode_split as DS  # noqa: E402
from kvcompile.ops.span_attention import decode_transposed as DT  # noqa: E402
from kvcompile.ops.span_attention.tma_codes import code_descriptors, tma_possible  # noqa: E402

STAMPS = 6          # entry, wait released, loop start, first tile done, end, SM
PAGE = 256
Q_HEADS = {128: 32, 256: 24}      # bench_attention's geometries
SPLIT_PID = "tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)"
REDUCE_PID = ("(tl.program_id(0) * tl.num_programs(1) + tl.program_id(1))"
              " * tl.num_programs(2) + tl.program_id(2)")


def stamped_source(fn, pid_expr: str, loop: bool) -> str:
    """`fn`'s source with a stamp buffer as first argument, globaltimer reads around its
    PDL wait (and with `loop`, at its tile loop's start and after its first tile), and the
    stamps stored at its end. Fails if the kernel no longer has the lines it looks for."""
    src = inspect.getsource(fn).replace(f"def {fn.__name__}(",
                                        f"def {fn.__name__}(stamp_ptr, ", 1)
    wait = next(w for w in ("wait_for_producers(PDL)", "wait_for_producers_hold_next(PDL)")
                if w in src)
    hooks = {wait: ("t_in = globaltimer()", None, "t_wait = globaltimer()",
                    "t_loop = t_wait", "t_first = t_wait")}
    if loop:
        hooks["for n0 in range(start, end, BLOCK_N):"] = ("t_loop = globaltimer()",
                                                          "first = 1", None)
        hooks["ks, vs = ks_next, vs_next"] = (None, "t_first = tl.where(first == 1, "
                                              "globaltimer(), t_first)", "first = 0")
    out, found = [], set()
    for ln in src.splitlines():
        key = ln.strip()
        if key not in hooks:
            out.append(ln)
            continue
        found.add(key)
        ind = ln[:len(ln) - len(ln.lstrip())]
        out += [ln if h is None else ind + h for h in hooks[key]]
    assert found == set(hooks), f"{fn.__name__} changed: no {set(hooks) - found}"
    stores = [f"tl.store(sp + {i}, {v})" for i, v in enumerate(
        ("t_in", "t_wait", "t_loop", "t_first", "globaltimer()", "smid().to(tl.int64)"))]
    out += [f"    sp = stamp_ptr + ({pid_expr}) * {STAMPS}"] + ["    " + s for s in stores]
    return "\n".join(out) + "\n"


def stamped_kernels():
    """A module with the stamped _decode_split_t and _decode_reduce (Triton needs their
    source in a file)."""
    head = ("import triton\nimport triton.language as tl\n"
            "from triton.language.extra.cuda import globaltimer, smid\n"
            "from kvcompile.ops.pdl import wait_for_producers, wait_for_producers_hold_next\n"
            "from kvcompile.ops.span_attention.decode_transposed import (\n"
            "    page_of, tile_scales, qk_blocks_t, program_rows_and_chunk, decode_tile,\n"
            "    online_softmax_along, scaled_v_codes_t, v_code_tile, partial_slot,\n"
            "    store_partial_stats, value_columns)\n"
            "from kvcompile.ops.span_attention.decode_split import _merge\n")
    body = (stamped_source(DT._decode_split_t.fn, SPLIT_PID, True) + "\n\n"
            + stamped_source(DS._decode_reduce.fn, REDUCE_PID, False))
    path = os.path.join(tempfile.mkdtemp(), "stamped_decode.py")
    with open(path, "w") as f:
        f.write(head + "\n\n" + body)
    spec = importlib.util.spec_from_file_location("stamped_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def stamped_call(mod, case, table, stamps_split, stamps_reduce, pps=None):
    """decode_transposed.span_attention_decode_transposed's launches (no rotation) with
    the stamped kernels, untraced as inside the op; returns (split programs, reduce
    programs, the split's kernel)."""
    q, kp, vp = case.q, case.kp, case.vp
    pdl = pdl_launch(q.device)
    assert pdl["PDL"] and tma_possible(kp, vp), "launch untraced on a Hopper GPU"
    sh = DS.decode_shape(q, kp, vp, table, case.q_pos, *case.types, PAGE, case.out)
    go = DS.split_launch(sh, DT.transposed_config(sh.head_dim, True), PAGE, q.device,
                         programs_per_sm=pps)
    bufs, _, (_, ks, kpe, kph, kch), (_, vs, vpe, vph, vch) = DS.split_operands(
        sh, q, kp, vp, None, go.n_chunks, raw_codes=True)
    kd, vd = code_descriptors(kp, vp, sh.kg.kv_type, sh.vg.kv_type, sh.kg.n_heads,
                              sh.head_dim, PAGE, go.block_n)
    split = mod._decode_split_t[(go.n_chunks, sh.n_kv)](
        stamps_split, q, kd, ks, vd, vs, table, case.q_pos, *bufs,
        q.stride(0), q.stride(1), sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len,
        kpe, kph, kch, vpe, vph, vch, QK_SCALE=case.scale * DT.LOG2E, G=sh.group,
        D=sh.head_dim, P=PAGE, BLOCK_R=max(2, 1 << (sh.mrows - 1).bit_length()),
        BLOCK_N=go.block_n, K_TYPE=sh.kg.kv_type, V_TYPE=sh.vg.kv_type, TMA=True,
        INTERP=False, num_warps=go.num_warps, num_stages=go.num_stages, **pdl,
        **register_cap(go.maxnreg))
    block_d = min(DS.REDUCE_BLOCK_D, sh.head_dim)
    block_c = DS.reduce_block(go.n_chunks, block_d)
    out = sh.out
    n_reduce = (sh.n_kv, sh.mrows, sh.head_dim // block_d)
    mod._decode_reduce[n_reduce](
        stamps_reduce, *bufs, case.q_pos, out, out, out.stride(0), out.stride(1),
        sh.n_rows, go.n_chunks, go.chunk_len, sh.table_len, G=sh.group, D=sh.head_dim,
        P=PAGE, ROWS_P2=max(2, 1 << (sh.n_rows - 1).bit_length()), BLOCK_C=block_c,
        BLOCK_D=block_d, ONE_STEP=block_c >= go.n_chunks, ROT=False,
        num_warps=DS.reduce_warps(block_c * block_d, False, block_d, few_warps=True), **pdl)
    return go.n_chunks * sh.n_kv, n_reduce[0] * n_reduce[1] * n_reduce[2], split


def summarise(ss, rs, ss_next) -> dict:
    """One call's phases, us from the first split program's passing its wait (with PDL
    programs may enter earlier: negative)."""
    t0 = ss[:, 1].min()

    def us(x):
        return round((x - t0).item() / 1e3, 2)

    return dict(
        split_first_entry=us(ss[:, 0].min()), split_last_entry=us(ss[:, 0].max()),
        split_last_wait=us(ss[:, 1].max()), split_median_loop_start=us(ss[:, 2].median()),
        split_median_first_tile=us(ss[:, 3].median()), split_first_end=us(ss[:, 4].min()),
        split_median_end=us(ss[:, 4].median()), split_last_end=us(ss[:, 4].max()),
        reduce_first_entry=us(rs[:, 0].min()), reduce_last_entry=us(rs[:, 0].max()),
        reduce_first_wait=us(rs[:, 1].min()),
        reduce_last_end=us(rs[:, 4].max()), next_split_first_wait=us(ss_next[:, 1].min()))


def raw(stamps, t0) -> list:
    return [[int(v) for v in ((p[:5] - t0) // 10).tolist()] + [int(p[5])] for p in stamps]


def timeline(mod, case, pps, keep_raw: bool) -> dict:
    """Capture the case's tables x 5 stamped calls in one graph (untraced launches, as
    inside the op), replay, summarise."""
    tables = case.tables * 5
    probe = [torch.zeros(1 << 16, STAMPS, dtype=torch.int64, device="cuda") for _ in "sr"]
    with set_wrap_triton_enabled(False):
        n_split, n_reduce, kernel = stamped_call(mod, case, tables[0], *probe, pps)
    st_s = torch.zeros(len(tables), n_split, STAMPS, dtype=torch.int64, device="cuda")
    st_r = torch.zeros(len(tables), n_reduce, STAMPS, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), set_wrap_triton_enabled(False):
        for i, t in enumerate(tables):
            stamped_call(mod, case, t, st_s[i], st_r[i], pps)
    for _ in range(3):
        graph.replay()
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    ss, rs = st_s.cpu(), st_r.cpu()
    i = len(tables) // 2
    calls = sorted((ss[j + 1, :, 1].min() - ss[j, :, 1].min()).item() / 1e3
                   for j in range(1, len(tables) - 1))
    row = dict(call_us_graph=round(begin.elapsed_time(end) * 1e3 / len(tables), 2),
               call_us_median_from_stamps=round(calls[len(calls) // 2], 2),
               n_split=n_split, n_reduce=n_reduce, split_registers=kernel.n_regs,
               split_shared=kernel.metadata.shared, **summarise(ss[i], rs[i], ss[i + 1]))
    if keep_raw:
        row["raw_split"], row["raw_reduce"] = raw(ss[i], ss[i][:, 1].min()), \
            raw(rs[i], ss[i][:, 1].min())
    return row


def shipped_registers(geoms) -> list:
    """Registers, shared memory and warps of the shipped split as the op launches it."""
    with set_wrap_triton_enabled(False):
        for n_kv, d in geoms:
            DecodeCase("q8_0", "q4_0", 4096, n_kv, d, Q_HEADS[d]).ms()
    return [dict(registers=k.n_regs, shared=k.metadata.shared, warps=k.metadata.num_warps)
            for cache in DT._decode_split_t.device_caches.values() for k in cache[0].values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--geoms", default="8x128,4x256")
    ap.add_argument("--pps", default="", help="programs_per_sm values (default: the kernel's)")
    ap.add_argument("--l2-pages", type=int, default=0,
                    help="page tables cycling over this many L2-resident pages")
    ap.add_argument("--raw", action="store_true", help="every program's stamps in the JSON")
    ap.add_argument("--json")
    a = ap.parse_args()
    assert not interpreting(), "globaltimer needs a GPU"
    geoms = [tuple(map(int, g.split("x"))) for g in a.geoms.split(",")]
    mod = stamped_kernels()
    rows = []
    for (n_kv, d), n_ctx in [(g, int(c)) for g in geoms for c in a.contexts.split(",")]:
        if a.l2_pages:
            case = l2_case(n_ctx, n_kv, d, Q_HEADS[d], "transposed", a.l2_pages)
        else:
            case = DecodeCase("q8_0", "q4_0", n_ctx, n_kv, d, Q_HEADS[d])
        for pps in [int(p) for p in a.pps.split(",")] if a.pps else [None]:
            row = dict(geom=f"{n_kv}x{d}", context=n_ctx, programs_per_sm=pps,
                       l2_pages=a.l2_pages, kv_bytes=case.kv_bytes,
                       **timeline(mod, case, pps, a.raw))
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("raw")}),
                  flush=True)
            rows.append(row)
        del case
        torch.cuda.empty_cache()
    shipped = shipped_registers(geoms)
    print(f"shipped split kernels: {shipped}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(shipped_split=shipped, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
