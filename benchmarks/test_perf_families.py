"""Gemma 3's windowed streaming (bench_families.py) as pytest-benchmark rows: decode tok/s,
its share of the PCIe bound over the global layers' streamed bytes, the host->device bytes
of a step over those bytes, and whether the greedy tokens equal the all-resident run's.

    pytest benchmarks/test_perf_families.py -m cpu      # gemma3 tiny, 12 layers, the CPU
    pytest benchmarks/test_perf_families.py -m gpu      # the 12B geometry at 128K, device
"""
from __future__ import annotations

import pytest

import bench_families

KEEP = ("mode", "context", "arena_mib", "decode_tok_s", "decode_vs_bound",
        "h2d_over_global_streamed", "h2d_bytes_per_token", "global_streamed_bytes",
        "window_rings", "tokens_equal_resident", "logits_equal_resident",
        "logits_max_abs_diff", "commit", "date")


def run(benchmark, argv):
    rows = benchmark.pedantic(bench_families.main, args=(argv,), rounds=1, iterations=1)
    for r in rows:
        benchmark.extra_info[f"{r['mode']}:{r['context']}"] = {k: r.get(k) for k in KEEP}
    return rows


def check(rows):
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    streamed = rows[1]
    assert streamed["window_rings"] is not None
    assert streamed["h2d_over_global_streamed"] <= 1.05, streamed
    assert streamed["tokens_equal_resident"], streamed
    assert streamed["logits_equal_resident"], streamed
    return streamed


@pytest.mark.cpu
def test_families_tiny_cpu(benchmark, tmp_path):
    streamed = check(run(benchmark, ["--tiny", "--device", "cpu",
                                     "--out", str(tmp_path / "families.json")]))
    assert streamed["h2d_bytes_per_token"] > 0       # the global layers stream


@pytest.mark.gpu
def test_families_gemma3_12b_at_128k_device(benchmark):
    streamed = check(run(benchmark, ["--preset", "gemma3-12b", "--context", "131072",
                                     "--arena-mib", "2048"]))
    assert streamed["decode_vs_bound"] >= 0.9, streamed
