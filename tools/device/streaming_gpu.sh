#!/usr/bin/env bash
# Streaming runtime on CUDA (issue 4): GPU tests of the CUDA backend and a host->device copy
# micro-benchmark (copy engine on a side stream vs an SM gather from pinned memory).
# Run from the repo root with R (repo root) and OUT set; writes $OUT/streaming_gpu/.
# Expected run time on one H200: ~1.7 minutes (tests ~65 s, benchmark ~30 s).
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/streaming_gpu"
mkdir -p "$O"
cd /tmp
python3 -m pytest -q -m gpu -s -rs "$R/tests/test_streaming_gpu.py" 2>&1 | tee "$O/pytest.log"
rc=${PIPESTATUS[0]}
python3 -m kvcompile.kv.cuda_gather --json "$O/copy_bench.json" 2>&1 | tee "$O/copy_bench.log"
exit $rc
