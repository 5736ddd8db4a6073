#!/usr/bin/env bash
# The GPU tests the step runner and the phase programs touch: phase programs (kept across
# requests), decode graphs, the Engine on CUDA, the qlinear kernels at their defaults.
# KEYS="expr" selects tests (pytest -k); TESTS="tests/a.py tests/b.py" replaces the files.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/gpu_tests_runner"; mkdir -p "$O"
cd /tmp
timeout ${TESTS_LIMIT:-500} python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider \
    $(for f in ${TESTS:-tests/test_phase_gpu.py tests/test_decode_graph_gpu.py \
        tests/test_engine_gpu.py tests/test_kernels_qlinear.py}; do echo "$R/$f"; done) \
    ${KEYS:+-k "$KEYS"} 2>&1 | grep --line-buffered -v "Warning\|warnings.warn" \
    | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
