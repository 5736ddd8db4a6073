#!/usr/bin/env bash
# The KV store's CUDA backend: its GPU tests (copy stream, event fences, pinned history, the
# SM gather). Run from the repo root with R (repo root) and OUT set; writes
# $OUT/streaming_gpu/. About a minute on one H200.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/streaming_gpu"
mkdir -p "$O"
cd /tmp
python3 -m pytest -q -m gpu -s -rs "$R/tests/test_streaming_gpu.py" 2>&1 | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
