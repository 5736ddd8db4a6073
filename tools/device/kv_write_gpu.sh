#!/usr/bin/env bash
# kv_write's Triton kernel on CUDA (tests/test_kernels_kv_write.py -m gpu): pools equal the
# reference byte for byte and hold gguf's q8_0 / q4_0 codes. ~1 minute. Writes $OUT/kv_write_gpu/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/kv_write_gpu"; mkdir -p "$O"
cd /tmp
timeout 300 python3 -m pytest -q -m gpu -rfEs "$R/tests/test_kernels_kv_write.py" 2>&1 | tee "$O/pytest.log"
exit "${PIPESTATUS[0]}"
