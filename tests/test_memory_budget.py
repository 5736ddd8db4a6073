"""The device-memory budget's split (kvcompile/memory_budget.py) and its errors, on sizes
given by hand; and the weight plan the loader and the budget share."""
from __future__ import annotations

import pytest
import torch

from kvcompile.errors import ArenaError, KvcompileError
from kvcompile.engine.memory_budget import GIB, MIB, BudgetError, kv_bytes, plan_budget
from kvcompile.io.weights import layout, weight_plan


def split(arena, budget=16, weights=13.6, workspace=1.0, kv_all=6.9, min_arena=0.45):
    return plan_budget(budget=int(budget * GIB), weights=int(weights * GIB),
                       workspace=int(workspace * GIB), kv_all=int(kv_all * GIB),
                       min_arena=int(min_arena * GIB), arena=arena)


def test_auto_arena_takes_what_the_budget_leaves_or_keeps_the_kv_resident():
    p = split("auto")
    assert p.arena == int(16 * GIB) - int(13.6 * GIB) - int(1.0 * GIB)
    assert "KV arena 1.40 GiB" in p.describe()
    assert split("auto", budget=40).arena == 0          # the whole KV fits: no streaming


def test_a_budget_too_small_names_each_part_and_the_smallest_that_works():
    with pytest.raises(BudgetError) as e:
        split("auto", budget=14)
    msg = str(e.value)
    assert isinstance(e.value, (ArenaError, KvcompileError))
    for part in ("weights 13.60 GiB", "workspace 1.00 GiB", "0.45 GiB of KV",
                 "--gpu-memory-gib to 15.05"):
        assert part in msg, msg
    with pytest.raises(BudgetError, match="--kv-stream-arena-mib auto"):
        split(0)                                         # the whole KV would not fit
    with pytest.raises(BudgetError, match="arena of 2048 MiB"):
        split(2048 * MIB)
    assert split(1024 * MIB).arena == 1024 * MIB


def test_kv_bytes_counts_whole_pages_of_both_types():
    from kvcompile.models.config import ModelConfig
    c = ModelConfig("llama", 2, 256, 512, 4, 2, 64, 1000, 4096)
    # q8_0 K: 34 bytes a 32-value block, q4_0 V: 18; 2 heads x 64 dims; 300 tokens = 2 pages
    assert kv_bytes(c, 2, 300, "q8_0", "q4_0") == 2 * 512 * (2 * 2 * 34 + 2 * 2 * 18)


def test_weight_plan_keeps_kernel_types_quantized_on_cuda_and_lays_fused_parts_together(
        tmp_path):
    from kvcompile.io.gguf.reader import open_gguf
    from kvcompile.io.make_model import make_model
    path = tmp_path / "tiny.gguf"
    make_model("llama", "tiny", path, "q4_k")
    infos = open_gguf(path).tensors.values()
    plan = {p.info.name: p for p in weight_plan(infos, torch.device("cuda"), torch.bfloat16)}
    assert plan["blk.0.attn_q.weight"].quantized and not plan["blk.0.attn_norm.weight"].quantized
    assert plan["blk.0.attn_norm.weight"].dtype == torch.float32
    cpu = weight_plan(infos, torch.device("cpu"), torch.float32)
    assert not any(p.quantized for p in cpu)
    offsets, total = layout(list(plan.values()))
    q, k, v = (offsets[f"blk.1.attn_{n}.weight"] for n in "qkv")
    assert k == q + plan["blk.1.attn_q.weight"].device_bytes
    assert v == k + plan["blk.1.attn_k.weight"].device_bytes
    assert total >= sum(p.device_bytes for p in plan.values())
