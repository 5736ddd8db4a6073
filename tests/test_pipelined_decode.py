"""Pipelined decoding (engine/tokens.py): each token drawn on the device and fed to
the next step before the host reads it. Greedy tokens against the recompute oracle and
against the one-step-at-a-time loop, in every executor mode, sampled ones against the loop for
a seed; the device draw against the host sampler's distribution; the forward order and what
an early stop leaves behind, on a scripted forward."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.models.llama import LlamaModel
from kvcompile.engine.sampling import Sampler, SamplingParams
from kvcompile.engine.tokens import pipelined_tokens
from kernel_oracle import fresh_seed
from test_runner import CFG, model, recompute_greedy, seed  # noqa: F401  (fixtures)


def test_each_forward_takes_the_device_pick_before_the_token_is_read():
    gen = torch.Generator().manual_seed(fresh_seed())
    table = torch.randn(10, 50, generator=gen)
    calls = []

    def forward(token, start):
        assert isinstance(token, torch.Tensor) and token.shape == (1,)
        calls.append((int(token[0]), start))
        return table[len(calls)]

    step_s: list = []
    pick = Sampler(SamplingParams(temperature=0)).pick
    tokens = pipelined_tokens(forward, table[0], pick, [7, 8, 9], 6, step_s)
    got = [next(tokens) for _ in range(3)]
    assert got == [int(table[i].argmax()) for i in range(3)]
    # the third token's successor was already asked for when the third was read
    assert calls == [(got[0], 3), (got[1], 4), (got[2], 5)]
    tokens.close()                       # a stop: nothing more runs
    assert len(calls) == 3 and len(step_s) == 2
    rest = list(pipelined_tokens(forward, table[0], pick, [7, 8, 9], 6, []))
    assert len(rest) == 6 and len(calls) == 3 + 5    # no forward after the last token
    assert list(pipelined_tokens(forward, table[0], pick, [1], 0, [])) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_device_draw_follows_the_host_samplers_distribution(device):
    """Sampler.pick where the logits are against Sampler.probs (the host's rule after
    temperature, top-k, min-p, top-p): frequencies of 6000 draws within 5 standard errors."""
    seed = fresh_seed()
    logits = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * 2
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=seed)
    want = Sampler(params).probs(logits, [])
    sampler, on = Sampler(params), logits.to(device)
    n = 6000
    counts = torch.bincount(torch.cat([sampler.pick(on).cpu() for _ in range(n)]),
                            minlength=64).double() / n
    err = (want * (1 - want) / n).sqrt()
    assert (counts[want == 0] == 0).all(), seed
    assert ((counts - want).abs() <= 5 * err + 1e-9).all(), (seed, (counts - want).abs().max())


@pytest.mark.parametrize("mode", ["eager", "resident-graphs", "streamed-graphs"])
@torch.inference_mode()
def test_pipelined_tokens_equal_the_oracle_and_the_stepwise_loop(model, seed, mode):
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, CFG.vocab_size, (300,), generator=gen).tolist()
    want = recompute_greedy(model, prompt, 6)
    kw = dict(ctx_size=512, ubatch=64, progress=False, cuda_graphs=mode != "eager")
    if mode == "streamed-graphs":
        kw["kv_stream_arena_mib"] = 0.7     # of 1 MiB of f32 KV: most of it streams
    e = Engine.from_model(model, **kw)
    assert e.pipeline is False             # the CPU's default: one step at a time
    stepwise = e.generate(prompt, max_tokens=6, temperature=0)
    e.pipeline = True
    piped = e.generate(prompt, max_tokens=6, temperature=0)
    assert piped.token_ids == stepwise.token_ids == want, (seed, mode)
    assert len(piped.step_s) == 5 and piped.decode_tok_s > 0
    # sampled: on the CPU the device draw uses the host sampler's generator, so a seed
    # draws the same tokens either way
    e.pipeline = False
    sampled = e.generate(prompt, max_tokens=6, temperature=0.9, top_k=0, min_p=0, seed=seed)
    e.pipeline = True
    assert e.generate(prompt, max_tokens=6, temperature=0.9, top_k=0, min_p=0,
                      seed=seed).token_ids == sampled.token_ids, (seed, mode)
    # a repeat penalty needs the host's sampler: the same request runs step by step
    penalized = e.generate(prompt, max_tokens=6, temperature=0, repeat_penalty=1.5)
    e.pipeline = False
    assert penalized.token_ids == e.generate(prompt, max_tokens=6, temperature=0,
                                             repeat_penalty=1.5).token_ids


@torch.inference_mode()
def test_a_stop_token_ends_a_pipelined_request_and_the_next_one_is_exact(tmp_path, seed):
    """qwen35 from a synthetic file (a tokenizer with an end-of-sequence id, a recurrent
    state): a request stopped by that id leaves one forward computed past it; the next
    request on the same Engine is still the stepwise one's."""
    from kvcompile.io.make_model import make_model
    path = tmp_path / "qwen35.gguf"
    make_model("qwen35", "tiny", path, weight_type="f32", seed=seed % 1000)
    e = Engine(str(path), ctx_size=512, ubatch=64, progress=False, cuda_graphs=True)
    gen = torch.Generator().manual_seed(seed + 2)
    prompt = torch.randint(0, e.model.config.vocab_size, (200,), generator=gen).tolist()
    stepwise = e.generate(prompt, max_tokens=24, temperature=0)
    eos = stepwise.token_ids[len(stepwise.token_ids) // 2] if stepwise.token_ids else None
    e.pipeline = True
    if eos is not None:                  # make a token of this request the stop token
        e.tokenizer.eos_id = eos
    piped = e.generate(prompt, max_tokens=24, temperature=0)
    cut = stepwise.token_ids.index(eos) if eos is not None else len(stepwise.token_ids)
    assert piped.token_ids == stepwise.token_ids[:cut], seed
    assert piped.finish_reason == ("stop" if eos is not None else stepwise.finish_reason)
    other = torch.randint(0, e.model.config.vocab_size, (150,), generator=gen).tolist()
    again = e.generate(other, max_tokens=8, temperature=0)
    e.pipeline = False
    assert again.token_ids == e.generate(other, max_tokens=8, temperature=0).token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_mode", ["resident", "streamed"])
@torch.inference_mode()
def test_cuda_pipelined_tokens_equal_the_stepwise_ones(kv_mode):
    """On the device, where the host really runs ahead: SmolLM2's geometry (random weights),
    16K of q8_0 KV, all resident or through a tiny arena, CUDA graphs; 64 greedy tokens
    pipelined (the CUDA default) equal the stepwise ones (the second request holds the
    prompt: it computes its last chunk again); a sampled request is reproducible for its
    seed."""
    from test_executor import tiny_arena
    from test_executor_gpu import SMOL
    seed, ctx = fresh_seed(), 16384
    cfg = replace(SMOL, context_length=ctx)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaModel(cfg).eval().requires_grad_(False)
    arena = tiny_arena(model, "q8_0", "q8_0", ctx) if kv_mode == "streamed" else 0
    e = Engine.from_model(model, ctx_size=ctx, cache_type_k="q8_0", cache_type_v="q8_0",
                          kv_stream_arena_mib=arena, ubatch=2048, progress=False)
    assert e.pipeline and e.executor.mode == "cuda graphs"
    prompt = torch.randint(0, cfg.vocab_size, (ctx - 200,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    piped = e.generate(prompt, max_tokens=64, temperature=0)
    e.pipeline = False
    stepwise = e.generate(prompt, max_tokens=64, temperature=0)
    assert piped.token_ids == stepwise.token_ids and len(piped.token_ids) == 64, seed
    e.pipeline = True
    sampled = [e.generate(prompt, max_tokens=16, seed=seed).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 16, seed
    print(f"{kv_mode}: seed {seed}, decode {piped.decode_tok_s:.1f} tok/s pipelined, "
          f"{stepwise.decode_tok_s:.1f} stepwise, programs {piped.programs}")
