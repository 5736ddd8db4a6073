"""Programmatic dependent launch (ops/pdl.py) on the device: the decode-step kernels are
launched with it, and a captured bf16 decode (our GEMV, row ops and decode attention, every
kernel overlapping its predecessor's tail) equals the eager model run without PDL bitwise."""
from __future__ import annotations

import pytest
import torch

from kvcompile.executor.executor import Executor, bucket_for
from kvcompile.kv.store import KvStore
from kvcompile.io.loader import load_model
from kvcompile.io.make_model import make_model
from kvcompile.ops import pdl
from kernel_oracle import fresh_seed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def pdl_switch():
    before = pdl.ENABLED
    yield
    pdl.ENABLED = before


def test_launch_options_follow_the_device_and_the_switch(pdl_switch):
    from torch._library.triton import set_wrap_triton_enabled
    cuda = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    with set_wrap_triton_enabled(False):              # as inside the ops' CUDA kernels
        pdl.ENABLED = True
        assert pdl.launch(cuda) == ({"PDL": True, "launch_pdl": True} if hopper
                                    else {"PDL": False})
        pdl.ENABLED = False
        assert pdl.launch(cuda) == {"PDL": False}
    pdl.ENABLED = True
    assert pdl.launch(cuda) == {"PDL": False}         # a traced launch takes no PDL
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}


@torch.inference_mode()
def eager(model, store, ids, start, rows=None):
    """The model run directly (its own host checks), optionally on verify-padded rows."""
    n = len(ids)
    pad = (rows or n) - n
    tokens = torch.tensor(ids + ids[-1:] * pad, device="cuda")
    pos = torch.tensor(list(range(start, start + n)) + [start + n - 1] * pad, device="cuda")
    return model(tokens, pos, store)[:n]


@pytest.mark.parametrize("kv", ["bf16", "q8_0/q4_0"])
@torch.inference_mode()
def test_captured_decode_with_pdl_equals_eager_without(tmp_path, pdl_switch, kv):
    """Same KV in two caches; each decode step (widths 1..8) through the captured program
    with PDL equals the eager model with PDL off on the same rows, bitwise."""
    path = tmp_path / "tiny_bf16.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=fresh_seed() % 10_000)
    loaded = load_model(str(path), device="cuda", dtype=torch.bfloat16, progress=False)
    model, cfg = loaded.model, loaded.config
    assert model.lm_head.weight.dtype == torch.bfloat16      # the GEMV path, not cuBLAS
    kt, vt = (kv, kv) if "/" not in kv else kv.split("/")
    ref = KvStore(cfg, 2048, 0, kt, vt, device="cuda")
    ours = KvStore(cfg, 2048, 0, kt, vt, device="cuda")
    g = torch.Generator().manual_seed(fresh_seed())
    ids = torch.randint(0, cfg.vocab_size, (700,), generator=g).tolist()
    pdl.ENABLED = False
    eager(model, ref, ids[:600], 0)
    ours.pages.copy_(ref.pages)                    # the same KV in both stores
    ours.history.publish(600, ours.layers)
    torch._dynamo.reset()
    ex = Executor(model, ours, ubatch=256, capture=True, compile=True, strict=True)
    pos = 600
    for w in [1, 1, 2, 1, 3, 8, 1]:
        step = ids[pos:pos + w]
        pdl.ENABLED = True
        for _ in range(2):                         # a width's first use traces, then captures
            ex.verify(step, pos)
        got = ex.verify(step, pos)[0]              # the replay (idempotent KV writes)
        pdl.ENABLED = False
        want = eager(model, ref, step, pos, rows=bucket_for(w))
        assert torch.equal(got, want), f"width {w} at {pos}: max diff {(got - want).abs().max()}"
        pos += w
    assert ex.program_stats()["replays"] >= 7
    assert torch.equal(ours.pages, ref.pages)
