#!/usr/bin/env bash
# The GPU tests of the executor and the KV store (kvcompile/executor, kvcompile/kv): captured
# steps bitwise the eager model (streamed and resident, llama and qwen35, 4K..64K), verify
# programs, the lowered ring ops, row publishing, PDL, pipelined decode, speculative
# rounds (the GDN rows in one recurrence call), the Engine on CUDA, the CUDA streaming backend,
# windowed layers, sessions and the prompt cache, prefill over pieces and dequantized
# spans. Needs the gguf, fla-core and
# einops wheels (.whl/). KEYS: a pytest -k expression; TESTS: other test files; WORKERS:
# pytest-xdist workers (4: correctness tests share the GPU fine; each file on one worker).
# Writes $OUT/executor_gpu/pytest.log.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/executor_gpu"; mkdir -p "$O"
cd /tmp
par=""; python3 -c "import xdist" 2>/dev/null && par="-n ${WORKERS:-4} --dist loadfile"
timeout ${TESTS_LIMIT:-540} python3 -m pytest -q --maxfail=3 --durations=15 -m gpu -rfEs \
    $par -p no:cacheprovider ${KEYS:+-k "$KEYS"} \
    $(for f in ${TESTS:-tests/test_executor_gpu.py tests/test_lower_ring.py \
        tests/test_row_publish.py tests/test_pdl_gpu.py tests/test_pipelined_decode.py \
        tests/test_speculative_hybrid.py tests/test_engine_gpu.py \
        tests/test_streaming_hybrid_gpu.py tests/test_streaming_gpu.py tests/test_sessions.py \
        tests/test_gated_deltanet.py tests/test_streaming_windows.py \
        tests/test_prefill_chunks.py}; do echo "$R/$f"; done) \
    2>&1 | grep --line-buffered -v "Warning\|warnings.warn" | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
