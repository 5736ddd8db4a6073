#!/usr/bin/env bash
# The 8B geometry with quantized weights against its bf16 twin (tests/test_quantized_model.py,
# gpu-marked: Q4_K, Q6_K, Q8_0, IQ4_XS). ~3 minutes. Writes $OUT/quant_model/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/quant_model"; mkdir -p "$O"
cd /tmp
timeout 400 python3 -m pytest -q -s -m gpu -rfEs -p no:cacheprovider \
    "$R/tests/test_quantized_model.py" 2>&1 | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
