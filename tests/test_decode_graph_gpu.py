"""Device: decode as one CUDA graph per step (kvcompile/phase/decode_graph.py) gives bitwise
the eager decode's logits and tokens -- llama and hybrid qwen35 models, KV streamed through a
tiny arena (every layer's pages pass the ring, the policy repartitions) or all resident,
across page boundaries."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from kvcompile.errors import ContextLengthError, PhaseError
from kvcompile.phase.decode_graph import DecodeGraph
from kvcompile.runner import make_sequence_cache
from kvcompile.runtime import forward, min_arena_bytes
from kvcompile.runtime.arena import MIB
from test_decode_graph import tiny_arena

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SEED = int.from_bytes(os.urandom(4), "little")
DEV = "cuda"


@pytest.fixture(scope="module")
def llama():
    from kvcompile.config import ModelConfig
    from kvcompile.models.llama import LlamaModel
    cfg = ModelConfig(arch="llama", n_layers=6, hidden=256, ffn=512, n_heads=4, n_kv_heads=2,
                      head_dim=64, vocab_size=4096, context_length=4096)
    torch.manual_seed(SEED)
    with torch.device(DEV):
        return LlamaModel(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from tiny_hybrid import tiny_hybrid
    return tiny_hybrid(tmp_path_factory.mktemp("hybrid"), SEED % 1000, device=DEV)


def make_cache(model, max_tokens, kv, streamed):
    mib = tiny_arena(model, *kv, ctx=max_tokens) if streamed else 0
    return make_sequence_cache(model, model.config, max_tokens, *kv, mib, torch.device(DEV))


def trunk(model):
    return model.layer_plan.trunk_kv_layers


@torch.inference_mode()
def run(model, cache, prompt, n_decode, program=None):
    """Prefill eagerly, then greedy decode eagerly or through the program."""
    layers = trunk(model)
    pos = torch.arange(len(prompt), device=DEV)
    rows = [forward(model, cache, prompt, pos, last_only=True, layers=layers, start=0).cpu()]
    ids = [int(rows[-1][-1].argmax())]
    for p in range(len(prompt), len(prompt) + n_decode):
        if program is None:
            out = forward(model, cache, torch.tensor([ids[-1]], device=DEV),
                          torch.tensor([p], device=DEV), last_only=True, layers=layers,
                          start=p)
        else:
            out = program.step([ids[-1]], p)
        rows.append(out.cpu())
        ids.append(int(rows[-1][-1].argmax()))
    return ids, torch.cat(rows)


@pytest.mark.parametrize("mode", ["traced", "filled-ahead", "tiny-arena", "resident"])
@pytest.mark.parametrize("kv", [("f16", "f16"), ("q8_0", "q4_0")], ids=lambda k: "/".join(k))
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_decode_graph_is_bitwise_eager_decode(request, arch, kv, mode):
    """traced: the streamed step runs the forward traced through passes.streamed_pipeline
    (ring ops lowered), as the Engine's; filled-ahead: the same, and each replay fills the
    next step's first layers, which that step's program skips (fill_ahead);
    tiny-arena: the eager model in the graph."""
    model = request.getfixturevalue("llama" if arch == "llama" else "hybrid")
    streamed = mode != "resident"
    n_prompt, n_decode = 500, 40          # decode crosses the page boundary at 512
    g = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=g).to(DEV)
    ref_cache = make_cache(model, 600, kv, streamed)
    ids_ref, ref = run(model, ref_cache, prompt, n_decode)
    cache = make_cache(model, 600, kv, streamed)
    if streamed:
        cache.fill_ahead = mode == "filled-ahead"
    program = DecodeGraph(model, cache, layers=trunk(model),
                          compile=mode in ("traced", "filled-ahead"))
    ids, got = run(model, cache, prompt, n_decode, program)
    diff = (got - ref).abs().max().item()
    print(f"{arch} {'/'.join(kv)} {'streamed' if streamed else 'resident'}: seed {SEED}, "
          f"{program.stats()}, max |dlogit| {diff:g}")
    s = program.stats()
    assert s["eager_steps"] + s["replays"] == n_decode and s["replays"] >= n_decode - 3, s
    # resident: one layout; streamed: one per page the decode reaches (and per split)
    assert s["captures"] == 1 if not streamed else s["captures"] >= 2, s
    assert ids == ids_ref and torch.equal(got, ref), SEED
    assert s["compiled"] == (mode in ("traced", "filled-ahead")) and "trace_error" not in s, s
    assert any(lay.ahead for lay in program.programs if lay != "resident") == (
        mode == "filled-ahead"), list(program.programs)
    if streamed:
        assert cache.stats()["streamed_fraction"] > 0.5
        cache.close()
        ref_cache.close()


def test_decode_graph_rejects_bad_steps(llama):
    cache = make_cache(llama, 600, ("f16", "f16"), streamed=False)
    program = DecodeGraph(llama, cache)
    with pytest.raises(PhaseError, match="runs 1 rows, got 2"):
        program.step([1, 2], 5)
    with pytest.raises(ContextLengthError, match="outside the KV cache"):
        program.step([1], 10 ** 6)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_engine_cuda_graphs_with_a_streamed_cache(tmp_path, arch):
    """--cuda-graphs with --kv-stream-arena-mib: the same tokens as the all-resident eager
    engine, decode steps replayed, over three requests: the programs survive a new sequence."""
    pytest.importorskip("gguf")
    from kvcompile.engine import Engine
    from kvcompile.make_model import make_model
    path = tmp_path / f"{arch}.gguf"
    make_model(arch, "tiny", path, weight_type="f32", seed=SEED % 1000)
    ref = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 cuda_graphs=False)
    mib = min_arena_bytes(ref.config, 1024) * 1.05 / MIB     # ~everything streamed
    eng = Engine(str(path), ctx_size=1024, device=DEV, dtype="f32", progress=False,
                 kv_stream_arena_mib=mib, cuda_graphs=True)
    assert eng.decode_graph is not None and eng.phases is None
    assert eng.cache.backend.name == "cuda"
    first = ref.tokenizer.encode("the quick brown fox " * 30)
    other = torch.randint(0, ref.config.vocab_size, (len(first),),
                          generator=torch.Generator().manual_seed(SEED)).tolist()
    shorter = other[:len(first) // 3]
    results = []
    for prompt in (first, other, shorter):
        a = ref.generate(prompt, max_tokens=20, temperature=0)
        b = eng.generate(prompt, max_tokens=20, temperature=0)
        assert a.token_ids == b.token_ids, (SEED, arch)
        results.append(dict(b.phases, tokens=b.completion_tokens))
    # the programs captured in the first request serve a second one over the same pages
    # (other tokens); a request over pages not seen yet captures only their layouts
    assert results[1]["captures"] == 0 and results[1]["total_captures"] == results[0]["captures"]
    assert results[0]["captures"] >= 1 and results[2]["captures"] <= 2
    assert all(p["replays"] >= p["tokens"] - 4 for p in results[1:]), results
    assert all("fallback" not in p for p in results)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_retrace_is_not_captured(request, arch):
    """Another traced program of the same model class (a second Engine) drops this one's
    trace (phase/compiled_forward.py resets the code). The next capture must not trace (a
    capture forbids what dynamo does): it gives way, that step runs eagerly and retraces,
    the step after captures; the tokens stay the eager decode's."""
    model = request.getfixturevalue("llama" if arch == "llama" else "hybrid")
    kv, n_prompt, n_decode = ("q8_0", "q4_0"), 500, 24      # crosses the page at 512
    g = torch.Generator().manual_seed(SEED + 1)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=g).to(DEV)
    ids_ref, ref = run(model, make_cache(model, 600, kv, True), prompt, n_decode)
    cache = make_cache(model, 600, kv, True)
    program = DecodeGraph(model, cache, layers=trunk(model), compile=True, strict=False)
    other = make_cache(model, 600, kv, True)
    hook = {}

    def step(tokens, start):
        if start == 505:                  # before the layout of page 512 is captured
            hook["other"] = DecodeGraph(model, other, layers=trunk(model), compile=True)
        return program.step(tokens, start)

    ids, got = run(model, cache, prompt, n_decode, SimpleNamespace(step=step))
    s = program.stats()
    print(arch, SEED, s)
    assert ids == ids_ref and torch.equal(got, ref), SEED
    assert s["retraces"] == 1 and s["compiled"] and "fallback" not in s, s
    assert s["replays"] >= n_decode - 4, s
