"""Triton kv_write against the reference and the gguf package's quantizers.

CPU: the kernel runs under TRITON_INTERPRET=1 (in a child process, see kernel_oracle) for
every K/V type pair and head dims 64/128/256. GPU (marked): the compiled kernel, larger.
The written pools must equal the reference's byte for byte, and q8_0 / q4_0 rows must
hold exactly gguf's codes and scales.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import kvcompile.ops  # noqa: F401
from kernel_oracle import (PAIRS, fresh_seed, garbage_pool, paired_pools, run_interpreted,
                           spaced_pools)
from kvcompile.errors import KvLayoutError
from kvcompile.ops import kv_format as F
from kvcompile.ops.kv_write.naive import kv_write_naive
from kvcompile.ops.kv_write.op import physical_slots

DIMS = [64, 128, 256]
GGUF = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
CASES = [(d, k, v) for d in DIMS for k, v in PAIRS]
IDS = [f"D{d}-K{k}-V{v}" for d, k, v in CASES]
SOME = (("q8_0", "q4_0"), ("q4_0", "bf16"), ("f16", "f32"))
GPU_CASES = [(128, k, v) for k, v in PAIRS] + [(d, k, v) for d in (64, 256) for k, v in SOME]
GPU_IDS = [f"D{d}-K{k}-V{v}" for d, k, v in GPU_CASES]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_case(head_dim, k_name, v_name, n_rows, n_kv, page_size, n_pages, gen):
    k = torch.randn(n_rows, n_kv, head_dim, generator=gen) * 3
    v = (torch.randn(n_rows, n_kv, head_dim, generator=gen) * 0.5).bfloat16()
    k[0, 0, 3], k[0, 0, 20] = 7.0, -7.0          # a tie of magnitudes: ggml keeps the first
    slots = torch.randperm(n_pages * page_size, generator=gen)[:n_rows]
    return dict(k_pool=garbage_pool(n_pages, k_name, page_size, n_kv, head_dim, gen),
                v_pool=garbage_pool(n_pages, v_name, page_size, n_kv, head_dim, gen),
                k_new=k, v_new=v, slots=slots, k_type=F.kv_type(k_name).ggml_id,
                v_type=F.kv_type(v_name).ggml_id, page_size=page_size)


def ggml_blocks(pool, name, slots, n_kv, page_size, head_dim, role):
    """Rows at `slots` re-assembled as ggml blocks (fp16 d, then codes): [T*H, bytes]."""
    codes, scales = F.split_pages(pool.cpu(), F.kv_type(name), n_kv, page_size, head_dim,
                                  role=role)
    width = codes.shape[-1] * 32 // head_dim                 # code bytes per block
    c = codes[slots // page_size, :, slots % page_size].reshape(-1, head_dim // 32, width)
    s = scales[slots // page_size, :, slots % page_size].reshape(-1, head_dim // 32, 1)
    return torch.cat([s.view(torch.uint8), c.view(torch.uint8)], -1).reshape(len(c), -1)


def check_case(a, got_k, got_v):
    ref_k, ref_v = a["k_pool"].clone(), a["v_pool"].clone()
    kv_write_naive(ref_k, ref_v, a["k_new"], a["v_new"], a["slots"], a["k_type"],
                   a["v_type"], a["page_size"])
    n_kv, head_dim = a["k_new"].shape[1:]
    diff = ((got_k.cpu() != ref_k).sum().item(), (got_v.cpu() != ref_v).sum().item())
    print(f"bytes differing from the reference (K, V): {diff}")
    assert diff == (0, 0)
    for pool, t, rows, role in ((got_k, a["k_type"], a["k_new"], "k"),
                                (got_v, a["v_type"], a["v_new"], "v")):
        name = F.kv_type(t).name
        if name in GGUF:
            want = gguf.quants.quantize(rows.float().reshape(-1, head_dim).numpy(), GGUF[name])
            got = ggml_blocks(pool, name, a["slots"], n_kv, a["page_size"], head_dim,
                              role).numpy()
            assert np.array_equal(got, want.reshape(got.shape)), f"{name} blocks differ from gguf"


@pytest.fixture(scope="module")
def interp_runs():
    gen = torch.Generator().manual_seed(fresh_seed())
    args = [make_case(d, k, v, n_rows=5, n_kv=2, page_size=16, n_pages=3, gen=gen)
            for d, k, v in CASES]
    results = run_interpreted([{"kind": "kv_write", "args": a} for a in args])
    return dict(zip(IDS, zip(args, results)))


@pytest.mark.parametrize("case", IDS)
def test_interpreted_kv_write_matches_reference_and_gguf(interp_runs, case):
    a, r = interp_runs[case]
    check_case(a, r["k_pool"], r["v_pool"])


def test_interpreted_kv_write_into_page_pairs():
    """Pools that are views of one buffer of page pairs (the streaming cache's layout):
    the kernel writes the reference's bytes into the views and nothing else of the buffer."""
    from kvcompile.kv.kv_pages import PagePair
    gen = torch.Generator().manual_seed(fresh_seed())
    cases, jobs = [], []
    for k_name, v_name in SOME:
        a = make_case(64, k_name, v_name, n_rows=6, n_kv=2, page_size=16, n_pages=4, gen=gen)
        kv, _, _ = paired_pools(a["k_pool"], a["v_pool"], gen)
        cases.append((a, kv))
        jobs.append({"kind": "kv_write", "args": dict(a, kv_pool=kv)})
    for (a, kv), r in zip(cases, run_interpreted(jobs)):
        got_k, got_v = PagePair(a["k_pool"].shape[1], a["v_pool"].shape[1]).views(r["kv_pool"])
        check_case(a, got_k, got_v)
        want = kv.clone()
        want_k, want_v = PagePair(got_k.shape[1], got_v.shape[1]).views(want)
        want_k.copy_(got_k)
        want_v.copy_(got_v)
        assert torch.equal(r["kv_pool"], want)       # no byte outside the two views moved


def test_interpreted_kv_write_into_spaced_pages():
    """K and V pages spaced by different strides, neither their page size: the same bytes
    as the reference writes into contiguous pools."""
    gen = torch.Generator().manual_seed(fresh_seed())
    cases = []
    for k_name, v_name in SOME:
        a = make_case(64, k_name, v_name, n_rows=6, n_kv=2, page_size=16, n_pages=4, gen=gen)
        kp, vp = spaced_pools(a["k_pool"], a["v_pool"], gen)
        assert kp.stride(0) != vp.stride(0) and kp.stride(0) != kp.shape[1]
        cases.append((a, dict(a, k_pool=kp, v_pool=vp)))
    results = run_interpreted([{"kind": "kv_write", "args": b} for _, b in cases])
    for (a, _), r in zip(cases, results):
        assert r["k_pool"].stride() == (a["k_pool"].shape[1] + 16, 1)
        check_case(a, r["k_pool"], r["v_pool"])


def with_page_table(a, gen):
    """The same write addressed by logical position through a permuted page table:
    (arguments for the op / kernel, the case with the physical slots for check_case)."""
    n_pages = a["k_pool"].shape[0]
    table = torch.randperm(n_pages, generator=gen).int()
    positions = torch.randperm(n_pages * a["page_size"], generator=gen)[:len(a["slots"])].int()
    return (dict(a, slots=positions, page_table=table),
            dict(a, slots=physical_slots(positions, table, a["page_size"])))


def test_kv_write_maps_positions_through_the_page_table():
    """Rows given by logical position + page table (what the models pass) land where the
    physical slots put them: the interpreted kernel and the op's CPU path, byte for byte."""
    gen = torch.Generator().manual_seed(fresh_seed())
    jobs, cases = [], []
    for d, k, v in ((128, "q8_0", "q4_0"), (64, "bf16", "f16"), (256, "f32", "q8_0")):
        by_pos, by_slot = with_page_table(
            make_case(d, k, v, n_rows=6, n_kv=2, page_size=16, n_pages=4, gen=gen), gen)
        jobs.append({"kind": "kv_write", "args": by_pos})
        cases.append((by_pos, by_slot))
    for (by_pos, by_slot), r in zip(cases, run_interpreted(jobs)):
        check_case(by_slot, r["k_pool"], r["v_pool"])
        kp, vp = by_pos["k_pool"].clone(), by_pos["v_pool"].clone()
        torch.ops.kvcompile.kv_write(kp, vp, *(by_pos[n] for n in (
            "k_new", "v_new", "slots", "k_type", "v_type", "page_size", "page_table")))
        check_case(by_slot, kp, vp)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim,k_name,v_name", GPU_CASES, ids=GPU_IDS)
def test_gpu_kv_write_matches_reference_and_gguf(head_dim, k_name, v_name):
    gen = torch.Generator().manual_seed(fresh_seed())
    a = make_case(head_dim, k_name, v_name, n_rows=300, n_kv=4, page_size=256, n_pages=4,
                  gen=gen)
    kp, vp = a["k_pool"].cuda(), a["v_pool"].cuda()
    torch.ops.kvcompile.kv_write(kp, vp, a["k_new"].cuda(), a["v_new"].cuda(),
                                 a["slots"].cuda(), a["k_type"], a["v_type"], a["page_size"])
    check_case(a, kp, vp)
    by_pos, by_slot = with_page_table(a, gen)
    kp, vp = a["k_pool"].cuda(), a["v_pool"].cuda()
    torch.ops.kvcompile.kv_write(kp, vp, a["k_new"].cuda(), a["v_new"].cuda(),
                                 by_pos["slots"].cuda(), a["k_type"], a["v_type"],
                                 a["page_size"], by_pos["page_table"].cuda())
    check_case(by_slot, kp, vp)


# ---- bad input (CPU, through the op) --------------------------------------------------------

def _pools(k_name="q8_0", v_name="q4_0", head_dim=128, n_kv=2, page_size=16):
    gen = torch.Generator().manual_seed(0)
    return (garbage_pool(2, k_name, page_size, n_kv, head_dim, gen),
            garbage_pool(2, v_name, page_size, n_kv, head_dim, gen))


def test_bad_inputs_raise_clear_errors():
    kp, vp = _pools()
    rows = torch.randn(3, 2, 128)
    slots = torch.arange(3)
    one_head = torch.randn(3, 1, 128)
    cases = {
        "unknown type": ((rows, rows, slots, 3, 2), "unsupported KV cache type"),
        "k/v shapes": ((rows, rows[:, :1], slots, 8, 2), "must both be"),
        "slots length": ((rows, rows, slots[:2], 8, 2), "slots must be"),
        "heads": ((one_head, one_head, slots, 8, 2), "KV heads"),
        "slots dtype": ((rows, rows, slots.float(), 8, 2), "int32 or int64"),
    }
    for name, (args, text) in cases.items():
        with pytest.raises(KvLayoutError, match=text):
            torch.ops.kvcompile.kv_write(kp, vp, *args, 16)
        print(f"{name}: raises KvLayoutError mentioning {text!r}")
    kp96, vp96 = _pools("f16", "f16", head_dim=96)       # fine for f16, not for q8_0
    rows96 = torch.randn(3, 2, 96)
    with pytest.raises(KvLayoutError, match="head dim"):
        torch.ops.kvcompile.kv_write(kp96, vp96, rows96, rows96, slots, 8, 1, 16)
    with pytest.raises(KvLayoutError, match="head dim"):
        F.page_bytes(F.Q4_0, 16, 2, 96)
    print("head dim 96 with q8_0 / q4_0: raises KvLayoutError mentioning 'head dim'")


def write_target_cases(kp, vp, rows, slots, table):
    """Bad slots / positions / page_table values for kv_write over 2 pages of 16 (op
    arguments after the pools) and the KvLayoutError text each must raise."""
    past = table.clone().fill_(2)
    return {
        "slot past the pools": ((rows, rows, slots + 30, 8, 2, 16), "slots span 30..32"),
        "negative slot": ((rows, rows, slots - 1, 8, 2, 16), "slots span -1..1"),
        "position past the table": ((rows, rows, slots + 20, 8, 2, 16, table[:1]),
                                    "positions span 20..22"),
        "table entry past the pools": ((rows, rows, slots, 8, 2, 16, past),
                                       "name physical pages 2..2"),
    }


def test_bad_write_targets_raise_clear_errors_and_lose_nothing():
    kp, vp = _pools()
    rows = torch.randn(3, 2, 128)
    slots = torch.arange(3)
    table = torch.tensor([1, 0], dtype=torch.int32)
    before = kp.clone(), vp.clone()
    cases = dict(write_target_cases(kp, vp, rows, slots, table), **{
        "pool pages differ": ((rows, rows, slots, 8, 2, 16), "same number of pages"),
        "integer rows": ((rows.long(), rows.long(), slots, 8, 2, 16), "floating rows"),
        "page size 0": ((rows, rows, slots, 8, 2, 0), "page size must be a positive"),
    })
    for name, (args, text) in cases.items():
        v_pool = vp[:1] if name == "pool pages differ" else vp
        with pytest.raises(KvLayoutError, match=text):
            torch.ops.kvcompile.kv_write(kp, v_pool, *args)
        print(f"{name}: raises KvLayoutError mentioning {text!r}")
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])      # nothing written
    torch.ops.kvcompile.kv_write(kp, vp, rows[:0], rows[:0], slots[:0], 8, 2, 16)
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])      # no rows: no-op
    torch.ops.kvcompile.kv_write(kp, vp, rows, rows, slots, 8, 2, 16, table)   # still serves
    want_k, want_v = before[0].clone(), before[1].clone()
    kv_write_naive(want_k, want_v, rows, rows, physical_slots(slots, table, 16), 8, 2, 16)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


@pytest.mark.gpu
@gpu
def test_gpu_write_targets_checked_when_asked(monkeypatch):
    """On CUDA the values are read only with KVCOMPILE_CHECK_INDICES=1 (a sync a call)."""
    from kvcompile.ops import index_checks
    kp, vp = (p.cuda() for p in _pools())
    rows = torch.randn(3, 2, 128, device="cuda")
    slots = torch.arange(3, device="cuda")
    table = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    before = kp.clone(), vp.clone()
    monkeypatch.setattr(index_checks, "ENABLED", True)
    for name, (args, text) in write_target_cases(kp, vp, rows, slots, table).items():
        with pytest.raises(KvLayoutError, match=text):
            torch.ops.kvcompile.kv_write(kp, vp, *args)
        print(f"cuda, {name}: raises KvLayoutError mentioning {text!r}")
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])
