#!/usr/bin/env bash
# Phase programs and the phase manager on the GPU (tests/test_phase_gpu.py, -m gpu):
#  1. captured decode (compiled through the pass pipeline, CUDA graph per verify width
#     1/2/4/8) == the eager model bitwise, f32 and q8_0/q4_0 KV, pages relocated between
#     steps, torch's sync debug mode "error" around each replay; captured prefill == eager;
#  2. prefill -> decode -> new request's prefill -> decode with layouts that differ, stale
#     programs raise, capture counts; Engine(cuda_graphs=True) tokens == plain Engine's
#     (prints decode tok/s of both);
#  3. the table: a fixed 512 MiB arena, ctx 8K..256K, decode KV pool and measured decode /
#     prefill program workspace (decode pool within 2%);
#  4. an arena too small for a captured program's workspace -> ArenaError.
# Expected run time: about 3 minutes (torch.compile of a tiny llama ~30 times, Triton
# compiles). Writes $OUT/phase_gpu/pytest.log. Exit status 1 if a test fails.
set -uo pipefail
R=${R:-$(pwd)}
D="$OUT/phase_gpu"
mkdir -p "$D"
cd /tmp
timeout 420 python3 -m pytest -q -s -m gpu -rfEP "$R/tests/test_phase_gpu.py" 2>&1 \
    | tee "$D/pytest.log"
exit "${PIPESTATUS[0]}"
