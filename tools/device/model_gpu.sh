#!/usr/bin/env bash
# The decoder layer's row ops on CUDA (tests/test_kernels_rows.py: rms_norm, add_rms_norm,
# rope_rotate, silu_mul against their references, 8B widths), the decode GEMV
# (tests/test_kernels_gemv.py), PDL launches (tests/test_pdl_gpu.py) and the engine /
# decode workspace GPU tests that run the model through them. ~2 minutes. Writes $OUT/model_gpu/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/model_gpu"; mkdir -p "$O"
cd /tmp
timeout 400 python3 -m pytest -q -s -m gpu -rfEs "$R/tests/test_kernels_rows.py" \
    "$R/tests/test_engine_gpu.py" "$R/tests/test_decode_workspace.py" \
    "$R/tests/test_kernels_gemv.py" "$R/tests/test_pdl_gpu.py" 2>&1 | tee "$O/pytest.log"
exit "${PIPESTATUS[0]}"
