"""Engine: loads a model once, serves many requests; generate() and stream() per request.

Data path of one request: text or chat messages -> tokenizer -> resume (the longest common
prefix of the prompt and the history the store holds stays: kv/prefix.py) -> prefill (the
rest of the prompt in ubatch chunks, each an executor step) -> decode loop (one token per
step, sampled by Sampler; or speculative verify rounds) -> stop on EOS / end-of-turn / stop
string / max_tokens.
"""
from __future__ import annotations

import sys
import threading
import time
from functools import partial

import torch
from tqdm import tqdm

from kvcompile.engine.config import EngineConfig
from kvcompile.engine.dtypes import cpu_fast_path
from kvcompile.models.layers import use_cpu_kernels
from kvcompile.engine.finite import check_finite
from kvcompile.engine.gate import RequestGate
from kvcompile.engine.memory_budget import plan_engine_memory
from kvcompile.engine.prompt import encode_prompt
from kvcompile.engine.request import Request
from kvcompile.engine.result import GenerationResult, TokenStream
from kvcompile.engine import session
from kvcompile.engine.sampling import Sampler, SamplingParams
from kvcompile.engine.speculative.decode import speculative_tokens
from kvcompile.engine.speculative.options import check_model_supports
from kvcompile.engine.speculative.stats import SpecStats
from kvcompile.engine.stop_strings import StopStringFilter
from kvcompile.engine.threads import CpuThreads
from kvcompile.engine.tokens import pipelined_tokens, plain_tokens
from kvcompile.errors import (ContextLengthError, KvcompileError, KvLayoutError, SessionError,
                              StreamInterruptedError)
from kvcompile.executor.executor import Executor
from kvcompile.executor.programs import verify_width
from kvcompile.io.default_model import resolve_model_path
from kvcompile.io.loader import load_model, open_model
from kvcompile.io.tokenizer import StreamDecoder
from kvcompile.kv.backend import make_backend
from kvcompile.kv.prompt_cache import PromptCache, set_aside, swap_in
from kvcompile.kv.snapshot import check, layout, put, take
from kvcompile.kv.store import KvStore
from kvcompile.kv.telemetry import summarize

PREFILL_BAR_TOKENS = 2048       # prompts from this long show a prefill progress bar


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
    def __init__(self, model=None, config: EngineConfig | None = None, **options):
        """model: None (the default model), a .gguf file or a Hugging Face folder; config
        and / or options: EngineConfig's fields. What needs no model is checked before the
        (possibly long) load."""
        cfg = EngineConfig.checked(config, **options)
        device = cfg.torch_device
        dtype = cfg.torch_dtype(device)
        source = open_model(resolve_model_path(model))      # the header only, parsed once
        ctx = cfg.context(source.config.context_length)
        # the device-memory budget, split before the load (memory_budget.py)
        memory = plan_engine_memory(source, device, dtype, ctx, cfg.ubatch, cfg.cache_type_k,
                                    cfg.cache_type_v, cfg.kv_stream_arena_mib,
                                    cfg.gpu_memory_gib, cfg.spec.verify_rows,
                                    mtp=cfg.spec.uses_mtp)
        fast = cpu_fast_path(cfg.dtype, device)
        loaded = load_model(source, device=device, dtype=dtype, progress=cfg.progress,
                            keep_quantized=fast or None)
        self._setup(loaded.model, loaded.tokenizer, loaded.path, cfg, device, dtype, ctx,
                    memory, fast)

    @classmethod
    def from_model(cls, model, config: EngineConfig | None = None, *, tokenizer=None,
                   **options) -> "Engine":
        """An Engine over a model built in memory (weights made or quantized on the device,
        no file): its device and dtype are its parameters'. Without a tokenizer, prompts are
        token ids and results carry token ids only (their text is empty)."""
        cfg = EngineConfig.checked(config, **options)
        if cfg.kv_stream_arena_mib == "auto" or cfg.gpu_memory_gib is not None:
            raise KvcompileError("kv_stream_arena_mib='auto' and gpu_memory_gib need a model "
                                 "file (the memory budget is planned from its header); give "
                                 "an arena size in MiB")
        p = next(model.parameters(), None)
        if p is None:
            p = next(model.buffers())
        c = model.config
        self = cls.__new__(cls)
        self._setup(model, tokenizer or TokenIdsOnly(c.vocab_size), None, cfg, p.device,
                    p.dtype, cfg.context(c.context_length), None)
        return self

    def _setup(self, model, tokenizer, path, cfg: EngineConfig, device, dtype, ctx,
               memory, fast: bool = False) -> None:
        spec = cfg.spec
        check_model_supports(model, spec)
        self.config, self.spec = cfg, spec
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.device, self.dtype, self.memory = torch.device(device), dtype, memory
        arena = (memory.arena_mib if memory is not None
                 else 0 if cfg.kv_stream_arena_mib in ("auto", None) else cfg.kv_stream_arena_mib)
        self.ctx_size, self.ubatch, self.progress = ctx, cfg.ubatch, cfg.progress
        self.threads = CpuThreads(cfg.threads) if self.device.type == "cpu" else None
        self._gate = RequestGate()    # one request at a time (stream())
        self.store = KvStore.for_model(
            model, ctx, cfg.cache_type_k, cfg.cache_type_v, arena, device=self.device,
            mtp=spec.uses_mtp, backend=make_backend(self.device, copy=cfg.stream_copy),
            ctx_checkpoints=cfg.ctx_checkpoints, decode_depth=cfg.decode_depth,
            prefetch_next=cfg.prefetch_next, fill_ahead=cfg.fill_ahead,
            # windowed layers' rings hold the widest forward: a chunk or a padded verify step
            window_rows=max(cfg.ubatch, verify_width(spec.verify_rows)))
        self.prompt_cache = PromptCache(cfg.cache_ram_bytes())   # other conversations
        self.cpu_fast = fast          # the CPU's fast path (dtypes.cpu_fast_path)
        if fast:
            use_cpu_kernels(model)
        capture, compile = cfg.graphs(self.device)
        self.executor = Executor(model, self.store, ubatch=cfg.ubatch, capture=capture,
                                 compile=compile, trace=cfg.trace)
        # Decoding draws each token on the device and queues the next step before the host
        # reads it (engine/tokens.py; not with a repeat penalty): on by default where the
        # device runs asynchronously; False runs one step at a time (the host reads every
        # token first, and a seed draws what it draws on the CPU).
        self.pipeline = self.device.type == "cuda"
        if spec.enabled and self.store.recurrent is not None:
            # the rollback buffers of every row a verify step (padded to its program's
            # width) can hold, allocated once, up front: captured programs keep addresses
            self.store.recurrent.reserve_rows(verify_width(spec.verify_rows))

    # ---- requests ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **params) -> GenerationResult:
        stream = self.stream(prompt, messages=messages, **params)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               cache_prompt: bool | None = None, cancel: threading.Event | None = None,
               **params) -> TokenStream:
        """cache_prompt: False computes this request from position 0 (None: the Engine's
        option). cancel: an Event another thread may set; the request then ends at its next
        prefill chunk or token (finish_reason "cancelled"; what it computed stays history).
        The rest are SamplingParams."""
        # Everything that can reject the request runs before any state changes.
        sampling = SamplingParams.from_options(**params)
        if cache_prompt not in (None, True, False):
            raise KvcompileError(f"cache_prompt must be True, False or None, got "
                                 f"{cache_prompt!r}")
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise KvcompileError(f"cancel must be a threading.Event, got "
                                 f"{type(cancel).__name__}")
        reuse = self.config.cache_prompt if cache_prompt is None else cache_prompt
        prompt_ids = self.encode_prompt(prompt, messages)
        if len(prompt_ids) >= self.ctx_size:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.ctx_size}; "
                f"shorten the prompt or raise ctx_size / --ctx-size (this model was trained on "
                f"{self.model.config.context_length})")
        if self.spec.uses_mtp and not all(map(self.store.has_layer,
                                              self.model.layer_plan.mtp)):
            raise KvcompileError("this Engine's store holds no MTP layer KV (it was built "
                                 "without draft-mtp): build it with spec_type including "
                                 "draft-mtp to draft with the MTP layer")
        # One request holds the store at a time: another thread's waits here for its turn
        # (first come, first served); a newer request of the holding thread takes over, and
        # the older stream, read after this, raises StreamInterruptedError instead of
        # continuing over the newer request's KV. The Engine is held until the stream ends,
        # is closed or is dropped.
        ticket = self._gate.enter()
        try:
            return TokenStream(self._run(Request(prompt_ids, sampling, ticket, reuse, cancel)),
                               release=partial(self._gate.leave, ticket))
        except BaseException:             # (no stream to give the Engine back: do it here)
            self._gate.leave(ticket)
            raise

    def encode_prompt(self, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
        return encode_prompt(self.tokenizer, self.model.config.vocab_size, prompt, messages)

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self, req: Request):
        """The request's text pieces; returns its GenerationResult."""
        try:
            return (yield from self._request_steps(req))
        except (GeneratorExit, StreamInterruptedError):
            raise                         # the history so far is whole: the next request
        except BaseException:             # may resume it
            if self._gate.holds(req.ticket):
                self.store.reset()        # a step failed part way: nothing is reusable
            raise
        finally:
            self._gate.leave(req.ticket)

    @torch.inference_mode()
    def _request_steps(self, req: Request):
        try:
            return (yield from self._request_loop(req))
        except StreamInterruptedError as e:
            # what the stream gave before a newer request took over (no telemetry: the
            # store's counters now mix in the newer request's)
            e.result = GenerationResult("".join(req.text), req.out_ids, len(req.prompt_ids),
                                        len(req.out_ids), "interrupted", 0.0, sum(req.step_s),
                                        step_s=req.step_s)
            raise

    def _request_loop(self, req: Request):
        t0 = time.perf_counter()          # the time to the first token counts the resume
        prompt_ids, sampling, ticket = req.prompt_ids, req.sampling, req.ticket
        out_ids, text, step_s = req.out_ids, req.text, req.step_s
        self._check_current(ticket)
        sampler = Sampler(sampling)
        stops = StopStringFilter(sampling.stop)
        text_of = StreamDecoder(self.tokenizer)
        stop_ids = set(self.tokenizer.stop_ids)
        budget = min(sampling.max_tokens, self.ctx_size - len(prompt_ids))
        cached = self._resume(prompt_ids, req.reuse)
        planned = len(prompt_ids) + budget
        self.executor.begin_request(planned)
        # the ids the store's rows are computed from: this request's prompt, then every
        # token the loop reads (a stop token too: a pipelined step may have fed it)
        history = self.store.prefix.tokens = list(prompt_ids)
        self.store.prefix.plan(planned, self.ubatch)
        telemetry = self.store.telemetry
        first_step = len(telemetry)
        # "context": the context filled before max_tokens did
        finish = "length" if budget == sampling.max_tokens else "context"

        # each timed span ends with the sampler's read of the token: GPU work completed
        drafter = self.spec.drafter(self.executor)
        if drafter is not None:
            drafter.reset(history)
        logits = self._prefill(prompt_ids, cached, drafter, req)
        prefill_s = 0.0
        if logits is None:                # cancelled part way: no token
            finish, budget = "cancelled", 0
        else:
            check_finite(logits, self.model, self.dtype)
        if not budget:
            prefill_s = time.perf_counter() - t0
        spec_stats = SpecStats() if drafter is not None else None
        ex = self.executor
        tokens = (speculative_tokens(ex.verify, ex.rollback, drafter, logits, sampler,
                                     history, budget, self.ctx_size, step_s, spec_stats)
                  if drafter is not None else
                  pipelined_tokens(self.forward, logits, sampler.pick, history, budget, step_s)
                  if self.pipeline and sampler.on_device else
                  plain_tokens(self.forward, logits, sampler, history, budget, step_s))
        for n, token in enumerate(tokens):
            if n:
                self._check_current(ticket)
            else:
                prefill_s = time.perf_counter() - t0      # to the first token
            history.append(token)
            if req.cancelled():
                finish = "cancelled"
                break
            if token in stop_ids:
                finish = "stop"
                break
            out_ids.append(token)
            piece = stops.feed(text_of.feed(token))
            if piece:
                text.append(piece)
                yield piece
                # a newer request may have taken the store while this stream was paused:
                # stop before the next forward runs over it
                self._check_current(ticket)
            if stops.stopped:
                finish = "stop"
                break
        tokens.close()
        self._check_current(ticket)       # paused at its last piece: the result would mix
        if drafter is not None:
            drafter.finish(history)       # (an MTP drafter's layer catches up with the trunk)
        tail = stops.feed(text_of.flush()) + stops.flush()
        if tail:
            text.append(tail)
            yield tail
        self._check_current(ticket)
        return GenerationResult("".join(text), out_ids, len(prompt_ids), len(out_ids),
                                         finish, prefill_s, sum(step_s),
                                         summarize(telemetry[first_step:]),
                                         self.executor.request_stats(), step_s,
                                         list(self.executor.host_s),
                                         spec_stats.as_dict() if spec_stats else {},
                                         cached_tokens=cached)

    def _resume(self, prompt_ids: list[int], reuse: bool) -> int:
        """The first position this request computes: with cache_prompt (`reuse`) the
        longest prefix of the prompt that the store's history (or a cached one) repeats is
        kept (kv/prefix.py), else the store starts over."""
        plan = self.model.layer_plan
        if not reuse:                     # (the live history stays in the prompt cache)
            set_aside(self.store, self.prompt_cache, self.ubatch, trunk=plan.trunk_kv_layers)
            self.store.reset()
            return 0
        swap_in(self.store, self.prompt_cache, prompt_ids, self.ubatch,
                trunk=plan.trunk_kv_layers)
        return self.store.prefix.resume(prompt_ids, self.ubatch, trunk=plan.trunk_kv_layers,
                                        mtp=plan.mtp if self.spec.uses_mtp else ())

    # ---- sessions ----------------------------------------------------------------------------
    def save_session(self, path) -> dict:
        """Write the history this Engine holds (its KV, token ids, recurrent state) to
        `path` (engine/session.py); returns its tokens and bytes."""
        ticket = self._gate.enter()           # not under another thread's request
        try:
            h = take(self.store)
        finally:
            self._gate.leave(ticket)
        nbytes = session.save(path, h, session.model_identity(self.model, self.path))
        return dict(tokens=len(h.held()), bytes=nbytes)

    def load_session(self, path) -> int:
        """Make a saved session this Engine's history (no prefill: the next request resumes
        from it); returns the tokens it holds. Another model's session, another KV layout,
        a newer format or a torn file raise SessionError and leave the history as it was."""
        h = session.load(path, session.model_identity(self.model, self.path),
                         layout(self.store))
        try:
            check(self.store, h)          # what the file says fits this store as it is
        except KvLayoutError as e:
            raise SessionError(f"{path} does not fit this Engine: {e}") from None
        ticket = self._gate.enter()
        try:
            # the conversation held now stays in the prompt cache, as a new one's would
            set_aside(self.store, self.prompt_cache, self.ubatch,
                      trunk=self.model.layer_plan.trunk_kv_layers)
            put(self.store, h)
        finally:
            self._gate.leave(ticket)
        return len(h.held())

    def forward_rows(self, ids: list[int], start: int) -> torch.Tensor:
        """Every row's logits of ids at positions start.. (a verify step)."""
        return self.executor.verify(ids, start)[0]

    def _check_current(self, ticket: int) -> None:
        if not self._gate.holds(ticket):
            raise StreamInterruptedError(
                "this stream was interrupted: a newer request on the same Engine has taken "
                "over its KV cache; read a stream to the end before starting the next one, or "
                "use one Engine per concurrent stream")

    def _prefill(self, ids: list[int], start: int, drafter=None,
                 req: Request | None = None) -> torch.Tensor | None:
        """The prompt from position `start` (what the store did not hold) in chunks on the
        ubatch grid (the first one ends at the next multiple of the ubatch: a resumed
        prefill cuts where a cold one does); None if the request was cancelled before the
        last."""
        # a bar once the rest is long enough to take a while (progress=False: none)
        bar = tqdm(total=len(ids) - start, desc="prefill", unit="tok", leave=False,
                   file=sys.stderr,
                   disable=not self.progress or len(ids) - start < PREFILL_BAR_TOKENS)
        logits = None
        prefix, ub = self.store.prefix, self.ubatch
        with bar:
            s = start
            while s < len(ids):
                if req is not None and req.cancelled():
                    return None           # the chunks so far stay history
                end = min(len(ids), (s // ub + 1) * ub)
                prefix.prefill_chunk(s, last=end == len(ids))   # recurrent checkpoints
                piece = ids[s:end]
                if drafter is not None and drafter.wants_hidden:   # the MTP layer's input
                    logits, hidden = self.executor.step_hidden(piece, s)
                    drafter.add(s, hidden, ids)
                else:
                    logits = self.forward(piece, s)
                bar.update(len(piece))
                s = end
        prefix.prompt_end(len(ids))
        return logits

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ids at positions start.. through the model; logits of the last one (with CUDA
        graphs a program's output buffer: valid until the next step, copy it to keep it)."""
        if self.threads is not None:
            self.threads.adjust()
        return self.executor.step(ids, start)
