"""One-call API: kvcompile.generate(...) and kvcompile.stream(...).

Both keep the last Engine they built, so repeated calls with the same model and engine
options do not reload the weights. Use Engine directly for explicit control.
"""
from __future__ import annotations

from kvcompile.engine.config import EngineConfig
from kvcompile.engine.engine import Engine, GenerationResult, TokenStream

# Engine's options (everything else is a sampling option of the request)
_ENGINE_KEYS = EngineConfig.names()
_cached: tuple[tuple, Engine] | None = None


def _engine(model, options: dict) -> Engine:
    global _cached
    key = (str(model),) + tuple(sorted((k, repr(v)) for k, v in options.items() if k != "progress"))
    if _cached is None or _cached[0] != key:
        _cached = None                      # free the old model before loading the next
        _cached = (key, Engine(model, **options))
    engine = _cached[1]
    engine.progress = options.get("progress", True)   # not in the key: no reload for it
    return engine


def _split(kwargs: dict) -> tuple[dict, dict]:
    engine_opts = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_KEYS}
    return engine_opts, kwargs


def generate(prompt: str | None = None, model=None, *, messages: list[dict] | None = None,
             **kwargs) -> GenerationResult:
    """Generate a completion. kwargs: sampling (max_tokens, temperature, top_k, top_p, min_p,
    repeat_penalty, repeat_last_n, seed, stop) and engine options (EngineConfig's fields:
    ctx_size, cache_type_k, cache_type_v, device, dtype, ubatch, kv_stream_arena_mib,
    gpu_memory_gib, cuda_graphs, cache_prompt, spec_type, ...).
    Returns text plus token counts and tok/s. An unknown option raises SamplingError."""
    engine_opts, sampling = _split(dict(kwargs))
    return _engine(model, engine_opts).generate(prompt, messages=messages, **sampling)


def stream(prompt: str | None = None, model=None, *, messages: list[dict] | None = None,
           **kwargs) -> TokenStream:
    """Like generate(), but yields text pieces as they are produced; `.result` at the end."""
    engine_opts, sampling = _split(dict(kwargs))
    return _engine(model, engine_opts).stream(prompt, messages=messages, **sampling)
