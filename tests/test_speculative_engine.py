"""ngram-simple speculative decoding through the Engine: at temperature 0 the tokens equal
plain decoding (real SmolLM2, a tiny llama all resident, streamed and with phase programs),
in fewer forwards; bad options and unsupported models fail clearly."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.errors import KvcompileError, UnsupportedModelError
from kvcompile.models.llama import LlamaModel
from test_kv_cache import TINY, tiny_weights

SEED = int.from_bytes(os.urandom(4), "little")
CFG = replace(TINY, context_length=2048)

STORY = ("The keeper climbed the tower, lit the lamp, and wrote in the log: wind from the "
         "west, sea calm, one ship passing. ")


def test_smollm2_ngram_greedy_equals_plain():
    plain = Engine(None, ctx_size=1024, progress=False)
    spec = Engine(None, ctx_size=1024, progress=False, spec_type="ngram-simple",
                  spec_ngram_size_n=2, spec_ngram_size_m=6)
    prompt = STORY * 4 + "The keeper climbed"
    a = plain.generate(prompt, max_tokens=48, temperature=0)
    b = spec.generate(prompt, max_tokens=48, temperature=0)
    print(b.stats_line(), b.speculative)
    assert a.token_ids == b.token_ids and a.text == b.text
    s = b.speculative
    assert s["drafted"] > 0 and s["accepted"] > 0
    assert s["forwards"] < b.completion_tokens - 1          # fewer forwards than tokens
    assert "speculative:" in b.stats_line()


@pytest.fixture(scope="module")
def model():
    return LlamaModel.from_weights(CFG, tiny_weights(CFG, torch.Generator().manual_seed(SEED)))


@pytest.mark.parametrize("setup", ["resident", "streamed", "programs"])
def test_tiny_ngram_greedy_equals_plain(model, setup):
    """A repetitive prompt of random ids (so drafts exist), n and m drawn per run."""
    rng = torch.Generator().manual_seed(SEED + 1)
    unit = torch.randint(0, CFG.vocab_size, (23,), generator=rng).tolist()
    prompt = unit * 12 + unit[:5]
    opts = dict(ctx_size=1024, ubatch=64, progress=False)
    if setup == "streamed":
        opts["kv_stream_arena_mib"] = 1.3        # of 2 MiB of f32 KV
    if setup == "programs":
        opts["cuda_graphs"] = True               # verify widths <= 8: decode programs
    n, m = 1 + SEED % 3, 2 + SEED % 7
    plain = Engine.from_model(model, **opts)
    spec = Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_n=n,
                             spec_ngram_size_m=m, **opts)
    a = plain.generate(prompt, max_tokens=60, temperature=0)
    b = spec.generate(prompt, max_tokens=60, temperature=0)
    assert a.token_ids == b.token_ids, (SEED, setup, n, m)
    assert b.speculative["forwards"] + 1 + b.speculative["accepted"] == b.completion_tokens
    c = spec.generate(prompt, max_tokens=60, temperature=0)      # a second request
    assert c.token_ids == a.token_ids


def test_options_and_models_that_cannot_speculate(model):
    with pytest.raises(KvcompileError, match="unknown --spec-type"):
        Engine.from_model(model, spec_type="eagle")
    with pytest.raises(UnsupportedModelError, match="no NextN/MTP layer"):
        Engine.from_model(model, spec_type="draft-mtp")
    with pytest.raises(UnsupportedModelError, match="no NextN/MTP layer"):
        Engine.from_model(model, spec_type="ngram-simple,draft-mtp")
    with pytest.raises(KvcompileError, match="spec-ngram-size-n"):
        Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_n=0)
    for depth in (0, 6, 2.5):
        with pytest.raises(KvcompileError, match="spec-draft-n-max"):
            Engine.from_model(model, spec_type="draft-mtp", spec_draft_n_max=depth)
    for p_min in (-0.1, 1.5, "high"):
        with pytest.raises(KvcompileError, match="spec-draft-p-min"):
            Engine.from_model(model, spec_type="draft-mtp", spec_draft_p_min=p_min)
    # the engine keeps serving after each refusal
    e = Engine.from_model(model, ctx_size=128, progress=False)
    assert e.generate([1, 2, 3], max_tokens=3, temperature=0).completion_tokens == 3


def test_sampled_speculation_runs_and_reports(model):
    """temperature > 0: drafts are kept by the sampled rule (its distribution is tested in
    test_speculative_rules.py); tokens stay in the vocabulary, counts add up. The prompt holds
    every token id, so a 1-token key always matches and the first round drafts whatever is
    sampled."""
    rng = torch.Generator().manual_seed(SEED + 2)
    unit = torch.randperm(CFG.vocab_size, generator=rng).tolist()
    e = Engine.from_model(model, ctx_size=1024, progress=False, spec_type="ngram-simple",
                          spec_ngram_size_n=1, spec_ngram_size_m=5)
    r = e.generate(unit * 2, max_tokens=40, temperature=0.7, seed=SEED % 1000)
    s = r.speculative
    assert r.completion_tokens == 40 and all(0 <= t < CFG.vocab_size for t in r.token_ids)
    assert s["forwards"] + 1 + s["accepted"] == r.completion_tokens and s["drafted"] > 0


def _chi2_passes(counts, probs, n) -> bool:
    from test_speculative_rules import _critical
    expected = n * probs
    keep = expected > 5
    chi2 = float(((counts - expected) ** 2 / expected)[keep].sum())
    return chi2 < _critical(int(keep.sum()) - 1)


@pytest.mark.parametrize("rule", ["engine", "wrong"])
def test_engine_acceptance_keeps_the_models_next_token_distribution(model, rule, monkeypatch):
    """At temperature 1 (top-k 0, top-p 1, min-p 0: the plain softmax), the Engine's
    acceptance over the rows of a real verify forward of the tiny model gives a first token
    distributed as the model's own next-token softmax (what decoding without speculation
    samples from), chi-square over 20,000 draws; a wrong rule (resampling from p itself
    after a rejection) fails. Two independent samples, as in test_speculative_rules."""
    import kvcompile.engine.speculative.decode as decode
    from kvcompile.engine.sampling import Sampler, SamplingParams
    from test_speculative_rules import _wrong_rule
    e = Engine.from_model(model, ctx_size=256, progress=False, spec_type="ngram-simple")
    rng = torch.Generator().manual_seed(SEED + 5)
    prompt = torch.randint(0, CFG.vocab_size, (40,), generator=rng).tolist()
    e.executor.begin_request(64)
    with torch.inference_mode():
        e.executor.step(prompt[:-1], 0)
        p0 = torch.softmax(e.executor.step(prompt[-1:], 39, all_rows=True)[-1].float(), -1)
        draft = [int(p0.argmax())]                  # the likeliest token: often kept
        rows = e.forward_rows(prompt[-1:] + draft, 39).float().clone()
    torch.testing.assert_close(torch.softmax(rows[0], -1), p0, rtol=1e-5, atol=1e-6)
    if rule == "wrong":
        monkeypatch.setattr(decode, "accept_sampled",
                            lambda d, probs, g: _wrong_rule(d, probs, g))
    sampler = Sampler(SamplingParams.from_options(temperature=1.0, top_k=0, top_p=1.0,
                                                  min_p=0.0, seed=SEED % 1000))
    n, passes = 20000, []
    for _ in range(2):
        counts = torch.zeros(CFG.vocab_size)
        for _ in range(n):
            counts[decode.accept(draft, rows, sampler, prompt)[0]] += 1
        passes.append(_chi2_passes(counts, p0, n))
    assert any(passes) == (rule == "engine"), (SEED, passes)
