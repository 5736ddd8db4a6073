#!/usr/bin/env bash
# The seed-27b hybrid in IQ4_XS: make-model on the device, bench_load.py (load time beside
# cat, peak RSS, device bytes of the weights), then bench_seed.py (a 256K prompt through the
# Engine under a 16 GiB budget with the arena chosen automatically, beside all resident).
# ~8 minutes. Writes $OUT/seed_load/ (load.json; seed.json: the row bench_seed appends).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/seed_load"; mkdir -p "$O"
F=/tmp/seed27b.iq4_xs.gguf
cd "$R"
[ -f "$F" ] || { s=$(date +%s); timeout 300 python3 -m kvcompile make-model --arch qwen35 \
    --preset seed-27b --type iq4_xs --out "$F" 2>&1 | tail -3 | tee "$O/make.log";
    echo "make-model $(( $(date +%s) - s )) s" | tee -a "$O/make.log"; }
timeout 120 python3 benchmarks/bench_load.py "$F" ${LOAD_ARGS:-} --out "$O/load.json" 2>&1 | tee "$O/load.log"
cd /tmp
timeout ${SEED_LIMIT:-420} python3 "$R/benchmarks/bench_seed.py" "$F" --out "$O/seed.json" \
    ${SEED_ARGS:-} 2>&1 | grep -v "Warn\|it/s" | tee "$O/seed.log"
exit ${PIPESTATUS[0]}
