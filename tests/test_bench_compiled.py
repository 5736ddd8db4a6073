"""benchmarks/bench_compiled.py on the CPU (--tiny): the rows it appends to a results file
that already holds other rows, the roofline and bound fields, and the eager twins; every row
through an Engine (on the CPU the captured systems rerun their programs' fixed layouts)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_path = Path(__file__).parents[1] / "benchmarks" / "bench_compiled.py"
_spec = importlib.util.spec_from_file_location("bench_compiled", _path)
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)


def test_tiny_run_appends_rows_and_keeps_the_file(tmp_path):
    out = tmp_path / "streaming.json"
    other = {"system": "hf-offload", "context": 32768, "kv_type": "bf16/bf16", "arena_mib": 0,
             "geometry": "llama-3-8b (random weights)", "status": "ok", "decode_tok_s": 4.5}
    out.write_text(json.dumps({"meta": {"date": "earlier"}, "rows": [other]}))
    rows = B.main(["--device", "cpu", "--tiny", "--out", str(out)])
    assert [(r["system"], r["context"]) for r in rows] == [
        ("ours-captured", 512), ("ours-captured-nopdl", 512), ("ours-resident", 512),
        ("ours-graphs", 1024), ("ours", 1024)]
    by = {r["system"]: r for r in rows}
    for r in rows:
        assert r["status"] == "ok" and r["decode_tok_s"] > 0, r
        assert r["commit"] and r["date"] and r["cached_tokens"] == 0, r
    # the programs decode the eager path's greedy tokens, replayed (captured in the warm-up
    # request, or at the measured context's first steps)
    for name in ("ours-captured", "ours-captured-nopdl", "ours-graphs"):
        r = by[name]
        assert r["tokens_equal_eager"] is True, r
        assert r["programs"]["compiled"] and r["programs"]["replays"] > 0, r["programs"]
        assert r["graphs"] > 0 and r["executor_mode"] == "cuda graphs", r
    for name in ("ours-resident", "ours"):
        assert by[name]["programs"]["replays"] == 0 and by[name]["executor_mode"] == "eager"
    assert by["ours"]["pcie_bound_tok_s"] is None or by["ours"]["pcie_bound_tok_s"] > 0
    assert by["ours"]["h2d_bytes_per_token"] > 0                   # 1024 tokens stream
    assert by["ours-resident"]["hbm_roofline_tok_s"] is None       # no HBM on the CPU
    saved = json.loads(out.read_text())
    assert saved["meta"]["date"] == "earlier" and "compiled" in saved["meta"]
    assert other in saved["rows"] and len(saved["rows"]) == 6


def test_weight_read_bytes_counts_one_embedding_row():
    torch = pytest.importorskip("torch")
    from kvcompile.models.config import ModelConfig
    from kvcompile.models.llama import LlamaModel
    cfg = ModelConfig(arch="llama", n_layers=1, hidden=64, ffn=128, n_heads=2, n_kv_heads=1,
                      head_dim=32, vocab_size=1000, context_length=64)
    untied = LlamaModel(cfg)
    total = sum(p.nbytes for p in untied.parameters())
    assert B.weight_read_bytes(untied) == total - 999 * 64 * 4
    untied.fuse_projections()          # fused q/k/v and gate/up: the same bytes, read once
    assert B.weight_read_bytes(untied) == total - 999 * 64 * 4
    tied = LlamaModel(cfg.__class__(**{**cfg.__dict__, "tie_embeddings": True}))
    assert B.weight_read_bytes(tied) == sum(p.nbytes for p in tied.parameters())
    del torch


def test_quantized_model_holds_fused_bytes_once_and_runs():
    """--weights: a fused projection quantized whole, its parts views of its rows; the bytes
    a step reads are the planar rows of every matrix once (the embedding one row)."""
    torch = pytest.importorskip("torch")
    from kvcompile.models.config import ModelConfig
    from kvcompile.engine.engine import Engine
    from kvcompile.models.llama import LlamaModel
    from kvcompile.ops.qlinear.formats import weight_format
    cfg = ModelConfig(arch="llama", n_layers=1, hidden=64, ffn=128, n_heads=2, n_kv_heads=1,
                      head_dim=32, vocab_size=1000, context_length=64)
    m = LlamaModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    m.fuse_projections()
    B.quantize_model(m, "q8_0")
    row = weight_format("Q8_0").planar_row_bytes
    attn = m.blocks[0].attn
    assert attn.wk.qweight.untyped_storage().data_ptr() == \
        attn.wqkv.qweight.untyped_storage().data_ptr()
    mats = (64 + 32 + 32) * row(64) + 64 * row(64) + 2 * 128 * row(64) + 64 * row(128)
    vectors = sum(p.nbytes for p in m.parameters())          # norms stay dense
    assert B.weight_read_bytes(m) == mats + 1000 * row(64) + row(64) + vectors
    e = Engine.from_model(m, ctx_size=16, progress=False)
    assert torch.isfinite(e.executor.step([1, 5, 7], 0, all_rows=True)).all()
    assert len(e.generate([1, 5, 7], max_tokens=3, temperature=0).token_ids) == 3
    del torch
