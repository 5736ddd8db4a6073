"""The executor's captured steps (kvcompile/executor/executor.py) on the CPU, where a
"graph" reruns the step's code in its fixed layout (kv/step_layout.py):

- the captured, streamed decode through a tiny arena equals the eager all-resident decode
  bit for bit, every step's logits and the greedy tokens, for llama and qwen35, across page
  boundaries;
- within a layout every step issues the same copies (same device and host addresses, same
  sizes, same order): what makes one CUDA graph valid for all of them;
- a layout is captured once: again per page boundary, none for a second request of the
  same length; steps of other widths (verify) interleave with the replays.
The same checks at 4K..64K on the device: tests/test_executor_gpu.py.
"""
from __future__ import annotations

from collections import Counter

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.models.llama import LlamaModel
from kvcompile.executor.executor import Executor
from kvcompile.kv.kv_pages import min_arena_bytes
from kvcompile.kv.store import KvStore
from kvcompile.kv.arena import MIB
from test_kv_cache import TINY, tiny_weights
from tiny_hybrid import tiny_hybrid

SEED = int.from_bytes(os.urandom(4), "little")
CTX = 1024
DECODE = 40
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = replace(TINY, context_length=CTX)
    llama = LlamaModel.from_weights(cfg, tiny_weights(cfg, torch.Generator().manual_seed(SEED)))
    return {"llama": llama, "qwen35": tiny_hybrid(tmp_path_factory.mktemp("dg"), SEED % 1000)}


def tiny_arena(model, k: str = "f32", v: str | None = None, ctx: int = CTX,
               times: float = 1.1) -> float:
    """`times` x the smallest arena (the MTP layer's KV counted): nearly every page streams."""
    full = model.layer_plan.kv_config(model.config)
    return min_arena_bytes(full, ctx, k, v or k) * times / MIB


def executor(model, arena: float = 0, k: str = "f32", v: str | None = None,
             capture: bool = False, **kw) -> Executor:
    """An executor over a new store of `model` (arena 0: all resident); capture: programs
    of fixed layouts (traced, rerun on the CPU)."""
    store = KvStore.for_model(model, CTX, k, v or k, arena, device=CPU)
    return Executor(model, store, ubatch=128, capture=capture, compile=capture, **kw)


@torch.inference_mode()
def greedy(runner: Executor, prompt: list[int], n: int = DECODE, ubatch: int = 128):
    runner.begin_request(len(prompt) + n + 1)
    for s in range(0, len(prompt), ubatch):
        logits = runner.step(prompt[s:s + ubatch], s)
    ids, rows = [int(logits.argmax())], [logits.float().cpu().clone()]
    for i in range(n):                   # (a program's output buffer is reused: copies)
        logits = runner.step(ids[-1:], len(prompt) + i)
        rows.append(logits.float().cpu().clone())
        ids.append(int(logits.argmax()))
    return ids, torch.stack(rows)


def prompt_of(model, n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(SEED + salt)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_captured_streamed_decode_equals_eager_resident(models, arch):
    model = models[arch]
    prompt = prompt_of(model, 500 - SEED % 12)          # decode crosses the page at 512
    ref_ids, ref = greedy(executor(model), prompt)
    runner = executor(model, tiny_arena(model), capture=True)
    cache = runner.store
    assert runner.mode == "cuda graphs"
    ids, got = greedy(runner, prompt)
    stats = runner.request_stats()
    decode = cache.telemetry[-DECODE:]
    frac = sum(s.streamed_reads for s in decode) / sum(
        s.streamed_reads + s.resident_reads for s in decode)
    print(f"{arch}: seed {SEED}, streamed {frac:.2f}, {stats}")
    assert ids == ref_ids and torch.equal(got, ref), SEED
    # one eager warm-up step, then two captures per layout (the page the decode started
    # in and the next one): the program of its first step (nothing filled ahead: the step
    # before ran eagerly or in another layout) and the one whose first layers the step
    # before filled ahead inside its graph
    assert stats["eager_steps"] == 1 and stats["captures"] == 4, stats
    # the steps run the traced forward, its ring ops lowered (passes/lower_ring.py)
    assert stats["compiled"], stats
    assert stats["replays"] == DECODE - 1 and frac > 0.5


class RecordingEngine:
    """Wraps the cache's copy engine: every copy's (dst address, src address, bytes, kind),
    and every row publish's (host pages address, pool address, positions address)."""

    def __init__(self, engine):
        self._engine, self.log = engine, []

    def copy(self, pairs, note, after=()):
        self.log.append(tuple((d.data_ptr(), s.data_ptr(), d.nbytes, note.kind)
                              for d, s in pairs))
        return self._engine.copy(pairs, note, after)

    def publish_rows(self, pools, hosts, table, positions, maps):
        self.log.append(tuple((h.data_ptr(), p.data_ptr(), positions.data_ptr(), "rows")
                              for p, h in zip(pools, hosts)))
        return self._engine.publish_rows(pools, hosts, table, positions, maps)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@torch.inference_mode()
def test_every_step_of_a_layout_issues_the_same_copies(models):
    model = models["llama"]
    runner = executor(model, tiny_arena(model, "q8_0"), "q8_0", capture=True)
    cache = runner.store
    rec = cache.streamer.pool.engine = cache.streamer.engine = RecordingEngine(
        cache.streamer.engine)
    prompt = prompt_of(model, 300, 1)
    runner.begin_request(CTX)                          # planned: the split streams
    for s in range(0, len(prompt), 128):
        logits = runner.step(prompt[s:s + 128], s)
    per_step, layouts = [], []
    for i in range(40):                                  # positions 300..339: one page
        n = len(rec.log)
        logits = runner.step([int(logits.argmax())], len(prompt) + i)
        per_step.append(rec.log[n:])
        layouts.append(cache.streamer._layouts.get(tuple(cache.layers)))
    first, *replayed = [c for c, lay in zip(per_step, layouts) if lay is not None]
    assert len(replayed) == 38 and replayed[0], runner.request_stats()
    assert all(c == replayed[0] for c in replayed)      # fills and publishes, all of them
    # Each step ends by filling the next one's first layers (end_issue), which that
    # step's program skips: a step's copies are the layout's fills once, the first step's
    # (its program fills every layer) those and the next step's filled ahead.
    steady = replayed[0]
    last_rows = max(i for i, group in enumerate(steady) if group[0][-1] == "rows")
    ahead = steady[last_rows + 1:]
    assert ahead and all(group[0][-1] == "fill" for group in ahead)
    assert Counter(first) - Counter(steady) == Counter(ahead), (first, steady)
    assert any(lay.ahead for lay in runner.programs[("step", 1)])
    kinds = [k for group in replayed[0] for *_, k in group]
    # a layer's pages are filled, its rows (not its pages) published: K and V per layer
    assert set(kinds) == {"fill", "rows"} and kinds.count("rows") == 2 * len(cache.layers)
    assert sum(1 for group in replayed[0] if group[0][-1] == "rows") == len(cache.layers)
    # the layout's program, and its program for steps whose first layers were filled ahead
    assert runner.request_stats()["captures"] == 2


def test_a_second_request_of_the_same_length_captures_nothing(models):
    model = models["qwen35"]
    opts = dict(ctx_size=CTX, ubatch=128, progress=False)
    ref = Engine.from_model(model, **opts)
    e = Engine.from_model(model, kv_stream_arena_mib=tiny_arena(model), cuda_graphs=True,
                          **opts)
    runs = []
    for salt in (2, 3):                # different prompts, the same length
        prompt = prompt_of(model, 200, salt)
        a = ref.generate(prompt, max_tokens=24, temperature=0)
        runs.append(e.generate(prompt, max_tokens=24, temperature=0))
        assert a.token_ids == runs[-1].token_ids, SEED
    first, b = runs
    assert b.programs["captures"] == 0 and b.programs["total_captures"] == 2, b.programs
    assert b.programs["replays"] == 23 and b.programs["eager_steps"] == 0   # warm: all replayed
    # the trace and the capture are the first request's warm-up, reported apart
    assert first.programs["warmup_s"] > 0 and b.programs["warmup_s"] == 0, (first.programs, b.programs)
    assert "of it warm-up" in first.stats_line() and "warm-up" not in b.stats_line()


@torch.inference_mode()
def test_verify_steps_replay_padded_programs(models):
    """A streamed llama's verify steps of 2-8 rows run the program of the smallest bucket
    (2, 4, 8) that holds them, padded by repeating the last row (same position, same slot,
    same bytes): every row's logits equal the eager all-resident verify's (to fp32
    rounding: a product of more rows may sum in another order), rollbacks between them keep
    both stores equal, and no padding row becomes history, to the end of the planned
    context."""
    import random
    model = models["llama"]
    prompt = prompt_of(model, 490 - SEED % 12, 7)         # the rounds cross the page at 512
    rng = random.Random(SEED)
    rounds = [rng.randint(1, 8) for _ in range(24)]
    planned = len(prompt) + sum(rounds) + 8
    ref = executor(model)
    runner = executor(model, tiny_arena(model), capture=True)
    cache = runner.store
    for r in (ref, runner):
        r.begin_request(planned)
        for s in range(0, len(prompt), 128):
            r.step(prompt[s:s + 128], s)
    pos, worst = len(prompt), 0.0

    def verify(width: int, keep: int) -> None:
        nonlocal pos, worst
        ids = [rng.randrange(model.config.vocab_size) for _ in range(width)]
        want, _ = ref.verify(ids, pos)
        got, _ = runner.verify(ids, pos)
        assert got.shape == want.shape == (width, model.config.vocab_size)
        worst = max(worst, (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for r in (ref, runner):
            r.rollback(keep, width, pos)
        pos += keep
        assert cache.history.rows[cache.layers[0]] == pos        # no padding row is history

    for width in rounds:
        verify(width, rng.randint(1, width))
    while pos < planned - 3:
        verify(1, 1)
    verify(3, 3)                  # the padding repeats the last row: it never passes it
    stats = runner.request_stats()
    widths = {rows: len(progs) for (kind, rows), progs in runner.programs.items() if progs}
    print(f"seed {SEED}, max |dlogit| {worst:.3g}, widths {rounds}, programs {widths}, "
          f"{stats}")
    assert set(widths) <= {1, 2, 4, 8} and set(widths) - {1}, (rounds, widths)
    assert stats["compiled"] and "trace_error" not in stats and "fallback" not in stats
    assert stats["replays"] > len(rounds), stats


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_wide_verify_steps_run_the_traced_program_uncaptured(models, arch):
    """Verify steps of 9-64 rows (an ngram round's long drafts) run the traced program of
    16, 32 or 64 padded rows, never captured: every row's logits equal the eager
    all-resident verify's (to fp32 rounding), rollbacks keep the stores (and a hybrid's
    recurrent state) equal, and the decode steps after them too."""
    from kvcompile.executor.programs import BUCKETS, WIDE, bucket_for
    model = models[arch]
    prompt = prompt_of(model, 300, 11)
    # (width, rows kept); a hybrid's CPU verify traces each row as a decode step: narrower
    rounds = ([(12, 5), (40, 40), (3, 1), (20, 13), (64, 2)] if arch == "llama" else
              [(10, 4), (3, 1), (12, 12)])
    planned = len(prompt) + sum(k for _, k in rounds) + 9
    ref = executor(model)
    runner = executor(model, tiny_arena(model), capture=True)
    rng = torch.Generator().manual_seed(SEED)
    with torch.inference_mode():
        for r in (ref, runner):
            r.begin_request(planned)
            for s in range(0, len(prompt), 128):
                r.step(prompt[s:s + 128], s)
        pos = len(prompt)
        for width, keep in rounds:
            ids = torch.randint(0, model.config.vocab_size, (width,), generator=rng).tolist()
            want, _ = ref.verify(ids, pos)
            got, _ = runner.verify(ids, pos)
            assert got.shape == want.shape == (width, model.config.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            for r in (ref, runner):
                r.rollback(keep, width, pos)
            pos += keep
        tok = int(want[keep - 1].argmax())
        for i in range(8):                    # decode after the rounds: the same state
            want, got = ref.step([tok], pos + i), runner.step([tok], pos + i)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            tok = int(want.argmax())
    wide = {rows: len(p) for (kind, rows), p in runner.programs.items() if rows > BUCKETS[-1]}
    # traced, not captured (a hybrid's larger checkpoint buffers drop the verify keys before)
    widest = bucket_for(max(w for w, _ in rounds), WIDE)
    assert set(wide) <= set(WIDE) and widest in wide and not any(wide.values()), wide
    stats = runner.request_stats()
    assert stats["compiled"] and "trace_error" not in stats and "fallback" not in stats


@pytest.mark.parametrize("arch,spec", [("qwen35", "ngram-simple"),
                                       ("qwen35", "ngram-simple,draft-mtp"),
                                       ("llama", "ngram-simple")])
def test_speculative_rounds_interleave_with_replays(models, arch, spec):
    """Verify steps (several rows with rollbacks: padded programs, the hybrid's recording
    its recurrent state after each row, returning the hidden rows an MTP drafter wants) and
    MTP draft steps (programs of their own) between one-row replays."""
    model = models[arch]
    unit = prompt_of(model, 19, 4)
    prompt = unit * 8 + unit[:4]
    opts = dict(ctx_size=CTX, ubatch=64, progress=False, kv_stream_arena_mib=tiny_arena(model))
    plain = Engine.from_model(model, **opts).generate(prompt, max_tokens=48, temperature=0)
    e = Engine.from_model(model, spec_type=spec, spec_ngram_size_n=1, spec_ngram_size_m=4,
                          spec_draft_n_max=3, spec_draft_p_min=0.0, cuda_graphs=True, **opts)
    r = e.generate(prompt, max_tokens=48, temperature=0)
    assert r.token_ids == plain.token_ids, (SEED, spec)
    assert r.speculative["drafted"] > 0
    # the kinds of wide steps that ran as programs, and those captured (once a width repeats)
    progs = e.executor.programs
    want = ({"verify+hidden", "mtp"} if "draft-mtp" in spec else
            {"verify"} if arch == "qwen35" else {"step"})
    assert want <= {kind for kind, rows in progs if rows > 1}, (SEED, list(progs))
    # captured once a key repeats: MTP steps of one row come every round (a verify width
    # may run only once in 48 tokens)
    captured = {kind for (kind, rows), p in progs.items() if p}
    assert ("mtp" in captured) == ("draft-mtp" in spec), (SEED, list(progs))
    # trunk and MTP steps alternate, each kind keeping its layout: captures stay rare
    assert r.programs["replays"] >= 4 * r.programs["captures"], (SEED, r.programs)
    assert r.programs["compiled"] and "fallback" not in r.programs


@torch.inference_mode()
def test_an_abandoned_capture_publishes_nothing_and_the_next_step_is_right(models):
    """What the executor does when a CUDA capture fails part way (layer 0 acquired, layer 1
    issued): the pool forgets the forward without publishing a page its captured work never
    wrote, restores its cursor and refill marks, and the step then runs eagerly, right."""
    model = models["llama"]
    prompt = prompt_of(model, 300, 5)
    want_ids, want = greedy(executor(model), prompt, n=3)
    runner = executor(model, tiny_arena(model))
    cache = runner.store
    ids, rows = greedy(runner, prompt, n=1)
    pool, layers = cache.streamer.pool, cache.layers
    history = {i: cache.history.k[i].clone() for i in layers}
    positions = torch.tensor([301])
    cache.open_forward(positions, 301, 301, layers)
    layout = cache.step_layout()
    cache.prepare_capture()
    before = (pool.cursor, list(pool.valid_upto))
    cache.issue_forward(layout)
    cache.layer(layers[0])
    assert pool.held > 0 and pool.ring.n_slots > 0
    ring = slice(pool.ring.first_physical_page, None)
    pool.k_pool[ring] = 7        # a capture's fills never ran: the slots hold other bytes
    cache.abandon_capture()
    assert (pool.cursor, pool.valid_upto, pool.held, pool.active) == (*before, 0, None)
    assert all(torch.equal(cache.history.k[i], history[i]) for i in layers)   # no publish
    cache.issue_forward()                                 # the same step, eagerly
    out = model(torch.tensor([ids[-1]]), positions, cache, last_only=True)
    cache.end_forward()
    nxt = runner.step([int(out[-1].argmax())], 302)
    assert torch.equal(out[-1], want[2]) and torch.equal(nxt, want[3]), SEED
    assert [ids[-1], int(out[-1].argmax())] == want_ids[1:3]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_failed_trace_falls_back_to_the_eager_model(models, arch, monkeypatch):
    """The Engine's executor (strict=False) whose trace fails warns once and decodes with
    the eager model in its graphs, giving the same tokens (a hybrid's recurrent state is put
    back to before the failed step); strict, the error reaches the caller."""
    from kvcompile.passes import PassError
    from kvcompile.passes.lower_ring import LowerRingOps

    def refuse(self, gm, example_inputs):
        raise PassError("lower_ring_ops refused (test)")

    model = models[arch]
    prompt = prompt_of(model, 300, 6)
    want_ids, want = greedy(executor(model), prompt, n=8)
    monkeypatch.setattr(LowerRingOps, "__call__", refuse)
    runner = executor(model, tiny_arena(model), capture=True)
    with pytest.warns(RuntimeWarning, match="tracing the model's step failed"):
        ids, got = greedy(runner, prompt, n=8)
    stats = runner.request_stats()
    assert ids == want_ids and torch.equal(got, want), SEED
    assert not stats["compiled"] and "refused" in stats["trace_error"], stats
    assert stats["replays"] == 7 and "fallback" not in stats, stats
    strict = executor(model, tiny_arena(model), capture=True, strict=True)
    with torch.inference_mode():
        logits = strict.step(prompt, 0)
        with pytest.raises(PassError, match="refused"):
            strict.step([int(logits.argmax())], len(prompt))


def test_a_dropped_engine_frees_its_cache(models):
    """torch.compile keeps every backend (and so the pass pipeline) for the life of the
    process; the lowered ring ops hold the store weakly, so a dropped executor's arena and
    pinned history go with it."""
    import gc
    import weakref

    model = models["llama"]
    runner = executor(model, tiny_arena(model), capture=True)
    cache = runner.store
    greedy(runner, prompt_of(model, 300, 7), n=3)
    assert runner.request_stats()["compiled"]
    ref = weakref.ref(cache)
    del runner, cache
    gc.collect()
    assert ref() is None


def test_a_capture_does_not_trace(models):
    """While a CUDA graph is captured the traced forward may only run its graph (dynamo's
    tracing makes calls a capture forbids): once its code was reset (another Engine's trace
    of the same model class), a call under `_no_tracing` fails with the message the executor
    takes as "trace again uncaptured first" (the retrace itself is tested on the device)."""
    model = models["llama"]
    runner = executor(model, tiny_arena(model), capture=True)
    greedy(runner, prompt_of(model, 300, 8), n=2)
    inp = runner._inputs[False, 1]          # the trunk's one-row input
    torch._dynamo.reset_code(type(model).forward.__code__)
    with pytest.raises(RuntimeError) as e, runner._no_tracing(), torch.inference_mode():
        runner._traced(inp.tokens, inp.positions, runner.store, last_only=False)
    assert "fail_on_recompile" in str(e.value)


def test_a_resident_hybrid_decodes_through_the_traced_forward_too(models):
    """A hybrid model over an all-resident store: its decode steps run the forward traced
    without ring ops, captured once (one layout: RESIDENT), bit for bit the eager decode."""
    model = models["qwen35"]
    prompt = prompt_of(model, 300, 9)
    want_ids, want = greedy(executor(model), prompt, n=12)
    runner = executor(model, capture=True)
    ids, got = greedy(runner, prompt, n=12)
    stats = runner.request_stats()
    assert runner.mode == "cuda graphs" and stats["compiled"], stats
    assert stats["replays"] == 11 and stats["captures"] == 1, stats
    assert ids == want_ids and torch.equal(got, want), SEED


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_stats_count_a_slow_copy_stream(models, graphs, monkeypatch):
    """The decode rate of the stats line agrees within 5% with the token times seen outside
    the engine when the streaming cache's copies are slow (each copy waits 2 ms on the CPU
    backend: most of a step), eager or replayed."""
    import time

    import kvcompile.engine.engine as E
    seen = []

    class Clocked(E.Sampler):
        def __call__(self, logits, history):
            token = super().__call__(logits, history)
            seen.append(time.perf_counter())
            return token

    model = models["llama"]
    e = Engine.from_model(model, ctx_size=CTX, ubatch=128, progress=False,
                          kv_stream_arena_mib=tiny_arena(model), cuda_graphs=graphs)
    monkeypatch.setattr(E, "Sampler", Clocked)
    e.store.streamer.engine.instrument.copy_delay = lambda: 0.002
    r = e.generate(prompt_of(model, 300, 8), max_tokens=12, temperature=0)
    assert r.completion_tokens == 12 and len(seen) == 12
    outside = 11 / (seen[-1] - seen[0])
    print(f"decode {r.decode_tok_s:.2f} tok/s, outside {outside:.2f}; {r.stats_line()}")
    assert abs(r.decode_tok_s / outside - 1) < 0.05
    assert f"decode {r.decode_tok_s:.1f} tok/s" in r.stats_line()
    assert r.step_ms()["p50"] >= 2.0 * len(e.store.layers)      # a copy a layer, at least
    assert (r.programs.get("replays", 0) > 0) == graphs


torch.library.define("kvcompile_executor_test::unlowered", "(Tensor x) -> Tensor")
torch.library.impl("kvcompile_executor_test::unlowered", "cpu", lambda x: x.clone())
torch.library.register_fake("kvcompile_executor_test::unlowered", lambda x: torch.empty_like(x))


class OddLlama(LlamaModel):
    def forward(self, tokens, positions, cache, last_only=False):
        return torch.ops.kvcompile_executor_test.unlowered(
            super().forward(tokens, positions, cache, last_only=last_only))


@torch.inference_mode()
def test_traced_programs_of_every_width_equal_the_eager_model(models):
    """Programs of every width (a prefill chunk of the ubatch, decode and padded verify
    steps) run the traced forward, equal to the eager executor bit for bit; several
    executors of one model class in one process each trace their own (found by review: the
    graphs of all of them counted toward dynamo's recompile limit of the forward)."""
    from kvcompile.executor.executor import BUCKETS
    prompt = prompt_of(models["llama"], 200, 10)
    for m in range(3):
        cfg = replace(TINY, context_length=CTX)
        model = LlamaModel.from_weights(cfg, tiny_weights(cfg, torch.Generator().manual_seed(m)))
        runs = []
        for capture in (False, True):
            ex = executor(model, capture=capture)
            out = [ex.step(prompt[:128], 0)]
            pos = 128
            for w in (1, 2, 3, 5, 8, 1):
                out.append(ex.verify(prompt[pos:pos + w], pos)[0])
                pos += w
            runs.append(out)
        assert all(torch.equal(a, b) for a, b in zip(*runs)), m
        widths = sorted(rows for (kind, rows) in ex.programs)
        assert set(widths) == set(BUCKETS) | {128}, widths


def test_bad_steps_are_clear_errors(models):
    from unittest import mock

    from kvcompile.errors import ContextLengthError, ProgramError
    from kvcompile.executor import compile as C
    from kvcompile.passes import PassError
    model = models["llama"]
    ex = executor(model, capture=True)
    with pytest.raises(ProgramError, match="at least one token"):
        ex.step([], 0)
    with pytest.raises(ContextLengthError, match="ctx-size"):
        ex.step([1, 2, 3, 4], CTX - 2)
    ex.step([1, 2], 0)                                 # the executor keeps serving
    # past dynamo's recompile limit the traced step would fall back to eager: an error (a
    # traced forward raises dynamo's limit to its own, RECOMPILE_LIMIT, at least)
    torch._dynamo.reset()
    ex = executor(model, capture=True)
    with torch._dynamo.config.patch(recompile_limit=1), \
            mock.patch.object(C, "RECOMPILE_LIMIT", 1):
        ex.step([1], 0)
        with pytest.raises(ProgramError, match="recompile limit"):
            ex.verify([1, 2], 1)
    # an op with no lowering: the pass pipeline names it when the step is traced
    cfg = replace(TINY, context_length=CTX)
    odd = OddLlama.from_weights(cfg, tiny_weights(cfg, torch.Generator().manual_seed(2)))
    torch._dynamo.reset()
    ex = executor(odd, capture=True, strict=True)
    with pytest.raises(PassError, match="kvcompile_executor_test.unlowered .*no kvcompile "
                                        "lowering"):
        ex.step([1], 0)
