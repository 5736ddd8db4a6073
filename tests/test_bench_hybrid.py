"""benchmarks/bench_hybrid.py on the CPU (--tiny): its config equals the one a made model
file yields, its weights follow the synthetic plan, and a tiny run through the Engine writes
the rows the device run will (KV and GDN-state bytes against sums from the geometry)."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_hybrid as H  # noqa: E402
from kvcompile.io.gguf.synthetic import preset_config, write_synthetic_gguf  # noqa: E402
from kvcompile.io.weights import load_weights  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")


def test_config_equals_made_model_file(tmp_path):
    syn, config, _ = H.synthetic(True, 4096)
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny"), path, "f32", seed=SEED % 1000)
    from_file = load_weights(path, progress=False).config
    # the file stores rms_eps as float32
    assert math.isclose(config.rms_eps, from_file.rms_eps, rel_tol=1e-6)
    assert replace(config, rms_eps=from_file.rms_eps) == from_file
    assert config.nextn_layers == 1 and config.ssm_v_heads == syn.gdn_v_heads


def test_weights_follow_the_plan():
    _, _, plan = H.synthetic(True, 4096)
    w = H.make_weights(plan, torch.bfloat16, torch.device("cpu"), SEED)
    again = H.make_weights(plan[::-1], torch.bfloat16, torch.device("cpu"), SEED)
    kinds = set()
    for t in plan:
        x = w[t.name]
        assert torch.equal(x, again[t.name]), (t.name, SEED)   # independent of the order
        assert tuple(x.shape) == t.shape
        assert x.dtype == (torch.float32 if t.ggml_type.name == "F32" else torch.bfloat16)
        x = x.float()
        kinds.add(t.init)
        if t.init == "normal" and x.numel() >= 4096:
            assert abs(float(x.std()) / t.scale - 1) < 0.1, (t.name, SEED)
            assert abs(float(x.mean())) < 0.1 * t.scale, (t.name, SEED)
        elif t.init == "norm" and x.numel() >= 64:
            assert abs(float(x.mean()) - 1) < 5 * t.scale / math.sqrt(x.numel()), (t.name, SEED)
        elif t.init == "uniform":
            assert float(x.min()) >= t.low and float(x.max()) <= t.low + t.scale
        elif t.init == "neg_log_uniform":
            assert float(x.max()) <= -math.exp(t.low) * (1 - 1e-6)
            assert float(x.min()) >= -math.exp(t.low + t.scale) * (1 + 1e-6)
    assert kinds == {"normal", "norm", "uniform", "neg_log_uniform"}


def test_tiny_run_writes_the_rows(tmp_path):
    out = tmp_path / "hybrid.json"
    rows = H.main(["--tiny", "--systems", "ours,ours-resident", "--contexts", "256,1536",
                   "--decode-steps", "2", "--fresh", "--seed", str(SEED % 1000), "--out", str(out)])
    assert [(r["system"], r["context"]) for r in rows] == [
        ("ours", 256), ("ours-resident", 256), ("ours", 1536), ("ours-resident", 1536)]
    saved = json.loads(out.read_text())
    c = preset_config("qwen35", "tiny")
    n_attn = c.n_layers // c.full_attention_interval
    values = c.n_kv_heads * c.head_dim                # per token per layer, K and V each
    per_token = n_attn * (values // 32 * 34 + values // 32 * 18)    # q8_0 K + q4_0 V blocks
    conv_dim = 2 * c.gdn_k_heads * c.gdn_head_dim + c.gdn_v_heads * c.gdn_head_dim
    gdn = (c.n_layers - n_attn) * 4 * ((c.conv_kernel - 1) * conv_dim
                                       + c.gdn_v_heads * c.gdn_head_dim ** 2)
    for r in saved["rows"]:
        assert r["status"] == "ok", r
        for field in ("system", "context", "kv_type", "arena_mib", "decode_tok_s",
                      "prefill_tok_s", "h2d_bytes_per_token", "pcie_gbps_measured",
                      "pcie_bound_tok_s", "gdn_state_bytes", "weight_bytes", "commit", "date"):
            assert field in r, field
        assert r["kv_bytes"] == r["context"] * per_token
        assert r["gdn_state_bytes"] == gdn
        assert r["store_kv_layers"] == n_attn             # no MTP drafter: no MTP pages
        assert r["cached_tokens"] == 0                   # every measured prefill is cold
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    by = {(r["system"], r["context"]): r for r in saved["rows"]}
    arena = int(0.45 * 2**20)
    assert by["ours", 256]["pcie_bound_tok_s"] is None               # fits in the arena
    assert by["ours", 256]["h2d_bytes_per_token"] == 0
    s = by["ours", 1536]
    assert s["pcie_bound_tok_s"] == pytest.approx(
        s["pcie_gbps_measured"] * 1e9 / (1536 * per_token - arena))
    assert s["h2d_bytes_per_token"] > 0 and s["telemetry"]["streamed_fraction"] > 0
    for ctx in (256, 1536):        # streaming changes where pages live, not the result
        assert by["ours", ctx]["decode_tokens"] == by["ours-resident", ctx]["decode_tokens"]
    assert saved["meta"]["sanity"]["q8_0/q4_0"]["bitwise_equal_resident"] is True
