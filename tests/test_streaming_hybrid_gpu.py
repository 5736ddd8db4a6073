"""Device: a hybrid qwen35 model (Gated DeltaNet + attention + an MTP layer) whose attention
KV streams through a tiny CUDA arena generates the same greedy tokens, with bitwise equal
logits, as with everything resident; the KV policy never touches the recurrent state (it
lives outside the arena at fixed addresses, and dropping every resident page mid-run leaves
it and the output unchanged)."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.kv.kv_pages import min_arena_bytes
from kvcompile.kv.store import KvStore
from kv_steps import forward
from kvcompile.kv.arena import MIB
from tiny_hybrid import tiny_hybrid

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SEED = int.from_bytes(os.urandom(4), "little")
DEV = "cuda"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_hybrid(tmp_path_factory.mktemp("hybrid"), SEED % 1000, device=DEV)


def greedy(model, cache, prompt, n_decode, chunk=200, on_step=None):
    """Main forwards acquire the attention layers only (the MTP layer keeps its own pages)."""
    main = model.layer_plan.kv_layers[:-1]
    rows = []
    with torch.inference_mode():
        for s in range(0, len(prompt), chunk):
            t = prompt[s:s + chunk]
            pos = torch.arange(s, s + len(t), device=DEV)
            rows.append(forward(model, cache, t, pos, last_only=True, layers=main).cpu())
        ids = [int(rows[-1][-1].argmax())]
        for i, p in enumerate(range(len(prompt), len(prompt) + n_decode)):
            if on_step is not None:
                on_step(i)
            rows.append(forward(model, cache, torch.tensor([ids[-1]], device=DEV),
                                torch.tensor([p], device=DEV), last_only=True,
                                layers=main).cpu())
            ids.append(int(rows[-1][-1].argmax()))
    return ids, torch.cat(rows)


def caches(model, max_tokens, kv):
    c = model.config
    full = replace(c, n_layers=c.n_layers + c.nextn_layers)
    kt, vt = kv
    resident = KvStore.for_model(model, max_tokens, kt, vt, 0, device=DEV)
    tiny = min_arena_bytes(full, max_tokens, kt, vt) * 1.1 / MIB
    streaming = KvStore.for_model(model, max_tokens, kt, vt, tiny, device=DEV)
    return resident, streaming


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q8_0", "q4_0")], ids=lambda k: "/".join(k))
def test_hybrid_streams_bitwise_and_policy_never_touches_recurrent_state(model, kv):
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, model.config.vocab_size, (1500,), generator=gen).to(DEV)
    max_tokens = len(prompt) + 40
    resident, streaming = caches(model, max_tokens, kv)
    ref_ids, ref = greedy(model, resident, prompt, 32)

    state = model.recurrent_state(streaming)
    ptrs = (state.conv.data_ptr(), state.ssm.data_ptr())
    arena = streaming.arena.buffer
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    snaps = {}

    def mid_run(i):
        if i == 16:    # the policy's "forget every resident page"; state must not notice
            snaps["before"] = (state.conv.clone(), state.ssm.clone())
            streaming.drop_resident()
            snaps["after"] = (state.conv.clone(), state.ssm.clone())

    ids, got = greedy(model, streaming, prompt, 32, on_step=mid_run)
    print(f"{'/'.join(kv)}: seed {SEED}, arena {streaming.arena.nbytes / MIB:.1f} MiB, "
          f"streamed {streaming.telemetry[-1].streamed_reads} page reads in the last step, "
          f"max |dlogit| {(got - ref).abs().max().item():.3g}")
    assert ids == ref_ids
    assert torch.equal(got, ref)
    assert (state.conv.data_ptr(), state.ssm.data_ptr()) == ptrs       # never moved
    for t in (state.conv, state.ssm):                                   # never in the arena
        assert not lo <= t.data_ptr() < hi
    assert all(torch.equal(a, b) for a, b in zip(snaps["before"], snaps["after"]))
    assert sum(s.streamed_reads for s in streaming.telemetry[-8:]) > 0
