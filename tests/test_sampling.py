"""Sampler against an independent numpy computation of the filtered distribution."""
import numpy as np
import pytest
import torch

from kvcompile.errors import SamplingError
from kvcompile.engine.sampling import Sampler, SamplingParams


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """Independent float64 reimplementation of the documented filter order."""
    x = np.asarray(logits, dtype=np.float64)
    keep = np.ones_like(x, dtype=bool)
    if top_k:
        keep &= x >= np.sort(x)[-top_k]
    z = np.where(keep, x / temperature, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0)
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        cut = order[mass_before >= top_p * p.sum()]
        p[cut] = 0
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.2),
    (0.9, 8, 0.9, 0.05)], ids=["plain", "top_k", "top_p", "min_p", "all"])
def test_sampled_frequencies_match_filtered_distribution(temperature, top_k, top_p, min_p):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(123)) * 1.5
    want = expected_distribution(logits.numpy(), temperature, top_k, top_p, min_p)
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                     min_p=min_p, seed=7))
    n = 6000
    counts = np.bincount([sampler(logits, []) for _ in range(n)], minlength=12) / n
    print("want", np.round(want, 3), "\ngot ", np.round(counts, 3))
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(want)), "sampled a filtered token"
    assert np.abs(counts - want).max() < 0.03


def test_greedy_and_seed_reproducibility():
    logits = torch.randn(1000)
    assert Sampler(SamplingParams(temperature=0))(logits, []) == int(np.argmax(logits.numpy()))
    a = [Sampler(SamplingParams(seed=42))(logits, []) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(seed=42, top_k=0, min_p=0)), Sampler(SamplingParams(seed=42, top_k=0, min_p=0))
    assert [s1(logits, []) for _ in range(20)] == [s2(logits, []) for _ in range(20)]
    assert len(set(a)) == 1


def test_repeat_penalty_follows_llama_cpp_rule():
    # positive logits are divided by the penalty, negative ones multiplied
    logits = torch.tensor([2.0, 1.9, -0.5, -0.4])
    greedy = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))
    assert greedy(logits, [0]) == 1                 # 2.0/1.5 < 1.9
    assert greedy(torch.tensor([-0.5, -0.6]), [1]) == 0  # -0.6*1.5 falls further behind
    assert greedy(torch.tensor([-0.5, -0.6]), [0]) == 1  # -0.5*1.5 = -0.75 < -0.6


@pytest.mark.parametrize("kwargs,word", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(max_tokens=-3), "max_tokens"), (dict(stop=("",)), "stop")],
    ids=lambda v: str(v) if isinstance(v, str) else None)
def test_invalid_values_raise_clear_errors(kwargs, word):
    with pytest.raises(SamplingError, match=word):
        SamplingParams(**kwargs).validated()
