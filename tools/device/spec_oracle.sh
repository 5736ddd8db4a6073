#!/usr/bin/env bash
# bench_speculative.py --oracle on the device (issue 27's speed lines): the seed-27b hybrid in
# IQ4_XS (made here, ~1.5 min), a 256K prompt streamed through a 2240 MiB arena, plain decode
# then oracle drafts of depth 5 in the same Engine (two 256K prefills, ~2.5 min each), then
# verify steps of widths 1..6 and 49 on that context, then draft-mtp's tokens against plain
# decoding on a 32K prompt of the same Engine. SPEC_ARGS overrides options; SPEC_OUT
# (a repo path, e.g. benchmarks/results/speculative.json) gets the row appended. Writes
# $OUT/spec_oracle/{speculative.json,log.txt}. Making the model (~90 s) comes before
# SPEC_LIMIT starts counting: a call's own limit must cover both. SPEC_LIMIT=420 was cut
# before the oracle decode (two 256K prefills of ~3 min each after the model): in one 600 s
# call take SPEC_LIMIT=490 SPEC_ARGS="--widths 1,6 --mtp-context 0", the rest in another.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/spec_oracle"; mkdir -p "$O"
# in RAM when it has room (the file took ~85 s to write to /tmp's disk at ~170 MB/s)
D=/tmp; [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 24 ] 2>/dev/null && D=/dev/shm
F=$D/seed27b.iq4_xs.gguf
cd "$R"
[ -f "$F" ] || timeout 300 python3 -m kvcompile make-model --arch qwen35 --preset seed-27b \
    --type iq4_xs --out "$F" 2>&1 | tail -2
S="${SPEC_OUT:-$O/speculative.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
timeout ${SPEC_LIMIT:-540} python3 "$R/benchmarks/bench_speculative.py" --oracle "$F" \
    --device cuda --context 262144 --depth 5 --arena-mib 2240 --widths 1,2,3,4,5,6,49 --mtp-context 32768 \
    ${SPEC_ARGS:-} --out "$S" 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/speculative.json" 2>/dev/null
exit $rc
