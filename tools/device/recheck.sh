#!/usr/bin/env bash
# Re-run the GPU tests that an op-signature change touches (gdn model vs CPU, prefill op
# default), ~2 minutes. Writes $OUT/recheck/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/recheck"; mkdir -p "$O"
cd /tmp
python3 -m pytest -q -m gpu -rs -s -n 4 "$R/tests/test_gdn_gpu.py" "$R/tests/test_prefill_chunks.py" "$R/tests/test_compile.py" 2>&1 | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
