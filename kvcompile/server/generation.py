"""A generation request's work on the Engine's thread: start the stream (the Engine's
checks refuse a bad request here, before anything runs), pass each text piece on, stop at the
next prefill chunk or token once the client is gone."""
from __future__ import annotations

from kvcompile.server.fields import GenRequest


def generation_work(req: GenRequest, metrics):
    """work(engine, job) for a Job: emits "start", then "piece"s; returns the
    GenerationResult (None when the client went away first)."""
    def work(engine, job):
        stream = engine.stream(req.prompt, messages=req.messages,
                               cache_prompt=None if req.cache_prompt else False,
                               cancel=job.cancel_event, **req.options)
        job.emit("start")
        try:
            for piece in stream:
                if job.cancelled:
                    break
                job.emit("piece", piece)
        finally:
            stream.close()            # the Engine is free for the next request
        metrics.observe(stream.result)
        return stream.result
    return work
