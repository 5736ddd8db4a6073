#!/usr/bin/env bash
# Piecewise CUDA graphs (kvcompile/phase/piecewise.py): replayed decode == eager decode
# bitwise, llama and hybrid qwen35, streamed and resident KV; the engine with --cuda-graphs.
# Needs the gguf, fla-core and einops wheels (.whl/). Writes $OUT/piecewise_gpu/.
# KEYS (optional): a pytest -k expression to run a subset.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/piecewise_gpu"; mkdir -p "$O"
cd /tmp
python3 -m pytest -q -s -x -m gpu -rs ${KEYS:+-k "$KEYS"} "$R/tests/test_piecewise_gpu.py" 2>&1 \
    | grep -v "Warning\|warnings.warn" | tee "$O/pytest.log"
exit ${PIPESTATUS[0]}
