"""Decode and prefill through Engine.generate (bench_runner.py) as pytest-benchmark rows:
each row's figures (tok/s, step percentiles, host time, the ratio to the PCIe bound or the
HBM roofline measured in the same run) land in the benchmark JSON's `extra_info`.

    pytest benchmarks/ -m cpu --benchmark-json=out.json     # tiny sizes, the CPU (CI)
    pytest benchmarks/ -m gpu --benchmark-json=out.json     # the device, 8B geometry
"""
from __future__ import annotations

import pytest

import bench_runner

KEEP = ("mode", "context", "fill_ahead", "kv_type", "arena_mib", "weights", "runner_mode", "decode_tok_s",
        "prefill_tok_s", "ttft_s", "step_ms", "mean_over_median_step", "host_step_ms",
        "launches_per_step", "decode_vs_bound", "decode_vs_hbm_roofline", "commit", "date")


def run(benchmark, argv):
    rows = benchmark.pedantic(bench_runner.main, args=(argv,), rounds=1, iterations=1)
    for r in rows:
        key = f"{r['mode']}:{r['context']}:ahead={r.get('fill_ahead')}"
        benchmark.extra_info[key] = {k: r.get(k) for k in KEEP}
        benchmark.extra_info[key]["captures_second_request"] = r["programs"].get("captures")
    return rows


@pytest.mark.cpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "programs"])
def test_runner_tiny_cpu(benchmark, tmp_path, graphs):
    argv = ["--tiny", "--device", "cpu", "--out", str(tmp_path / "runner.json"),
            "--fill-ahead", "both", "--cuda-graphs" if graphs else "--no-cuda-graphs",
            "--ngram-check", "--second-request", "--turn", "24"]
    rows = run(benchmark, argv)
    assert [r["mode"] for r in rows] == ["streamed", "streamed", "resident"]
    assert [r["fill_ahead"] for r in rows[:2]] == [False, True]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["host_step_ms"] > 0
    assert rows[0]["tokens"] == rows[1]["tokens"] == rows[2]["tokens"]   # same prompt
    assert rows[0]["decode_vs_bound"] is not None and rows[0]["kv"]["streamed_fraction"] > 0
    assert all(r["ngram"]["tokens_equal"] for r in rows), [r["ngram"] for r in rows]
    assert all(r["second_request"]["tokens_equal"] for r in rows)
    # the next turn reuses the prompt: its tokens are a cold prefill's (bitwise on the CPU)
    for r in rows[:2]:
        t = r["turn"]
        assert t["cached_tokens"] > 0 and t["tokens_equal"], t
    assert "turn" not in rows[2]
    if graphs:     # all resident with programs: the measured (second) request captures none
        assert rows[2]["programs"]["captures"] == 0 and rows[2]["runner_mode"] == "cuda graphs"
        # streamed: on the CPU each replay reruns the step's fixed layout
        for r in rows[:2]:
            assert r["runner_mode"] == "cuda graphs" and r["launches_per_step"] == 1
            assert r["programs"]["replays"] > 0 and "fallback" not in r["programs"]
            assert r["programs"]["compiled"]       # the traced forward, ring ops lowered
            assert r["launch_ms"] > 0              # the graphs' launch time is recorded
            split = r["host_split_ms"]             # and the parts of a step's host time
            assert all(split[p] > 0 for p in ("prepare", "launch", "close")), split
            assert 0 < len(r["host_steps_ms"]) <= r["decode_steps"]
        # every program the second request needs was made by the first
        assert all(r["second_request"]["captures"] == 0 for r in rows), rows


@pytest.mark.gpu
def test_runner_8b_device(benchmark):
    rows = run(benchmark, ["--cases", "streamed:131072,streamed:65536,resident:8192",
                           "--second-request", "--turn", "300"])
    # resident programs survive from the warm-up request; a streamed request at a new context
    # captures its layouts (one per page it decodes in), one graph launch a step; the same
    # request again captures nothing
    assert all(r["programs"].get("captures") == 0 for r in rows if r["mode"] == "resident")
    assert all(r["launches_per_step"] == 1 and "fallback" not in r["programs"] for r in rows)
    assert all(r["second_request"]["captures"] == 0 and r["second_request"]["tokens_equal"]
               for r in rows)
    turn = rows[0]["turn"]
    assert turn["ttft_over_first"] <= 0.05 and turn["equal_or_near_tie"], turn
