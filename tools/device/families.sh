#!/usr/bin/env bash
# Gemma 3's windowed streaming on the device (issue 45): bench_families.py, the gemma3-12b
# preset geometry (random bf16 weights made on the device) at 128K, all resident and
# through a 2048 MiB arena (FAMILY_ARGS overrides), q8_0/q4_0 KV; then the GPU tests of
# the window kernels and the windowed store (FAMILY_TESTS=0 skips them). Writes
# $OUT/families/{families.json,log.txt,pytest.log}; FAMILY_OUT (a repo path, default
# benchmarks/results/families.json) gets the rows appended.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/families"; mkdir -p "$O"
S="${FAMILY_OUT:-benchmarks/results/families.json}"; [ "${S#/}" = "$S" ] && S="$R/$S"
cd /tmp
timeout ${FAMILY_LIMIT:-360} python3 "$R/benchmarks/bench_families.py" \
    ${FAMILY_ARGS:---preset gemma3-12b --context 131072 --arena-mib 2048} --out "$S" 2>&1 \
    | grep --line-buffered -v "Warn\|warn(" | tee "$O/log.txt"
rc=${PIPESTATUS[0]}
cp "$S" "$O/families.json" 2>/dev/null
if [ "${FAMILY_TESTS:-1}" = 1 ]; then
  timeout ${FAMILY_TESTS_LIMIT:-180} python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs \
      "$R/tests/test_streaming_windows.py" "$R/tests/test_kernels_span_attention.py" \
      -k "window or Window" 2>&1 | grep -v "Warning\|warnings.warn" | tee "$O/pytest.log"
  [ ${PIPESTATUS[0]} = 0 ] || rc=1
fi
exit $rc
