"""Speculative decoding against plain decoding through Engine.generate (bench_speculative.py)
as a pytest-benchmark row: tokens a verify forward yields, acceptance and the speed-up over
plain decoding measured in the same run land in `extra_info`.

    pytest benchmarks/ -m cpu --benchmark-json=out.json     # SmolLM2, the CPU (CI)
    pytest benchmarks/ -m gpu --benchmark-json=out.json     # the same task on the device
"""
from __future__ import annotations

import pytest

import bench_speculative

KEEP = ("spec_type", "ngram", "completion_tokens", "tokens_equal", "plain_decode_tok_s",
        "spec_decode_tok_s", "speedup", "forwards", "acceptance", "verify_width",
        "tokens_per_forward", "device", "commit", "date")


def run(benchmark, argv):
    row = benchmark.pedantic(bench_speculative.main, args=(argv,), rounds=1, iterations=1)
    benchmark.extra_info.update({k: row.get(k) for k in KEEP})
    assert row["tokens_equal"], row               # speculation never changes greedy tokens
    assert row["forwards"] < row["completion_tokens"] - 1 and row["accepted"] > 0
    return row


@pytest.mark.cpu
def test_ngram_edit_task_smollm2_cpu(benchmark, tmp_path):
    run(benchmark, ["--max-tokens", "64", "--out", str(tmp_path / "speculative.json")])


@pytest.mark.gpu
def test_ngram_edit_task_smollm2_device(benchmark, tmp_path):
    run(benchmark, ["--device", "cuda", "--out", str(tmp_path / "speculative.json")])


@pytest.mark.cpu
@pytest.mark.parametrize("mtp_context", ["300", "300,1024"], ids=["mtp-short", "mtp-both"])
def test_oracle_drafts_tiny_hybrid_cpu(benchmark, tmp_path, mtp_context):
    """The oracle task at tiny size: every draft kept, tokens equal, a cost per width;
    draft-mtp's tokens on a shorter prompt after it, and on the whole prompt before it."""
    from kvcompile.io.make_model import make_model
    path = tmp_path / "qwen35-tiny.gguf"
    make_model("qwen35", "tiny", path, weight_type="f32", seed=7)
    row = benchmark.pedantic(bench_speculative.main, rounds=1, iterations=1, args=([
        "--oracle", str(path), "--device", "cpu", "--context", "1024", "--arena-mib", "1",
        "--kv", "f32/f32", "--depth", "5", "--decode-steps", "24", "--widths", "1,2,6,9",
        "--mtp-context", mtp_context, "--out", str(tmp_path / "speculative.json")],))
    benchmark.extra_info.update({k: row[k] for k in ("speedup", "verify_cost_over_width1")})
    assert row["tokens_equal"] and row["spec"]["acceptance"] == 1.0
    assert row["spec"]["forwards"] < 24 and set(row["verify_s"]) == {"1", "2", "6", "9"}
    # draft-mtp on the same Engine: the plain tokens, in rounds that drafted
    n = 1024 - 24 - 9 - 2                                  # the prompt: room for the steps
    want = sorted(min(int(c), n) for c in mtp_context.split(","))
    assert sorted(m["context"] for m in row["mtp"]) == want, row["mtp"]
    for m in row["mtp"]:
        assert m["tokens_equal"] and m["spec"]["drafted"] > 0, m
    # the oracle request resumes the plain one's history, which resumed draft-mtp's (a
    # hybrid recomputes the prompt's last ubatch chunk: 256 tokens by default)
    assert row["cached_tokens"]["oracle"] > n - 256, row["cached_tokens"]
    if want[-1] == n:
        assert row["cached_tokens"]["plain"] > n - 256, row["cached_tokens"]
