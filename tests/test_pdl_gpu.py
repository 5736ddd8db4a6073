"""Programmatic dependent launch (ops/pdl.py) on the device: the decode-step kernels are
launched with it, and a captured bf16 decode (our GEMV, row ops and decode attention, every
kernel overlapping its predecessor's tail) equals the eager model run without PDL bitwise."""
from __future__ import annotations

import pytest
import torch

from kvcompile.kv_cache import PagedKvCache
from kvcompile.loader import load_model
from kvcompile.make_model import make_model
from kvcompile.ops import pdl
from kvcompile.phase import PhaseManager, bucket_for
from test_phase_gpu import eager, fresh_seed

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


@pytest.mark.parametrize("kv", ["bf16", "q8_0/q4_0"])
def test_captured_decode_with_pdl_equals_eager_without(tmp_path, pdl_switch, kv):
    """Same KV in two caches; each decode step (widths 1..8) through the captured program
    with PDL equals the eager model with PDL off on the same rows, bitwise."""
    path = tmp_path / "tiny_bf16.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=fresh_seed() % 10_000)
    loaded = load_model(str(path), device="cuda", dtype=torch.bfloat16, progress=False)
    model, cfg = loaded.model, loaded.config
    assert model.lm_head.weight.dtype == torch.bfloat16      # the GEMV path, not cuBLAS
    kt, vt = (kv, kv) if "/" not in kv else kv.split("/")
    ref = PagedKvCache(cfg, 2048, k_type=kt, v_type=vt, device="cuda")
    ours = PagedKvCache(cfg, 2048, k_type=kt, v_type=vt, device="cuda")
    g = torch.Generator().manual_seed(fresh_seed())
    ids = torch.randint(0, cfg.vocab_size, (700,), generator=g).tolist()
    pdl.ENABLED = False
    eager(model, ref, ids[:600], 0)
    for i in ref.layers:
        ours.layer(i).k_pool.copy_(ref.layer(i).k_pool)
        ours.layer(i).v_pool.copy_(ref.layer(i).v_pool)
    torch._dynamo.reset()
    m = PhaseManager(model, ours, ubatch=256, lower="graph")
    pos = 600
    for w in [1, 1, 2, 1, 3, 8, 1]:
        step = ids[pos:pos + w]
        pdl.ENABLED = True
        m.forward(step, pos)                       # captures on a width's first use
        got = m.forward(step, pos)                 # the replay (idempotent KV writes)
        pdl.ENABLED = False
        want = eager(model, ref, step, pos, rows=bucket_for(w))
        assert torch.equal(got, want), f"width {w} at {pos}: max diff {(got - want).abs().max()}"
        pos += w
    for i in ref.layers:
        assert torch.equal(ours.layer(i).k_pool, ref.layer(i).k_pool)
        assert torch.equal(ours.layer(i).v_pool, ref.layer(i).v_pool)
