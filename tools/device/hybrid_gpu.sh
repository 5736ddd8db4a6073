#!/usr/bin/env bash
# Hybrid qwen35 streaming on CUDA (issue 6): tiny arena vs all resident, recurrent state
# untouched by the KV policy (tests/test_streaming_hybrid_gpu.py). Needs the gguf, fla-core
# and einops wheels (.whl/). 95 s on one H200. Writes $OUT/hybrid_gpu/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/hybrid_gpu"; mkdir -p "$O"
cd /tmp
python3 -m pytest -q -s -m gpu -rs "$R/tests/test_streaming_hybrid_gpu.py" 2>&1 | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
