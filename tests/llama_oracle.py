"""Helpers for the llama parity tests: llama.cpp as the oracle, greedy decoding on both
sides, and the agreement metrics."""
from __future__ import annotations

import numpy as np
import torch

from kvcompile.kv.store import KvStore


def plain_cpu_buffers() -> None:
    """Load llama.cpp models without its extra CPU weight buffers (AMX / repacked): with
    them llama-cpp-python 0.3.36 segfaults in the first quantized matmul on VMs that
    report AMX but do not enable its tiles (this project's machines). Called once for the
    whole suite (conftest); harmless where they would have worked."""
    try:
        import llama_cpp.llama_cpp as lc
    except ImportError:
        return
    defaults = lc.llama_model_default_params
    if getattr(defaults, "_kvcompile_plain", False):
        return
    if "use_extra_bufts" not in {f[0] for f in lc.llama_model_params._fields_}:
        return

    def plain():
        p = defaults()
        p.use_extra_bufts = False
        return p
    plain._kvcompile_plain = True
    lc.llama_model_default_params = plain
    import llama_cpp
    llama_cpp.llama_model_default_params = plain


def llama_cpp(path, n_ctx: int = 2048, type_k: int = 0, type_v: int = 0):
    """f32 KV unless told (ggml type ids; smaller types need flash attention), logits of
    every row. One thread: the 2 cores are shared with other test
    processes, and two spinning llama.cpp threads then run ~10x slower than one."""
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, type_k=type_k, type_v=type_v,
                 flash_attn=bool(type_k or type_v), logits_all=True,
                 n_threads=1, n_threads_batch=1, n_batch=512, verbose=False)


def llama_cpp_logits(llm, tokens: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))


def llama_cpp_greedy(llm, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp's own decode path, one eval per token; returns tokens and top-2 logit gaps."""
    llm.reset()
    llm.eval(prompt)
    out, gaps = [], []
    for _ in range(n):
        row = torch.from_numpy(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        out.append(int(row.argmax()))
        gaps.append(float(top2_gap(row)))
        llm.eval([out[-1]])
    return out, gaps


@torch.inference_mode()
def our_greedy(model, cache: KvStore, prompt: list[int], n: int) -> list[int]:
    """Prefill the prompt in one forward, then one forward per generated token."""
    cache.reset()
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache, last_only=True)
    out = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        logits = model(torch.tensor(out[-1:]), torch.tensor([pos]), cache, last_only=True)
        out.append(int(logits[-1].argmax()))
    return out


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(ref || ours), max KL) over rows of logits."""
    top1 = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return top1, kl.mean().item(), kl.max().item()


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """How far each row's top logit leads its second (last dim)."""
    top = logits.topk(2, -1).values
    return top[..., 0] - top[..., 1]


def decisive_agreement(ours: torch.Tensor, ref: torch.Tensor,
                       gap: float) -> tuple[float, int]:
    """(top-1 agreement, row count) over the rows where ref's top-1 logit leads its second
    by at least `gap`: the rows a small perturbation of the logits cannot flip (nan: none)."""
    keep = top2_gap(ref) >= gap
    agree = ours.argmax(-1)[keep] == ref.argmax(-1)[keep]
    return agree.double().mean().item(), int(keep.sum())
