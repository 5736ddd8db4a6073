"""kvcompile eval: perplexity against a one-forward oracle, KL 0 against itself, streamed KV
against the same KV all resident, the CLI's table and its errors."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from kvcompile.engine.engine import Engine
from kvcompile.errors import KvcompileError
from kvcompile.engine.evaluate import evaluate, reference_options, summary
from kvcompile.kv.store import KvStore
from kvcompile.io.make_model import make_model

SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "tiny.gguf"
    make_model("llama", "tiny", path, weight_type="f32", seed=SEED % 1000)
    return path


def ids_for(engine, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.model.config.vocab_size, (n,), generator=gen).tolist()


def test_perplexity_matches_one_forward_and_kl_is_zero_against_itself(tiny):
    e = Engine(str(tiny), ctx_size=512, progress=False, cuda_graphs=False)
    same = Engine(str(tiny), ctx_size=512, progress=False, cuda_graphs=False)
    ids = ids_for(e, 300, SEED)
    stats = evaluate(e, ids, 64, reference=same)
    assert [s.start for s in stats] == list(range(0, 300, 64)) and stats[-1].end == 300
    with torch.inference_mode():        # the oracle: one forward over the whole text
        logits = e.model(torch.tensor(ids), torch.arange(300), KvStore(e.model.config, 300))
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]),
                                            reduction="sum").item()
    tot = summary(stats)
    assert math.isclose(tot["ppl"], math.exp(nll / 299), rel_tol=1e-4), (SEED, tot)
    assert tot["kl"] == 0 and tot["top1"] == 1.0, (SEED, tot)


def test_streamed_kv_costs_nothing_and_quantized_kv_costs_little(tiny):
    base = dict(ctx_size=1024, progress=False, cuda_graphs=False)
    resident = Engine(str(tiny), **base)
    streamed = Engine(str(tiny), kv_stream_arena_mib=1.5, **base)    # of 4 MiB: most pages stream
    ids = ids_for(resident, 900, SEED + 1)
    tot = summary(evaluate(streamed, ids, 128, reference=resident))
    assert tot["kl"] < 1e-9 and tot["top1"] == 1.0, (SEED, tot)
    assert streamed.store.stats()["h2d_bytes"] > 0
    q = Engine(str(tiny), cache_type_k="q8_0", cache_type_v="q4_0", **base)
    tq = summary(evaluate(q, ids, 128, reference=resident))
    assert 0 < tq["kl"] < 0.05 and tq["top1"] > 0.8, (SEED, tq)


def test_reference_options_and_errors(tiny):
    opts = dict(cache_type_k="q8_0", cache_type_v="q4_0", dtype="auto")
    assert reference_options("f32", opts)["cache_type_k"] == "f32"
    assert reference_options("resident", opts)["kv_stream_arena_mib"] == 0
    assert reference_options("q8_0/q8_0", opts)["cache_type_v"] == "q8_0"
    with pytest.raises(KvcompileError, match="--reference takes"):
        reference_options("q8_0", opts)
    e = Engine(str(tiny), ctx_size=64, progress=False, cuda_graphs=False)
    with pytest.raises(KvcompileError, match="raise --ctx-size"):
        evaluate(e, ids_for(e, 100, 1), 32)


def test_cli_prints_a_row_per_chunk(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the lighthouse keeper wrote down every storm that passed " * 20)
    r = subprocess.run([sys.executable, "-m", "kvcompile", "eval", "-m", str(tiny), "-f",
                        str(text), "--chunk", "64", "--reference", "resident", "-c", "1024",
                        "--no-progress"], capture_output=True, text=True, timeout=300)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    rows = [l for l in r.stdout.splitlines() if l.startswith("[")]
    assert len(rows) >= 2 and all("KL 0.000e+00  top-1 1.0000" in l for l in rows)
    assert "perplexity" in r.stdout and "mean KL 0.000e+00" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvcompile", "eval", "-m", str(tiny), "-f",
                          str(text), "--reference", "bogus"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "--reference takes" in bad.stderr
