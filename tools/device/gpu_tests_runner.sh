#!/usr/bin/env bash
# The GPU tests the step runner and the phase programs touch: phase programs (kept across
# requests), piecewise decode, the Engine on CUDA, the qlinear kernels at their defaults.
# KEYS="expr" selects tests (pytest -k).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/gpu_tests_runner"; mkdir -p "$O"
cd /tmp
timeout ${TESTS_LIMIT:-500} python3 -m pytest -q -m gpu -rfEs -p no:cacheprovider \
    "$R/tests/test_phase_gpu.py" "$R/tests/test_piecewise_gpu.py" "$R/tests/test_engine_gpu.py" \
    "$R/tests/test_kernels_qlinear.py" ${KEYS:+-k "$KEYS"} 2>&1 | grep -v "Warning\|warnings.warn" \
    | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
