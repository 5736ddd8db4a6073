"""The streaming runtime on the CUDA backend against an all-resident KvStore on CUDA.

Models are built in memory with random weights (seed printed): one of SmolLM2-135M's
geometry for the long-context runs, a small one for the fence and memory runs.
"""
from __future__ import annotations

import os
import random
import re

import pytest
import torch

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ArenaError
from kvcompile.kv.store import KvStore
from kvcompile.models.llama import LlamaModel
from kvcompile.kv.copy_engine import Instrument
from kvcompile.kv.kv_pages import min_arena_bytes
from kv_steps import forward
from kvcompile.kv.arena import MIB

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEED = int.from_bytes(os.urandom(4), "little")
DEV = "cuda"
# SmolLM2-135M's geometry (30 layers, 9 query / 3 KV heads of 64), random weights.
SMOL = ModelConfig(arch="llama", n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3,
                   head_dim=64, vocab_size=49152, context_length=65536 + 256,
                   rope_theta=100000.0, tie_embeddings=True)
SMALL = ModelConfig(arch="llama", n_layers=6, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                    head_dim=64, vocab_size=4096, context_length=4096)


def build(cfg, seed=SEED):
    torch.manual_seed(seed)
    with torch.device(DEV):
        return LlamaModel(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def smol():
    return build(SMOL)


@pytest.fixture(scope="module")
def small():
    return build(SMALL)


def prompt_of(cfg, n, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=g).to(DEV)


@torch.inference_mode()
def generate(model, cache, prompt, n_decode, chunk=2048, on_step=None):
    """Greedy: chunked prefill, then decode; (token ids, last-row logits of every forward)."""
    rows = []
    for s in range(0, len(prompt), chunk):
        t = prompt[s:s + chunk]
        pos = torch.arange(s, s + len(t), device=DEV)
        rows.append(forward(model, cache, t, pos, last_only=True))
        rows[-1] = rows[-1].cpu()        # kept on the host: device memory stays flat
    ids = [int(rows[-1][-1].argmax())]
    for i, pos in enumerate(range(len(prompt), len(prompt) + n_decode)):
        rows.append(forward(model, cache, torch.tensor([ids[-1]], device=DEV),
                            torch.tensor([pos], device=DEV), last_only=True).cpu())
        ids.append(int(rows[-1][-1].argmax()))
        if on_step is not None:
            on_step(i)
    return ids, torch.cat(rows)


def tiny_mib(cfg, max_tokens, kt, vt, slack=1.1):
    """An arena just over the minimum: the ring holds one layer's context, ~nothing resident."""
    return min_arena_bytes(cfg, max_tokens, kt, vt) * slack / MIB


# ---- tiny arena vs all resident at long context ---------------------------------------------
@pytest.mark.parametrize("ctx,kv", [(4096, "f32"), (16384, "f16"), (65536, "q8_0")])
def test_tiny_arena_greedy_matches_all_resident(smol, ctx, kv):
    n_decode = 16
    n_prompt = ctx - n_decode - random.Random(SEED).randrange(1, 200)
    prompt = prompt_of(SMOL, n_prompt)
    ref_cache = KvStore(SMOL, ctx, k_type=kv, v_type=kv, device=DEV)
    ids_ref, ref = generate(smol, ref_cache, prompt, n_decode)
    del ref_cache
    cache = KvStore(SMOL, ctx, tiny_mib(SMOL, ctx, kv, kv), k_type=kv, v_type=kv,
                          device=DEV)
    assert isinstance(cache, KvStore) and cache.backend.name == "cuda"
    ids, got = generate(smol, cache, prompt, n_decode)
    cache.synchronize()
    st = cache.stats()
    decode = cache.telemetry[-n_decode:]
    streamed = sum(s.streamed_reads for s in decode)
    frac = streamed / sum(s.streamed_reads + s.resident_reads for s in decode)
    print(f"ctx {ctx} {kv}: seed {SEED}, arena {cache.arena.nbytes / MIB:.1f} MiB, decode "
          f"streamed {frac:.3f}, h2d {st['h2d_bytes'] / 2**30:.2f} GiB, copy busy "
          f"{st['copy_busy_pct']:.1f}%, misses {st['readiness_misses']}, "
          f"max |dlogit| {(got - ref).abs().max().item():.3g}")
    assert ids == ids_ref, (SEED, ids, ids_ref)
    assert torch.equal(got, ref), SEED
    assert frac >= 0.9
    assert all(s.h2d_bytes > 0 for s in decode)
    assert st["copy_busy_pct"] > 0 and st["d2h_bytes"] > 0
    cache.close()


# ---- fences under injected device-side delays ----------------------------------------------
def _instrumented(model_cfg, max_tokens, pages, copy_ms, compute_ms, unsafe=frozenset(),
                  seed=SEED):
    from kvcompile.kv.cuda_backend import CudaBackend, TimelineChecker
    rng = random.Random(seed)
    checker = TimelineChecker()
    inst = Instrument(checker=checker, copy_delay=lambda: rng.random() * copy_ms / 1000,
                      compute_delay=lambda: rng.random() * compute_ms / 1000)
    mib = tiny_mib(model_cfg, pages * 256, "f32", "f32", slack=1.0)
    cache = KvStore(model_cfg, max_tokens, mib, backend=CudaBackend(DEV, inst),
                             unsafe=unsafe)
    return cache, checker


@pytest.mark.parametrize("copy_ms,compute_ms", [(3, 0.3), (0.3, 3)])
def test_fences_hold_under_injected_device_delays(small, copy_ms, compute_ms):
    max_tokens, n_decode = 3072, 12
    prompt = prompt_of(SMALL, 2900)
    ids_ref, ref = generate(small, KvStore(SMALL, max_tokens, device=DEV), prompt,
                            n_decode, chunk=512)
    # 30 pages: the ring holds ~2.5 layers of 12 pages, so copies overlap compute
    cache, checker = _instrumented(SMALL, max_tokens, 30, copy_ms, compute_ms)
    ids, got = generate(small, cache, prompt, n_decode, chunk=512)
    chk = checker.replay()
    print(f"copy {copy_ms} ms compute {compute_ms} ms: {chk.events} events, "
          f"misses {cache.stats()['readiness_misses']}")
    cache.close()
    assert chk.violations == [], (SEED, chk.violations[:3])
    assert chk.events > 100
    assert ids == ids_ref and torch.equal(got, ref), SEED
    last = cache.telemetry[-1]
    assert last.streamed_reads > last.ring_slots > 0     # slots reused within a forward


@pytest.mark.parametrize("unsafe,copy_ms,compute_ms,expect", [
    ("skip_ready_wait", 20, 0, "read-before-ready"),
    ("skip_consumed_wait", 0, 20, "overwrite-before-consumed"),
])
def test_broken_ordering_is_caught_on_the_device(small, unsafe, copy_ms, compute_ms, expect):
    cache, checker = _instrumented(SMALL, 2048, 8, copy_ms, compute_ms, unsafe={unsafe})
    generate(small, cache, prompt_of(SMALL, 1500, SEED + 5), 3, chunk=512)
    chk = checker.replay()
    cache.close()
    assert any(v.startswith(expect) for v in chk.violations), chk.violations[:3]


# ---- one arena: nothing else grows -------------------------------------------------------
def test_memory_outside_arena_and_weights_is_flat_over_1000_decode_steps(small):
    max_tokens, n_prompt, n_decode, warm = 2560, 1200, 1000, 50
    cache = KvStore(SMALL, max_tokens, tiny_mib(SMALL, max_tokens, "q8_0", "q8_0", 1.3),
                          k_type="q8_0", v_type="q8_0", device=DEV)
    seen = {}

    def watch(i):
        if i == warm:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            seen.update(alloc=torch.cuda.memory_allocated(),
                        reserved=torch.cuda.max_memory_reserved(), top=0)
        elif i > warm:
            seen["top"] = max(seen["top"], abs(torch.cuda.memory_allocated() - seen["alloc"]))
    generate(small, cache, prompt_of(SMALL, n_prompt), n_decode, chunk=512, on_step=watch)
    torch.cuda.synchronize()
    grown_reserved = torch.cuda.max_memory_reserved() - seen["reserved"]
    st = cache.stats()
    print(f"1000 decode steps: allocated drift {seen['top']} B, max reserved growth "
          f"{grown_reserved} B, streamed {st['streamed_fraction']:.3f}, "
          f"h2d {st['h2d_bytes'] / 2**30:.2f} GiB")
    assert st["streamed_fraction"] > 0.5 and st["h2d_bytes"] > 0
    assert seen["top"] < MIB and grown_reserved < MIB
    cache.close()


# ---- bad input -------------------------------------------------------------------------------
def test_bad_input_fails_clearly_and_the_process_stays_usable(small):
    from kvcompile.kv.cuda_backend import CudaBackend
    backend = CudaBackend(DEV)
    with pytest.raises(ArenaError, match="cannot pin"):
        backend.host_buffer((2 ** 20, 2 ** 30))          # 1 PiB: more than any address space
    huge = ModelConfig(arch="llama", n_layers=4096, hidden=1024, ffn=1024, n_heads=8,
                       n_kv_heads=8, head_dim=128, vocab_size=256, context_length=131072)
    with pytest.raises(ArenaError, match="pinned host memory"):
        KvStore(huge, 131072, 1100, device=DEV)    # 4 TiB of history, checked first
    with pytest.raises(ArenaError, match="cannot allocate an arena"):
        KvStore(SMALL, 2048, 2 ** 30, device=DEV)  # 1 PiB arena
    with pytest.raises(ArenaError, match=r"--kv-stream-arena-mib (\d+)") as e:
        KvStore(SMALL, 2048, 0.5, device=DEV)
    smallest = int(re.search(r"--kv-stream-arena-mib (\d+)", str(e.value)).group(1))
    # the smallest arena named works, and gives the all-resident output
    prompt = prompt_of(SMALL, 1800)
    ids_ref, ref = generate(small, KvStore(SMALL, 2048, device=DEV), prompt, 8, chunk=512)
    cache = KvStore(SMALL, 2048, smallest, device=DEV)
    ids, got = generate(small, cache, prompt, 8, chunk=512)
    assert ids == ids_ref and torch.equal(got, ref), SEED
    cache.close()


# ---- through the engine ---------------------------------------------------------------------
def test_engine_streams_on_cuda(tmp_path):
    pytest.importorskip("gguf")
    from kvcompile.engine.engine import Engine
    from kvcompile.io.make_model import make_model
    path = tmp_path / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=SEED % 1000)
    ref = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 cuda_graphs=False)
    need = min_arena_bytes(ref.model.config, 1024) / MIB
    eng = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 kv_stream_arena_mib=need * 1.05)
    assert eng.store.backend.name == "cuda"
    text = "the quick brown fox " * 40
    a = ref.generate(text, max_tokens=24, temperature=0)
    b = eng.generate(text, max_tokens=24, temperature=0)
    assert a.text == b.text and a.completion_tokens == b.completion_tokens
    assert eng.store.stats()["h2d_bytes"] > 0


# ---- the SM gather copy mode ---------------------------------------------------------------
def test_gather_copy_equals_the_source():
    from kvcompile.kv.cuda_gather import gather_copy
    g = torch.Generator().manual_seed(SEED)
    for n in (16, 4096, 52224 * 7, 3 * 2 ** 20 + 48):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).pin_memory()
        dst = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, device=DEV)
        tail = dst[n:].clone()
        gather_copy(dst[:n], src)
        assert torch.equal(dst[:n].cpu(), src) and torch.equal(dst[n:], tail)


def test_gather_mode_tiny_arena_matches_all_resident(small):
    from kvcompile.kv.cuda_backend import CudaBackend
    max_tokens, kv = 3072, "q8_0"
    prompt = prompt_of(SMALL, 2700, SEED + 1)
    ids_ref, ref = generate(small, KvStore(SMALL, max_tokens, k_type=kv, v_type=kv,
                                                device=DEV), prompt, 16, chunk=512)
    cache = KvStore(SMALL, max_tokens, tiny_mib(SMALL, max_tokens, kv, kv, 2.2),
                             k_type=kv, v_type=kv, backend=CudaBackend(DEV, copy="gather"))
    ids, got = generate(small, cache, prompt, 16, chunk=512)
    assert ids == ids_ref and torch.equal(got, ref), SEED
    assert cache.stats()["streamed_fraction"] > 0.5
    cache.close()
