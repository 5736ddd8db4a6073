#!/usr/bin/env bash
# bench_runner.py on the device: the 8B geometry (random bf16 weights made on the device)
# through Engine.generate, streamed through a 2048 MiB arena at 128K and 64K and all
# resident at 8K and 128K (RUNNER_CASES overrides), q8_0/q4_0 KV, 64 decode steps, each case
# a warm-up request, the measured one and the measured one again (--second-request: its
# captures and time to first token); the largest streamed case then a next turn of
# RUNNER_TURN (300) new tokens against a cold prefill of it. Writes $OUT/runner/{runner.json,log.txt};
# RUNNER_OUT (a repo path) also gets the rows appended; RUNNER_ARGS="--ngram-check" adds
# each case's ngram-simple tokens against the plain ones (issue 27's 8B exactness line).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/runner"; mkdir -p "$O"
S="${RUNNER_OUT:-$O/runner.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
timeout ${RUNNER_LIMIT:-540} python3 "$R/benchmarks/bench_runner.py" \
    --cases "${RUNNER_CASES:-streamed:131072,streamed:65536,resident:8192,resident:131072}" \
    --second-request --turn ${RUNNER_TURN:-300} ${RUNNER_ARGS:-} --out "$S" 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/runner.json" 2>/dev/null
exit $rc
