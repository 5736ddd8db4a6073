#!/usr/bin/env bash
# bench_speculative.py --oracle on the device (issue 43's speed lines): the seed-27b hybrid in
# IQ4_XS (made here, ~1.5 min), a 256K prompt streamed under a 16 GiB budget with the arena it
# leaves (the configuration), plain decode then oracle drafts of depth 5 in the same
# Engine (the second request resumes the first one's history: one 256K prefill), then verify
# steps of widths 1..6 and 49 on that context, draft-mtp's tokens against plain decoding on
# the whole prompt (its request first: the plain and oracle ones resume its history) and
# on a 32K prompt of the same Engine. SPEC_ARGS adds or overrides options (e.g.
# "--mtp-context 0", "--widths 1,6"); SPEC_OUT (a repo path, e.g.
# benchmarks/results/speculative.json) gets the row appended. Writes
# $OUT/spec_oracle/{speculative.json,log.txt}. SPEC_LIMIT (default: what is left of 575 s
# after making the model) bounds the benchmark.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/spec_oracle"; mkdir -p "$O"
# in RAM when it has room (the file took ~85 s to write to /tmp's disk at ~170 MB/s)
D=/tmp; [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -gt 24 ] 2>/dev/null && D=/dev/shm
F=$D/seed27b.iq4_xs.gguf
T0=$(date +%s)
cd "$R"
[ -f "$F" ] || timeout 300 python3 -m kvcompile make-model --arch qwen35 --preset seed-27b \
    --type iq4_xs --out "$F" 2>&1 | tail -2
S="${SPEC_OUT:-$O/speculative.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
# the rest of a 600 s call unless SPEC_LIMIT says (the install ran before this script)
timeout ${SPEC_LIMIT:-$(( 575 - $(date +%s) + T0 ))} python3 "$R/benchmarks/bench_speculative.py" --oracle "$F" \
    --device cuda --context 262144 --depth 5 --gpu-memory-gib 16 --arena-mib auto \
    --widths 1,2,3,4,5,6,49 --mtp-context 32768,262144 \
    ${SPEC_ARGS:-} --out "$S" 2>&1 | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/speculative.json" 2>/dev/null
exit $rc
