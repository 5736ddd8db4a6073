"""The server's Prometheus metrics (GET /metrics), in a registry of their own.

Requests by endpoint and status; prompt, completion and cached (reused) prompt tokens;
prefill and decode rates of the last request; time to first token; the queue; the KV
store's arena and host->device / device->host bytes (streamed stores move pages)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# kvcompile_<name>_total: what each counts
COUNTS = {
    "requests_cancelled": "generations stopped because their client disconnected",
    "prompt_tokens": "prompt tokens of finished requests",
    "prompt_tokens_cached": "prompt tokens whose KV was reused (not prefilled)",
    "completion_tokens": "generated tokens",
    "kv_h2d_bytes": "KV bytes copied host -> device",
    "kv_d2h_bytes": "KV bytes copied device -> host",
}
# kvcompile_<name>: the last finished request's
LAST = {
    "prefill_tokens_per_second": "prefill rate (cached tokens left out)",
    "decode_tokens_per_second": "decode rate",
    "kv_resident_pages": "KV pages resident in the arena at its end",
    "kv_streamed_fraction": "page reads from the streamed ring",
}


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, worker):
        r = self.registry = CollectorRegistry()
        self.count = {name: Counter(f"kvcompile_{name}", doc, registry=r)
                      for name, doc in COUNTS.items()}
        self.last = {name: Gauge(f"kvcompile_{name}", f"the last request's {doc}", registry=r)
                     for name, doc in LAST.items()}
        self.requests = Counter("kvcompile_requests", "HTTP requests answered, by endpoint "
                                "and status code", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("kvcompile_time_to_first_token_seconds", "time from the "
                              "request's start on the engine to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        store = worker.engine.store
        live = {"queue_depth": ("requests waiting for the engine", lambda: worker.depth),
                "requests_running": ("requests on the engine (0 or 1)",
                                     lambda: worker.running),
                "kv_arena_bytes": ("the KV store's device arena", lambda: store.nbytes),
                "kv_streamed": ("1 when the KV history streams from host memory through "
                                "the arena", lambda: int(store.streams))}
        for name, (doc, read) in live.items():
            Gauge(f"kvcompile_{name}", doc, registry=r).set_function(read)

    def observe(self, result) -> None:
        """A finished generation (None or "cancelled": its client went away first)."""
        count, last = self.count, self.last
        if result is None or result.finish_reason == "cancelled":
            count["requests_cancelled"].inc()
            return
        count["prompt_tokens"].inc(result.prompt_tokens)
        count["prompt_tokens_cached"].inc(result.cached_tokens)
        count["completion_tokens"].inc(result.completion_tokens)
        if result.prompt_tokens > result.cached_tokens and result.prefill_s:
            last["prefill_tokens_per_second"].set(result.prefill_tok_s)
        if result.completion_tokens:
            self.ttft.observe(result.prefill_s)
        if result.completion_tokens > 1:
            last["decode_tokens_per_second"].set(result.decode_tok_s)
        kv = result.kv
        if kv:
            count["kv_h2d_bytes"].inc(kv["h2d_bytes"])
            count["kv_d2h_bytes"].inc(kv["d2h_bytes"])
            last["kv_resident_pages"].set(kv["resident_pages"])
            last["kv_streamed_fraction"].set(kv["streamed_fraction"])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
