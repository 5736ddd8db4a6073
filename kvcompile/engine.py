"""Engine: loads a model once, serves many requests; generate() and stream() per request.

Data path of one request: text or chat messages -> tokenizer -> prefill (prompt in ubatches
through model.forward, which writes KV pages and attends over them) -> decode loop (one token
per forward, sampled by Sampler) -> stop on EOS / end-of-turn / stop string / max_tokens.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Iterator

import torch
from tqdm import tqdm

from kvcompile.dtypes import resolve_dtype
from kvcompile.engine_options import check_engine_options, parse_device
from kvcompile.errors import ContextLengthError, KvcompileError, StreamInterruptedError
from kvcompile.default_model import resolve_model_path
from kvcompile.loader import load_model, open_model
from kvcompile.memory_budget import plan_engine_memory
from kvcompile.runtime import forward as run_forward
from kvcompile.runtime import make_kv_cache
from kvcompile.runtime.streaming_cache import is_streamed
from kvcompile.runtime.telemetry import summarize
from kvcompile.sampling import Sampler, SamplingParams
from kvcompile.stop_strings import StopStringFilter
from kvcompile.tokenizer import StreamDecoder

DEFAULT_CTX_SIZE = 4096
PREFILL_BAR_TOKENS = 2048       # prompts from this long show a prefill progress bar


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str            # "stop" (EOS / end of turn / stop string) or "length"
    prefill_s: float              # to the first token (its sampling included): the TTFT
    decode_s: float               # the decode steps, each to its token's read (GPU completion)
    kv: dict = field(default_factory=dict)   # streaming telemetry (empty when all resident)
    phases: dict = field(default_factory=dict)   # cuda_graphs only: program counters
    step_s: list = field(default_factory=list)   # each decode step's seconds, in order

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.completion_tokens - 1, 0)   # the first token comes out of prefill
        return steps / self.decode_s if self.decode_s else 0.0

    def step_ms(self) -> dict:
        """p50, p90 and max of the decode steps' times, in milliseconds (empty: no step)."""
        if not self.step_s:
            return {}
        t = sorted(self.step_s)
        pick = lambda q: 1e3 * t[min(len(t) - 1, int(q * len(t)))]   # noqa: E731
        return dict(p50=pick(0.5), p90=pick(0.9), max=1e3 * t[-1])

    def stats(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("text", "token_ids", "step_s")}
        out.update(ttft_s=self.prefill_s, prefill_tok_s=self.prefill_tok_s,
                   decode_tok_s=self.decode_tok_s, step_ms=self.step_ms())
        return out

    def stats_line(self) -> str:
        """One line for people: tokens, time to first token, prefill and decode rates, step
        time percentiles."""
        steps = self.step_ms()
        step = (f", step p50 {steps['p50']:.1f} / p90 {steps['p90']:.1f} / max "
                f"{steps['max']:.1f} ms" if steps else "")
        return (f"[{self.prompt_tokens} prompt tokens, {self.completion_tokens} generated "
                f"({self.finish_reason}); first token after {self.prefill_s:.2f} s; prefill "
                f"{self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s{step}]")


class TokenStream:
    """Iterator of text pieces; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)


class Engine:
    def __init__(self, model=None, *, ctx_size: int | None = None, cache_type_k: str = "f32",
                 cache_type_v: str = "f32", device: str | None = None,
                 dtype: torch.dtype | str | None = None, ubatch: int = 256, progress: bool = True,
                 kv_stream_arena_mib: float | str = 0, trace: bool = False,
                 cuda_graphs: bool = False, gpu_memory_gib: float | None = None):
        # what needs no model is checked before the (possibly long) load
        self.device = parse_device(device)
        check_engine_options(ctx_size, ubatch, cache_type_k, cache_type_v, kv_stream_arena_mib,
                             gpu_memory_gib)
        # weights and activations: None / "auto" = bf16 on CUDA, f32 on the CPU
        self.dtype = resolve_dtype(dtype, self.device)
        source = open_model(resolve_model_path(model))      # the header only, parsed once
        limit = source.config.context_length
        ctx = ctx_size or min(limit, DEFAULT_CTX_SIZE)
        if ctx > limit:
            raise ContextLengthError(f"ctx_size (--ctx-size) {ctx} exceeds the model's trained "
                                     f"context of {limit} tokens; use {limit} or less")
        # the device-memory budget, split before the load (memory_budget.py)
        self.memory = plan_engine_memory(source, self.device, self.dtype, ctx, ubatch,
                                         cache_type_k, cache_type_v, kv_stream_arena_mib,
                                         gpu_memory_gib)
        if self.memory is not None:
            kv_stream_arena_mib = self.memory.arena_mib
        elif kv_stream_arena_mib == "auto":
            kv_stream_arena_mib = 0                   # no device budget on the CPU
        loaded = load_model(source, device=self.device, dtype=self.dtype, progress=progress)
        self.path, self.config, self.tokenizer, self.model = (
            loaded.path, loaded.config, loaded.tokenizer, loaded.model)
        self.ctx_size, self.ubatch, self.progress = ctx, ubatch, progress
        self._request = 0             # the newest request; older streams stop (stream())
        self.trace = trace
        # The KV layers a plain forward acquires: a hybrid model's attention layers without
        # its MTP layer (no speculative step runs here, so the MTP pages are never read);
        # None = every layer of the cache.
        self._trunk_kv_layers = getattr(self.model, "trunk_kv_layers", None)
        self.cache = self._make_cache(ctx, cache_type_k, cache_type_v, kv_stream_arena_mib)
        # cuda_graphs: steps run as phase programs (captured on CUDA, eager on the CPU) in the
        # prefill / decode layouts of one arena, or, for a streamed cache or a hybrid model
        # on CUDA, decode as piecewise graphs (kvcompile/phase, docs/phases.md)
        self.phases = self.piecewise = None
        if cuda_graphs:
            hybrid = self._trunk_kv_layers is not None
            if (is_streamed(self.cache) or hybrid) and self.device.type == "cuda":
                # a streamed cache or a hybrid model: decode as CUDA graphs between the
                # per-layer KV hooks (kvcompile/phase/piecewise.py), prefill eagerly
                from kvcompile.phase.piecewise import PiecewiseDecode
                self.piecewise = PiecewiseDecode(self.model, self.cache,
                                                 layers=self._trunk_kv_layers, strict=False)
            else:
                from kvcompile.phase import PhaseManager
                self.phases = PhaseManager(self.model, self.cache, ubatch=min(ubatch, ctx))

    def _make_cache(self, ctx: int, k_type: str, v_type: str, arena_mib: float):
        """arena_mib 0: every page on the device; else KV history on the host, streamed
        through an arena of that size. Hybrid models name the layers that hold KV."""
        make_own = getattr(self.model, "make_cache", None)
        if not arena_mib and make_own is not None:
            return make_own(ctx, k_type=k_type, v_type=v_type, device=self.device)
        config, layers = self.config, getattr(self.model, "kv_layers", None)
        if layers is not None:      # the MTP layer sits after the trunk's layers
            config = replace(config, n_layers=config.n_layers + config.nextn_layers)
        return make_kv_cache(config, ctx, arena_mib, k_type=k_type, v_type=v_type,
                             device=self.device, layers=layers)

    # ---- requests ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **params) -> GenerationResult:
        stream = self.stream(prompt, messages=messages, **params)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               **params) -> TokenStream:
        # Everything that can reject the request runs before any state changes.
        sampling = SamplingParams.from_options(**params)
        prompt_ids = self.encode_prompt(prompt, messages)
        if len(prompt_ids) >= self.ctx_size:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.ctx_size}; "
                f"shorten the prompt or raise ctx_size / --ctx-size (this model was trained on "
                f"{self.config.context_length})")
        # A newer request takes over the one cache: an older stream read after this raises
        # StreamInterruptedError instead of continuing over the newer request's KV.
        self._request += 1
        stream = TokenStream(iter(()))
        stream._pieces = self._run(prompt_ids, sampling, stream, self._request)
        return stream

    def encode_prompt(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise KvcompileError("pass either a prompt string or chat messages, not both or neither")
        if messages is not None:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        elif isinstance(prompt, (list, tuple)):           # token ids, as they are
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise KvcompileError(f"a prompt of token ids takes ints in [0, {vocab}) "
                                     f"(this model's vocabulary)")
            prompt = list(prompt)
            if not prompt:
                raise KvcompileError("the prompt is empty; give at least one token")
            return prompt
        elif not isinstance(prompt, str):
            raise KvcompileError(f"prompt must be a string or a list of token ids, got "
                                 f"{type(prompt).__name__}")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise KvcompileError("the prompt is empty; give at least one token of text")
        return ids

    # ---- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, prompt_ids: list[int], sampling: SamplingParams, stream: TokenStream,
             request: int):
        self._check_current(request)
        sampler = Sampler(sampling)
        stops = StopStringFilter(sampling.stop)
        text_of = StreamDecoder(self.tokenizer)
        stop_ids = set(self.tokenizer.stop_ids)
        self.cache.reset()
        telemetry = getattr(self.cache, "telemetry", [])
        first_step = len(telemetry)
        history, out_ids, text, finish = list(prompt_ids), [], [], "length"
        budget = min(sampling.max_tokens, self.ctx_size - len(prompt_ids))

        # each timed span ends with the sampler's read of the token: GPU work completed
        t0 = time.perf_counter()
        logits = self._prefill(prompt_ids)
        prefill_s, step_s = 0.0, []
        if not budget:
            prefill_s = time.perf_counter() - t0
        for step in range(budget):
            if step:
                self._check_current(request)
                t = time.perf_counter()
                pos = len(history) - 1
                logits = self.forward([history[-1]], pos)
            token = sampler(logits, history)
            if step:
                step_s.append(time.perf_counter() - t)
            else:
                prefill_s = time.perf_counter() - t0      # to the first token
            if token in stop_ids:
                finish = "stop"
                break
            history.append(token)
            out_ids.append(token)
            piece = stops.feed(text_of.feed(token))
            if piece:
                text.append(piece)
                yield piece
            if stops.stopped:
                finish = "stop"
                break
        self._check_current(request)      # paused at its last piece: the result would mix
        tail = stops.feed(text_of.flush()) + stops.flush()
        if tail:
            text.append(tail)
            yield tail
        self._check_current(request)
        stream.result = GenerationResult("".join(text), out_ids, len(prompt_ids), len(out_ids),
                                         finish, prefill_s, sum(step_s),
                                         summarize(telemetry[first_step:]),
                                         self._program_stats(), step_s)

    def _check_current(self, request: int) -> None:
        if request != self._request:
            raise StreamInterruptedError(
                "this stream was interrupted: a newer request on the same Engine has taken "
                "over its KV cache; read a stream to the end before starting the next one, or "
                "use one Engine per concurrent stream")

    def _program_stats(self) -> dict:
        if self.phases is not None:
            return self.phases.stats()
        if self.piecewise is not None:
            return self.piecewise.stats()
        return {}

    def _prefill(self, ids: list[int]) -> torch.Tensor:
        # a bar once the prompt is long enough to take a while (progress=False: none)
        bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False, file=sys.stderr,
                   disable=not self.progress or len(ids) < PREFILL_BAR_TOKENS)
        logits = None
        with bar:
            for start in range(0, len(ids), self.ubatch):
                piece = ids[start:start + self.ubatch]
                logits = self.forward(piece, start)
                bar.update(len(piece))
        return logits

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ids at positions start.. through the model; logits of the last one."""
        if self.phases is not None:
            return self.phases.forward(ids, start)[-1]
        if self.piecewise is not None and len(ids) == self.piecewise.rows:
            logits = self.piecewise.step(ids, start)[-1]
        else:
            tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
            positions = torch.arange(start, start + len(ids), dtype=torch.long,
                                     device=self.device)
            logits = run_forward(self.model, self.cache, tokens, positions, last_only=True,
                                 layers=self._trunk_kv_layers, start=start)[-1]
        if self.trace and getattr(self.cache, "telemetry", None):
            print(f"[kv step] {self.cache.telemetry[-1].as_dict()}", file=sys.stderr)
        return logits
