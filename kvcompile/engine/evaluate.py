"""`kvcompile eval`: perplexity of a model over a text, and, against a reference run of the
same model (another KV type, all resident, or f32 everywhere), the mean KL divergence and
top-1 agreement of the next-token distributions, per chunk of context.

Both runs read the text in the same chunks (the ubatch) through their own Engine's cache,
teacher-forced, in lockstep: chunk i of the test run, chunk i of the reference, compared,
dropped; so memory holds two chunks of logits, never the whole text's. It is the evidence
that quantized or streamed KV costs nothing: streamed attention is exact, so a streamed run
against the same KV types all resident gives KL 0 up to summation order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompile.errors import KvcompileError

REFERENCES = ("f32", "resident")


@dataclass
class ChunkStats:
    start: int
    end: int                      # positions [start, end) predicted the tokens after them
    nll: float                    # summed negative log-likelihood of those next tokens
    count: int
    kl: float | None = None       # summed KL(reference || test) over the positions
    top1: int | None = None       # positions whose argmax agrees with the reference's

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")


def chunk_logits(engine, ids: list[int], chunk: int):
    """(start, fp32 logits of every row) for ids in chunks through the engine's executor,
    from position 0 (the store starts over)."""
    engine.store.reset()
    engine.executor.begin_request(len(ids))
    for start in range(0, len(ids), chunk):
        logits = engine.executor.step(ids[start:start + chunk], start, all_rows=True)
        yield start, logits.float()


def evaluate(engine, ids: list[int], chunk: int, reference=None) -> list[ChunkStats]:
    """Per-chunk statistics of engine over ids (and against reference, another Engine of
    the same model and vocabulary, when given)."""
    if len(ids) < 2:
        raise KvcompileError("the text has fewer than 2 tokens: nothing to predict")
    if len(ids) > engine.ctx_size:
        raise KvcompileError(f"the text has {len(ids)} tokens but the context holds "
                             f"{engine.ctx_size}; raise --ctx-size or shorten the text")
    target = torch.tensor(ids[1:] + [-1], dtype=torch.long)
    ref_chunks = chunk_logits(reference, ids, chunk) if reference is not None else None
    out = []
    for start, logits in chunk_logits(engine, ids, chunk):
        n = logits.shape[0]
        tgt = target[start:start + n].to(logits.device)
        keep = tgt >= 0                           # the last position predicts nothing
        logp = torch.log_softmax(logits, -1)
        nll = -logp[keep].gather(1, tgt[keep, None]).sum().item()
        st = ChunkStats(start, start + n, nll, int(keep.sum()))
        if ref_chunks is not None:
            _, ref = next(ref_chunks)
            ref_logp = torch.log_softmax(ref.to(logits.device), -1)
            st.kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0).sum().item()
            st.top1 = int((ref.argmax(-1).to(logits.device) == logits.argmax(-1)).sum())
        out.append(st)
    return out


def summary(stats: list[ChunkStats]) -> dict:
    nll = sum(s.nll for s in stats)
    count = sum(s.count for s in stats)
    rows = sum(s.end - s.start for s in stats)
    out = dict(tokens=stats[-1].end, ppl=math.exp(nll / count))
    if stats[0].kl is not None:
        out.update(kl=sum(s.kl for s in stats) / rows, top1=sum(s.top1 for s in stats) / rows)
    return out


def reference_options(reference: str | None, options: dict) -> dict | None:
    """The reference Engine's options: `f32` (f32 weights, activations and KV, all
    resident), `resident` (the same KV types, all resident), or K/V types (`q8_0/q4_0`,
    all resident)."""
    if reference is None:
        return None
    ref = dict(options, kv_stream_arena_mib=0, gpu_memory_gib=None)
    if reference == "f32":
        return dict(ref, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    if reference == "resident":
        return ref
    k, sep, v = reference.partition("/")
    if not sep or not k or not v:
        raise KvcompileError(f"--reference takes f32, resident or K/V cache types such as "
                             f"q8_0/q4_0, got {reference!r}")
    return dict(ref, cache_type_k=k, cache_type_v=v)
