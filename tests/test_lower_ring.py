"""lower_ring_ops (passes/lower_ring.py): a streamed forward's ring ops become the streaming
runtime's page movement.

- On hand-built graphs: each ring_acquire / ring_release calls the runtime in graph order,
  the attention and the layer's write read the table the runtime returns (so the result
  depends on the lowering: not a no-op), dead-code elimination keeps the calls, and bad
  pipelines fail with a PassError.
- End to end on the CPU: the tiny llama traced by torch.compile through
  `streamed_pipeline` over a streaming cache with a tiny arena (nearly every page streams)
  shows the lowered calls in its graph, copies pages from host history on every forward, and
  gives the eager all-resident logits bit for bit.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

import kvcompile.passes as P
from kvcompile.ops import debug
from kvcompile.passes import LowerRingOps, PassError, PlaceRingOps, streamed_pipeline
from kvcompile.passes.lower_ring import acquire_pages, release_pages
from test_passes import ACQ, ATT, KVW, REL, attention_chain

SEED = int.from_bytes(os.urandom(4), "little")


class RecordingRuntime:
    """Stands in for the streaming cache: records the calls, hands out its own tables."""

    def __init__(self, tables: dict[int, torch.Tensor]):
        self.tables, self.calls = tables, []

    def acquire_pages(self, layer: int) -> torch.Tensor:
        self.calls.append(("acquire", layer))
        return self.tables[layer]

    def release_pages(self, layer: int) -> None:
        self.calls.append(("release", layer))


def _lowered(n: int, runtime, write_table: bool = True):
    gm, inputs = attention_chain(n, layer_meta=list(range(n)), with_writes=True,
                                 write_table=write_table)
    gm = PlaceRingOps(0)(gm, inputs)
    return LowerRingOps(runtime)(gm, inputs), inputs


def test_lowered_ops_call_the_runtime_in_order_and_its_tables_are_read():
    n = 3
    gm, inputs = attention_chain(n, layer_meta=list(range(n)), with_writes=True,
                                 write_table=True)
    # the runtime's tables: the graph's input permutations rolled by one (other pages)
    tables = {i: torch.roll(inputs[5 + 3 * i], 1) for i in range(n)}
    swapped = list(inputs)
    for i in range(n):
        swapped[5 + 3 * i] = tables[i]
    want = gm(*[t.clone() for t in swapped])           # the chain reading the runtime's tables
    unlowered = gm(*[t.clone() for t in inputs])       # what the reference ring ops give
    assert not torch.equal(want, unlowered)
    runtime = RecordingRuntime(tables)
    gm, _ = _lowered(n, runtime)
    assert not any(nd.target in (ACQ, REL) for nd in gm.graph.nodes)
    targets = [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    assert targets.count(acquire_pages) == n and targets.count(release_pages) == n
    got = gm(*[t.clone() for t in inputs])
    assert runtime.calls == [(k, i) for i in range(n) for k in ("acquire", "release")]
    assert torch.equal(got, want)
    # every acquire comes before its layer's write and attention, every release after it
    order = {nd: i for i, nd in enumerate(gm.graph.nodes)}
    acq = {nd.args[3]: nd for nd in gm.graph.nodes if nd.target is acquire_pages}
    rel = {nd.args[3]: nd for nd in gm.graph.nodes if nd.target is release_pages}
    for nd in gm.graph.nodes:
        if nd.target in (ATT, KVW):
            layer = nd.meta["kvcompile_layer"]
            assert order[acq[layer]] < order[nd]
            if nd.target is ATT:
                assert order[nd] < order[rel[layer]] and rel[layer].args[2] is nd
    # dead-code elimination keeps the calls (their tokens are not outputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert [nd.target for nd in gm.graph.nodes if nd.op == "call_function"] == targets


def test_lowering_errors():
    runtime = RecordingRuntime({})
    gm, inputs = attention_chain(2, with_writes=True, write_table=True)
    with pytest.raises(PassError, match="no ring ops"):
        LowerRingOps(runtime)(gm, inputs)
    gm = PlaceRingOps(1)(gm, inputs)
    with pytest.raises(PassError, match=r"distance=0"):
        LowerRingOps(runtime)(gm, inputs)
    gone = RecordingRuntime({})
    lower = LowerRingOps(gone)
    del gone                                           # held weakly: a dropped store
    gm, inputs = attention_chain(2, with_writes=True, write_table=True)
    with pytest.raises(PassError, match="is gone"):
        lower(PlaceRingOps(0)(gm, inputs), inputs)


def test_streamed_pipeline_refuses_to_drop_its_ring_passes(monkeypatch):
    pipeline = streamed_pipeline(RecordingRuntime({}))
    assert pipeline.names.index("place_ring_ops") < pipeline.names.index("lower_ring_ops")
    gm, inputs = attention_chain(2, with_writes=True, write_table=True)
    for name in ("place_ring_ops", "lower_ring_ops"):
        with pytest.raises(PassError, match="cannot be disabled"):
            pipeline.run(gm, inputs, disable={name})
        monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset({name}))
        with pytest.raises(PassError, match="cannot be disabled"):
            pipeline.run(gm, inputs)
        monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    with pytest.raises(PassError, match="not in the pipeline"):
        P.PassPipeline([PlaceRingOps(0)], required=("lower_ring_ops",))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
@torch.inference_mode()
def test_compiled_streamed_forward_moves_pages_and_equals_resident(monkeypatch, device):
    """On CUDA the lowered acquires issue the copies on the copy stream with event fences
    (kv/cuda_backend.py): the ring ops are lowered there too, not a no-op."""
    from kvcompile.kv.store import KvStore
    from kvcompile.models.llama import LlamaModel
    from kv_steps import forward
    from test_executor import tiny_arena
    from test_kv_cache import TINY, tiny_weights

    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    ctx, dev = 512, torch.device(device)
    cfg = replace(TINY, context_length=ctx)
    model = LlamaModel.from_weights(cfg, tiny_weights(cfg, torch.Generator().manual_seed(SEED)),
                                    device=device)
    g = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, cfg.vocab_size, (300 + SEED % 40,), generator=g).to(dev)
    resident = KvStore.for_model(model, ctx, "q8_0", "q4_0", 0, device=dev)
    cache = KvStore.for_model(model, ctx, "q8_0", "q4_0", tiny_arena(model, "q8_0", ctx=ctx),
                              device=dev)
    graphs, pipeline = [], streamed_pipeline(cache)

    def backend(gm, example_inputs):
        gm = pipeline.run(gm, example_inputs)
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    for c in (resident, cache):                        # prefill: the eager model
        forward(model, c, prompt, torch.arange(len(prompt), device=dev), last_only=True)
    tok, want, got, moved = prompt[-1:], [], [], []
    for pos in range(len(prompt), len(prompt) + 6):
        positions = torch.tensor([pos], device=dev)
        want.append(forward(model, resident, tok, positions, last_only=True))
        before = cache.streamer.engine.bytes_h2d
        cache.begin_forward(positions, start=pos)
        got.append(compiled(tok, positions, cache, last_only=True))
        cache.end_forward(ahead=False)
        moved.append(cache.streamer.engine.bytes_h2d - before)
        tok = want[-1].argmax(-1)
    if device == "cuda":
        cache.synchronize()
    assert torch.equal(torch.cat(got), torch.cat(want)), SEED
    assert len(graphs) == 1, "one trace serves every decode step"
    targets = [nd.target for nd in graphs[0].graph.nodes if nd.op == "call_function"]
    n = cfg.n_layers
    assert targets.count(acquire_pages) == n and targets.count(release_pages) == n
    # every forward copied pages in from host history, and nearly all of its reads streamed
    assert all(m > 0 for m in moved), moved
    step = cache.telemetry[-1]
    assert step.streamed_reads > step.resident_reads
