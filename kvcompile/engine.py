"""Engine: loads a model once, serves many requests; generate() and stream() per request.

Data path of one request: text or chat messages -> tokenizer -> prefill (prompt in ubatches
through model.forward, which writes KV pages and attends over them) -> decode loop (one token
per forward, sampled by Sampler) -> stop on EOS / end-of-turn / stop string / max_tokens.
"""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from kvcompile.dtypes import resolve_dtype
from kvcompile.engine_options import check_engine_options, parse_device
from kvcompile.errors import ContextLengthError, KvcompileError, StreamInterruptedError
from kvcompile.default_model import resolve_model_path
from kvcompile.loader import load_model, open_model
from kvcompile.memory_budget import plan_engine_memory
from kvcompile.runner import StepRunner, make_sequence_cache
from kvcompile.generation_result import GenerationResult, TokenStream
from kvcompile.speculative.decode import pipelined_tokens, plain_tokens, speculative_tokens
from kvcompile.speculative.options import SpecOptions, check_model_supports
from kvcompile.speculative.stats import SpecStats
from kvcompile.runtime.telemetry import summarize
from kvcompile.sampling import Sampler, SamplingParams
from kvcompile.stop_strings import StopStringFilter
from kvcompile.tokenizer import StreamDecoder

DEFAULT_CTX_SIZE = 4096
PREFILL_BAR_TOKENS = 2048       # prompts from this long show a prefill progress bar


def _context_size(ctx_size: int | None, limit: int) -> int:
    ctx = ctx_size or min(limit, DEFAULT_CTX_SIZE)
    if ctx > limit:
        raise ContextLengthError(f"ctx_size (--ctx-size) {ctx} exceeds the model's trained "
                                 f"context of {limit} tokens; use {limit} or less")
    return ctx


class TokenIdsOnly:
    """The tokenizer of an Engine built from a model without one: prompts are token ids,
    tokens have no text, no token stops generation before max_tokens."""

    stop_ids: tuple = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise KvcompileError("this Engine was built from a model without a tokenizer; pass "
                             "the prompt as a list of token ids")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.encode("")

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        return b""


class Engine:
    def __init__(self, model=None, *, ctx_size: int | None = None, cache_type_k: str = "f32",
                 cache_type_v: str = "f32", device: str | None = None,
                 dtype: torch.dtype | str | None = None, ubatch: int = 256, progress: bool = True,
                 kv_stream_arena_mib: float | str = 0, trace: bool = False,
                 cuda_graphs: bool | None = None, gpu_memory_gib: float | None = None,
                 spec_type: str = "none", spec_ngram_size_n: int = 3,
                 spec_ngram_size_m: int = 8, spec_draft_n_max: int = 3,
                 spec_draft_p_min: float = 0.7):
        # what needs no model is checked before the (possibly long) load
        spec = SpecOptions.checked(spec_type, spec_ngram_size_n, spec_ngram_size_m,
                                   spec_draft_n_max, spec_draft_p_min)
        device = parse_device(device)
        check_engine_options(ctx_size, ubatch, cache_type_k, cache_type_v, kv_stream_arena_mib,
                             gpu_memory_gib)
        # weights and activations: None / "auto" = bf16 on CUDA, f32 on the CPU
        dtype = resolve_dtype(dtype, device)
        source = open_model(resolve_model_path(model))      # the header only, parsed once
        ctx = _context_size(ctx_size, source.config.context_length)
        # the device-memory budget, split before the load (memory_budget.py)
        memory = plan_engine_memory(source, device, dtype, ctx, ubatch, cache_type_k,
                                    cache_type_v, kv_stream_arena_mib, gpu_memory_gib,
                                    spec.verify_rows)
        loaded = load_model(source, device=device, dtype=dtype, progress=progress)
        self._setup(loaded.model, loaded.config, loaded.tokenizer, loaded.path, device, dtype,
                    ctx, ubatch, cache_type_k, cache_type_v, kv_stream_arena_mib, memory,
                    cuda_graphs, progress, trace, spec)

    @classmethod
    def from_model(cls, model, *, tokenizer=None, ctx_size: int | None = None,
                   cache_type_k: str = "f32", cache_type_v: str = "f32", ubatch: int = 256,
                   progress: bool = True, kv_stream_arena_mib: float = 0, trace: bool = False,
                   cuda_graphs: bool | None = None, spec_type: str = "none",
                   spec_ngram_size_n: int = 3, spec_ngram_size_m: int = 8,
                   spec_draft_n_max: int = 3, spec_draft_p_min: float = 0.7) -> "Engine":
        """An Engine over a model built in memory (weights made or quantized on the device,
        no file): its device and dtype are its parameters'. Without a tokenizer, prompts are
        token ids and results carry token ids only (their text is empty)."""
        if kv_stream_arena_mib == "auto":
            raise KvcompileError("kv_stream_arena_mib='auto' needs a model file (the memory "
                                 "budget is planned from its header); give a size in MiB")
        check_engine_options(ctx_size, ubatch, cache_type_k, cache_type_v, kv_stream_arena_mib,
                             None)
        spec = SpecOptions.checked(spec_type, spec_ngram_size_n, spec_ngram_size_m,
                                   spec_draft_n_max, spec_draft_p_min)
        p = next(model.parameters(), None)
        if p is None:
            p = next(model.buffers())
        config = model.config
        self = cls.__new__(cls)
        self._setup(model, config, tokenizer or TokenIdsOnly(config.vocab_size), None,
                    p.device, p.dtype, _context_size(ctx_size, config.context_length), ubatch,
                    cache_type_k, cache_type_v, kv_stream_arena_mib, None, cuda_graphs,
                    progress, trace, spec)
        return self

    def _setup(self, model, config, tokenizer, path, device, dtype, ctx, ubatch, k_type,
               v_type, arena_mib, memory, cuda_graphs, progress, trace, spec) -> None:
        check_model_supports(model, spec)
        self.spec = spec
        self.model, self.config, self.tokenizer, self.path = model, config, tokenizer, path
        self.device, self.dtype, self.memory = torch.device(device), dtype, memory
        if memory is not None:
            arena_mib = memory.arena_mib
        elif arena_mib == "auto":
            arena_mib = 0                      # no device budget on the CPU
        self.ctx_size, self.ubatch, self.progress, self.trace = ctx, ubatch, progress, trace
        self._request = 0             # the newest request; older streams stop (stream())
        self.cache = make_sequence_cache(model, config, ctx, k_type, v_type, arena_mib,
                                         self.device)
        # CUDA graphs are the default on CUDA (kvcompile/runner.py says which kind runs);
        # cuda_graphs=False debugs eagerly; on the CPU True runs the programs eagerly
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        self.runner = StepRunner(model, self.cache, device=self.device, ubatch=ubatch,
                                 cuda_graphs=cuda_graphs, trace=trace)
        # Decoding draws each token on the device and queues the next step before the host
        # reads it (speculative/decode.py; not with a repeat penalty): on by default where
        # the device runs asynchronously; False runs one step at a time (the host reads
        # every token first, and a seed draws what it draws on the CPU).
        self.pipeline = self.device.type == "cuda"
        if spec.enabled and self.runner.recurrent is not None:
            # checkpoints of every row a verify step can hold, allocated once, up front
            self.runner.recurrent.reserve_rows(spec.verify_rows)

    @property
    def phases(self):
        return self.runner.phases

    @property
    def decode_graph(self):
        return self.runner.decode_graph

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
        budget = min(sampling.max_tokens, self.ctx_size - len(prompt_ids))
        self.runner.begin_request(len(prompt_ids) + budget)
        telemetry = getattr(self.cache, "telemetry", [])
        first_step = len(telemetry)
        history, out_ids, text, finish = list(prompt_ids), [], [], "length"

        # each timed span ends with the sampler's read of the token: GPU work completed
        drafter = self.spec.drafter(self.runner)
        if drafter is not None:
            drafter.reset(history)
        t0 = time.perf_counter()
        logits = self._prefill(prompt_ids, drafter)
        prefill_s, step_s = 0.0, []
        if not budget:
            prefill_s = time.perf_counter() - t0
        spec_stats = SpecStats() if drafter is not None else None
        tokens = (speculative_tokens(self.runner.verify, self.runner.rollback, drafter, logits,
                                     sampler, history, budget, self.ctx_size, step_s, spec_stats)
                  if drafter is not None else
                  pipelined_tokens(self.forward, logits, sampler.pick, history, budget, step_s)
                  if self.pipeline and sampler.on_device else
                  plain_tokens(self.forward, logits, sampler, history, budget, step_s))
        for n, token in enumerate(tokens):
            if n:
                self._check_current(request)
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
                # a newer request may have taken the cache while this stream was paused:
                # stop before the next forward runs over it
                self._check_current(request)
            if stops.stopped:
                finish = "stop"
                break
        tokens.close()
        self._check_current(request)      # paused at its last piece: the result would mix
        tail = stops.feed(text_of.flush()) + stops.flush()
        if tail:
            text.append(tail)
            yield tail
        self._check_current(request)
        stream.result = GenerationResult("".join(text), out_ids, len(prompt_ids), len(out_ids),
                                         finish, prefill_s, sum(step_s),
                                         summarize(telemetry[first_step:]),
                                         self.runner.request_stats(), step_s,
                                         list(self.runner.host_s),
                                         spec_stats.as_dict() if spec_stats else {})

    def forward_rows(self, ids: list[int], start: int) -> torch.Tensor:
        """Every row's logits of ids at positions start.. (a verify step)."""
        return self.runner.verify(ids, start)[0]

    def _check_current(self, request: int) -> None:
        if request != self._request:
            raise StreamInterruptedError(
                "this stream was interrupted: a newer request on the same Engine has taken "
                "over its KV cache; read a stream to the end before starting the next one, or "
                "use one Engine per concurrent stream")

    def _prefill(self, ids: list[int], drafter=None) -> torch.Tensor:
        # a bar once the prompt is long enough to take a while (progress=False: none)
        bar = tqdm(total=len(ids), desc="prefill", unit="tok", leave=False, file=sys.stderr,
                   disable=not self.progress or len(ids) < PREFILL_BAR_TOKENS)
        logits = None
        with bar:
            for start in range(0, len(ids), self.ubatch):
                piece = ids[start:start + self.ubatch]
                if drafter is not None and drafter.wants_hidden:   # the MTP layer's input
                    logits, hidden = self.runner.step_hidden(piece, start)
                    drafter.add(start, hidden, ids)
                else:
                    logits = self.forward(piece, start)
                bar.update(len(piece))
        return logits

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ids at positions start.. through the model; logits of the last one (with CUDA
        graphs a program's output buffer: valid until the next step, copy it to keep it)."""
        return self.runner.step(ids, start)
