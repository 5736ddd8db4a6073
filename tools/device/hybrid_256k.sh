#!/usr/bin/env bash
# The issue-6 target row alone: seed-27b geometry at 256K, q8_0/q4_0, arena 2240 MiB.
# SYSTEMS (default ours-graphs), LIMIT seconds (default 255). ~3.5 min on one H200
# (fla autotune ~1 min, 256K prefill ~2 min). Writes $OUT/hybrid_256k/{hybrid.json,log.txt}.
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/hybrid_256k"; mkdir -p "$D"
cd /tmp
timeout "${LIMIT:-255}" python3 "$R/benchmarks/bench_hybrid.py" --contexts 262144 \
    --systems "${SYSTEMS:-ours-graphs}" --decode-steps 8 --no-sanity --fresh \
    --out "$D/hybrid.json" > "$D/log.txt" 2>&1
rc=$?
grep -v "it/s\|chunk/s" "$D/log.txt" | tail -25
exit $rc
