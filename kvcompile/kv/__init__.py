"""The KV store (store.py) and what it is made of: the arena, the pages, host history, the
resident/ring pool, the policy, fences, copy engines, backends, telemetry, the recurrent
state and prefix reuse. docs/streaming.md describes the modules."""
