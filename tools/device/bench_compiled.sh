#!/usr/bin/env bash
# Issue 5's benchmark: compiled + captured decode (all resident, 8K) and decode graphs
# (streamed, 128K, arena 2048 MiB) beside their eager twins, Llama-3-8B geometry.
# ARGS takes bench_compiled.py's options, e.g. --systems, --trials 3. Writes
# $OUT/bench_compiled/{streaming.json,log.txt}: merge its rows into
# benchmarks/results/streaming.json (bench_streaming.save(..., section="compiled")); copy
# the JSON to $OUT's top level in the same call (many files under $OUT come back as none).
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/bench_compiled"; mkdir -p "$D"
cd /tmp
python3 "$R/benchmarks/bench_compiled.py" --out "$D/streaming.json" ${ARGS:-} 2>&1 \
    | grep --line-buffered -v "it/s\|chunk/s" | tee "$D/log.txt"
exit "${PIPESTATUS[0]}"
