"""Row publishing (kv/row_publish.py): a captured step copies the bytes of its rows, not
its pages, from the arena to host history.

Oracle: kv_write's reference writing the same new rows straight into the host pages. The
pool's pages hold other random bytes, so copying one byte too many, or one too few, shows.
The reference runs on the CPU; the Triton kernel under the interpreter (small blocks, so a
row spans several programs and the last is masked) and, marked, on CUDA into pinned memory.
"""
from __future__ import annotations

import pytest
import torch

from kernel_oracle import (PAIRS, fresh_seed, garbage_pool, paired_pools, run_interpreted,
                           spaced_pools)
from kvcompile.ops import kv_format as F
from kvcompile.ops.kv_write.naive import kv_write_naive
from kvcompile.kv.row_publish import RowMap, publish_rows_cuda, publish_rows_reference

H, P, PAGES = 2, 16, 6
IDS = [f"K{k}-V{v}" for k, v in PAIRS]
GPU_PAIRS = [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("f16", "bf16"), ("f32", "q4_0")]


@pytest.mark.parametrize("role", F.ROLES)
@pytest.mark.parametrize("name", list(F.KV_TYPES))
def test_a_rows_bytes_are_its_position_in_split_pages(name, role):
    t, d = F.kv_type(name), 64
    gen = torch.Generator().manual_seed(fresh_seed())
    page = torch.randint(0, 256, (1, F.page_bytes(t, P, H, d)), dtype=torch.uint8, generator=gen)
    base, stride = F.row_byte_offsets(t, H, P, d, role=role)
    assert base.numel() == F.bytes_per_token(t, H, d)
    vals, scales = F.split_pages(page, t, H, P, d, role=role)
    covered = torch.zeros(page.shape[1], dtype=torch.int64)
    for p in range(P):
        want = vals[0, :, p].contiguous().view(torch.uint8).reshape(-1)
        if scales is not None:
            want = torch.cat([want, scales[0, :, p].contiguous().view(torch.uint8).reshape(-1)])
        assert torch.equal(page[0, base + p * stride], want), (name, role, p)
        covered[base + p * stride] += 1
    assert bool((covered == 1).all())          # every byte of the page is one position's


def case(k_name, v_name, head_dim, n_rows, gen):
    """Pools of random pages, a random page table, host pages of other random bytes, and
    n_rows new rows at distinct positions written (kv_write's reference) into the pools."""
    table = torch.randperm(PAGES, generator=gen).to(torch.int32)
    positions = torch.randperm(PAGES * P, generator=gen)[:n_rows]
    k = torch.randn(n_rows, H, head_dim, generator=gen)
    v = torch.randn(n_rows, H, head_dim, generator=gen)
    ids = (F.kv_type(k_name).ggml_id, F.kv_type(v_name).ggml_id)
    pools = [garbage_pool(PAGES, n, P, H, head_dim, gen) for n in (k_name, v_name)]
    hosts = [garbage_pool(PAGES, n, P, H, head_dim, gen) for n in (k_name, v_name)]
    slots = table[positions // P].long() * P + positions % P
    kv_write_naive(*pools, k, v, slots, *ids, P)
    want = [h.clone() for h in hosts]
    kv_write_naive(*want, k, v, positions, *ids, P)        # the rows, straight to the host
    maps = [RowMap.of(n, H, P, head_dim, role, "cpu") for n, role in ((k_name, "k"),
                                                                     (v_name, "v"))]
    return dict(table=table, positions=positions, pools=pools, hosts=hosts, want=want,
                maps=maps)


@pytest.mark.parametrize("k_name,v_name", PAIRS, ids=IDS)
def test_reference_publishes_exactly_the_written_rows(k_name, v_name):
    gen = torch.Generator().manual_seed(fresh_seed())
    c = case(k_name, v_name, 64, 3, gen)
    publish_rows_reference(c["pools"], c["hosts"], c["table"], c["positions"], c["maps"])
    assert torch.equal(c["hosts"][0], c["want"][0]) and torch.equal(c["hosts"][1], c["want"][1])


def test_kernel_interpreted_equals_the_oracle():
    gen = torch.Generator().manual_seed(fresh_seed())
    cases = [case(k, v, 64, 2, gen) for k, v in (("q8_0", "q4_0"), ("f16", "bf16"),
                                                  ("q4_0", "f32"))]
    # the last case's pools as views of page pairs (the streaming cache's layout): pool
    # and host pages then lie different distances apart
    c = cases[-1]
    c["pools"] = list(paired_pools(*c["pools"], gen)[1:])
    assert c["pools"][0].stride(0) != c["hosts"][0].stride(0)
    # the one before on K and V pages spaced by different strides
    cases[-2]["pools"] = list(spaced_pools(*cases[-2]["pools"], gen))
    jobs = [dict(kind="publish_rows", opts=dict(block=64), args=dict(
        pools=c["pools"], hosts=c["hosts"], maps=[(m.base, m.stride) for m in c["maps"]],
        table=c["table"], positions=c["positions"], page_size=P)) for c in cases]
    for i, (r, c) in enumerate(zip(run_interpreted(jobs), cases)):
        assert torch.equal(r["hosts"][0], c["want"][0]), i
        assert torch.equal(r["hosts"][1], c["want"][1]), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k_name,v_name", GPU_PAIRS, ids=lambda p: str(p))
def test_cuda_kernel_writes_pinned_host_pages(k_name, v_name):
    gen = torch.Generator().manual_seed(fresh_seed())
    c = case(k_name, v_name, 128, 5, gen)
    hosts = [h.pin_memory() for h in c["hosts"]]
    maps = [RowMap.of(n, H, P, 128, role, "cuda") for n, role in ((k_name, "k"), (v_name, "v"))]
    publish_rows_cuda([p.cuda() for p in c["pools"]], hosts, c["table"].cuda(),
                      c["positions"].cuda(), maps)
    torch.cuda.synchronize()
    assert torch.equal(hosts[0], c["want"][0]) and torch.equal(hosts[1], c["want"][1])


def test_a_kernel_that_cannot_run_falls_back_to_page_publishes(monkeypatch):
    """Before a capture the cache launches the row publish once; if that fails (a Triton
    that cannot reach pinned memory, say) it warns and captured steps publish pages."""
    from kvcompile.models.config import ModelConfig
    from kvcompile.kv.store import KvStore
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=128, ffn=256, n_heads=4, n_kv_heads=2,
                      head_dim=64, vocab_size=256, context_length=256)
    cache = KvStore(cfg, 256, arena_mib=1, page_size=16)
    assert cache.streamer.pool.row_maps is not None

    def broken(*_):
        raise RuntimeError("pointer argument cannot be accessed from Triton")
    monkeypatch.setattr(cache.streamer.pool, "warm_row_publish", broken)
    cache.open_forward(torch.arange(0, 1), 0, 0)
    with pytest.warns(RuntimeWarning, match="publish whole pages"):
        cache.prepare_capture()
    assert cache.streamer.pool.row_maps is None
    cache.end_forward(ok=False)
