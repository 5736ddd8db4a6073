#!/usr/bin/env bash
# bench_server.py on the device: the 8B geometry (random bf16 weights made on the device)
# behind `kvcompile serve`'s app, KV q8_0/q4_0 streamed through a 2048 MiB arena: a 64K
# first turn and 5 later turns of 300 new tokens (TTFT of each, target <= 0.05 x the
# first's), then a 32K session saved, restored in a new process and continued (tokens
# equal, load <= 0.1 x the cold prefill). Needs the server's wheels in .whl (starlette,
# uvicorn, h11, click, anyio, idna, prometheus_client). Writes $OUT/server/{server.json,
# log.txt}; SERVER_OUT (a repo path) also gets the rows appended.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/server"; mkdir -p "$O"
S="${SERVER_OUT:-$O/server.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
timeout ${SERVER_LIMIT:-540} python3 "$R/benchmarks/bench_server.py" ${SERVER_ARGS:-} \
    --out "$S" 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/server.json" 2>/dev/null
exit $rc
