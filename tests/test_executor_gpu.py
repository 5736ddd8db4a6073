"""Device: the executor's captured steps (one CUDA graph per step, ring copies, fences and
publishes included) against the eager model, bit for bit:

- streamed decode through a tiny arena equals the eager all-resident decode -- every
  step's logits and 64 greedy tokens -- for llama and qwen35 at 4K, 16K and 64K;
- verify steps of 1-8 rows (padded programs) over a streamed llama, with rollbacks;
- every mode of a decode program (traced, filled ahead, the eager model in the graph, all
  resident) across a page boundary;
- an all-resident store's programs of every width (decode, padded verify, a prefill chunk)
  with pages relocated between steps and no synchronising call in a replay;
- the Engine with a streamed store over three requests, and a retrace never captured.
The same checks on the CPU: tests/test_executor.py."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kvcompile.executor.executor import Executor, bucket_for
from kvcompile.io.gguf.synthetic import preset_config, write_synthetic_gguf
from kvcompile.io.weights import load_weights
from kvcompile.kv.arena import MIB
from kvcompile.kv.kv_pages import min_arena_bytes
from kvcompile.kv.store import KvStore
from kvcompile.models.config import ModelConfig
from kvcompile.models.llama import LlamaModel
from kvcompile.models.qwen35 import Qwen35Model
from test_executor import tiny_arena

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SEED = int.from_bytes(os.urandom(4), "little")
DEV = torch.device("cuda")
CTX = 65536 + 512
DECODE = 64
# SmolLM2-135M's geometry with random weights (a real model's shapes, seconds to build)
SMOL = ModelConfig(arch="llama", n_layers=30, hidden=576, ffn=1536, n_heads=9, n_kv_heads=3,
                   head_dim=64, vocab_size=49152, context_length=CTX, rope_theta=100000.0,
                   tie_embeddings=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(SEED)
    with torch.device(DEV):
        llama = LlamaModel(SMOL).eval().requires_grad_(False)
    path = tmp_path_factory.mktemp("executor") / "qwen35.gguf"
    write_synthetic_gguf(preset_config("qwen35", "tiny", n_layers=8, vocab_size=2048,
                                       context_length=CTX), path, "f32", seed=SEED % 1000)
    w = load_weights(path, progress=False)
    qwen = Qwen35Model.from_weights(w.config, w.tensors, dtype=torch.bfloat16, device=DEV)
    return {"llama": llama, "qwen35": qwen}


def executor(model, ctx: int, kv, arena: float = 0, capture: bool = False,
             ubatch: int = 2048, **kw) -> Executor:
    k, v = kv if isinstance(kv, tuple) else (kv, kv)
    store = KvStore.for_model(model, ctx, k, v, arena, device=DEV, **kw)
    return Executor(model, store, ubatch=ubatch, capture=capture, compile=capture,
                    strict=capture)


@torch.inference_mode()
def greedy(runner: Executor, prompt: list[int], n: int, ubatch: int = 2048):
    runner.begin_request(len(prompt) + n + 1)
    for s in range(0, len(prompt), ubatch):
        logits = runner.step(prompt[s:s + ubatch], s)
    ids, rows = [int(logits.argmax())], [logits.float().cpu().clone()]
    for i in range(n):                   # (a program's output buffer is reused: copies)
        logits = runner.step(ids[-1:], len(prompt) + i)
        rows.append(logits.float().cpu().clone())
        ids.append(int(logits.argmax()))
    return ids, torch.stack(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("ctx,kv,times,depth", [
    (4096, "f32", 1.1, "off"), (16384, "f16", 1.1, "auto"), (65536, "q8_0", 1.1, "auto"),
    (16384, "f16", 1.7, 1.5)], ids=["4K-f32-whole-fills", "16K-f16", "64K-q8_0",
                                    "16K-f16-split-fills"])
def test_captured_streamed_decode_equals_eager_resident(models, arch, ctx, kv, times, depth):
    """times: the arena over the smallest one; at 1.7 decode takes a ring of 1.5 layers
    (its own split, refilled before the first captured step) whose fills split in two.
    depth: the store's decode_depth ("auto": CUDA's 1.25 layers; "off": prefill's ring,
    whole-layer fills)."""
    model = models[arch]
    c = model.config
    n_prompt = ctx - DECODE - 1 - SEED % 200
    prompt = torch.randint(0, c.vocab_size, (n_prompt,),
                           generator=torch.Generator().manual_seed(SEED)).tolist()
    ref_ids, ref = greedy(executor(model, ctx, kv), prompt, DECODE)
    arena = tiny_arena(model, kv, kv, ctx, times)
    streamed = executor(model, ctx, kv, arena, capture=True, decode_depth=depth)
    cache = streamed.store
    assert streamed.mode == "cuda graphs"
    ids, got = greedy(streamed, prompt, DECODE)
    stats = streamed.request_stats()
    decode = cache.telemetry[-DECODE:]
    frac = sum(s.streamed_reads for s in decode) / sum(
        s.streamed_reads + s.resident_reads for s in decode)
    print(f"{arch} {ctx} {kv}: seed {SEED}, arena {arena:.1f} MiB, streamed {frac:.3f}, "
          f"programs {stats}, max |dlogit| {(got - ref).abs().max().item():.3g}")
    assert ids == ref_ids, (SEED, arch, ctx)
    assert torch.equal(got, ref), (SEED, arch, ctx)
    assert stats["replays"] >= DECODE - 2 and "fallback" not in stats
    assert frac > (0.5 if times < 1.5 else 0.2), frac
    if times > 1.5 and len(cache.layers) > 2:   # (two layers: a ring of at most one)
        assert any(s.split_layers for s in cache.telemetry if s.tokens == 1), SEED
    cache.close()


@torch.inference_mode()
def test_captured_streamed_verify_steps_equal_eager_resident(models):
    """Verify steps of 1-8 rows over a streamed llama (16K, q8_0) replay the programs of
    their bucket (2, 4, 8 rows, padded by repeating the last row), and steps of 9-64 rows
    run the traced forward of 16, 32 or 64 rows uncaptured, with rollbacks between them:
    every row's logits equal the eager all-resident verify's to rounding (a product of more
    rows may round otherwise)."""
    import random
    model, kv, ctx = models["llama"], "q8_0", 16384
    c = model.config
    rng = random.Random(SEED)
    rounds = [rng.randint(1, 8) for _ in range(40)] + [rng.randint(9, 64) for _ in range(4)]
    n_prompt = ctx - sum(rounds) - 16 - SEED % 200
    prompt = torch.randint(0, c.vocab_size, (n_prompt,),
                           generator=torch.Generator().manual_seed(SEED)).tolist()
    resident = executor(model, ctx, kv)
    streamed = executor(model, ctx, kv, tiny_arena(model, kv, kv, ctx), capture=True)
    for r in (resident, streamed):
        r.begin_request(ctx)
        for s in range(0, n_prompt, 2048):
            r.step(prompt[s:s + 2048], s)
    pos, worst = n_prompt, 0.0
    for width in rounds:
        ids = [rng.randrange(c.vocab_size) for _ in range(width)]
        want = resident.verify(ids, pos)[0].float()
        got = streamed.verify(ids, pos)[0].float()
        worst = max(worst, (got - want).abs().max().item())
        # (no argmax check: 180 rows of a 49K vocabulary hold near-ties within rounding)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3)
        keep = rng.randint(1, width)
        for r in (resident, streamed):
            r.rollback(keep, width, pos)
        pos += keep
        assert streamed.store.rows() == pos            # no padding row is history
    stats = streamed.request_stats()
    widths = {rows: len(p) for (kind, rows), p in streamed.programs.items() if p}
    print(f"verify: seed {SEED}, max |dlogit| {worst:.3g}, programs {widths}, {stats}")
    assert stats["compiled"] and "trace_error" not in stats and "fallback" not in stats
    assert set(widths) - {1} and stats["replays"] >= len(rounds) // 2, (widths, stats)
    streamed.store.close()


@pytest.mark.parametrize("mode", ["traced", "filled-ahead", "eager-in-graph", "resident"])
@pytest.mark.parametrize("kv", [("f16", "f16"), ("q8_0", "q4_0")], ids=lambda k: "/".join(k))
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@torch.inference_mode()
def test_decode_programs_are_bitwise_eager_decode(models, arch, kv, mode):
    """traced: the streamed step runs the forward traced through passes.streamed_pipeline
    (ring ops lowered), as the Engine's; filled-ahead: the same, and each replay fills the
    next step's first layers, which that step's program skips (fill_ahead); eager-in-graph:
    the eager model captured; resident: every page on the device, one layout."""
    model = models[arch]
    streamed = mode != "resident"
    n_prompt, n_decode, ctx = 500, 40, 1024      # the decode crosses the page at 512
    g = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=g).tolist()
    arena = tiny_arena(model, *kv, ctx=ctx) if streamed else 0
    ids_ref, ref = greedy(executor(model, ctx, kv, arena), prompt, n_decode)
    store = KvStore.for_model(model, ctx, *kv, arena, device=DEV,
                              fill_ahead=mode == "filled-ahead")
    program = Executor(model, store, ubatch=2048, capture=True,
                       compile=mode != "eager-in-graph", strict=True)
    ids, got = greedy(program, prompt, n_decode)
    s = program.request_stats()
    print(f"{arch} {'/'.join(kv)} {mode}: seed {SEED}, {s}, max |dlogit| "
          f"{(got - ref).abs().max().item():g}")
    assert s["eager_steps"] + s["replays"] == n_decode and s["replays"] >= n_decode - 3, s
    # resident: one layout; streamed: one per page the decode reaches (and per split)
    assert s["captures"] == 1 if not streamed else s["captures"] >= 2, s
    assert ids == ids_ref and torch.equal(got, ref), SEED
    assert s["compiled"] == (mode != "eager-in-graph") and "trace_error" not in s, s
    layouts = list(program.programs[("step", 1)])
    assert any(lay.ahead for lay in layouts if streamed) == (mode == "filled-ahead"), layouts
    if streamed:
        assert store.stats()["streamed_fraction"] > 0.5
    store.close()


@contextlib.contextmanager
def no_sync():
    """Any synchronising CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def relocate(store: KvStore, a: int, b: int) -> None:
    """Swap physical pages a and b of the store (bytes, and the page-table entries of
    every layer), in place: the logical KV is unchanged, its addresses are not."""
    pages = store.pages
    pages[[a, b]] = pages[[b, a]]
    for i in store.layers:
        t = store.layer(i).page_table
        at_a, at_b = t == a, t == b
        t[at_a], t[at_b] = b, a


@pytest.mark.parametrize("kv", ["f32", "q8_0/q4_0"])
@torch.inference_mode()
def test_resident_programs_of_every_width_equal_eager_bitwise(tmp_path, kv):
    """Two all-resident stores with the same KV; every step (a prefill chunk of the ubatch,
    widths 1, 2, 3 -> 4, 5 -> 8) through the captured program equals the eager model on the
    same (padded) rows bitwise, with pages relocated (tables rewritten in place) between
    steps, and no synchronising call in a replay."""
    from kvcompile.io.loader import load_model
    from kvcompile.io.make_model import make_model
    path = tmp_path / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=SEED % 10_000)
    loaded = load_model(str(path), device=DEV, dtype=torch.bfloat16,   # the GEMV path
                        progress=False)
    model, cfg = loaded.model, loaded.config
    k, v = (kv, kv) if "/" not in kv else kv.split("/")
    ref = KvStore(cfg, 2048, 0, k, v, device=DEV)
    ex = Executor(model, KvStore(cfg, 2048, 0, k, v, device=DEV), ubatch=256,
                  capture=True, compile=True, strict=True)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg.vocab_size, (1100,), generator=g).tolist()

    def eager(step, pos, rows=None):
        pad = (rows or len(step)) - len(step)
        tokens = torch.tensor(step + step[-1:] * pad, device=DEV)
        p = torch.tensor(list(range(pos, pos + len(step))) + [pos + len(step) - 1] * pad,
                         device=DEV)
        return model(tokens, p, ref, last_only=rows is None)

    for s in range(0, 768, 256):       # prefill: the first chunk traces, the next capture
        want = eager(ids[s:s + 256], s)
        got = ex.step(ids[s:s + 256], s, all_rows=False)
        assert torch.equal(got, want[-1]), s
    pos, steps = 768, 0
    for w in [1, 1, 2, 3, 1, 5, 8, 1, 4, 1, 1]:
        step = ids[pos:pos + w]
        for _ in range(2):             # a width's first step traces, its second captures
            ex.verify(step, pos)
        torch.cuda.synchronize()
        relocate(ref, steps % 3, 3 + steps % 5)
        relocate(ex.store, steps % 3, 3 + steps % 5)
        want = eager(step, pos, rows=bucket_for(w))[:w]
        with no_sync():                # the replay (idempotent KV writes), no sync inside
            got = ex.verify(step, pos)[0]
        assert torch.equal(got, want), f"width {w} at {pos}: max diff {(got - want).abs().max()}"
        pos, steps = pos + w, steps + 1
    s = ex.program_stats()
    print(kv, s)
    assert s["captures"] == 5 and "fallback" not in s   # prefill/256, step/1, /2, /4, /8


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_engine_cuda_graphs_with_a_streamed_store(tmp_path, arch):
    """--cuda-graphs with --kv-stream-arena-mib: the same tokens as the all-resident eager
    engine, decode steps replayed, over three requests (the second resumes nothing: other
    tokens): the programs survive a new sequence."""
    pytest.importorskip("gguf")
    from kvcompile.engine.engine import Engine
    from kvcompile.io.make_model import make_model
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", path, weight_type="f32", seed=SEED % 1000)
    ref = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 cuda_graphs=False, compile=False, ubatch=32)
    c = ref.model.config
    full = ref.model.layer_plan.kv_config(c)
    mib = min_arena_bytes(full, 1024) * 1.05 / MIB     # ~everything streamed
    eng = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 kv_stream_arena_mib=mib, cuda_graphs=True, ubatch=32)
    assert eng.executor.mode == "cuda graphs" and eng.store.backend.name == "cuda"
    first = ref.tokenizer.encode("the quick brown fox " * 30)
    other = torch.randint(0, c.vocab_size, (len(first),),
                          generator=torch.Generator().manual_seed(SEED)).tolist()
    shorter = other[:len(first) // 3]
    results = []
    for prompt in (first, other, shorter):
        a = ref.generate(prompt, max_tokens=20, temperature=0)
        b = eng.generate(prompt, max_tokens=20, temperature=0)
        assert a.token_ids == b.token_ids, (SEED, arch)
        results.append(dict(b.programs, tokens=b.completion_tokens, cached=b.cached_tokens))
    # the programs captured in the first request serve a second one over the same pages
    # (other tokens); a request over pages not seen yet captures only their layouts
    assert results[1]["captures"] == 0 and results[1]["total_captures"] == results[0]["captures"]
    assert results[0]["captures"] >= 1 and results[2]["captures"] <= 2
    assert all(p["replays"] >= p["tokens"] - 4 for p in results[1:]), results
    assert all("fallback" not in p for p in results)
    assert results[2]["cached"] > 0, results            # a prefix of the second request


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@torch.inference_mode()
def test_a_retrace_is_not_captured(models, arch):
    """Another traced executor of the same model class (a second Engine) drops this one's
    trace (executor/compile.py resets the code). The next capture must not trace (a capture
    forbids what dynamo does): it gives way, that step runs uncaptured and retraces, the
    step after captures; the tokens stay the eager decode's."""
    model = models[arch]
    kv, n_prompt, n_decode, ctx = ("q8_0", "q4_0"), 500, 24, 1024   # crosses page 512
    g = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=g).tolist()
    arena = tiny_arena(model, *kv, ctx=ctx)
    ids_ref, ref = greedy(executor(model, ctx, kv, arena), prompt, n_decode)
    store = KvStore.for_model(model, ctx, *kv, arena, device=DEV)
    program = Executor(model, store, ubatch=2048, capture=True, compile=True, strict=False)
    program.begin_request(n_prompt + n_decode + 1)
    logits = program.step(prompt, 0)
    ids, rows = [int(logits.argmax())], [logits.float().cpu().clone()]
    for i in range(n_decode):
        if n_prompt + i == 505:          # before the layout of page 512 is captured
            other = executor(model, ctx, kv, arena, capture=True)
            greedy(other, prompt[:300], 2)
        logits = program.step(ids[-1:], n_prompt + i)
        rows.append(logits.float().cpu().clone())
        ids.append(int(logits.argmax()))
    s = program.request_stats()
    print(arch, SEED, s)
    assert ids == ids_ref and torch.equal(torch.stack(rows), ref), SEED
    assert s["retraces"] == 1 and s["compiled"] and "fallback" not in s, s
    assert s["replays"] >= n_decode - 4, s
