#!/usr/bin/env bash
# Issue 5's benchmark: compiled + captured decode (all resident, 8K) and piecewise graphs
# (streamed, 128K, arena 2048 MiB) beside their eager twins, Llama-3-8B geometry.
# NOT run yet; estimated ~5 min on one H200 (the 8B compile ~1-2 min, two 128K prefills
# ~40 s each). Writes $OUT/bench_compiled/{streaming.json,log.txt}: merge its rows into
# benchmarks/results/streaming.json (bench_streaming.save(..., section="compiled")).
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/bench_compiled"; mkdir -p "$D"
cd /tmp
python3 "$R/benchmarks/bench_compiled.py" --out "$D/streaming.json" ${ARGS:-} 2>&1 \
    | grep -v "it/s\|chunk/s" | tee "$D/log.txt"
exit "${PIPESTATUS[0]}"
