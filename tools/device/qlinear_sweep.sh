#!/usr/bin/env bash
# Launch-configuration sweep of the quantized GEMVs (bench_qlinear.py --sweep) at the 8B
# shapes, then the default rows. ~4 minutes. Writes $OUT/qlinear_sweep/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/qlinear_sweep"; mkdir -p "$O"
cd "$R"
timeout 420 python3 benchmarks/bench_qlinear.py --sweep ${QL_ARGS:-} --out "$O/qlinear.json" \
    2>&1 | grep --line-buffered -v "^ \\|Warn" | tee "$O/bench.log"
exit ${PIPESTATUS[0]}
