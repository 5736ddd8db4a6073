"""kvcompile: long-context LLM inference with exact attention over a streamed KV cache."""
from kvcompile.errors import KvcompileError  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import kvcompile` stays cheap (no torch model code) until the API is used.
    if name in ("generate", "stream"):
        from kvcompile import api
        return getattr(api, name)
    if name in ("Engine", "GenerationResult", "TokenStream"):
        from kvcompile.engine import engine
        return getattr(engine, name)
    if name == "SamplingParams":
        from kvcompile.engine.sampling import SamplingParams
        return SamplingParams
    if name == "EngineConfig":
        from kvcompile.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'kvcompile' has no attribute {name!r}")


__all__ = ["generate", "stream", "Engine", "EngineConfig", "GenerationResult", "TokenStream",
           "SamplingParams", "KvcompileError"]
