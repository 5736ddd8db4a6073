#!/usr/bin/env bash
# All GPU kernel tests (placement independence, exactness, kv_write = gguf, prefill pieces,
# decode workspace) and the decode benchmark (BENCH=0: tests only; BENCH_ARGS adds options,
# e.g. "--untraced --contexts 32768,262144"). ~5 minutes.
# Writes $OUT/kernels_full/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/kernels_full"; mkdir -p "$O"
cd /tmp
python3 -m pytest -q -m gpu -n 15 -rfE "$R/tests/test_kernels_span_attention.py" \
    "$R/tests/test_kernels_kv_write.py" "$R/tests/test_prefill_chunks.py" \
    "$R/tests/test_decode_workspace.py" 2>&1 | tail -40 | tee "$O/pytest.log"
rc=${PIPESTATUS[0]}
[ "${BENCH:-1}" = 0 ] && exit $rc    # BENCH=0: the tests only
python3 "$R/benchmarks/bench_attention.py" --decode-only --rows 1,8 --impls blocks,legacy \
    --out "$O/attention_decode.json" ${BENCH_ARGS:-} 2>&1 | grep --line-buffered -v "^  decode" | tee "$O/bench.log"
exit $rc
