#!/usr/bin/env bash
# Decode steps as one CUDA graph each (kvcompile/phase/decode_graph.py): replayed decode ==
# eager decode bitwise, llama and hybrid qwen35, streamed and resident KV; the engine with
# --cuda-graphs; the runner's captured streamed decode at 4K..64K; speculative rounds
# between replays; the lowered ring ops of a traced streamed forward (test_lower_ring.py).
# Needs the gguf, fla-core and einops wheels (.whl/).
# Writes $OUT/decode_graph_gpu/. KEYS (optional): a pytest -k expression to run a subset.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/decode_graph_gpu"; mkdir -p "$O"
cd /tmp
timeout ${TESTS_LIMIT:-540} python3 -m pytest -q -s --maxfail=3 --durations=12 -m gpu -rs -p no:cacheprovider \
    ${KEYS:+-k "$KEYS"} "$R/tests/test_lower_ring.py" "$R/tests/test_row_publish.py" "$R/tests/test_decode_graph_gpu.py" "$R/tests/test_runner_gpu.py" \
    "$R/tests/test_speculative_hybrid.py" "$R/tests/test_pipelined_decode.py" 2>&1 \
    | grep --line-buffered -v "Warning\|warnings.warn" | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
