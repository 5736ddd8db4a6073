#!/usr/bin/env bash
# The quantized-linear kernels on the GPU: tests/test_kernels_qlinear.py (every type, GEMV at
# 1/2/4/8 rows and GEMM at 512 against gguf's dequantization) and bench_qlinear.py (GEMV
# fraction of HBM at the 8B shapes, GEMM beside cuBLAS). ~3 minutes. Writes $OUT/qlinear/.
set -uo pipefail
R=${R:-$(pwd)}
O="$OUT/qlinear"; mkdir -p "$O"
cd /tmp
timeout 300 python3 -m pytest -q -s -m gpu -rfEs "$R/tests/test_kernels_qlinear.py" 2>&1 \
    | tee "$O/pytest.log"
rc=${PIPESTATUS[0]}
cd "$R"
timeout 300 python3 benchmarks/bench_qlinear.py ${QL_ARGS:-} --out "$O/qlinear.json" 2>&1 \
    | tee "$O/bench.log"
exit $(( rc || PIPESTATUS[0] ))
