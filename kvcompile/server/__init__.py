"""`kvcompile serve`: an OpenAI-compatible HTTP server over one Engine (docs/server.md).

Nothing here is imported by `import kvcompile`; the server's dependencies (starlette,
uvicorn, prometheus-client: `pip install 'kvcompile[serve]'`) load only when it starts.
Modules: `app` (routes), `fields` (request bodies), `body` (reading them), `worker` (the
engine's thread and its queue), `generation` (a request's run), `shapes` (OpenAI's response
shapes), `api_error` (errors), `metrics` (Prometheus), `slots` (saved sessions),
`cli_serve` (the command line).
"""
