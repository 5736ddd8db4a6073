"""kvcompile.passes on tiny hand-built FX graphs (CPU): the pipeline (order, disable by
name or env, errors), place_ring_ops (ordering, prefetch distance, tokens, DCE),
select_attention_kernel, checkpoint_hook, check_lowerable; and end to end, the tiny llama
compiled with a backend that runs the default pipeline equals eager bitwise."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

import kvcompile.passes as P
from kvcompile.ops import debug
from kvcompile.errors import KvcompileError
from kvcompile.ops import kv_format as F
from kvcompile.passes import PassError, PassPipeline, PlaceRingOps, default_pipeline
from kvcompile.passes.pipeline import op_name

H, HKV, D, PAGE, PAGES = 2, 1, 32, 8, 4
ATT = torch.ops.kvcompile.span_attention.default
KVW = torch.ops.kvcompile.kv_write.default
ACQ = torch.ops.kvcompile.ring_acquire.default
REL = torch.ops.kvcompile.ring_release.default


def attention_chain(n_layers: int, rows: int = 1, layer_meta: list[int] | None = None,
                    with_writes: bool = False, write_table: bool = False):
    """x -> [kv_write ->] span_attention -> x * 2 per layer, built with fx.Graph directly;
    write_table: the writes map q_pos through the layer's page table, as the models' do
    (else they take physical slots). Returns (gm, example inputs)."""
    g = fx.Graph()
    x = g.placeholder("x")
    q_pos = g.placeholder("q_pos")
    slots = g.placeholder("slots")
    inputs = [torch.randn(rows, H, D), torch.arange(rows, dtype=torch.int32) + 3,
              torch.arange(rows, dtype=torch.int64) + 3]
    nbytes = F.page_bytes(F.F32, PAGE, HKV, D)
    gen = torch.Generator().manual_seed(0)
    layer_inputs = []
    for i in range(n_layers):          # placeholders first, as dynamo emits them
        layer_inputs.append((g.placeholder(f"k_pool_{i}"), g.placeholder(f"v_pool_{i}"),
                             g.placeholder(f"page_table_{i}")))
        inputs += [torch.randn(PAGES, nbytes // 4, generator=gen).view(torch.uint8),
                   torch.randn(PAGES, nbytes // 4, generator=gen).view(torch.uint8),
                   torch.randperm(PAGES, generator=gen).to(torch.int32)]
    for i, (kp, vp, pt) in enumerate(layer_inputs):
        if with_writes:
            kv = g.call_function(torch.narrow, (x, 1, 0, HKV))
            w = g.call_function(KVW, (kp, vp, kv, kv, q_pos, 0, 0, PAGE, pt) if write_table
                                else (kp, vp, kv, kv, slots, 0, 0, PAGE))
            if layer_meta:
                w.meta["kvcompile_layer"] = layer_meta[i]
        a = g.call_function(ATT, (x, kp, vp, pt, q_pos, 0, 0, PAGE, D ** -0.5))
        if layer_meta:
            a.meta["kvcompile_layer"] = layer_meta[i]
        x = g.call_function(torch.mul, (a, 2.0))
    g.output(x)
    return fx.GraphModule(torch.nn.Module(), g), inputs


def ring_sequence(gm):
    """[(kind, layer)] of ring ops and attentions in graph order."""
    out = []
    for n in gm.graph.nodes:
        name = op_name(n.target) if n.op == "call_function" else None
        if name == "kvcompile.ring_acquire":
            out.append(("acquire", n.args[2]))
        elif name == "kvcompile.ring_release":
            out.append(("release", n.args[2]))
        elif name == "kvcompile.span_attention":   # the packet in dynamo graphs
            out.append(("attention", n.meta.get("kvcompile_layer", n.args[3].meta.get(
                "kvcompile_layer"))))
    return out


# ---------------------------------------------------------------- pipeline

def _tag(name):
    def p(gm, example_inputs):
        gm.meta.setdefault("order", []).append(name)
        return gm
    p.name = name
    return p


def test_pipeline_runs_in_order_and_disables_by_name(monkeypatch):
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    pipe = PassPipeline([_tag("a"), _tag("b"), _tag("c")])
    gm, inputs = attention_chain(1)
    gm = pipe.run(gm, inputs)
    assert gm.meta["order"] == ["a", "b", "c"] and gm.meta["kvcompile_passes"] == ["a", "b", "c"]
    gm, _ = attention_chain(1)
    gm = pipe.run(gm, inputs, disable={"b"})
    assert gm.meta["order"] == ["a", "c"]
    gm, _ = attention_chain(1)
    gm = pipe.run(gm, inputs, disable="b")               # one name as a string
    assert gm.meta["order"] == ["a", "c"]
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset({"a", "c"}))
    gm, _ = attention_chain(1)
    gm = pipe.run(gm, inputs)
    assert gm.meta["order"] == ["b"] and gm.meta["kvcompile_passes"] == ["b"]


def test_pipeline_errors(monkeypatch):
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    pipe = PassPipeline([_tag("a"), _tag("b")])
    gm, inputs = attention_chain(1)
    with pytest.raises(KvcompileError, match=r"unknown pass.*'nope'.*\['a', 'b'\]"):
        pipe.run(gm, inputs, disable={"nope"})
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset({"place_ring_opz"}))
    with pytest.raises(PassError, match="place_ring_opz"):
        default_pipeline().run(gm, inputs)
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    with pytest.raises(PassError, match="unique"):
        PassPipeline([_tag("a"), _tag("a")])

    def bad(gm, example_inputs):
        return None
    with pytest.raises(PassError, match="'bad' returned NoneType"):
        PassPipeline([bad]).run(gm, inputs)
    with pytest.raises(PassError, match="distance"):
        PlaceRingOps(-1)
    with pytest.raises(PassError, match="layer indices"):
        default_pipeline(streamed="ab")


# ---------------------------------------------------------------- place_ring_ops

@pytest.mark.parametrize("distance", [0, 1, 2, 5])
def test_ring_ops_ordering_and_prefetch_distance(distance):
    n = 4
    gm, inputs = attention_chain(n)
    want = gm(*inputs)
    gm = PlaceRingOps(distance)(gm, inputs)
    seq = ring_sequence(gm)
    print(distance, seq)
    # expected: before attention k, the acquires of layers whose anchor is k
    expected = []
    for k in range(n):
        expected += [("acquire", j) for j in range(n) if max(0, j - distance) == k]
        expected += [("attention", k), ("release", k)]
    assert seq == expected
    # every acquire is `distance` attention ops ahead (or as early as the graph allows)
    attn_pos = [i for i, s in enumerate(seq) if s[0] == "attention"]
    for j in range(n):
        acq = seq.index(("acquire", j))
        ahead = sum(1 for p in attn_pos if acq < p < attn_pos[j])
        assert ahead == min(distance, j)

    # tokens: one chain through every ring op, in graph order, starting at a fresh zero token
    ring = [nd for nd in gm.graph.nodes if nd.target in (ACQ, REL)]
    first = ring[0].args[0]
    assert first.target is torch.zeros and first.kwargs["dtype"] == torch.int64
    for prev, nxt in zip(ring, ring[1:]):
        tok = prev if prev.target is REL else next(u for u in prev.users if u.args[1] == 0)
        assert nxt.args[0] is tok
    # each attention reads the page table returned by its own acquire; release reads the output
    for nd in gm.graph.nodes:
        if nd.target is ATT:
            table = nd.args[3]
            assert table.target is operator.getitem and table.args[1] == 1
            assert table.args[0].target is ACQ and table.args[0].args[1].name.startswith("page_table_")
            assert any(u.target is REL for u in nd.users)
    # DCE keeps the ring ops (their final token is not an output) and the result is unchanged
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert [s for s in ring_sequence(gm)] == expected
    assert torch.equal(gm(*inputs), want)


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_ring_ops_rewire_the_layers_writes_through_its_table(distance):
    """A kv_write that maps its rows through the layer's page table reads the acquired table
    too, and the acquire comes before it (else new rows would land where the attention no
    longer reads); writes with physical slots and other layers' tables are left alone."""
    n = 3
    gm, inputs = attention_chain(n, layer_meta=[0, 1, 2], with_writes=True, write_table=True)
    want = gm(*[t.clone() for t in inputs])
    gm = PlaceRingOps(distance, streamed={0, 2})(gm, inputs)
    pos = {nd: i for i, nd in enumerate(gm.graph.nodes)}
    acq = {nd.args[2]: nd for nd in gm.graph.nodes if nd.target is ACQ}
    assert sorted(acq) == [0, 2]
    for w in (nd for nd in gm.graph.nodes if nd.target is KVW):
        layer, table = w.meta["kvcompile_layer"], w.args[8]
        if layer in acq:
            assert table.target is operator.getitem and table.args == (acq[layer], 1)
            assert pos[acq[layer]] < pos[w]
        else:
            assert table.op == "placeholder" and table.name == f"page_table_{layer}"
    for a in (nd for nd in gm.graph.nodes if nd.target is ATT):
        layer = a.meta["kvcompile_layer"]
        assert (a.args[3].target is operator.getitem) == (layer in acq)
    out = gm(*[t.clone() for t in inputs])
    assert torch.equal(out, want)
    # writes with physical slots (no table argument) keep their arguments
    gm, inputs = attention_chain(2, layer_meta=[0, 1], with_writes=True)
    before = [w.args for w in gm.graph.nodes if w.target is KVW]
    gm = PlaceRingOps(distance)(gm, inputs)
    assert [w.args for w in gm.graph.nodes if w.target is KVW] == before


def test_ring_ops_only_for_streamed_layers_and_layer_ids_from_meta():
    gm, inputs = attention_chain(3, layer_meta=[3, 7, 11])    # hybrid: attention every 4th
    gm = PlaceRingOps(1, streamed={7, 11})(gm, inputs)
    seq = ring_sequence(gm)
    print(seq)
    # distance counts every attention op (a resident layer's compute overlaps copies too)
    assert seq == [("acquire", 7), ("attention", 3), ("acquire", 11), ("attention", 7),
                   ("release", 7), ("attention", 11), ("release", 11)]
    acq = [nd for nd in gm.graph.nodes if nd.target is ACQ]
    assert all(nd.meta["kvcompile_prefetch_distance"] == 1 for nd in acq)
    with pytest.raises(PassError, match="once"):
        PlaceRingOps(1)(gm, inputs)


def test_no_streamed_layer_leaves_graph_alone():
    gm, inputs = attention_chain(2)
    before = P.call_targets(gm)
    gm = PlaceRingOps(1, streamed=())(gm, inputs)
    assert P.call_targets(gm) == before


def test_ring_op_reference_is_an_ordering_token():
    tok = torch.zeros(1, dtype=torch.int64)
    table = torch.tensor([2, 0, 1], dtype=torch.int32)
    t1, placed = ACQ(tok, table, 0, 1)
    assert torch.equal(placed, table) and placed.data_ptr() != table.data_ptr()
    t2 = REL(t1, torch.zeros(3), 0)
    assert t1.item() == 1 and t2.item() == 2 and tok.item() == 0
    g = fx.Graph()           # unused results: DCE still keeps both ops (side-effectful)
    t, pt = g.placeholder("t"), g.placeholder("pt")
    a = g.call_function(ACQ, (t, pt, 0, 1))
    g.call_function(REL, (t, pt, 0))
    g.output(None)
    assert not g.eliminate_dead_code()
    assert a.is_impure()


# ---------------------------------------------------------------- select_attention_kernel

@pytest.mark.parametrize("rows,kernel", [(1, "decode"), (8, "decode"), (9, "prefill"), (17, "prefill")])
def test_select_attention_kernel_from_example_inputs(rows, kernel):
    gm, inputs = attention_chain(2, rows=rows)        # hand-built: no metadata, fake-propagated
    gm = P.select_attention_kernel(gm, inputs)
    attns = [nd for nd in gm.graph.nodes if nd.target is ATT]
    assert [nd.meta["kvcompile_kernel"] for nd in attns] == [kernel, kernel]
    assert [nd.meta["kvcompile_rows"] for nd in attns] == [rows, rows]
    assert gm.meta["kvcompile_phase"] == kernel
    assert torch.equal(gm(*inputs), attention_chain(2, rows=rows)[0](*inputs))


def test_select_attention_kernel_symbolic_rows_stay_by_shape():
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    gm, inputs = attention_chain(1, rows=3)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC,
                                                  DimDynamic.STATIC])
    x = next(iter(gm.graph.nodes))
    x.meta["val"] = mode.from_tensor(inputs[0], source=ConstantSource("q"), symbolic_context=ctx)
    gm = P.select_attention_kernel(gm, inputs)
    attn = next(nd for nd in gm.graph.nodes if nd.target is ATT)
    assert attn.meta["kvcompile_kernel"] == "by_shape"
    assert gm.meta["kvcompile_phase"] == "by_shape"


# ---------------------------------------------------------------- checkpoint_hook

def test_checkpoint_hook_records_sites():
    gm, inputs = attention_chain(2, layer_meta=[0, 1], with_writes=True)
    # a recurrent-state style in-place update of a graph input
    g = gm.graph
    state = g.placeholder("state")
    out = next(nd for nd in g.nodes if nd.op == "output")
    with g.inserting_before(out):
        g.call_method("copy_", (state, out.args[0]))
    gm.recompile()
    gm = P.checkpoint_hook(gm, inputs)
    sites = gm.meta["kvcompile_checkpoint_sites"]
    print(sites)
    assert [(kind, layer) for _, kind, layer in sites] == [("kv_suffix", 0), ("kv_suffix", 1),
                                                           ("state_snapshot", None)]
    writes = [nd for nd in gm.graph.nodes if nd.target is KVW]
    assert [nd.meta["kvcompile_checkpoint"]["layer"] for nd in writes] == [0, 1]
    assert writes[0].meta["kvcompile_checkpoint"]["slots"] == "slots"
    copy = next(nd for nd in gm.graph.nodes if nd.target == "copy_")
    assert copy.meta["kvcompile_checkpoint"] == {"kind": "state_snapshot", "state": "state"}
    # nothing inserted yet: the graph's calls are unchanged
    assert P.call_targets(gm).count("kvcompile.kv_write") == 2
    assert not any("checkpoint" in t for t in P.call_targets(gm))


def test_checkpoint_hook_records_row_state_captures_and_they_are_lowerable():
    """A verify forward of a hybrid model calls checkpoint_capture after each GDN row: the
    hook records those sites and check_lowerable knows the op."""
    g = fx.Graph()
    conv_rows, ssm_rows = g.placeholder("conv_rows"), g.placeholder("ssm_rows")
    conv, ssm = g.placeholder("conv"), g.placeholder("ssm")
    cap = torch.ops.kvcompile.checkpoint_capture.default
    for row in range(3):
        g.call_function(cap, (conv_rows, ssm_rows, conv, ssm, row))
    g.output(None)
    gm = P.check_lowerable(P.checkpoint_hook(fx.GraphModule(torch.nn.Module(), g), []), [])
    assert [kind for _, kind, _ in gm.meta["kvcompile_checkpoint_sites"]] == ["row_states"] * 3
    # and the op is what a rollback reads back: row r of the buffers holds the state given
    rows = (torch.zeros(3, 2, 5), torch.zeros(3, 2, 4, 4))
    states = [(torch.randn(2, 5), torch.randn(2, 4, 4)) for _ in range(3)]
    for r, (c, m) in enumerate(states):
        cap(*rows, c, m, r)
    assert all(torch.equal(rows[0][r], c) and torch.equal(rows[1][r], m)
               for r, (c, m) in enumerate(states))
    with pytest.raises(Exception, match="outside the 3 rows"):
        cap(*rows, *states[0], 3)


def test_checkpoint_hook_rejects_a_pool_made_inside_the_graph():
    g = fx.Graph()
    rows, slots = g.placeholder("rows"), g.placeholder("slots")
    pool = g.call_function(torch.zeros, (PAGES, F.page_bytes(F.F32, PAGE, HKV, D)),
                           {"dtype": torch.uint8})
    g.call_function(KVW, (pool, pool, rows, rows, slots, 0, 0, PAGE))
    g.output(None)
    with pytest.raises(PassError, match="k_pool that is not a graph input"):
        P.checkpoint_hook(fx.GraphModule(torch.nn.Module(), g), [])


# ---------------------------------------------------------------- check_lowerable

@torch.library.custom_op("kvcompile::test_unlowered", mutates_args=())
def _unlowered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_unlowered.register_fake(lambda x: torch.empty_like(x))


@torch.library.custom_op("kvcompile_test::foreign", mutates_args=())
def _foreign(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


_foreign.register_fake(lambda x: torch.empty_like(x))


@pytest.mark.parametrize("op,name", [(torch.ops.kvcompile.test_unlowered, "kvcompile.test_unlowered"),
                                     (torch.ops.kvcompile_test.foreign.default, "kvcompile_test.foreign")])
def test_check_lowerable_names_the_op_without_lowering(op, name, monkeypatch):
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())

    def graph():
        gm, inputs = attention_chain(2)
        out = next(nd for nd in gm.graph.nodes if nd.op == "output")
        with gm.graph.inserting_before(out):
            y = gm.graph.call_function(op, (out.args[0],))
        out.args = (y,)
        gm.recompile()
        return gm, inputs

    with pytest.raises(KvcompileError, match=rf"calls {name} .*no kvcompile lowering"):
        default_pipeline().run(*graph())
    # disabled by name, the same graph goes through (for debugging)
    gm2 = default_pipeline().run(*graph(), disable={"check_lowerable"})
    assert "check_lowerable" not in gm2.meta["kvcompile_passes"]


def test_default_pipeline_on_a_clean_graph(monkeypatch):
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    gm, inputs = attention_chain(3, rows=1, with_writes=True)
    ref_inputs = [t.clone() for t in inputs]
    want = attention_chain(3, rows=1, with_writes=True)[0](*ref_inputs)
    gm = default_pipeline(distance=2).run(gm, inputs)
    assert gm.meta["kvcompile_passes"] == default_pipeline().names
    assert gm.meta["kvcompile_phase"] == "decode"
    assert torch.equal(gm(*inputs), want)
    assert all(torch.equal(a, b) for a, b in zip(inputs, ref_inputs))   # same pool bytes


# ---------------------------------------------------------------- end to end

def prefill_then_decode(fn, config, prompt):
    """fn's logits over a 12-token prompt: 9 prefilled, then 3 decode steps, on a fresh
    16-position-page cache; and the cache."""
    from kvcompile.kv.store import KvStore
    cache = KvStore(config, 64, page_size=16)
    with torch.inference_mode():
        rows = [fn(prompt[:9], torch.arange(9), cache)]
        rows += [fn(prompt[i:i + 1], torch.tensor([i]), cache) for i in range(9, 12)]
    return torch.cat(rows), cache


def compiled_through_pipeline(model, distance: int = 1):
    """torch.compile(model) with the default pass pipeline as its backend: (the compiled
    model, the list its graphs are appended to as they compile, the pipeline)."""
    graphs, pipeline = [], default_pipeline(distance=distance)

    def backend(gm, example_inputs):
        gm = pipeline.run(gm, example_inputs)
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, fullgraph=True, backend=backend), graphs, pipeline


def test_tiny_llama_compiled_through_the_pipeline_equals_eager(monkeypatch):
    from test_kv_cache import TINY, tiny_weights
    from kvcompile.models.llama import LlamaModel

    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    g = torch.Generator().manual_seed(1234)
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, g))
    prompt = torch.randint(0, TINY.vocab_size, (12,), generator=g)
    compiled, graphs, pipeline = compiled_through_pipeline(model)

    eager, eager_cache = prefill_then_decode(model, TINY, prompt)
    ours, our_cache = prefill_then_decode(compiled, TINY, prompt)
    print("graphs", len(graphs), [gm.meta["kvcompile_phase"] for gm in graphs],
          [P.call_targets(gm).count("kvcompile.ring_acquire") for gm in graphs])
    assert torch.equal(ours, eager)
    for i in range(TINY.n_layers):
        assert torch.equal(our_cache.layer(i).k_pool, eager_cache.layer(i).k_pool)
    assert len(graphs) == 2
    assert sorted(gm.meta["kvcompile_phase"] for gm in graphs) == ["decode", "prefill"]
    for gm in graphs:
        targets = P.call_targets(gm)
        assert targets.count("kvcompile.ring_acquire") == TINY.n_layers
        assert targets.count("kvcompile.ring_release") == TINY.n_layers
        assert gm.meta["kvcompile_passes"] == pipeline.names
        # each layer's kv_write maps its rows through the table its acquire returned
        writes = [nd for nd in gm.graph.nodes if P.graph_util.is_op(nd, "kv_write")]
        assert len(writes) == TINY.n_layers
        for w in writes:
            table = P.graph_util.arg(w, 8, "page_table")
            assert table.target is operator.getitem and table.args[0].target is ACQ
        seq = ring_sequence(gm)
        assert [s[0] for s in seq] == ["acquire", "acquire", "attention", "release",
                                       "attention", "release"]
        assert [s[1] for s in seq if s[0] != "attention"] == [0, 1, 0, 1]
        assert [l for _, _, l in gm.meta["kvcompile_checkpoint_sites"]] == [0, 1]


def test_ring_ops_survive_aot_and_inductor(monkeypatch):
    """The CUDA path hands the pipeline's graph to inductor: after functionalization and
    AOT's dead code elimination the ring ops are still there, in order, around the attention
    (whose CPU body is the reference op), and the outputs equal eager to fp32 rounding."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from test_kv_cache import TINY, tiny_weights
    from kvcompile.kv.store import KvStore
    from kvcompile.models.llama import LlamaModel

    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, torch.Generator().manual_seed(7)))
    pipeline, post_grad = default_pipeline(distance=1), []

    def inner(gm, example_inputs, **kw):
        post_grad.append([op_name(n.target) for n in gm.graph.nodes
                          if n.op == "call_function" and ("kvcompile.ring" in op_name(n.target)
                                                          or "span_attention" in op_name(n.target))])
        return compile_fx_inner(gm, example_inputs, **kw)

    def backend(gm, example_inputs):
        return compile_fx(pipeline.run(gm, example_inputs), example_inputs, inner_compile=inner)

    import torch._functorch.config as aot_config
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    tokens, positions = torch.arange(5), torch.arange(5)
    with torch.inference_mode(), inductor_config.patch(fx_graph_cache=False), \
            aot_config.patch(enable_autograd_cache=False):          # inner_compile must run
        ours = compiled(tokens, positions, KvStore(TINY, 64, page_size=16))
    with torch.inference_mode():
        eager = model(tokens, positions, KvStore(TINY, 64, page_size=16))
    print(post_grad)
    assert post_grad == [["kvcompile.ring_acquire", "kvcompile.ring_acquire",
                          "kvcompile.span_attention_reference", "kvcompile.ring_release",
                          "kvcompile.span_attention_reference", "kvcompile.ring_release"]]
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)


def test_compiled_model_with_an_unlowered_op_fails_clearly(monkeypatch):
    """Through torch.compile the pass's error reaches the caller unwrapped."""
    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset())

    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.ops.kvcompile.test_unlowered(x * 2)

    torch._dynamo.reset()
    run = P.compile_model(Odd(), default_pipeline())
    with pytest.raises(PassError, match=r"calls kvcompile.test_unlowered .*no kvcompile lowering"):
        run(torch.ones(3))
    torch._dynamo.reset()
    ok = P.compile_model(Odd(), default_pipeline(), disable={"check_lowerable"})
    assert torch.equal(ok(torch.ones(3)), torch.full((3,), 2.0))


def test_dynamic_shapes_and_env_disable_under_compile(monkeypatch):
    """dynamic=True: one graph serves prefill and decode, so the kernel stays by_shape;
    KVCOMPILE_DISABLE_PASSES=place_ring_ops leaves the ring ops out; outputs equal eager."""
    from test_kv_cache import TINY, tiny_weights
    from kvcompile.kv.store import KvStore
    from kvcompile.models.llama import LlamaModel

    monkeypatch.setattr(debug, "DISABLE_PASSES", frozenset({"place_ring_ops"}))
    model = LlamaModel.from_weights(TINY, tiny_weights(TINY, torch.Generator().manual_seed(3)))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm
    record.name = "record"
    pipeline = PassPipeline([*default_pipeline().passes, record])
    torch._dynamo.reset()
    run = P.compile_model(model, pipeline, dynamic=True)
    prompt = torch.randint(0, TINY.vocab_size, (10,), generator=torch.Generator().manual_seed(4))

    def generate(fn):
        cache = KvStore(TINY, 64, page_size=16)
        with torch.inference_mode():
            rows = [fn(prompt[:6], torch.arange(6), cache), fn(prompt[6:9], torch.arange(6, 9), cache)]
            rows += [fn(prompt[9:], torch.tensor([9]), cache)]
        return torch.cat(rows)

    assert torch.equal(generate(run), generate(model))
    print("graphs", len(graphs), [gm.meta.get("kvcompile_phase") for gm in graphs])
    assert graphs and all(gm.meta["kvcompile_phase"] in ("by_shape", "decode", "prefill")
                          for gm in graphs)
    assert any(gm.meta["kvcompile_phase"] == "by_shape" for gm in graphs)
    assert all("kvcompile.ring_acquire" not in P.call_targets(gm) for gm in graphs)
