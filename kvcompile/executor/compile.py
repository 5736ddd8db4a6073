"""The model's forward traced by torch.compile through a pass pipeline, for the executor's
programs (executor.py): over a streamed store the streamed pipeline, whose ring ops are
lowered to the store's page movement; over an all-resident store the default one."""
from __future__ import annotations

import torch

from kvcompile.errors import ProgramError


# traces a forward may hold: one per row count of the programs that share it (the decode and
# verify widths, the prefill ubatch) for a few Engines of one model class (dynamo's
# default, 8, is two such Engines)
RECOMPILE_LIMIT = 32


def _fail_on_recompile_limit():
    import torch._dynamo.config as cfg
    return cfg.patch(fail_on_recompile_limit_hit=True,
                     recompile_limit=max(cfg.recompile_limit, RECOMPILE_LIMIT))


def trace_forward(model, store, lower: str = "graph"):
    """The model's forward over `store`, traced: its ring ops lowered to the store's page
    movement when the store streams, none when every page is resident."""
    from kvcompile.passes import default_pipeline, streamed_pipeline
    pipeline = streamed_pipeline(store) if store.streams else default_pipeline(streamed=())
    return compile_forward(model, pipeline, lower)


def compile_forward(model, pipeline, lower: str = "graph"):
    """`passes.compile_model(model, pipeline)` with static shapes. Dynamo keys its cache on
    the backend, so an earlier program's graphs of this model class are never reused here,
    yet they count toward the recompile limit of the forward (the third Engine of a process
    hit it): they are dropped first. Past the limit dynamo would silently run the forward
    eagerly, whose host-side checks cannot be captured: that fails with the reason."""
    from kvcompile.passes import compile_model

    torch._dynamo.reset_code(type(model).forward.__code__)
    compiled = compile_model(model, pipeline, lower=lower, dynamic=False)
    from torch._dynamo.exc import FailOnRecompileLimitHit as limit_hit

    def run(*args, **kwargs):
        with _fail_on_recompile_limit():
            try:
                return compiled(*args, **kwargs)
            except limit_hit as e:
                raise ProgramError(
                    f"the compiled forward hit torch._dynamo's recompile limit ({e}); call "
                    f"torch._dynamo.reset() between models or raise "
                    f"torch._dynamo.config.recompile_limit") from None
    return run
