#!/usr/bin/env bash
# bench_sweep.py on the device (issue 28): the 8B geometry (random bf16 weights made on the
# device) through Engine.generate at 8K..256K for arenas of 1024, 2048, 4096 MiB and auto,
# q8_0/q4_0 KV, 32 decode steps, and the HF peers (resident, offloaded) up to 64K. Writes
# $OUT/sweep/{sweep.json,arena_sweep.png,log.txt}. SWEEP_ARGS adds options; a full sweep is
# 3 calls: "--contexts 8192,32768,65536,131072" (~6 min), then "--contexts 262144 --arenas
# 1024,2048 --no-peers" and "--contexts 262144 --arenas 4096,auto --no-peers" (~7 min each,
# estimated: 256K was never timed). SWEEP_LIMIT (default 540 s): no case starts that would
# end later (a hard timeout follows 30 s after). SWEEP_OUT (a repo path, e.g.
# benchmarks/results/sweep.json) gets the rows appended, so the PNG draws every call's rows
# of this commit, and the PNG is copied to docs/arena_sweep.png. Pass
# KVCOMPILE_COMMIT=<hash>: the device's copy has no .git.
# usage (device, repo root): SWEEP_ARGS="..." tools/device/batch.sh sweep
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/sweep"; mkdir -p "$O"
S="${SWEEP_OUT:-$O/sweep.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
L=${SWEEP_LIMIT:-540}
cd /tmp
timeout $((L + 30)) python3 "$R/benchmarks/bench_sweep.py" --limit-s "$L" \
    ${SWEEP_ARGS:-} --out "$S" --plot "$O/arena_sweep.png" 2>&1 \
    | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/sweep.json" 2>/dev/null
if [ -n "${SWEEP_OUT:-}" ] && [ -f "$O/arena_sweep.png" ]; then
    cp "$O/arena_sweep.png" "$R/docs/arena_sweep.png"
fi
exit $rc
