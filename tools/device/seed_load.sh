#!/usr/bin/env bash
# The seed-27b hybrid in IQ4_XS: make-model on the device, bench_load.py (load time beside
# cat, peak RSS, device bytes of the weights), then bench_seed.py (a 256K prompt through the
# Engine under a 16 GiB budget with the arena chosen automatically, beside all resident).
# make-model ~1.5 min, bench_load ~0.5, each 256K prefill ~5-7: run the two parts in two
# calls, SEED_ARGS="--part budget" then SEED_ARGS="--part resident" with
# SEED_OUT=benchmarks/results/quantized_weights.json in both (the resident part compares its
# tokens with the budget row there: carry the file back between the calls) and SEED_LIMIT
# near the call's time left. SEED_TYPE=q4_k makes and loads that type instead; SEED_RUN=0
# stops after the load (the Q4_K file's memory and load line); LOAD=0 skips bench_load.
# Writes $OUT/seed_load/ (load.json, seed.json, logs).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/seed_load"; mkdir -p "$O"
T=${SEED_TYPE:-iq4_xs}
F=/tmp/seed27b.$T.gguf
cd "$R"
[ -f "$F" ] || { s=$(date +%s); timeout 300 python3 -m kvcompile make-model --arch qwen35 \
    --preset seed-27b --type "$T" --out "$F" 2>&1 | tail -3 | tee "$O/make.log";
    echo "make-model $(( $(date +%s) - s )) s" | tee -a "$O/make.log"; }
if [ "${LOAD:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/bench_load.py "$F" ${LOAD_ARGS:-} --out "$O/load.json" 2>&1 | tee "$O/load.log"
  [ "${SEED_RUN:-1}" = 0 ] && exit ${PIPESTATUS[0]}
fi
cd /tmp
S="${SEED_OUT:-$O/seed.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
timeout ${SEED_LIMIT:-420} python3 "$R/benchmarks/bench_seed.py" "$F" --out "$S" \
    ${SEED_ARGS:-} 2>&1 | grep --line-buffered -v "Warn\|it/s" | tee "$O/seed.log"
rc=${PIPESTATUS[0]}
cp "$S" "$O/seed.json" 2>/dev/null
exit $rc
