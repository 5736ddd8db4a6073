"""The model's forward traced once by torch.compile through a pass pipeline, for the
programs that capture it (phase/manager.py, phase/decode_graph.py)."""
from __future__ import annotations

import contextlib

import torch

from kvcompile.errors import PhaseError


def _recompile_limit_error():
    import torch._dynamo.exc as exc
    return getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit", ())


# traces a forward may hold: one per row count of the programs that share it (decode and
# the verify widths, runner.py) for a few Engines of one model class (dynamo's default, 8,
# is two such Engines)
RECOMPILE_LIMIT = 32


def _fail_on_recompile_limit():
    import torch._dynamo.config as cfg
    patch = {}
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, name):
            patch[name] = True
            break
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            patch[name] = max(getattr(cfg, name), RECOMPILE_LIMIT)
            break
    return cfg.patch(**patch) if patch else contextlib.nullcontext()


def compile_forward(model, pipeline, lower: str = "graph"):
    """`passes.compile_model(model, pipeline)` with static shapes. Dynamo keys its cache on
    the backend, so an earlier program's graphs of this model class are never reused here,
    yet they count toward the recompile limit of the forward (the third Engine of a process
    hit it): they are dropped first. Past the limit dynamo would silently run the forward
    eagerly, whose host-side checks cannot be captured: that fails with the reason."""
    from kvcompile.passes import compile_model

    torch._dynamo.reset_code(type(model).forward.__code__)
    compiled = compile_model(model, pipeline, lower=lower, dynamic=False)
    limit_hit = _recompile_limit_error()

    def run(*args, **kwargs):
        with _fail_on_recompile_limit():
            try:
                return compiled(*args, **kwargs)
            except limit_hit as e:
                raise PhaseError(
                    f"the compiled forward hit torch._dynamo's recompile limit ({e}); call "
                    f"torch._dynamo.reset() between models or raise "
                    f"torch._dynamo.config.recompile_limit") from None
    return run
