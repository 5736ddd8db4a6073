#!/usr/bin/env bash
# bench_prefill.py on the device (issue 46's prefill lines): the 8B geometry (random bf16
# weights made here) at 128K through Engine.generate, all resident and through a 2048 MiB
# arena, q8_0/q4_0 KV, beside transformers' DynamicCache on the same weights; then the
# prefill kernel beside SDPA at 16K and 64K. PREFILL_ARGS adds or overrides options;
# PREFILL_OUT (a repo path, default benchmarks/results/prefill.json) gets the rows appended.
# Writes $OUT/prefill/{prefill.json,log.txt}. About 5 minutes.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/prefill"; mkdir -p "$O"
S="${PREFILL_OUT:-benchmarks/results/prefill.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
timeout ${PREFILL_LIMIT:-540} python3 "$R/benchmarks/bench_prefill.py" ${PREFILL_ARGS:-} \
    --out "$S" 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/prefill.json" 2>/dev/null
exit $rc
