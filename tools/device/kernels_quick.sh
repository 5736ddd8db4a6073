#!/usr/bin/env bash
# Quick GPU checks of the ops and the engine: decode workspace, engine vs CPU reference.
# Expected run time: ~1.5 minutes. Writes $OUT/kernels_quick/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/kernels_quick"; mkdir -p "$O"
cd /tmp
python3 -m pytest -q -m gpu -rs -s "$R/tests/test_decode_workspace.py" "$R/tests/test_engine_gpu.py" 2>&1 | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
