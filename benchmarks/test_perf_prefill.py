"""Prefill through Engine.generate beside transformers and SDPA (bench_prefill.py) as
pytest-benchmark rows: tok/s, the streamed / resident ratio, the ratio to transformers'
DynamicCache, in the benchmark JSON's `extra_info`.

    pytest benchmarks/test_perf_prefill.py -m cpu      # tiny sizes, the CPU (CI)
    pytest benchmarks/test_perf_prefill.py -m gpu      # the device, 8B geometry at 128K
"""
from __future__ import annotations

import pytest
import torch

import bench_prefill

KEEP = ("kind", "mode", "context", "kv_type", "arena_mib", "ubatch", "prefill_tok_s",
        "ttft_s", "vs_resident", "vs_hf", "first_token_equal", "commit", "date")


def run(benchmark, argv):
    rows = benchmark.pedantic(bench_prefill.main, args=(argv,), rounds=1, iterations=1)
    for r in rows:
        if r["kind"] != "kernel":
            benchmark.extra_info[f"{r['kind']}:{r['mode']}"] = {k: r.get(k) for k in KEEP}
    return rows


@pytest.mark.cpu
def test_prefill_tiny_cpu(benchmark, tmp_path):
    rows = run(benchmark, ["--tiny", "--device", "cpu", "--out", str(tmp_path / "p.json")])
    resident, streamed = rows[:2]
    assert (resident["mode"], streamed["mode"]) == ("resident", "streamed")
    assert resident["prompt_tokens"] == streamed["prompt_tokens"] == 1022
    assert resident["prefill_tok_s"] > 0 and streamed["vs_resident"] > 0
    assert streamed["first_token_equal"]            # the same prompt, the same model
    assert resident["captures"] == 0                # captured in the warm-up request


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_8b_gpu(benchmark, tmp_path):
    rows = run(benchmark, ["--out", str(tmp_path / "p.json")])
    assert {r["kind"] for r in rows} >= {"engine", "kernel"}
