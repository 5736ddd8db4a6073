"""ngram-simple speculative decoding through the Engine: at temperature 0 the tokens equal
plain decoding (real SmolLM2, a tiny llama all resident, streamed and with phase programs),
in fewer forwards; bad options and unsupported models fail clearly."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvcompile.engine import Engine
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


def test_options_and_models_that_cannot_speculate(tmp_path, model):
    with pytest.raises(KvcompileError, match="unknown --spec-type"):
        Engine.from_model(model, spec_type="eagle")
    with pytest.raises(UnsupportedModelError, match="MTP layer is not built"):
        Engine.from_model(model, spec_type="draft-mtp")
    with pytest.raises(KvcompileError, match="spec-ngram-size-n"):
        Engine.from_model(model, spec_type="ngram-simple", spec_ngram_size_n=0)
    from kvcompile.make_model import make_model
    path = tmp_path / "qwen35.gguf"
    make_model("qwen35", "tiny", path, weight_type="f32", seed=SEED % 1000)
    with pytest.raises(UnsupportedModelError, match="recurrent state rolled back"):
        Engine(str(path), ctx_size=256, progress=False, spec_type="ngram-simple")


def test_sampled_speculation_runs_and_reports(model):
    """temperature > 0: drafts are kept by the sampled rule (its distribution is tested in
    test_speculative_rules.py); tokens stay in the vocabulary, counts add up."""
    rng = torch.Generator().manual_seed(SEED + 2)
    unit = torch.randint(0, CFG.vocab_size, (17,), generator=rng).tolist()
    e = Engine.from_model(model, ctx_size=1024, progress=False, spec_type="ngram-simple",
                          spec_ngram_size_n=2, spec_ngram_size_m=5)
    r = e.generate(unit * 10, max_tokens=40, temperature=0.7, seed=SEED % 1000)
    s = r.speculative
    assert r.completion_tokens == 40 and all(0 <= t < CFG.vocab_size for t in r.token_ids)
    assert s["forwards"] + 1 + s["accepted"] == r.completion_tokens and s["drafted"] > 0
